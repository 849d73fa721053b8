"""Pipeline-parallel schedules as data, and a list-scheduling simulator that times them.

A model of S = p * v stages runs on p ranks; rank r holds the v chunks r, p + r, 2p + r, ... (chunk c of
rank r is model stage c * p + r, round-robin as in Narayanan et al. 2021 §2.2). A schedule is, per
rank, the ordered tuple of `Action`s that rank runs: compute actions F (forward), B (full backward),
BI (backward-input: dL/dx, on the critical path) and BW (backward-weight: dL/dW, deferrable), each of
one micro-batch on one stage, and SEND / RECV of an activation (forward, to stage s + 1) or a gradient
(backward, to stage s - 1). The executor walks a rank's tuple in order; a page draws the rank x time
grid from `simulate(...).timeline()`.

Semantics the executor must keep (the simulator assumes the same):
  * SEND is non-blocking (post an isend and go on; keep the tensor alive until it completes).
  * RECV blocks until its tensor has arrived; the tensor is kept by its `Action.message` key until the
    compute that needs it runs. RECVs are placed just before the compute that needs them and, per
    ordered pair of ranks, in the sender's SEND order, so plain FIFO point-to-point matching (no tags)
    pairs every SEND with its RECV. A RECV may therefore fetch an earlier message a little ahead of use.
  * With p = 1 every stage is on rank 0 and there is no SEND / RECV.

Pictures below: p = 4 ranks, m = 8 micro-batches, t_B = 2 t_F (t_BI = t_BW = t_F for ZB-H1), no
communication time; one cell per t_F / v; `.` is a bubble (idle). Bubble fraction = bubble time / ideal
compute time m (t_F + t_B) (Narayanan et al. 2021 eq. 1); "held" = peak micro-batches whose forward ran
and whose B / BI has not, per rank. Drawn by `render_ascii(simulate(make_schedule(name, 4, 8, v)))`
(with wrap_cells=29 for interleaved).

GPipe (Huang et al. 2019): all forwards, then all backwards. Bubble (p - 1) / m = 0.375, held [8, 8, 8, 8]::

    r0 F0F1F2F3F4F5F6F7..................B0--B1--B2--B3--B4--B5--B6--B7--
    r1 ..F0F1F2F3F4F5F6F7............B0--B1--B2--B3--B4--B5--B6--B7--
    r2 ....F0F1F2F3F4F5F6F7......B0--B1--B2--B3--B4--B5--B6--B7--
    r3 ......F0F1F2F3F4F5F6F7B0--B1--B2--B3--B4--B5--B6--B7--

1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2): rank r runs p - 1 - r warm-up forwards, then
alternates one forward and one backward, then drains the backwards (cool-down). The same bubble as
GPipe, (p - 1) / m = 0.375, but rank r holds p - r activations instead of m: held [4, 3, 2, 1]::

    r0 F0F1F2F3............B0--F4B1--F5B2--F6B3--F7B4--..B5--..B6--..B7--
    r1 ..F0F1F2........B0--F3B1--F4B2--F5B3--F6B4--F7B5--..B6--..B7--
    r2 ....F0F1....B0--F2B1--F3B2--F4B3--F5B4--F6B5--F7B6--..B7--
    r3 ......F0B0--F1B1--F2B2--F3B3--F4B4--F5B5--F6B6--F7B7--

Interleaved 1F1B (Narayanan et al. 2021 §2.2, in Megatron-LM's order): each rank holds v chunks and a
micro-batch visits every rank v times, each visit 1/v as long, so fill and drain shrink v-fold: bubble
(p - 1) / (v m) = 0.1875 for v = 2. Micro-batches go round in groups of p, so m must be a multiple of p.
Rank r warms up with 2 (p - 1 - r) + (v - 1) p chunk-forwards (all of them when m = p), so it holds
more: (micro-batch, chunk) pairs [11, 9, 7, 5], i.e. [5.5, 4.5, 3.5, 2.5] micro-batches' worth of
activations. Cells show micro-batch and chunk, `3B` = forward of micro-batch 3 on chunk b (stage
p + r), `3b` its backward::

    r0 0A1A2A3A0B1B2B3B4A5A6A......0b--7A1b--..4B2b--5B3b--6B0a--
    r1 ..0A1A2A3A0B1B2B3B4A....0b--5A1b--6A2b--7A3b--4B0a--5B1a--
    r2 ....0A1A2A3A0B1B2B..0b--3B1b--4A2b--5A3b--6A0a--7A1a--4B2a
    r3 ......0A1A2A3A0B0b--1B1b--2B2b--3B3b--4A0a--5A1a--6A2a--7A

    r0 7B1a--2a--..3a--..4b--..5b--..6b--..7b--4a--5a--6a--7a--
    r1 6B2a--7B3a--..4b--..5b--..6b--..7b--4a--5a--6a--7a--
    r2 --5B3a--6B4b--7B5b--..6b--..7b--4a--5a--6a--7a--
    r3 3a--4B4b--5B5b--6B6b--7B7b--4a--5a--6a--7a--

ZB-H1 (Qi et al. 2023 §2.1): the backward is split into BI (`B`, dL/dx, on the critical path) and BW
(`W`, dL/dW, deferrable). With only BI on the path the backward wave crosses the pipeline faster, and
rank r defers its BW by r micro-batches to fill the cool-down. Bubble
(p - 1)(t_F + t_BI - t_BW) / (m (t_F + t_BI + t_BW)) = 0.125, a third of 1F1B's, for equal op times
and m >= p (other times: trust the simulator). Activations held until BI are 1F1B's, [4, 3, 2, 1];
rank r also keeps up to r + 1 micro-batches' BW inputs (layer inputs and output gradients, smaller:
Qi et al. 2023 Table 1)::

    r0 F0F1F2F3......B0W0F4B1W1F5B2W2F6B3W3F7B4W4B5W5B6W6B7W7
    r1 ..F0F1F2....B0F3B1W0F4B2W1F5B3W2F6B4W3F7B5W4B6W5B7W6W7
    r2 ....F0F1..B0F2B1F3B2W0F4B3W1F5B4W2F6B5W3F7B6W4B7W5W6W7
    r3 ......F0B0F1B1F2B2F3B3W0F4B4W1F5B5W2F6B6W3F7B7W4W5W6W7
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.trace import Span, Timeline

FORWARD = "F"
BACKWARD = "B"
BACKWARD_INPUT = "BI"
BACKWARD_WEIGHT = "BW"
SEND = "SEND"
RECV = "RECV"
COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
ACTION_KINDS = COMPUTE_KINDS + (SEND, RECV)
ACTIVATION = "act"
GRADIENT = "grad"

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


class ScheduleError(ValueError):
    """A schedule that cannot be built or would not run; the message says what to change."""


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule.

    For compute kinds, `stage` / `chunk` say which layers run (global model stage, and its index among
    this rank's chunks). For SEND it is the stage that produced the tensor, for RECV the stage that will
    consume it; `peer` is the other rank and `tensor` is ACTIVATION or GRADIENT.
    """

    kind: str
    micro_batch: int
    stage: int
    chunk: int
    peer: int | None = None
    tensor: str = ""

    def __post_init__(self):
        if self.kind not in ACTION_KINDS:
            raise ScheduleError(f"action kind must be one of {ACTION_KINDS}, got {self.kind!r}")
        is_comm = self.kind in (SEND, RECV)
        if is_comm != (self.peer is not None) or is_comm != (self.tensor in (ACTIVATION, GRADIENT)):
            raise ScheduleError(f"{self.kind} needs a peer and a tensor exactly when it is SEND or RECV")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def message(self) -> tuple[str, int, int] | None:
        """(tensor, micro_batch, sending stage): the key a SEND and its RECV share."""
        if self.kind == SEND:
            return (self.tensor, self.micro_batch, self.stage)
        if self.kind == RECV:
            sender = self.stage - 1 if self.tensor == ACTIVATION else self.stage + 1
            return (self.tensor, self.micro_batch, sender)
        return None

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind} mb{self.micro_batch} s{self.stage}"
        arrow = "->" if self.kind == SEND else "<-"
        return f"{self.kind} {self.tensor} mb{self.micro_batch} s{self.stage} {arrow} r{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one pipeline step; `actions[r]` is what rank r runs, in order."""

    name: str
    num_ranks: int
    num_micro_batches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        return any(a.kind == BACKWARD_INPUT for rank in self.actions for a in rank)

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.num_ranks

    def stage_of(self, rank: int, chunk: int) -> int:
        # Round-robin chunks: Narayanan et al. 2021 §2.2.
        return chunk * self.num_ranks + rank

    def compute_order(self, rank: int) -> tuple[Action, ...]:
        return tuple(a for a in self.actions[rank] if a.is_compute)


def _check_sizes(num_ranks: int, num_micro_batches: int, virtual_stages: int = 1) -> None:
    for what, value in (("num_ranks (p)", num_ranks), ("num_micro_batches (m)", num_micro_batches),
                        ("virtual_stages (v)", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{what} must be an integer >= 1, got {value!r}")


def _compute(kind: str, micro_batch: int, stage: int, num_ranks: int) -> Action:
    return Action(kind, micro_batch, stage, stage // num_ranks)


def _outgoing(action: Action, num_ranks: int, num_stages: int) -> tuple[tuple[str, int, int], int] | None:
    """The message a compute action sends and its destination rank, or None when nothing leaves."""
    if action.kind == FORWARD and action.stage < num_stages - 1:
        dest = (action.stage + 1) % num_ranks
        msg = (ACTIVATION, action.micro_batch, action.stage)
    elif action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage > 0:
        dest = (action.stage - 1) % num_ranks
        msg = (GRADIENT, action.micro_batch, action.stage)
    else:
        return None
    return (msg, dest) if dest != action.stage % num_ranks else None


def _incoming(action: Action, num_ranks: int, num_stages: int) -> tuple[tuple[str, int, int], int] | None:
    """The message a compute action needs from another rank and that rank, or None."""
    if action.kind == FORWARD and action.stage > 0:
        src_stage, tensor = action.stage - 1, ACTIVATION
    elif action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage < num_stages - 1:
        src_stage, tensor = action.stage + 1, GRADIENT
    else:
        return None
    src = src_stage % num_ranks
    return ((tensor, action.micro_batch, src_stage), src) if src != action.stage % num_ranks else None


def _with_comm(name: str, num_ranks: int, num_micro_batches: int, virtual_stages: int,
               compute_orders: list[list[Action]]) -> Schedule:
    """Insert SEND after each producer and RECV before each consumer, FIFO-consistent per rank pair."""
    p, num_stages = num_ranks, num_ranks * virtual_stages
    outbox: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for src, order in enumerate(compute_orders):
        for action in order:
            out = _outgoing(action, p, num_stages)
            if out is not None:
                outbox.setdefault((src, out[1]), []).append(out[0])
    position = {(pair, msg): i for pair, msgs in outbox.items() for i, msg in enumerate(msgs)}

    ranks: list[tuple[Action, ...]] = []
    for rank, order in enumerate(compute_orders):
        received = {src: 0 for src in range(p)}
        actions: list[Action] = []
        for action in order:
            need = _incoming(action, p, num_stages)
            if need is not None:
                msg, src = need
                # Receive everything src sent us before `msg` too, so both sides agree on the FIFO order;
                # src produced those earlier, so this adds no waiting and no new dependency.
                msgs = outbox[(src, rank)]
                while received[src] <= position[((src, rank), msg)]:
                    tensor, mb, sender_stage = msgs[received[src]]
                    consumer = sender_stage + 1 if tensor == ACTIVATION else sender_stage - 1
                    actions.append(Action(RECV, mb, consumer, consumer // p, peer=src, tensor=tensor))
                    received[src] += 1
            actions.append(action)
            out = _outgoing(action, p, num_stages)
            if out is not None:
                (tensor, mb, stage), dest = out
                actions.append(Action(SEND, mb, stage, stage // p, peer=dest, tensor=tensor))
        ranks.append(tuple(actions))
    return Schedule(name, num_ranks, num_micro_batches, virtual_stages, tuple(ranks))


def gpipe(num_ranks: int, num_micro_batches: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019)."""
    _check_sizes(num_ranks, num_micro_batches)
    p, m = num_ranks, num_micro_batches
    orders = [[_compute(FORWARD, i, r, p) for i in range(m)] + [_compute(BACKWARD, i, r, p) for i in range(m)]
              for r in range(p)]
    return _with_comm("gpipe", p, m, 1, orders)


def one_f_one_b(num_ranks: int, num_micro_batches: int) -> Schedule:
    """PipeDream-Flush: p - 1 - r warm-up forwards, then one forward / one backward, then cool-down.

    With m < p the warm-up of the first ranks takes every micro-batch (GPipe's order there; correct, but
    the bubble grows as (p - 1) / m says).
    """
    _check_sizes(num_ranks, num_micro_batches)
    p, m = num_ranks, num_micro_batches
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)  # Narayanan et al. 2021 §2.2 (Megatron-LM's num_warmup_microbatches)
        order = [_compute(FORWARD, i, r, p) for i in range(warmup)]
        for i in range(m - warmup):
            order += [_compute(FORWARD, warmup + i, r, p), _compute(BACKWARD, i, r, p)]
        order += [_compute(BACKWARD, i, r, p) for i in range(m - warmup, m)]
        orders.append(order)
    return _with_comm("1f1b", p, m, 1, orders)


def _interleaved_action(kind: str, k: int, rank: int, num_ranks: int, virtual_stages: int) -> Action:
    """Rank's k-th forward (or backward) in Megatron-LM's interleaved order.

    Micro-batches go in groups of p: the group runs chunk 0, then chunk 1, ... (backward: v-1 first).
    """
    group, in_group = divmod(k, num_ranks * virtual_stages)
    chunk = in_group // num_ranks
    if kind == BACKWARD:
        chunk = virtual_stages - 1 - chunk
    return _compute(kind, group * num_ranks + k % num_ranks, chunk * num_ranks + rank, num_ranks)


def interleaved_1f1b(num_ranks: int, num_micro_batches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B with v chunks per rank (Narayanan et al. 2021 §2.2; Megatron-LM's order)."""
    _check_sizes(num_ranks, num_micro_batches, virtual_stages)
    p, m, v = num_ranks, num_micro_batches, virtual_stages
    if m % p:
        below, above = m - m % p, m - m % p + p
        raise ScheduleError(
            f"interleaved-1f1b needs num_micro_batches to be a multiple of num_ranks ({p}), got {m}: "
            f"use {f'{below} or {above}' if below else above} micro-batches")
    total = m * v
    orders = []
    for r in range(p):
        # Megatron-LM: (p - r - 1) * 2 + (v - 1) * p warm-up chunk-forwards, all of them when m == p.
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)

        fwd = [_interleaved_action(FORWARD, k, r, p, v) for k in range(total)]
        bwd = [_interleaved_action(BACKWARD, k, r, p, v) for k in range(total)]
        order = fwd[:warmup]
        for k in range(total - warmup):
            order += [fwd[warmup + k], bwd[k]]
        order += bwd[total - warmup:]
        orders.append(order)
    return _with_comm("interleaved-1f1b", p, m, v, orders)


def zb_h1(num_ranks: int, num_micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023 §2.1): 1F1B with BI on the critical path and rank r's BW deferred by r."""
    _check_sizes(num_ranks, num_micro_batches)
    p, m = num_ranks, num_micro_batches
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)  # as 1F1B, so activations held until BI match 1F1B's
        order = [_compute(FORWARD, i, r, p) for i in range(warmup)]
        for i in range(m):
            if i < m - warmup:
                order.append(_compute(FORWARD, warmup + i, r, p))
            order.append(_compute(BACKWARD_INPUT, i, r, p))
            if i >= r:
                order.append(_compute(BACKWARD_WEIGHT, i - r, r, p))
        order += [_compute(BACKWARD_WEIGHT, i, r, p) for i in range(max(0, m - r), m)]
        orders.append(order)
    return _with_comm("zb-h1", p, m, 1, orders)


def make_schedule(name: str, num_ranks: int, num_micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by its CLI name (one of SCHEDULE_NAMES)."""
    if name == "interleaved-1f1b":
        return interleaved_1f1b(num_ranks, num_micro_batches, virtual_stages)
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {SCHEDULE_NAMES}")
    if virtual_stages != 1:
        raise ScheduleError(f"{name} runs one stage per rank: set virtual_stages to 1 "
                            f"(got {virtual_stages}) or use interleaved-1f1b")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}[name](num_ranks, num_micro_batches)


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
        # Qi et al. 2023 §2.1: ZB-H1 bubble (p - 1)(T_F + T_B - T_W), T_B being our BI.
        bubble = (p - 1) * (t.forward_s + t.backward_input_s - t.backward_weight_s)
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


def _peaks(order: tuple[Action, ...]) -> tuple[int, int]:
    held = pending = peak_held = peak_pending = 0
    for a in order:
        held += {FORWARD: 1, BACKWARD: -1, BACKWARD_INPUT: -1}.get(a.kind, 0)
        pending += {BACKWARD_INPUT: 1, BACKWARD_WEIGHT: -1}.get(a.kind, 0)
        peak_held, peak_pending = max(peak_held, held), max(peak_pending, pending)
    return peak_held, peak_pending


def check_schedule(schedule: Schedule) -> None:
    """Every stage runs F and B (or BI and BW) of every micro-batch once, on its own rank; every SEND
    has one RECV on the right peer. Dependencies and deadlocks are `simulate`'s to find."""
    p, m, num_stages = schedule.num_ranks, schedule.num_micro_batches, schedule.num_stages
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {p} ranks")
    seen: dict[tuple[str, int, int], int] = {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if not (0 <= a.stage < num_stages and 0 <= a.micro_batch < m):
                raise ScheduleError(f"{schedule.name}: rank {rank} has {a}, outside {num_stages} stages "
                                    f"and {m} micro-batches")
            if a.stage % p != rank or a.chunk != a.stage // p:
                raise ScheduleError(f"{schedule.name}: rank {rank} has {a}, "
                                    f"whose stage is on rank {a.stage % p}")
            if a.is_compute:
                key = (a.kind, a.micro_batch, a.stage)
                seen[key] = seen.get(key, 0) + 1
            else:
                _, _, sender_stage = a.message
                receiver_stage = a.stage if a.kind == RECV else (
                    sender_stage + 1 if a.tensor == ACTIVATION else sender_stage - 1)
                if not 0 <= receiver_stage < num_stages or a.peer != (
                        receiver_stage if a.kind == SEND else sender_stage) % p:
                    raise ScheduleError(f"{schedule.name}: rank {rank} has {a}, whose peer is wrong")
                key = (a.kind, *a.message)
                seen[key] = seen.get(key, 0) + 1
    backward_kinds = (BACKWARD_INPUT, BACKWARD_WEIGHT) if schedule.split_backward else (BACKWARD,)
    for kind in (FORWARD,) + backward_kinds:
        for stage in range(num_stages):
            for mb in range(m):
                if seen.get((kind, mb, stage), 0) != 1:
                    raise ScheduleError(f"{schedule.name}: {kind} of micro-batch {mb} on stage {stage} runs "
                                        f"{seen.get((kind, mb, stage), 0)} times, must run once")
    computes = sum(1 for key in seen if key[0] in COMPUTE_KINDS)
    if computes != (1 + len(backward_kinds)) * num_stages * m:
        raise ScheduleError(f"{schedule.name}: mixes fused B with split BI/BW")
    for key, count in seen.items():
        if key[0] == SEND and (count != 1 or seen.get((RECV, *key[1:])) != 1):
            raise ScheduleError(f"{schedule.name}: message {key[1:]} is sent {count} times and received "
                                f"{seen.get((RECV, *key[1:]), 0)} times, must be once each")
        if key[0] == RECV and (SEND, *key[1:]) not in seen:
            raise ScheduleError(f"{schedule.name}: message {key[1:]} is received but never sent")


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


def render_ascii(simulation: Simulation, wrap_cells: int | None = None) -> str:
    """The rank x time grid as text: one cell per shortest compute op, `.` where a rank idles.

    Each op prints as its kind (BI as B, BW as W, as in Qi et al.'s figures) and micro-batch; when v > 1
    as micro-batch and chunk letter instead, upper case for forward (`3B`: forward of micro-batch 3 on
    chunk b), lower case for backward. An op is padded with `-` over the cells it lasts. Times that are not
    multiples of the shortest op are rounded to the nearest cell. wrap_cells cuts long rows into blocks.
    """
    sched, v = simulation.schedule, simulation.schedule.virtual_stages
    durations = [simulation.times.duration_s(a, v) for rank in sched.actions for a in rank if a.is_compute]
    cell_s = min(durations)
    letter = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}

    def label(a: Action) -> str:
        if v == 1:
            return letter[a.kind] + str(a.micro_batch)
        chunk = "abcdefghijklmnopqrstuvwxyz"[a.chunk]
        return str(a.micro_batch) + (chunk.upper() if a.kind == FORWARD else chunk)

    width = max(len(label(a)) for rank in sched.actions for a in rank if a.is_compute)
    num_cells = round(simulation.makespan_s / cell_s)
    rows = []
    for actions, intervals in zip(sched.actions, simulation.intervals_s, strict=True):
        row = ["." * width] * num_cells
        for a, (start, end) in zip(actions, intervals, strict=True):
            if a.is_compute:
                first, last = round(start / cell_s), round(end / cell_s)
                row[first] = label(a).ljust(width, "-")
                for cell in range(first + 1, last):
                    row[cell] = "-" * width
        rows.append(row)
    step = wrap_cells or num_cells
    blocks = ["\n".join(f"r{rank} {''.join(row[first:first + step]).rstrip('.')}".rstrip()
                        for rank, row in enumerate(rows))
              for first in range(0, num_cells, step)]
    return "\n\n".join(blocks)


def stage_units(m, num_stages: int, stage: int) -> list[int]:
    """Indices into Transformer.units (embed = 0, layer i = i + 1, head = L + 1) that `stage` runs."""
    per_stage = m.layers // num_stages
    units = list(range(1 + stage * per_stage, 1 + (stage + 1) * per_stage))
    if stage == 0:
        units.insert(0, 0)
    if stage == num_stages - 1:
        units.append(m.layers + 1)
    return units
