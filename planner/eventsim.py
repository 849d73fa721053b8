"""A discrete-event simulation of N ranks running programs of compute and communication, on shared cores.

Each rank runs a list of operations in order:

    Compute(name, seconds)              `seconds` of work at one core's full speed
    Collective(name, group, seconds)    every member of `group` posts it; it starts when the last member
                                        has posted it, the group's previous operation has started and
                                        one of the group's GLOO_THREADS worker threads is free (a gloo
                                        process group works its queue in posting order on a pool of
                                        threads), and takes `seconds`; blocking unless `handle`.
                                        An asynchronous one with `contended_s` runs at 1/contended_s
                                        of its work per second while any member computes, 1/seconds
                                        while none does (gloo barely progresses under its ranks' compute);
                                        while two of its group's operations run at once, each gets
                                        `concurrency` / 2 of its speed (the group's lowest: both gloo
                                        threads want the same cores)
    Wait(handle)                        blocks until that asynchronous operation has completed
    Send(name, dst, key, seconds)       posts a message (isend): it arrives `seconds` after it is sent,
                                        and not before `late_s` after its receive is posted (either may
                                        be a tuple: its k-th entry when k cores' worth of work (computing
                                        ranks, busy gloo threads) is wanted as the second of the two is
                                        posted, the last for more; `idle_late_s` when
                                        nothing is wanted then: the sender blocked, no rank
                                        computing);
                                        with `handle`, Wait(handle) blocks the sender until it has arrived;
                                        posting it holds the sender `post_s` (drawn as a blocking
                                        span "post <name>"), a core's worth of work wanted all
                                        the while (the sender's own thread writes the message)
    Recv(name, src, key)                posts the receive and blocks until the message with `key` has
                                        arrived

Point-to-point is a rendezvous, as gloo's is: a message moves only once its receive is posted too, so a
receive posted long after the send still waits for the transfer (`late_s`, default `seconds`). Measured
here: a receive posted 20 ms after its send took 0.5 ms for 1 KB (0.3 ms when posted first) and 1.7 ms
for 1 MB (1.5 ms); the sender's wait on its isend returned only once the receive was posted (20.8 ms).
How long either takes depends on whether a gloo thread finds a core: on 2 cores a late 1 KB transfer took
0.6-1.1 ms with one sender computing, 4.5-6 ms with two, a message to a waiting receive 0.1-0.2 ms with one
and about 3 ms with two (engine/calibrate._pipeline_messages), so `seconds` and `late_s` may give it by how
busy the cores are when the second side is posted (computing ranks and gloo threads, as below; a sender
computing, or held posting it, right after its isend counts). A late receive while nothing computes (its
sender blocked in a wait or a receive of its own) has a calibrated time of its own, `idle_late_s`: its
median is the same 0.1-0.2 ms, but a tenth or more of them wait a scheduler tick (3-4 ms) for the blocked
sender's thread, 0.6-1.2 ms on average against 0.2-1.1 with the sender computing.

The cores are shared as a processor-sharing server: while k ranks compute and c communication
operations keep a thread busy (weight `cpu` each), a computing rank progresses at min(1, cores /
(k + sum of cpu)) of its full speed. Communication durations are what was measured with the whole
world communicating, so they are not scaled again.

The result is a `Timeline` in the engine's span format (one compute lane, one comm lane per rank; a
rank's waits are the gaps) and each rank's end time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.timeline import Span, Timeline
from hardware.this_machine import GLOO_THREADS


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
    # asynchronous only: its duration while a member computes (None: as `seconds`; math.inf: it makes
    # no progress until every member has stopped computing)
    contended_s: float | None = None
    # operations' worth of work its group gets through in `seconds` while GLOO_THREADS of its operations run
    # at once (GLOO_THREADS: each at full speed; 1: together no faster than one after the other)
    concurrency: float = GLOO_THREADS

    def __post_init__(self):
        if not 1 <= self.concurrency <= GLOO_THREADS:
            raise ValueError(f"{self.name}: concurrency must be within 1..{GLOO_THREADS}, got {self.concurrency!r}")


@dataclass
class Wait:
    handle: str


@dataclass
class Send:
    name: str
    dst: int
    key: tuple
    seconds: float | tuple[float, ...]  # a tuple: by the load as it is matched, as `late_s`
    nbytes: int = 0
    group_name: str = "pp"
    micro_batch: int | None = None
    handle: str | None = None  # Wait(handle) blocks the sender until the message has arrived
    # its transfer when the receive is posted after the send (None: `seconds`); a tuple: by the load at that
    # moment (the k-th entry for k cores' worth of computing ranks and busy gloo threads, rounded; the first
    # for less, the last for more)
    late_s: float | tuple[float, ...] | None = None
    idle_late_s: float | None = None  # its transfer when the receive is posted late while no work is wanted
    post_s: float | None = None  # how long posting it holds the sender (None: not at all)


@dataclass
class Recv:
    name: str
    src: int
    key: tuple
    group_name: str = "pp"
    micro_batch: int | None = None


@dataclass
class _Posted:
    """One collective as it is being posted by its members, then run."""

    op: Collective
    members: set[int] = field(default_factory=set)
    posted_at: float = 0.0  # when its last member posted it
    start: float | None = None
    end: float | None = None
    left: float = 1.0  # fraction of its work still to do (asynchronous ones progress at a varying rate)

    @property
    def dynamic(self) -> bool:
        """Whether its progress is followed step by step (its speed can change while it runs): an
        asynchronous one under compute, or any of a group whose operations can slow each other."""
        return (self.op.handle is not None and self.op.contended_s is not None) or len(self.members) > 1

    def rate(self, computing: set[int], share: float = 1.0) -> float:
        """Fraction of the operation done per second now, with `share` of its speed (its group's)."""
        busy = any(m in computing for m in self.members)
        seconds = self.op.contended_s if busy and self.op.contended_s is not None else self.op.seconds
        return share / seconds if seconds > 0 else math.inf


_RESOLUTION_S = 1e-13  # per second of clock: events closer than this to the clock are taken as now


def _by_load(value: float | tuple[float, ...], busy: int) -> float:
    """A Send's time given as a tuple by how busy the cores are (its `busy`-th entry, the last for more), or
    as one number."""
    return value[min(busy, len(value)) - 1] if isinstance(value, tuple) else value


class SimulationError(RuntimeError):
    """The programs cannot all finish (a collective some member never posts, a message never sent)."""


def simulate(programs: dict[int, list], cores: float,
             max_events: int = 2_000_000) -> tuple[Timeline, dict[int, float]]:
    """Run every rank's program from time 0; return the timeline and each rank's end time."""
    programs = {r: list(ops) for r, ops in programs.items()}  # a Send's posting is inserted as it runs
    ranks = sorted(programs)
    pc = dict.fromkeys(ranks, 0)
    clock = dict.fromkeys(ranks, 0.0)
    remaining: dict[int, float] = {}  # rank -> compute work left in its current Compute
    started: dict[int, float] = {}  # rank -> start of its current Compute
    blocked_since: dict[int, float] = {}
    seq: dict[tuple[int, tuple], int] = {}  # (rank, group) -> collectives posted so far
    current: dict[int, tuple] = {}  # rank -> the blocking collective it has posted and waits for
    posted: dict[tuple, _Posted] = {}  # (group, n) -> the group's n-th collective
    waiting: list[tuple] = []  # collectives every member has posted, not started yet
    handles: dict[tuple[int, str], tuple] = {}  # (rank, handle) -> collective id
    arrivals: dict[tuple, float] = {}  # (key, dst) -> when the message arrives (both sides posted)
    sends: dict[tuple, tuple[float, int, Send]] = {}  # (key, dst) -> (posted at, sender, op)
    receives: dict[tuple, float] = {}  # (key, dst) -> when the receive was posted
    send_handles: dict[tuple[int, str], tuple] = {}  # (sender, handle) -> (key, dst)
    spans: list[Span] = []
    spans_pending: dict[tuple, list] = {}
    done = dict.fromkeys(ranks, False)
    t = 0.0

    def running() -> list[_Posted]:
        return [p for p in posted.values() if p.start is not None and p.start <= t and not reached(p.end)]

    def shares(active: list[_Posted]) -> dict[tuple, float]:
        """Each group's share of its operations' speed now: with k > 1 of them running, the lowest
        `concurrency` among them over k."""
        by_group: dict[tuple, list[float]] = {}
        for p in active:
            by_group.setdefault(p.op.group, []).append(p.op.concurrency)
        return {g: min(1.0, min(c) / len(c)) for g, c in by_group.items()}

    def load(active: list[_Posted], share: dict[tuple, float] | None = None) -> float:
        """Cores' worth of work wanted now: each computing rank, and each running operation's threads (an
        operation slowed by its group's share keeps its threads that much less busy); `share`: `shares`
        of `active`, when the caller has it."""
        share = shares(active) if share is None else share
        return len(remaining) + sum(p.op.cpu * len(p.members) * share[p.op.group] for p in active)

    in_flight: dict[tuple, list[_Posted]] = {}  # group -> its operations started and not yet ended

    def reached(when: float | None) -> bool:
        """Whether an event at `when` has happened by now, within the clock's resolution (one tolerance for
        every check, so an event the next-event search skips as 'now' is also taken as done)."""
        return when is not None and when <= t + _RESOLUTION_S * max(1.0, t)

    def start_ready() -> None:
        """Start each fully posted collective once the group's previous operation has started and one of
        its GLOO_THREADS worker threads is free (fewer of its operations are running)."""
        for cid in sorted(waiting, key=lambda c: c[1]):
            group, n = cid
            before = posted.get((group, n - 1))
            if before is not None and (before.start is None or before.start > t):
                continue
            running = [q for q in in_flight.get(group, []) if not reached(q.end)]
            in_flight[group] = running
            if len(running) >= GLOO_THREADS:
                continue
            p = posted[cid]
            p.start = t
            running.append(p)
            if not p.dynamic:
                p.end = p.start + p.op.seconds
            waiting.remove(cid)

    def send_span(mid: tuple, end: float) -> None:
        sent, src, op = sends[mid]
        spans.append(Span(src, "comm", op.name, sent, end, bytes=op.nbytes, group=op.group_name, is_async=True,
                          micro_batch=op.micro_batch))

    def match(mid: tuple, sender_computes: bool = False) -> None:
        """Once a message's send and receive are both posted: when it arrives, and its span. A sender that
        computes right after its isend, or is held posting it (an operation of the sender alone), counts
        as computing (it is between two operations now)."""
        if mid in arrivals or mid not in sends or mid not in receives:
            return
        sent, _, op = sends[mid]
        wanted = round(load(running()) + sender_computes)  # cores' worth of work wanted now
        busy = max(wanted, 1)
        arrival = sent + _by_load(op.seconds, busy)
        if receives[mid] > sent:  # a late receive: the rendezvous moves the message only now
            late = op.idle_late_s if wanted == 0 and op.idle_late_s is not None else \
                _by_load(op.seconds if op.late_s is None else op.late_s, busy)
            arrival = max(arrival, receives[mid] + late)
        arrivals[mid] = arrival
        send_span(mid, arrivals[mid])

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
                    p = posted.setdefault(cid, _Posted(op))
                    p.members.add(r)
                    p.posted_at = max(p.posted_at, t)
                    if op.handle is not None:
                        handles[(r, op.handle)] = cid
                    if len(p.members) == len(op.group):
                        waiting.append(cid)
                        start_ready()
                    spans_pending.setdefault(cid, []).append((r, op, t))
                    if op.handle is not None:
                        del current[r]
                        pc[r] += 1
                        continue
                p = posted[cid]
                if not reached(p.end):
                    return
                del current[r]
                pc[r] += 1
                continue
            if isinstance(op, Wait):
                if (r, op.handle) in send_handles:
                    if not reached(arrivals.get(send_handles[(r, op.handle)])):
                        return
                    pc[r] += 1
                    continue
                cid = handles.get((r, op.handle))
                if cid is None:
                    raise SimulationError(f"rank {r} waits for {op.handle!r}, which it never posted")
                p = posted[cid]
                if not reached(p.end):
                    return
                pc[r] += 1
                continue
            if isinstance(op, Send):
                mid = (op.key, op.dst)
                sends[mid] = (t, r, op)
                if op.handle is not None:
                    send_handles[(r, op.handle)] = mid
                after = prog[pc[r] + 1] if pc[r] + 1 < len(prog) else None
                holds = op.post_s is not None
                match(mid, holds or isinstance(after, Compute))
                pc[r] += 1
                if holds and op.post_s > 0:  # posting holds the sender: an operation of its own, next
                    # its thread busy on a core (cpu 1), so the ranks computing meanwhile share the cores with
                    # it: counted as idle, posting had let them run on as if it took none. Over eight
                    # calibrations here this took the same 21 measured runs' mean error from 8.7-16.7 % to
                    # 8.5-15.3 % (lower with every one), 2-rank Mamba-2 context parallel (its state messages
                    # posted while gradient buckets keep gloo busy) from -15..-25 % to -3..-14 %; in three
                    # sessions of a fresh calibration then the runs, 11.0 / 15.3 / 13.3 % to 11.6 / 14.4 / 11.4
                    prog.insert(pc[r], Collective(f"post {op.name}", (r,), op.group_name, op.post_s,
                                                  micro_batch=op.micro_batch, cpu=1.0))
                continue
            if isinstance(op, Recv):
                mid = (op.key, r)
                receives.setdefault(mid, t)
                match(mid)
                arrival = arrivals.get(mid)
                if not reached(arrival):
                    blocked_since.setdefault(r, t)
                    return
                since = blocked_since.pop(r, t)
                # recorded even when the message was already there (no wait), as the engine records it
                spans.append(Span(r, "comm", op.name, since, t, group=op.group_name, micro_batch=op.micro_batch))
                pc[r] += 1
                continue
            raise TypeError(f"unknown operation {op!r}")
        if not done[r]:
            done[r] = True
            clock[r] = t

    for _ in range(max_events):
        for _settle in range(len(ranks) + 1):  # posting can start collectives that let others go on
            before = (dict(pc), len(waiting))
            for r in ranks:
                if not done[r] and r not in remaining:
                    advance(r)
            start_ready()
            if (dict(pc), len(waiting)) == before:
                break
        if all(done.values()):
            break
        computing = {r for r in ranks if r in remaining}
        active = running()
        share = shares(active)
        wanted = load(active, share)
        rate = min(1.0, cores / wanted) if wanted > 0 else 1.0
        dynamic = [(p, p.rate(computing, share[p.op.group])) for p in active if p.dynamic]
        instant = [p for p, speed in dynamic if speed == math.inf]
        if instant:  # a zero-second operation (a fit can reach 0 for a small buffer) is done as soon as it runs
            for p in instant:
                p.end = t
            continue
        # the next event: a compute finishing, a collective ending or starting, a message arriving
        candidates = [t + remaining[r] / rate for r in computing]
        candidates += [p.end for p in posted.values() if p.end is not None and p.end > t]
        candidates += [p.start for p in posted.values() if p.start is not None and p.start > t]
        candidates += [t + p.left / speed for p, speed in dynamic if speed > 0]
        candidates += [a for a in arrivals.values() if a > t]
        future = [c for c in candidates if not reached(c)]
        if not future:
            stuck = ", ".join(f"rank {r} at {programs[r][pc[r]]}" for r in ranks if not done[r])
            raise SimulationError(f"the programs deadlock: {stuck}")
        t_next = min(future)
        for r in computing:
            remaining[r] -= (t_next - t) * rate
            if remaining[r] <= 1e-12 or remaining[r] / rate <= _RESOLUTION_S * max(1.0, t_next):
                op = programs[r][pc[r]]
                spans.append(Span(r, "compute", op.name, started[r], t_next, micro_batch=op.micro_batch))
                del remaining[r], started[r]
                pc[r] += 1
        for p, speed in dynamic:
            p.left -= (t_next - t) * speed
            # done when the time it still needs is below the clock's resolution: the fraction left carries
            # the rounding of t_next - t times its speed (a 10 us operation at t = 1 s keeps ~1e-11 of
            # its work), and a remainder shorter than the next-event threshold would never be reached
            if p.left <= 1e-12 or (speed > 0 and p.left / speed <= _RESOLUTION_S * max(1.0, t_next)):
                p.end = t_next
        t = t_next
    else:
        raise SimulationError("the simulation did not finish within its event budget")
    for mid, (sent, _, op) in sends.items():  # never received: drawn for their own time
        if mid not in arrivals:
            send_span(mid, sent + op.seconds)
    for cid, members in spans_pending.items():
        p = posted[cid]
        # from when this rank posted it, as the engine's spans are drawn (engine/comm.py: from the call): a
        # blocking collective's wait for its peers and for the operations queued before it is its own time on
        # both timelines (drawn from its start, the wait had read as "waiting for a peer" in the prediction
        # and as the collective in the measurement: "reduce-scatter took 6.1x its predicted time")
        for r, op, posted_at in members:
            spans.append(Span(r, "comm", op.name, min(posted_at, p.start), p.end, bytes=op.nbytes,
                              group=op.group_name, is_async=op.handle is not None, micro_batch=op.micro_batch))
    return Timeline(spans, source="predicted", meta={"cores": cores}), {r: clock[r] for r in ranks}
