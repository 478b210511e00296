"""Signed frames for the engine's channels to its workers (HMAC-SHA256 over a shared secret).

Every frame on a ZeroMQ socket between the engine and its workers is ``tag | counter |
sender | body``: the tag is the HMAC of the rest under the deployment's secret, checked
before the body is looked at (the body is a pickle, so an unchecked one would run whatever
it was sent, as vLLM's V0 multi-node pickle over ZeroMQ did). The counter rises with every
frame of a sender, so a frame captured on the wire cannot be replayed.

The secret of a multi-node deployment: ``LANE_RPC_SECRET``, else the file of
``--rpc-secret-file``, else ``~/.cache/lane/rpc-secret``; node 0 writes a new one (mode
0600) where none exists yet, headless nodes must be given the same one. A one-node run never
listens on the network; its key is random per engine and reaches its workers through the
spawn pipe.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import time

logger = logging.getLogger(__name__)

SECRET_ENV = "LANE_RPC_SECRET"
DEFAULT_SECRET_FILE = os.path.join("~", ".cache", "lane", "rpc-secret")
_TAG = hashlib.sha256().digest_size
_HEAD = struct.Struct("<QI")  # counter, sender
MIN_SECRET_BYTES = 16


class AuthError(Exception):
    """A frame whose tag does not check: another secret, or not one of ours."""


class RpcAuth:
    """One process's end of the signed channels: seals what it sends (its own counter) and
    opens what it gets (each sender's counter must rise)."""

    def __init__(self, key: bytes, sender: int = 0) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the RPC secret is {len(key)} bytes; at least {MIN_SECRET_BYTES} are needed")
        self._key, self.sender = key, sender
        self._counter = 0
        self._seen: dict[int, int] = {}
        self._dropped_at = 0.0

    @classmethod
    def random(cls) -> "RpcAuth":
        return cls(secrets.token_bytes(32))

    def for_sender(self, sender: int) -> "RpcAuth":
        """The same key, sealing as ``sender`` (a worker's rank) with a counter of its own."""
        return RpcAuth(self._key, sender)

    def key(self) -> bytes:
        return self._key

    def seal(self, body: bytes) -> bytes:
        self._counter += 1
        head = _HEAD.pack(self._counter, self.sender)
        return hmac.new(self._key, head + body, hashlib.sha256).digest() + head + body

    def open(self, frame: bytes | memoryview) -> tuple[int, memoryview]:
        """(sender, body) of a frame that checks; AuthError for any other (nothing of it is read)."""
        frame = memoryview(frame)
        if len(frame) < _TAG + _HEAD.size:
            raise AuthError(f"a {len(frame)}-byte frame is too short to be signed")
        want = hmac.new(self._key, frame[_TAG:], hashlib.sha256).digest()
        if not hmac.compare_digest(want, frame[:_TAG]):
            raise AuthError("a frame signed with another secret (or not signed)")
        counter, sender = _HEAD.unpack_from(frame, _TAG)
        if counter <= self._seen.get(sender, 0):
            raise AuthError(f"a replayed frame (sender {sender}, counter {counter})")
        self._seen[sender] = counter
        return sender, frame[_TAG + _HEAD.size:]

    def log_dropped(self, where: str, err: AuthError) -> None:
        """Say a frame was dropped (at most once a second: a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._dropped_at >= 1.0:
            self._dropped_at = now
            logger.warning("%s: dropped %s; nothing of it was read", where, err)


def resolve_rpc_secret(secret_file: str | None, create: bool) -> bytes:
    """The deployment's secret: ``LANE_RPC_SECRET``, else the file (``--rpc-secret-file`` or
    the default). ``create`` (node 0): write a new secret where the file does not exist.
    A headless node without one is refused, naming where it looked."""
    if text := os.environ.get(SECRET_ENV):
        secret = text.encode()
        source = SECRET_ENV
    else:
        path = os.path.expanduser(secret_file or DEFAULT_SECRET_FILE)
        if not os.path.exists(path):
            if not create:
                raise ValueError(f"--rpc-secret-file: no RPC secret at {path} and {SECRET_ENV} is not set; "
                                 f"give this node node 0's secret (node 0 wrote it there on its machine)")
            os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            logger.info("Wrote a new RPC secret to %s: give every headless node the same one "
                        "(--rpc-secret-file or %s)", path, SECRET_ENV)
        with open(path, "rb") as f:
            secret = f.read().strip()
        source = f"--rpc-secret-file {path}"
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source}: the RPC secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
    return secret
