"""The engine's broadcast to its workers (vLLM's ``MessageQueue``): one writer, every rank a
reader. Readers on the writer's machine read the message from a shared-memory ring and get
only a one-byte wake-up over ZeroMQ (ipc); readers on other machines get the message itself
over ZeroMQ (tcp). Messages are pickled (the writer and readers are one program).

The ring has ``SLOTS`` slots; a slot is rewritten only after every local reader has flagged
it read (the engine waits for rank 0's reply each step, so the ring rarely fills). A
message larger than a slot travels inline on the local socket too. The shared-memory file is
unlinked once every local reader has mapped it: nothing is left behind, whatever ends how.
Readers on other machines also get a heartbeat (``HEARTBEAT_S``) while the writer lives, so
they can tell an idle engine from a dead one (local readers watch their parent process).
"""
from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import zmq

SLOTS = 4
SLOT_BYTES = 4 << 20
HEARTBEAT_S = 2.0
_HEADER = 16  # per slot: payload length (u64), sequence number (u64); then one read flag per reader


@dataclass
class QueueHandle:
    """What a reader needs to attach (picklable)."""
    shm_path: str | None
    local_address: str | None
    remote_address: str | None
    num_local: int


def _slot_size(num_local: int) -> int:
    return _HEADER + (num_local + 7) // 8 * 8 + SLOT_BYTES


class MessageQueue:
    def __init__(self, num_local: int, num_remote: int = 0, remote_port: int | None = None,
                 remote_host: str = "*") -> None:
        self.num_local, self.num_remote = num_local, num_remote
        self.ctx = zmq.Context()
        self.local_socket = self.remote_socket = None
        self.shm_path = None
        self._mm = None
        if num_local:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            self.shm_path = os.path.join(base, f"lane-mq-{uuid.uuid4().hex[:12]}")
            size = SLOTS * _slot_size(num_local)
            with open(self.shm_path, "wb+") as f:
                f.truncate(size)
                self._mm = mmap.mmap(f.fileno(), size)
            self.local_socket = self.ctx.socket(zmq.XPUB)
            self.local_socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every reader's subscription, not the first
            self.local_address = f"ipc://{self.shm_path}.sock"
            self.local_socket.bind(self.local_address)
        if num_remote:
            self.remote_socket = self.ctx.socket(zmq.XPUB)
            self.remote_socket.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.remote_socket.bind(f"tcp://{remote_host}:{remote_port}")
        self.remote_port = remote_port
        self.seq = 0
        self._used = [False] * SLOTS
        self._remote_lock = threading.Lock()  # the heartbeat thread sends on the remote socket too
        self._closed = threading.Event()
        if num_remote:
            threading.Thread(target=self._heartbeat, daemon=True, name="MessageQueueHeartbeat").start()

    def _heartbeat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            with self._remote_lock:
                if not self._closed.is_set():
                    self.remote_socket.send(b"h")

    def handle(self, remote_host: str = "127.0.0.1") -> QueueHandle:
        return QueueHandle(self.shm_path, self.local_address if self.num_local else None,
                           f"tcp://{remote_host}:{self.remote_port}" if self.num_remote else None, self.num_local)

    def wait_for_readers(self, timeout_s: float) -> None:
        """Until every reader has subscribed (XPUB shows each subscription), so no message is
        lost to a reader still connecting; then the ring's file is unlinked."""
        deadline = time.monotonic() + timeout_s
        for sock, n in ((self.local_socket, self.num_local), (self.remote_socket, self.num_remote)):
            seen = 0
            while sock is not None and seen < n:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    raise TimeoutError(f"{n - seen} of {n} workers did not connect within {timeout_s:.0f} s")
                if sock.recv()[:1] == b"\x01":
                    seen += 1
        if self.shm_path:
            os.unlink(self.shm_path)

    def enqueue(self, obj, timeout_s: float = 60.0) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if self.local_socket is not None:
            slot = self.seq % SLOTS
            if len(data) <= SLOT_BYTES:
                base = slot * _slot_size(self.num_local)
                flags = slice(base + _HEADER, base + _HEADER + self.num_local)
                deadline = time.monotonic() + timeout_s
                while self._used[slot] and self._mm[flags].count(1) < self.num_local:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"a worker has not read a message for {timeout_s:.0f} s")
                    time.sleep(1e-4)
                data_at = base + _slot_size(self.num_local) - SLOT_BYTES
                self._mm[data_at:data_at + len(data)] = data
                self._mm[base:base + _HEADER] = struct.pack("<QQ", len(data), self.seq)
                self._mm[flags] = bytes(self.num_local)
                self._used[slot] = True
                self.local_socket.send(b"s" + struct.pack("<I", slot), copy=False)
            else:
                self.local_socket.send(b"i" + data, copy=False)
        if self.remote_socket is not None:
            with self._remote_lock:
                self.remote_socket.send(b"i" + data, copy=False)
        self.seq += 1

    def close(self) -> None:
        with self._remote_lock:
            self._closed.set()
        for sock in (self.local_socket, self.remote_socket):
            if sock is not None:
                sock.close(linger=0)
        if self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)
        self.ctx.term()


class MessageReader:
    """One rank's end: ``local_index`` its flag in the ring (None for a reader on another machine)."""

    def __init__(self, handle: QueueHandle, local_index: int | None) -> None:
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.local_index = local_index
        self._mm = None
        if local_index is not None:
            with open(handle.shm_path, "rb+") as f:  # mapped before subscribing: the writer unlinks it after
                self._mm = mmap.mmap(f.fileno(), SLOTS * _slot_size(handle.num_local))
            self.slot_size = _slot_size(handle.num_local)
            self.socket.connect(handle.local_address)
        else:
            self.socket.connect(handle.remote_address)

    def dequeue(self, timeout_s: float | None = None):
        """The next message; None if none (nor a heartbeat) came within ``timeout_s``."""
        while True:
            if timeout_s is not None and not self.socket.poll(int(timeout_s * 1000)):
                return None
            msg = self.socket.recv(copy=False).buffer
            if msg[:1] != b"h":
                break
        if msg[:1] == b"i":
            return pickle.loads(msg[1:])
        slot = struct.unpack("<I", msg[1:5])[0]
        base = slot * self.slot_size
        n, _ = struct.unpack("<QQ", self._mm[base:base + _HEADER])
        data_at = base + self.slot_size - SLOT_BYTES
        obj = pickle.loads(self._mm[data_at:data_at + n])
        self._mm[base + _HEADER + self.local_index] = 1
        return obj

    def close(self) -> None:
        self.socket.close(linger=0)
        self.ctx.term()
