"""The engine -> frontend outputs channel (a Unix stream socket of length-prefixed frames) and
what the engine loop puts on it, without a model."""
from __future__ import annotations

import random
import socket
import threading

import msgspec

from lane.engine.messages import (FRAME_HEADER, EngineCoreOutput, EngineCoreOutputs, EngineCoreOutputType,
                                  FrameReader, frame)
from lane.metrics.stats import SchedulerStats


def _messages(n: int, seed: int = 0) -> list[tuple[EngineCoreOutputType, bytes]]:
    rng = random.Random(seed)
    enc = msgspec.msgpack.Encoder()
    out = []
    for i in range(n):
        outs = [EngineCoreOutput(f"r{i}-{j}", [rng.randrange(50000) for _ in range(rng.randrange(1, 4))])
                for j in range(rng.randrange(0, 70))]
        kind = rng.choice([EngineCoreOutputType.OUTPUTS, EngineCoreOutputType.SPANS])
        out.append((kind, enc.encode(EngineCoreOutputs(0, outs, SchedulerStats(i, 0)))))
    return out


def test_frames_split_anywhere_come_out_whole_and_in_order():
    msgs = _messages(40)
    stream = b"".join(frame(k, p) for k, p in msgs)
    rng = random.Random(1)
    for _ in range(20):  # random cuts, single bytes included
        reader, got, pos = FrameReader(), [], 0
        while pos < len(stream):
            step = rng.choice([1, 2, FRAME_HEADER.size, rng.randrange(1, 3000)])
            got += [(k, bytes(p)) for k, p in reader.feed(stream[pos:pos + step])]
            pos += step
        assert got == [(k.value, p) for k, p in msgs]


def test_a_large_message_and_the_fast_path():
    big = bytes(range(256)) * 20000  # 5 MB, more than one socket read
    reader = FrameReader()
    one = frame(EngineCoreOutputType.OUTPUTS, b"abc")
    (k, p), = reader.feed(one)  # one whole frame in one read
    assert k == EngineCoreOutputType.OUTPUTS.value and bytes(p) == b"abc"
    data = frame(EngineCoreOutputType.SPANS, big) + one
    got = reader.feed(data[:100]) + reader.feed(data[100:])
    assert [(k, bytes(p)) for k, p in got] == [(EngineCoreOutputType.SPANS.value, big),
                                                 (EngineCoreOutputType.OUTPUTS.value, b"abc")]
    assert reader.feed(b"") == []


def test_frames_through_a_unix_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    msgs = _messages(200, seed=3)

    def send() -> None:  # more than the socket buffer holds: the reader reads meanwhile
        for k, p in msgs:
            a.sendall(frame(k, p))
        a.close()

    sender = threading.Thread(target=send)
    sender.start()
    reader, got = FrameReader(), []
    while data := b.recv(1 << 16):
        got += [(k, bytes(p)) for k, p in reader.feed(data)]
    b.close()
    sender.join()
    assert got == [(k.value, p) for k, p in msgs]
    dec = msgspec.msgpack.Decoder(EngineCoreOutputs)
    assert dec.decode(got[-1][1]).scheduler_stats == SchedulerStats(199, 0)
