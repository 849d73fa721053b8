"""A list-scheduling simulator that times a schedule (op times per micro-batch, point-to-point latency),
and the papers' closed-form bubble fractions it is checked against."""

from __future__ import annotations

from dataclasses import dataclass

from core.schedules.build import (
    ACTIVATION,
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    GRADIENT,
    RECV,
    SCHEDULE_NAMES,
    SEND,
    Action,
    Schedule,
    ScheduleError,
)
from core.schedules.check import _peaks, check_schedule
from core.timeline import Span, Timeline


def formula_bubble_fraction(name: str, num_ranks: int, num_micro_batches: int, virtual_stages: int = 1,
                            times: OpTimes | None = None) -> float:
    """The papers' bubble time / ideal compute time, for comm_s = 0 (and m >= p for ZB-H1)."""
    p, m, v = num_ranks, num_micro_batches, virtual_stages
    if name in ("gpipe", "1f1b"):
        return (p - 1) / m  # Narayanan et al. 2021 eq. 1
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m)  # Narayanan et al. 2021 §2.2
    if name == "zb-h1":
        t = times or OpTimes()
        # Qi et al. 2023 §2.1: ZB-H1 bubble (p - 1)(T_F + T_B - T_W), T_B being our BI, derived with equal op times.
        # Its deferred BWs fill the gaps only as far as they go: rank 0 holds at most p forwards (1F1B's memory),
        # so it idles at least (p - 1) T_B before its first BI, and the last rank at least (p - 1) T_F before its
        # first F. With t_B = 3 t_F the paper's expression gives 0.094 at p = 4, m = 8, the schedule 0.141.
        bubble = (p - 1) * max(t.forward_s, t.backward_input_s,
                               t.forward_s + t.backward_input_s - t.backward_weight_s)
        return bubble / (m * (t.forward_s + t.backward_s))
    raise ScheduleError(f"unknown schedule {name!r}: choose one of {SCHEDULE_NAMES}")


@dataclass(frozen=True)
class OpTimes:
    """Seconds for one micro-batch through all the layers one rank holds (a chunk takes 1/v of them).

    A fused backward takes backward_input_s + backward_weight_s. comm_s is the latency of one
    point-to-point transfer; transfers do not contend for links.
    """

    forward_s: float = 1.0
    backward_input_s: float = 1.0
    backward_weight_s: float = 1.0
    comm_s: float = 0.0

    def __post_init__(self):
        for name in ("forward_s", "backward_input_s", "backward_weight_s"):
            if not getattr(self, name) > 0:
                raise ScheduleError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.comm_s >= 0:
            raise ScheduleError(f"comm_s must be >= 0, got {self.comm_s!r}")

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s

    def duration_s(self, action: Action, virtual_stages: int) -> float:
        per_rank = {FORWARD: self.forward_s, BACKWARD: self.backward_s, BACKWARD_INPUT: self.backward_input_s,
                    BACKWARD_WEIGHT: self.backward_weight_s}.get(action.kind, 0.0)
        return per_rank / virtual_stages


@dataclass(frozen=True)
class Simulation:
    """Start and end of every action (aligned with `schedule.actions`), and what they add up to.

    bubble_fraction = (makespan - ideal) / ideal, ideal being one rank's compute time m (t_F + t_B):
    Narayanan et al. 2021 eq. 1's bubble time / ideal time. peak_in_flight[r] counts (micro-batch, chunk)
    pairs whose forward ran and whose B / BI has not (activations held; a chunk holds 1/v of the
    rank's layers). peak_weight_grads_pending[r] counts BI done, BW not yet.
    """

    schedule: Schedule
    times: OpTimes
    intervals_s: tuple[tuple[tuple[float, float], ...], ...]
    transfers_s: dict[tuple[str, int, int], tuple[float, float]]  # message -> (sent, arrived)
    makespan_s: float
    ideal_s: float
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    peak_weight_grads_pending: tuple[int, ...]

    def timeline(self, step: int = 0) -> Timeline:
        """Compute spans, transfer spans on both ends, and the idle gaps (bubbles) of each rank."""
        sched, spans = self.schedule, []
        for rank, (actions, intervals) in enumerate(zip(sched.actions, self.intervals_s, strict=True)):
            busy_until = 0.0
            for action, (start, end) in zip(actions, intervals, strict=True):
                if action.is_compute:
                    if start > busy_until:
                        spans.append(Span(rank, "idle", "bubble", busy_until, start, step=step))
                    spans.append(Span(rank, "compute", f"{action.kind} s{action.stage}", start, end,
                                      step=step, micro_batch=action.micro_batch))
                    busy_until = end
                elif self.times.comm_s > 0:
                    sent, arrived = self.transfers_s[action.message]
                    spans.append(Span(rank, "comm", f"{action.kind.lower()} {action.tensor} s{action.stage}",
                                      sent, arrived, step=step, micro_batch=action.micro_batch,
                                      group="pp", is_async=action.kind == SEND))
            if self.makespan_s > busy_until:
                spans.append(Span(rank, "idle", "bubble", busy_until, self.makespan_s, step=step))
        meta = {"schedule": sched.name, "num_ranks": sched.num_ranks,
                "num_micro_batches": sched.num_micro_batches, "virtual_stages": sched.virtual_stages,
                "bubble_fraction": self.bubble_fraction}
        return Timeline(spans, source="predicted", meta=meta)


def simulate(schedule: Schedule, times: OpTimes | None = None) -> Simulation:
    """List-schedule every rank's actions in order, honouring data dependencies; raise on a deadlock.

    An action starts when its rank has finished the previous one and its inputs are ready: F on stage s
    needs F of s - 1 (same micro-batch), B / BI on s needs its own F and B / BI of s + 1, BW needs its
    BI; an input from another rank must have been RECVed earlier on this rank. A SEND costs its rank
    nothing; its tensor arrives comm_s later; a RECV waits for that arrival.
    """
    times = times or OpTimes()
    check_schedule(schedule)
    p, v, num_stages = schedule.num_ranks, schedule.virtual_stages, schedule.num_stages
    done_s: dict[tuple[str, int, int], float] = {}  # ("F" | "grad" | "BI", mb, stage) -> end time
    transfers: dict[tuple[str, int, int], tuple[float, float]] = {}
    received: list[set] = [set() for _ in range(p)]
    clock = [0.0] * p
    cursor = [0] * p
    intervals: list[list[tuple[float, float]]] = [[] for _ in range(p)]

    def local_input(rank: int, key: tuple[str, int, int], action: Action) -> float:
        if key not in done_s:
            raise ScheduleError(f"{schedule.name}: rank {rank} runs {action} before its input {key} "
                                f"was computed on this rank")
        return done_s[key]

    def step(rank: int) -> bool:
        """Run rank's next action if it can start; False when it waits on another rank."""
        a = schedule.actions[rank][cursor[rank]]
        start = clock[rank]
        if a.kind == RECV:
            if a.message not in transfers:
                return False
            start_transfer_s, arrival_s = transfers[a.message]
            end = max(start, arrival_s)
            received[rank].add(a.message)
        elif a.kind == SEND:
            producer = (FORWARD if a.tensor == ACTIVATION else "grad", a.micro_batch, a.stage)
            local_input(rank, producer, a)
            end = start
            transfers[a.message] = (start, start + times.comm_s)
        else:
            inputs = []
            if a.kind == FORWARD and a.stage > 0:
                inputs.append((FORWARD, ACTIVATION, a.stage - 1))
            if a.kind in (BACKWARD, BACKWARD_INPUT):
                inputs.append((FORWARD, None, a.stage))
                if a.stage < num_stages - 1:
                    inputs.append(("grad", GRADIENT, a.stage + 1))
            if a.kind == BACKWARD_WEIGHT:
                inputs.append((BACKWARD_INPUT, None, a.stage))
            for done_kind, tensor, stage in inputs:
                if stage % p != rank:
                    if (tensor, a.micro_batch, stage) not in received[rank]:
                        raise ScheduleError(f"{schedule.name}: rank {rank} runs {a} before it RECVs "
                                            f"{tensor} of micro-batch {a.micro_batch} from stage {stage}")
                else:
                    start = max(start, local_input(rank, (done_kind, a.micro_batch, stage), a))
            end = start + times.duration_s(a, v)
            done_s[(a.kind, a.micro_batch, a.stage)] = end
            if a.kind in (BACKWARD, BACKWARD_INPUT):
                done_s[("grad", a.micro_batch, a.stage)] = end
        intervals[rank].append((start, end))
        clock[rank] = end
        cursor[rank] += 1
        return True

    while True:
        progressed = False
        for rank in range(p):
            while cursor[rank] < len(schedule.actions[rank]) and step(rank):
                progressed = True
        if all(cursor[r] == len(schedule.actions[r]) for r in range(p)):
            break
        if not progressed:
            waits = ", ".join(f"rank {r} at {schedule.actions[r][cursor[r]]}" for r in range(p)
                              if cursor[r] < len(schedule.actions[r]))
            raise ScheduleError(f"{schedule.name}: deadlock, every rank waits for a SEND that never "
                                f"comes ({waits}); reorder the actions")

    makespan_s = max(clock)
    ideal_s = max(sum(times.duration_s(a, v) for a in actions) for actions in schedule.actions)
    peaks = [_peaks(schedule.compute_order(r)) for r in range(p)]
    return Simulation(
        schedule=schedule, times=times,
        intervals_s=tuple(tuple(iv) for iv in intervals), transfers_s=transfers,
        makespan_s=makespan_s, ideal_s=ideal_s, bubble_fraction=(makespan_s - ideal_s) / ideal_s,
        peak_in_flight=tuple(h for h, _ in peaks), peak_weight_grads_pending=tuple(w for _, w in peaks))
