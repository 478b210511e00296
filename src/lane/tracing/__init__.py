"""Tracing: the seed's step catalogue (``steps``), the span recorder each process uses
(``recorder``) and the API server's store of recent requests' spans (``store``)."""
from lane.tracing.recorder import ForwardProfile, Span, Tracer, forward_mark, forward_profile, tracer
from lane.tracing.steps import (DECODE_STEP, LANES, PHASES, STEPS, Step, StepInfo, coverage, coverage_line,
                                occasional_steps, skipped_steps)
from lane.tracing.store import TraceStore, span_dict

__all__ = ["DECODE_STEP", "LANES", "PHASES", "STEPS", "ForwardProfile", "Span", "Step", "StepInfo", "coverage",
           "coverage_line",
           "TraceStore", "Tracer", "forward_mark", "forward_profile", "occasional_steps", "skipped_steps", "span_dict",
           "tracer"]
