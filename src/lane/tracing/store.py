"""The API server's trace store: spans of the last requests, served by /trace."""
from __future__ import annotations

from lane.tracing.recorder import Span
from lane.tracing.steps import STEPS


class TraceStore:
    """The frontend's spans of the last ``max_requests`` requests, plus the start-up
    spans every trace carries (lane serve --trace)."""

    def __init__(self, max_requests: int = 100) -> None:
        from collections import OrderedDict, deque

        self.max_requests = max_requests
        self.startup: list[Span] = []
        self.skipped: dict[int, str] = {}
        self.occasional: dict[int, str] = {}  # background steps, and why a request may have seen none
        self.requests: OrderedDict[str, list[Span]] = OrderedDict()
        self.background: deque[Span] = deque(maxlen=512)

    @staticmethod
    def parent_id(request_id: str) -> str:
        """An n > 1 sample's engine id is "<i>_<parent id>"."""
        head, sep, rest = request_id.partition("_")
        return rest if sep and head.isdigit() else request_id

    def add(self, span: Span) -> None:
        if span.request_ids is None:
            (self.startup if span.step <= 9 else self.background).append(span)
            return
        for rid in {self.parent_id(r) for r in span.request_ids}:
            spans = self.requests.get(rid)
            if spans is None:
                spans = self.requests[rid] = []
                while len(self.requests) > self.max_requests:
                    self.requests.popitem(last=False)
            spans.append(span)

    def get(self, request_id: str) -> dict | None:
        spans = self.requests.get(request_id)
        if spans is None:
            return None
        t0 = min(s.start for s in spans)
        t1 = max(s.start + s.dur for s in spans)
        background = [s for s in self.background if t0 <= s.start <= t1]
        ran = {s.step for s in background} | {s.step for s in spans}
        reasons = {**{k: v for k, v in self.occasional.items() if k not in ran}, **self.skipped}
        skipped = [Span(step, t0, 0.0, None, {}, 0, reason) for step, reason in sorted(reasons.items())]
        return {"request_id": request_id, "spans": [span_dict(s) for s in
                                                    sorted(self.startup + spans + background, key=_order)]
                + [span_dict(s) for s in skipped]}


def _order(s: Span) -> tuple:
    return (s.start, s.step)


def span_dict(s: Span) -> dict:
    step = STEPS[s.step]
    d = {"step": s.step, "name": step.span, "lane": step.lane, "phase": step.phase, "start": s.start,
         "dur": s.dur, "pid": s.pid, "attrs": s.attrs}
    if s.request_ids is not None:
        d["request_ids"] = s.request_ids
    if s.skipped is not None:
        d["skipped"] = s.skipped
    return d
