"""The pipeline schedule run pass by pass with each stage's own chunk costs: when every pass starts and ends.

Each rank runs its compute actions of the engine's own schedule (`core.schedules`) in their order; a pass
starts once its rank is free and its input exists: a forward needs the previous stage's forward of the
same micro-batch, a backward (or ZB-H1's input-gradient pass) its own forward and the next stage's
backward, a deferred weight-gradient pass its input-gradient pass. This is list scheduling with the
schedule's fixed order per rank, and its end is the pipeline's time. The closed form that
`planner.simulate.pipeline_time_s` gives, m S_max + (sum S - S_max) / v, is exact for equal chunks; where
stages hold chunks of different sizes (layers that do not split evenly, the embedding and the output
heads, a run's own split) it misses either way: the dependencies between chunks can stall a rank the closed
form leaves busy (DeepSeek-V3's 61 layers over 16 stages of 3 chunks run 11 % longer pass by pass), and a
heavy stage's warm-up can hide fill the closed form charges (17 of 32 layers on the first of 4 stages: 19 %
shorter).

Around that, per rank:
* with `schedule_runs` r > 1 under staged ZeRO-3, each run but the last ends with the stage's gradients
  reduce-scattered and its weights gathered again (`StageCost.dp_exposed_s`), which the rank waits for
  ("gap" passes);
* with `ep_comm_overlap`, the passes no other micro-batch's pass runs beside (each run's warm-up forwards
  and draining backwards, `unpaired_passes`) show their expert all-to-all whole
  (planner.simulate.unpaired_ep_s);
* after its last pass (`tail`): the exposed part of the data-parallel sync, a shared embedding's gradient
  sum once every stage holding it has synced (it waits for the last), the gradient buffer's passes and
  the optimizer step. The step ends with the last rank's tail.

Both the step time (planner.simulate) and the predicted timeline (planner.timeline) read their times from
here, so the timeline ends where the step does. The search ranks layouts with the closed form
(`planner.layout_search`) and runs its best ones pass by pass.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from core.schedules import compute_orders
from planner.case import Layout
from planner.memory import in_flight_chunks

GAP = "gap"  # a rank's wait between runs of the schedule (staged ZeRO-3)


KINDS = ("F", "B", "BI", "BW", GAP)  # a pass's kind, stored as its index here


@dataclass(frozen=True)
class Plan:
    """Every pass of one step in an order that respects the dependencies (each pass after its inputs), as
    parallel arrays, one entry per pass (a step of a large pipeline has hundreds of thousands)."""

    ranks: array  # the rank that runs it
    kind_codes: bytes  # index into KINDS
    micro_batches: array
    stages: array  # the global model stage (chunk = stage // p); 0 for a gap
    chunks: array  # the rank's chunk index
    showing: bytes  # 1: an unpaired pass, its expert all-to-all shows whole
    dep1: array  # index of a pass whose end it waits for, or -1
    dep2: array

    @property
    def kinds(self) -> list[str]:
        return [KINDS[c] for c in self.kind_codes]


def unpaired_passes(actions: list, count: float, runs: int) -> set[int]:
    """Indices, in a rank's actions over every run, of each run's first `count` forwards and last `count`
    backwards: the passes with no other micro-batch's pass beside them."""
    forwards = [i for i, a in enumerate(actions) if a.kind == "F"][:int(count)]
    backwards = [i for i, a in enumerate(actions) if a.kind in ("B", "BI")][-int(count):] if count >= 1 else []
    return {i + k * len(actions) for k in range(runs) for i in forwards + backwards}


@lru_cache(maxsize=32)
def plan(schedule: str, p: int, micro_batches: int, v: int, runs: int, unpaired_counts: tuple | None,
         gaps: bool) -> Plan:
    """The passes of `runs` runs of the schedule over `micro_batches` // `runs` micro-batches each;
    `unpaired_counts`: each rank's count of unpaired passes at each end of a run when expert all-to-alls
    overlap (None: they do not); `gaps`: a gap after each run but the last (staged ZeRO-3)."""
    per_run = micro_batches // runs
    one_run = compute_orders(schedule, p, per_run, v)
    order = [[(a.kind, a.micro_batch + k * per_run, a.stage) for k in range(runs) for a in actions]
             for actions in one_run]
    run_end = [{len(actions) * (k + 1) for k in range(runs - 1)} if gaps else set() for actions in one_run]
    unpaired = [unpaired_passes(actions, unpaired_counts[r], runs) if unpaired_counts else set()
                for r, actions in enumerate(one_run)]
    last_stage = p * v - 1
    ranks, chunks, mbs, stages = array("H"), array("H"), array("l"), array("l")
    codes, showing, dep1, dep2 = bytearray(), bytearray(), array("l"), array("l")
    done: dict[tuple[str, int, int], int] = {}
    waiting: dict[tuple[str, int, int], list[int]] = {}  # a pass not yet placed -> the ranks blocked on it
    cursor = [0] * p
    ready = deque(range(p))

    code_of = {k: KINDS.index(k) for k in KINDS}
    gap = code_of[GAP]
    while ready:
        r = ready.popleft()
        actions, here, ends_run = order[r], unpaired[r], run_end[r]
        while cursor[r] < len(actions):
            kind, mb, stage = actions[cursor[r]]
            # the passes it waits for: F the previous stage's F; BW its own B; B (or BI) its F and the next stage's B
            if kind == "F":
                first, second = ("F", mb, stage - 1) if stage > 0 else None, None
            elif kind == "BW":
                first, second = ("B", mb, stage), None
            else:
                first, second = ("F", mb, stage), ("B", mb, stage + 1) if stage < last_stage else None
            if first is not None and first not in done:
                waiting.setdefault(first, []).append(r)
                break
            if second is not None and second not in done:
                waiting.setdefault(second, []).append(r)
                break
            key = (kind if kind in ("F", "BW") else "B", mb, stage)
            done[key] = len(ranks)
            ranks.append(r)
            codes.append(code_of[kind])
            mbs.append(mb)
            stages.append(stage)
            chunks.append(stage // p)
            showing.append(cursor[r] in here)
            dep1.append(done[first] if first is not None else -1)
            dep2.append(done[second] if second is not None else -1)
            ready.extend(waiting.pop(key, ()))
            cursor[r] += 1
            if cursor[r] in ends_run:
                for arr, value in ((ranks, r), (mbs, 0), (stages, 0), (chunks, 0), (dep1, -1), (dep2, -1)):
                    arr.append(value)
                codes.append(gap)
                showing.append(False)
    if any(cursor[r] < len(order[r]) for r in range(p)):
        raise RuntimeError(f"schedule {schedule} deadlocked when run pass by pass")
    return Plan(ranks, bytes(codes), mbs, stages, chunks, bytes(showing), dep1, dep2)


def unpaired_count(stage: int, lay: Layout, micro_batches: int) -> float:
    """Passes at each end of a run of the schedule with no other micro-batch's pass beside them: the
    forwards the stage runs before its first backward, its warm-up and one more (planner.memory's
    in_flight_chunks, the chunks it holds at its peak). ZB-H1 runs 1F1B's order, p - i of them on stage i,
    where its memory bound counts min(p, m) for the deferred weight-gradient inputs it also keeps."""
    if lay.pp_schedule == "zb-h1":
        return min(lay.pp - stage, micro_batches)
    return in_flight_chunks(stage, lay, micro_batches)


def layout_plan(lay: Layout, micro_batches: int) -> Plan:
    """The plan of `lay`'s schedule over `micro_batches` micro-batches."""
    runs = lay.schedule_runs
    counts = None
    if lay.ep_comm_overlap and lay.ep > 1:
        counts = tuple(unpaired_count(r, lay, lay.per_run(micro_batches)) for r in range(lay.pp))
    return plan(lay.pp_schedule, lay.pp, micro_batches, lay.virtual_stages, runs, counts, lay.staged_zero3)


@dataclass(frozen=True)
class Run:
    """A plan run with a layout's stage costs: each pass's start and end, each rank's last end."""

    plan: Plan
    starts: list[float]
    ends: list[float]
    clocks: list[float]

    @property
    def end_s(self) -> float:
        return max(self.clocks)


def run(stages, lay: Layout, micro_batches: int) -> Run:
    """Start and end of every pass of one step of `lay` (planner.simulate.StageCost per rank)."""
    pl = layout_plan(lay, micro_batches)
    durations = {}  # (rank, chunk, showing) -> seconds by kind code
    shows = (False, True) if any(pl.showing) else (False,)
    for r, st in enumerate(stages):
        gap = st.dp_exposed_s if lay.staged_zero3 else 0.0
        for c, chunk in enumerate(st.chunks):
            for show in shows:
                ch = chunk.showing_ep() if show else chunk
                durations[r, c, show] = (ch.fwd_s, ch.bwd_s, ch.bwd_s - ch.wgrad_s, ch.wgrad_s, gap)
    clock = [0.0] * lay.pp
    n = len(pl.ranks)
    starts, ends = [0.0] * n, [0.0] * n
    ranks, chunks, showing, codes, dep1, dep2 = pl.ranks, pl.chunks, pl.showing, pl.kind_codes, pl.dep1, pl.dep2
    for i in range(n):
        r = ranks[i]
        start = clock[r]
        d = dep1[i]
        if d >= 0 and ends[d] > start:
            start = ends[d]
        d = dep2[i]
        if d >= 0 and ends[d] > start:
            start = ends[d]
        end = start + durations[r, chunks[i], bool(showing[i])][codes[i]]
        starts[i], ends[i], clock[r] = start, end, end
    return Run(pl, starts, ends, clock)


@dataclass(frozen=True)
class Tail:
    """What one rank runs after its last pass, each (start, end): the exposed gradient sync, the wait for
    and the sum of a shared embedding's gradient, the gradient buffer's passes, the optimizer step."""

    sync: tuple[float, float]
    tied_wait: tuple[float, float]
    tied: tuple[float, float]
    passes: tuple[float, float]
    optimizer: tuple[float, float]

    @property
    def end_s(self) -> float:
        return self.optimizer[1]


def tails(stages, clocks: list[float]) -> list[Tail]:
    """Each rank's tail from its last pass's end `clocks[r]` (module docstring)."""
    synced = [c + st.dp_exposed_s for st, c in zip(stages, clocks)]
    tied_start = max((s for s, st in zip(synced, stages) if st.tied_sync_s), default=0.0)
    out = []
    for st, c, s in zip(stages, clocks, synced):
        wait_end = max(s, tied_start) if st.tied_sync_s else s
        tied_end = wait_end + st.tied_sync_s
        passes_end = tied_end + st.grad_passes_s
        out.append(Tail((c, s), (s, wait_end), (wait_end, tied_end), (tied_end, passes_end),
                        (passes_end, passes_end + st.optimizer_s)))
    return out
