"""What a measured pipeline step looks like on the shared Timeline: its bubbles, and their fraction.

No torch: `engine.run` calls `bubble_spans` in the calling process so that a measured pipeline timeline
carries the same ``idle`` "bubble" spans as the simulator's predicted one (engine/schedules.py), and
pages can put the two side by side.
"""

from __future__ import annotations

from engine.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from engine.trace import Span, Timeline

PIPELINE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


def _pipeline_spans(timeline: Timeline, step: int) -> list[Span]:
    """The F / B / BI / BW compute spans of one step (engine/pp.py names them "F s1", "BW s0", ...)."""
    return [s for s in timeline.spans if s.step == step and s.lane == "compute"
            and s.name.split(" ")[0] in PIPELINE_KINDS]


def measured_bubble_fraction(timeline: Timeline, step: int) -> float:
    """(pipeline makespan - busiest rank's compute) / that compute, from the F/B/BI/BW spans of one step:
    the simulator's definition (engine/schedules.Simulation), Narayanan et al. 2021 eq. 1's ratio."""
    spans = _pipeline_spans(timeline, step)
    makespan_s = max(s.end_s for s in spans) - min(s.start_s for s in spans)
    busy_s = max(sum(s.duration_s for s in spans if s.rank == r) for r in {s.rank for s in spans})
    return (makespan_s - busy_s) / busy_s


def bubble_spans(timeline: Timeline) -> list[Span]:
    """Per step and rank, an idle "bubble" span for every gap between its pipeline compute spans, from the
    step's first pipeline op on any rank to its last (what the simulator draws as `.`)."""
    out = []
    for step in sorted({s.step for s in timeline.spans}):
        spans = _pipeline_spans(timeline, step)
        if not spans:
            continue
        first_s, last_s = min(s.start_s for s in spans), max(s.end_s for s in spans)
        for rank in sorted({s.rank for s in spans}):
            busy_until = first_s
            for s in sorted((s for s in spans if s.rank == rank), key=lambda s: s.start_s):
                if s.start_s > busy_until:
                    out.append(Span(rank, "idle", "bubble", busy_until, s.start_s, step=step))
                busy_until = max(busy_until, s.end_s)
            if last_s > busy_until:
                out.append(Span(rank, "idle", "bubble", busy_until, last_s, step=step))
    return out
