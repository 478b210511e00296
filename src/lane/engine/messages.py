"""What crosses the frontend <-> engine-core boundary (vLLM's ``v1/engine/__init__.py``):
plain dataclasses that msgspec encodes. This module imports no model, worker or torch
code, so the API-server process can use it without loading the model stack."""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from lane.metrics.stats import SchedulerStats
from lane.sampling_params import SamplingParams
from lane.tracing import Span


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list | None = None  # per token: (sampled logprob, sampled rank, [(id, logprob)...])
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # engine-side times (monotonic), sent with a request's first token for the metrics
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    kv_transfer_params: dict | None = None  # PD disaggregation: with the last output, for the next engine


@dataclass
class EngineCoreOutputs:
    engine_index: int
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a frontend -> engine message."""
    ADD = b"\x00"
    ABORT = b"\x01"  # payload: list[str], the request ids


class EngineCoreOutputType(bytes, enum.Enum):
    """First frame of an engine -> frontend message."""
    READY = b"\x00"
    OUTPUTS = b"\x01"
    SPANS = b"\x02"  # trace spans, sent after the outputs they describe
    ERROR = b"\x03"  # [engine index, the error's text]: a runtime error stops the engine


@dataclass
class EngineReady:
    engine_index: int
    pid: int
    num_gpu_blocks: int  # vLLM's name; blocks of the KV pool, the null block excluded
    block_size: int
    kv_cache_bytes: int
    enable_prefix_caching: bool
    threads: int
    spans: list[Span] | None = None  # start-up steps 1-8, when tracing
    skipped: dict[int, str] | None = None  # steps this model never performs, and why
    # background steps that run now and then: why a request that saw none of them has none
    occasional: dict[int, str] | None = None


# -- engine -> frontend framing (a Unix stream socket) ----------------------------------------
# Each message: its EngineCoreOutputType byte, the payload's length (4 bytes, big-endian), the
# msgspec payload.
FRAME_HEADER = struct.Struct(">cI")


def frame(kind: EngineCoreOutputType, payload: bytes) -> bytes:
    return FRAME_HEADER.pack(kind.value, len(payload)) + payload


class FrameReader:
    """Splits what arrives on a stream socket into (kind byte, payload) messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, memoryview]]:
        """The whole messages now received; a partial one waits for the rest."""
        hs = FRAME_HEADER.size
        if not self._buf and len(data) >= hs:  # the common case: whole messages in one read
            kind, n = FRAME_HEADER.unpack_from(data)
            if len(data) == hs + n:
                return [(kind, memoryview(data)[hs:])]
        self._buf += data
        out, pos, buf = [], 0, self._buf
        while len(buf) - pos >= hs:
            kind, n = FRAME_HEADER.unpack_from(buf, pos)
            if len(buf) - pos - hs < n:
                break
            out.append((kind, memoryview(bytes(buf[pos + hs:pos + hs + n]))))
            pos += hs + n
        del buf[:pos]
        return out
