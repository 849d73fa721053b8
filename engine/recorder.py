"""Per-rank span recording on one clock shared by all ranks.

Each rank reads its own monotonic clock and adds `offset_s`, measured once at start-up against
rank 0 (see `comm.measure_clock_offset`), so spans from different ranks line up on one time axis.
No torch import: the engine hands in a `synchronize` callable when the device is asynchronous (cuda).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

from core.timeline import Span


class Recorder:
    def __init__(self, rank: int, offset_s: float = 0.0, enabled: bool = True,
                 synchronize: Callable[[], None] | None = None):
        self.rank = rank
        self.offset_s = offset_s
        self.enabled = enabled
        self.synchronize = synchronize
        self.step = 0
        self.micro_batch: int | None = None
        self.spans: list[Span] = []

    def now(self) -> float:
        return time.perf_counter() + self.offset_s

    def add(self, lane: str, name: str, start_s: float, end_s: float, **kw) -> None:
        if self.enabled:
            self.spans.append(Span(self.rank, lane, name, start_s, max(end_s, start_s), step=self.step,
                                   micro_batch=self.micro_batch, **kw))

    @contextmanager
    def compute(self, name: str, flops: float = 0.0):
        """Time a block of compute; on an asynchronous device wait for it so the span is honest."""
        if not self.enabled:
            yield
            return
        if self.synchronize:
            self.synchronize()
        start = self.now()
        yield
        if self.synchronize:
            self.synchronize()
        self.add("compute", name, start, self.now(), flops=flops)

    def take(self) -> list[Span]:
        spans, self.spans = self.spans, []
        return spans
