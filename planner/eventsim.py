"""A discrete-event simulation of N ranks running programs of compute and communication, on shared cores.

Each rank runs a list of operations in order:

    Compute(name, seconds)              `seconds` of work at one core's full speed
    Collective(name, group, seconds)    every member of `group` posts it; it starts when the last member
                                        has posted it and each member's queue for that group is free,
                                        and takes `seconds` (gloo runs one operation at a time per
                                        process group, in posting order); blocking unless `handle`
    Wait(handle)                        blocks until that asynchronous operation has completed
    Send(name, dst, key, seconds)       posts a message that arrives `seconds` later (isend)
    Recv(name, src, key)                blocks until the message with `key` has arrived

The cores are shared as a processor-sharing server: while k ranks compute and c communication
operations keep a thread busy (weight `cpu` each), a computing rank progresses at min(1, cores /
(k + sum of cpu)) of its full speed. Communication durations are what was measured with the whole
world communicating, so they are not scaled again.

The result is a `Timeline` in the engine's span format (one compute lane, one comm lane per rank, idle
spans where a rank waits) and each rank's end time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.trace import Span, Timeline


@dataclass
class Compute:
    name: str
    seconds: float
    micro_batch: int | None = None


@dataclass
class Collective:
    name: str
    group: tuple[int, ...]  # global ranks, the same tuple on every member
    group_name: str  # mesh axis ("dp", "tp", ...), for the span
    seconds: float
    nbytes: int = 0
    handle: str | None = None  # asynchronous when set: Wait(handle) blocks for it
    cpu: float = 0.0  # share of a core its thread keeps busy while it runs
    micro_batch: int | None = None


@dataclass
class Wait:
    handle: str


@dataclass
class Send:
    name: str
    dst: int
    key: tuple
    seconds: float
    nbytes: int = 0
    group_name: str = "pp"
    micro_batch: int | None = None


@dataclass
class Recv:
    name: str
    src: int
    key: tuple
    group_name: str = "pp"
    micro_batch: int | None = None


@dataclass
class _Posted:
    """One collective as it is being posted by its members."""

    seconds: float
    members: set[int] = field(default_factory=set)
    ready: dict[int, float] = field(default_factory=dict)  # member -> time its queue can start it
    start: float | None = None
    end: float | None = None


class SimulationError(RuntimeError):
    """The programs cannot all finish (a collective some member never posts, a message never sent)."""


def simulate(programs: dict[int, list], cores: float, max_events: int = 2_000_000) -> tuple[Timeline, dict[int, float]]:
    """Run every rank's program from time 0; return the timeline and each rank's end time."""
    ranks = sorted(programs)
    pc = dict.fromkeys(ranks, 0)
    clock = dict.fromkeys(ranks, 0.0)
    remaining: dict[int, float] = {}  # rank -> compute work left in its current Compute
    started: dict[int, float] = {}  # rank -> start of its current Compute
    blocked_since: dict[int, float] = {}
    seq: dict[tuple[int, tuple], int] = {}  # (rank, group) -> collectives posted so far
    current: dict[int, tuple] = {}  # rank -> the blocking collective it has posted and waits for
    queue_free: dict[tuple[int, tuple], float] = {}
    posted: dict[tuple, _Posted] = {}
    handles: dict[tuple[int, str], tuple] = {}  # (rank, handle) -> collective id
    arrivals: dict[tuple, float] = {}
    running_comm: list[tuple[float, float, float]] = []  # (start, end, cpu) of every collective per member
    spans: list[Span] = []
    done = dict.fromkeys(ranks, False)
    t = 0.0

    def cpu_load(now: float) -> float:
        return sum(cpu for s, e, cpu in running_comm if s <= now < e)

    def start_collective(cid: tuple) -> None:
        p = posted[cid]
        p.start = max(p.ready.values())
        p.end = p.start + p.seconds
        for member in p.members:
            queue_free[(member, cid[0])] = p.end

    def advance(r: int) -> None:
        """Run rank r's instantaneous operations at time t until it computes, blocks or ends."""
        prog = programs[r]
        while pc[r] < len(prog):
            op = prog[pc[r]]
            if isinstance(op, Compute):
                if r not in remaining:
                    remaining[r] = op.seconds
                    started[r] = t
                return
            if isinstance(op, Collective):
                gkey = op.group
                cid = current.get(r)
                if cid is None:  # post it
                    n = seq.get((r, gkey), 0)
                    cid = current[r] = (gkey, n)
                    seq[(r, gkey)] = n + 1
                    p = posted.setdefault(cid, _Posted(op.seconds))
                    p.members.add(r)
                    p.ready[r] = max(t, queue_free.get((r, gkey), 0.0))
                    if op.handle is not None:
                        handles[(r, op.handle)] = cid
                    if len(p.members) == len(op.group):
                        start_collective(cid)
                        for member in p.members:
                            running_comm.append((p.start, p.end, op.cpu))
                    spans_pending.setdefault(cid, []).append((r, op))
                    if op.handle is not None:
                        del current[r]
                        pc[r] += 1
                        continue
                p = posted[cid]
                if p.end is None or p.end > t:
                    return
                del current[r]
                pc[r] += 1
                continue
            if isinstance(op, Wait):
                cid = handles.get((r, op.handle))
                if cid is None:
                    raise SimulationError(f"rank {r} waits for {op.handle!r}, which it never posted")
                p = posted[cid]
                if p.end is None or p.end > t:
                    return
                pc[r] += 1
                continue
            if isinstance(op, Send):
                arrivals[(op.key, op.dst)] = t + op.seconds
                spans.append(Span(r, "comm", op.name, t, t + op.seconds, bytes=op.nbytes, group=op.group_name,
                                  is_async=True, micro_batch=op.micro_batch))
                pc[r] += 1
                continue
            if isinstance(op, Recv):
                arrival = arrivals.get((op.key, r))
                if arrival is None or arrival > t:
                    blocked_since.setdefault(r, t)
                    return
                since = blocked_since.pop(r, t)
                if t > since:
                    spans.append(Span(r, "comm", op.name, since, t, group=op.group_name, micro_batch=op.micro_batch))
                pc[r] += 1
                continue
            raise TypeError(f"unknown operation {op!r}")
        if not done[r]:
            done[r] = True
            clock[r] = t

    spans_pending: dict[tuple, list] = {}
    for _ in range(max_events):
        for r in ranks:
            if not done[r] and r not in remaining:
                advance(r)
        if all(done.values()):
            break
        computing = [r for r in ranks if r in remaining]
        load = len(computing) + cpu_load(t)
        rate = min(1.0, cores / load) if load > 0 else 1.0
        # the next event: a compute finishing, a collective ending or starting, a message arriving
        candidates = [t + remaining[r] / rate for r in computing]
        candidates += [p.end for p in posted.values() if p.end is not None and p.end > t]
        candidates += [p.start for p in posted.values() if p.start is not None and p.start > t]
        candidates += [a for a in arrivals.values() if a > t]
        future = [c for c in candidates if c > t + 1e-15]
        if not future:
            stuck = ", ".join(f"rank {r} at {programs[r][pc[r]]}" for r in ranks if not done[r])
            raise SimulationError(f"the programs deadlock: {stuck}")
        t_next = min(future)
        for r in computing:
            remaining[r] -= (t_next - t) * rate
            if remaining[r] <= 1e-12:
                op = programs[r][pc[r]]
                spans.append(Span(r, "compute", op.name, started[r], t_next, micro_batch=op.micro_batch))
                del remaining[r], started[r]
                pc[r] += 1
        t = t_next
    else:
        raise SimulationError("the simulation did not finish within its event budget")
    for cid, members in spans_pending.items():
        p = posted[cid]
        for r, op in members:
            spans.append(Span(r, "comm", op.name, p.start, p.end, bytes=op.nbytes, group=op.group_name,
                              is_async=op.handle is not None, micro_batch=op.micro_batch))
    return Timeline(spans, source="predicted", meta={"cores": cores}), {r: clock[r] for r in ranks}


def idle_spans(timeline: Timeline, end_s: float) -> list[Span]:
    """Gaps where a rank neither computes nor communicates (pipeline bubbles, waits for peers)."""
    out = []
    for rank in timeline.ranks:
        busy = sorted((s.start_s, s.end_s) for s in timeline.spans if s.rank == rank and s.lane != "idle"
                      and not s.is_async)
        t = 0.0
        for a, b in busy:
            if a > t + 1e-9:
                out.append(Span(rank, "idle", "wait", t, a))
            t = max(t, b)
        if end_s > t + 1e-9:
            out.append(Span(rank, "idle", "wait", t, end_s))
    return out

