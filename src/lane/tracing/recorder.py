"""The span recorder each process uses, and the per-forward profile of the model's steps.

Cheap when on, free when off: every call site tests ``tracer.enabled`` (or gets the
no-op ``mark``) before doing any work. Times are time.monotonic() seconds:
CLOCK_MONOTONIC is one clock for every process on a machine, so spans recorded by
the API server and the engine cores lie on one axis without offsets.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

@dataclass
class Span:
    step: int
    start: float  # time.monotonic() seconds
    dur: float = 0.0
    request_ids: list[str] | None = None  # None: not tied to requests (start-up, background)
    attrs: dict = field(default_factory=dict)
    pid: int = 0
    skipped: str | None = None  # reason, for a step that does not apply


class Tracer:
    """This process's span buffer."""

    def __init__(self) -> None:
        self.enabled = False
        self.layer_detail = False
        self.spans: list[Span] = []
        self.pid = os.getpid()
        self.sink = None  # a callable taking each span at once (the API server's TraceStore)
        self.rank: int | None = None  # a worker's rank: every span it records carries it

    def enable(self, layer_detail: bool = False) -> None:
        self.enabled, self.layer_detail, self.pid = True, layer_detail, os.getpid()

    def record(self, step: int, start: float, end: float, request_ids: list[str] | None = None,
               **attrs) -> Span:
        if self.rank is not None:
            attrs["rank"] = self.rank
        span = Span(step, start, max(end - start, 0.0), request_ids, attrs, self.pid)
        if self.sink is not None:
            self.sink(span)
        else:
            self.spans.append(span)
        return span

    def skip(self, step: int, reason: str) -> None:
        self.spans.append(Span(step, time.monotonic(), 0.0, None, {}, self.pid, reason))

    def drain(self) -> list[Span]:
        out, self.spans = self.spans, []
        return out


tracer = Tracer()


class ForwardProfile:
    """Per-layer step times of one forward, summed over layers (steps 21-32). Model code
    calls ``mark(step)`` after each piece: the time since the previous mark is that step's."""

    def __init__(self) -> None:
        self.acc: dict[int, float] = {}
        self.attrs: dict[int, dict[str, set]] = {}  # step -> attribute -> the values layers gave
        self.sums: dict[int, dict[str, float]] = {}  # step -> attribute -> summed over layers (bytes moved)
        self.detail: list[tuple[int, float, float, dict]] = []  # (step, start, end, attrs) with --trace-layers
        self.start = self.last = 0.0

    def begin(self) -> None:
        self.acc = {}
        self.attrs = {}
        self.sums = {}
        self.detail = []
        self.start = self.last = time.monotonic()

    def add(self, step: int, seconds: float) -> None:
        """Time measured elsewhere (the fused decode kernel's pieces) into a step's sum; the
        next mark counts from now."""
        self.acc[step] = self.acc.get(step, 0.0) + seconds
        self.last = time.monotonic()

    def count(self, step: int, **numbers: float) -> None:
        """Numbers summed into a step's span (a collective's bytes and time), without a mark."""
        sums = self.sums.setdefault(step, {})
        for k, v in numbers.items():
            sums[k] = sums.get(k, 0) + v

    def mark(self, step: int, **attrs) -> None:
        """``attrs`` describe this layer's piece (e.g. its layer type): per-layer spans
        carry them; summed spans list every value seen."""
        now = time.monotonic()
        self.acc[step] = self.acc.get(step, 0.0) + (now - self.last)
        for k, v in attrs.items():
            self.attrs.setdefault(step, {}).setdefault(k, set()).add(v)
        if tracer.layer_detail:
            self.detail.append((step, self.last, now, attrs))
        self.last = now

    def emit(self, request_ids: list[str], num_layers: int, step_attrs: dict[int, dict] | None = None) -> None:
        """One span per step, laid end to end from the forward's start in step order
        (their real times interleave layer by layer; the sums are what they cost)."""
        step_attrs = step_attrs or {}
        if self.detail:
            for step, s, e, attrs in self.detail:
                tracer.record(step, s, e, request_ids, placement="per-layer", **step_attrs.get(step, {}), **attrs)
            return
        t = self.start
        for step in sorted(self.acc):
            dur = self.acc[step]
            seen = {k: ",".join(sorted(map(str, v))) for k, v in self.attrs.get(step, {}).items()}
            seen.update({k: round(v, 3) if isinstance(v, float) else v for k, v in self.sums.get(step, {}).items()})
            tracer.record(step, t, t + dur, request_ids, layers=1 if step in (32,) else num_layers,
                          placement="summed over layers", **{**step_attrs.get(step, {}), **seen})
            t += dur


_profile = ForwardProfile()


def _noop(step: int, **attrs) -> None:
    pass


def forward_mark():
    """``mark`` for model code: the profile's when tracing, else a no-op."""
    return _profile.mark if tracer.enabled else _noop


def forward_profile() -> ForwardProfile | None:
    return _profile if tracer.enabled else None
