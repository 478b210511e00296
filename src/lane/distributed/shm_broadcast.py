"""The engine's broadcast to its workers (vLLM's ``MessageQueue``): one writer, every rank a
reader. Readers on the writer's machine read the message from a shared-memory ring and get
only a one-byte wake-up over ZeroMQ (ipc); readers on other machines get the message itself
over ZeroMQ (tcp), in frames signed with the deployment's secret (``rpc_auth``): a reader
checks each frame's signature before it unpickles anything (the writer and readers are one
program; nobody else's pickle is ever loaded).

The ring has ``SLOTS`` slots; a slot is rewritten only after every local reader has flagged
it read: a writer that finds the ring full waits, and gives up with a clear error when a
reader has not read for ``timeout_s``. A message larger than a slot travels inline on the
local socket too. The shared-memory file (mode 0600) is unlinked once every local reader has
mapped it. Readers on other machines also get a signed heartbeat (``HEARTBEAT_S``) while the
writer lives, so they can tell an idle engine from a dead one (local readers watch their
parent process); a remote reader's first checked frame (``wait_for_writer``) proves its
secret and its subscription before it says it is ready.

Each ZeroMQ socket has one owner thread: the caller's for the local socket, the sender thread
for the remote one (the caller hands it messages over an inproc pipe).
"""
from __future__ import annotations

import mmap
import os
import pickle
import struct
import threading
import time
from dataclasses import dataclass

import zmq

from lane.distributed.rpc_auth import AuthError, RpcAuth
from lane.ipc_paths import shm_file_path

SLOTS = 4
SLOT_BYTES = 4 << 20
HEARTBEAT_S = 2.0
_HEADER = 16  # per slot: payload length (u64), sequence number (u64); then one read flag per reader


@dataclass
class QueueHandle:
    """What a reader needs to attach (picklable; no secret in it)."""
    shm_path: str | None
    local_address: str | None
    remote_address: str | None
    num_local: int


def _slot_size(num_local: int) -> int:
    return _HEADER + (num_local + 7) // 8 * 8 + SLOT_BYTES


class MessageQueue:
    """``remote_host``: the interface remote readers reach (never all of them);
    ``auth``: signs the remote frames (needed with ``num_remote``)."""

    def __init__(self, num_local: int, num_remote: int = 0, remote_port: int | None = None,
                 remote_host: str | None = None, auth: RpcAuth | None = None) -> None:
        self.num_local, self.num_remote = num_local, num_remote
        self.ctx = zmq.Context()
        self.local_socket = self._to_sender = None
        self.shm_path = None
        self._mm = None
        if num_local:
            self.shm_path = shm_file_path("mq")
            size = SLOTS * _slot_size(num_local)
            fd = os.open(self.shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb+") as f:
                f.truncate(size)
                self._mm = mmap.mmap(f.fileno(), size)
            self.local_socket = self.ctx.socket(zmq.XPUB)
            self.local_socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every reader's subscription, not the first
            self.local_address = f"ipc://{self.shm_path}.sock"
            self.local_socket.bind(self.local_address)
        self.remote_port = remote_port
        if num_remote:
            if auth is None or remote_host is None:
                raise ValueError("a queue with remote readers needs an interface and an RPC secret")
            self._start_sender(remote_host, remote_port, auth)
        self.seq = 0
        self._used = [False] * SLOTS

    def _start_sender(self, host: str, port: int, auth: RpcAuth) -> None:
        """The remote socket's own thread: signs and sends what enqueue hands it, and a
        heartbeat whenever it has sent nothing for HEARTBEAT_S."""
        pipe = f"inproc://mq-remote-{id(self)}"
        self._to_sender = self.ctx.socket(zmq.PAIR)
        self._to_sender.bind(pipe)
        bound: list = []
        started = threading.Event()

        def run() -> None:
            sock = self.ctx.socket(zmq.PUB)
            inbox = self.ctx.socket(zmq.PAIR)
            try:
                sock.bind(f"tcp://{host}:{port}")
                inbox.connect(pipe)
                bound.append(None)
            except zmq.ZMQError as e:
                bound.append(e)
            started.set()
            if bound[0] is not None:
                sock.close(linger=0)
                inbox.close(linger=0)
                return
            last = time.monotonic()
            while True:
                wait = max(0.0, HEARTBEAT_S - (time.monotonic() - last))
                if inbox.poll(int(wait * 1000)):
                    body = inbox.recv(copy=False).buffer
                    if body[:1] == b"q":
                        break
                else:
                    body = b"h"
                sock.send(auth.seal(body), copy=False)
                last = time.monotonic()
            sock.close(linger=500)
            inbox.close(linger=0)

        self._sender = threading.Thread(target=run, daemon=True, name="MessageQueueRemote")
        self._sender.start()
        started.wait()
        if bound[0] is not None:
            self._to_sender.close(linger=0)
            self._to_sender = None
            raise OSError(f"cannot listen for the workers on tcp://{host}:{port}: {bound[0]}")

    def handle(self, remote_host: str = "127.0.0.1") -> QueueHandle:
        return QueueHandle(self.shm_path, self.local_address if self.num_local else None,
                           f"tcp://{remote_host}:{self.remote_port}" if self.num_remote else None, self.num_local)

    def wait_for_readers(self, timeout_s: float) -> None:
        """Until every local reader has subscribed (XPUB shows each subscription), so no message
        is lost to a reader still connecting; then the ring's file is unlinked. (Remote readers
        prove their subscription themselves: ``MessageReader.wait_for_writer``.)"""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while self.local_socket is not None and seen < self.num_local:
            left = deadline - time.monotonic()
            if left <= 0 or not self.local_socket.poll(int(left * 1000)):
                raise TimeoutError(f"{self.num_local - seen} of {self.num_local} workers did not connect "
                                   f"within {timeout_s:.0f} s")
            if self.local_socket.recv()[:1] == b"\x01":
                seen += 1
        if self.shm_path and os.path.exists(self.shm_path):
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
                        behind = [i for i, f in enumerate(self._mm[flags]) if not f]
                        raise TimeoutError(f"the ring is full: local reader(s) {behind} have not read a message "
                                           f"for {timeout_s:g} s (gone or stuck)")
                    time.sleep(1e-4)
                data_at = base + _slot_size(self.num_local) - SLOT_BYTES
                self._mm[data_at:data_at + len(data)] = data
                self._mm[base:base + _HEADER] = struct.pack("<QQ", len(data), self.seq)
                self._mm[flags] = bytes(self.num_local)
                self._used[slot] = True
                self.local_socket.send(b"s" + struct.pack("<I", slot), copy=False)
            else:
                self.local_socket.send(b"i" + data, copy=False)
        if self._to_sender is not None:
            self._to_sender.send(b"i" + data, copy=False)
        self.seq += 1

    def close(self) -> None:
        if self._to_sender is not None:
            self._to_sender.send(b"q")
            self._sender.join(2.0)
            self._to_sender.close(linger=0)
            self._to_sender = None
        if self.local_socket is not None:
            self.local_socket.close(linger=0)
            self.local_socket = None
            sock_path = f"{self.shm_path}.sock"
            if os.path.exists(sock_path):
                os.unlink(sock_path)
        if self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)
        self.ctx.term()


class MessageReader:
    """One rank's end: ``local_index`` its flag in the ring (None for a reader on another
    machine, which needs ``auth`` to check the frames)."""

    def __init__(self, handle: QueueHandle, local_index: int | None, auth: RpcAuth | None = None) -> None:
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.local_index = local_index
        self._mm = None
        self._pending = None
        self.auth = None
        if local_index is not None:
            with open(handle.shm_path, "rb+") as f:  # mapped before subscribing: the writer unlinks it after
                self._mm = mmap.mmap(f.fileno(), SLOTS * _slot_size(handle.num_local))
            self.slot_size = _slot_size(handle.num_local)
            self.socket.connect(handle.local_address)
        else:
            if auth is None:
                raise ValueError("a reader on another machine needs the RPC secret")
            self.auth = auth
            self.where = handle.remote_address
            self.socket.connect(handle.remote_address)

    def _recv(self) -> memoryview:
        """The next frame's body, its signature checked (remote) (AuthError if it fails)."""
        frame = self.socket.recv(copy=False).buffer
        return frame if self.auth is None else self.auth.open(frame)[1]

    def wait_for_writer(self, timeout_s: float) -> None:
        """A remote reader: until the writer's first frame has arrived and checked, which
        proves this node holds the writer's secret and is subscribed. AuthError if the
        frame does not check (another secret), TimeoutError if none comes."""
        if self.auth is None:
            return
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no word from the engine at {self.where} within {timeout_s:.0f} s")
        msg = self._recv()
        if msg[:1] != b"h":
            self._pending = msg

    def dequeue(self, timeout_s: float | None = None):
        """The next message; None if none (nor a heartbeat) came within ``timeout_s``. A
        frame that does not check is dropped (and logged), as if it never came."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        msg, self._pending = self._pending, None
        while msg is None:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not self.socket.poll(int(left * 1000)):
                    return None
            try:
                msg = self._recv()
            except AuthError as e:
                self.auth.log_dropped(f"engine broadcast at {self.where}", e)
                continue
            if msg[:1] == b"h":  # alive: the wait starts over
                msg = None
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
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
