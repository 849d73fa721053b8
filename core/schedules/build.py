"""Pipeline-parallel schedules as data: the actions of every rank, built per schedule (torch-free, below
both engines: the live executor engine/pipeline walks them, the planner and the pages simulate and draw
them with core/schedules/simulate.py and render.py, checked by check.py).

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
Rank r warms up with 2 (p - 1 - r) + (v - 1) p chunk-forwards (at most all m v of them), so it holds
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
    return _with_comm("gpipe", num_ranks, num_micro_batches, 1, _gpipe_orders(num_ranks, num_micro_batches))


def _gpipe_orders(num_ranks: int, num_micro_batches: int) -> list[list[Action]]:
    _check_sizes(num_ranks, num_micro_batches)
    p, m = num_ranks, num_micro_batches
    return [[_compute(FORWARD, i, r, p) for i in range(m)] + [_compute(BACKWARD, i, r, p) for i in range(m)]
            for r in range(p)]


def one_f_one_b(num_ranks: int, num_micro_batches: int) -> Schedule:
    """PipeDream-Flush: p - 1 - r warm-up forwards, then one forward / one backward, then cool-down.

    With m < p the warm-up of the first ranks takes every micro-batch (GPipe's order there; correct, but
    the bubble grows as (p - 1) / m says).
    """
    return _with_comm("1f1b", num_ranks, num_micro_batches, 1, _one_f_one_b_orders(num_ranks, num_micro_batches))


def _one_f_one_b_orders(num_ranks: int, num_micro_batches: int) -> list[list[Action]]:
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
    return orders


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
    return _with_comm("interleaved-1f1b", num_ranks, num_micro_batches, virtual_stages,
                      _interleaved_orders(num_ranks, num_micro_batches, virtual_stages))


def _interleaved_orders(num_ranks: int, num_micro_batches: int, virtual_stages: int) -> list[list[Action]]:
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
        # Megatron-LM: (p - r - 1) * 2 + (v - 1) * p warm-up chunk-forwards (schedules.py
        # get_pp_rank_microbatches; since 4295be1a6c, core_r0.10.0, not all of them when m == p). One chunk
        # is not interleaved: Megatron runs it as 1F1B, p - 1 - r warm-up forwards (2 (p - 1 - r) had held
        # twice 1F1B's activations: 7 against 4 on rank 0 at p = 4)
        warmup = min((p - r - 1) * 2 + (v - 1) * p if v > 1 else p - 1 - r, total)

        fwd = [_interleaved_action(FORWARD, k, r, p, v) for k in range(total)]
        bwd = [_interleaved_action(BACKWARD, k, r, p, v) for k in range(total)]
        order = fwd[:warmup]
        for k in range(total - warmup):
            order += [fwd[warmup + k], bwd[k]]
        order += bwd[total - warmup:]
        orders.append(order)
    return orders


def zb_h1(num_ranks: int, num_micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023 §2.1): 1F1B with BI on the critical path and rank r's BW deferred by r."""
    return _with_comm("zb-h1", num_ranks, num_micro_batches, 1, _zb_h1_orders(num_ranks, num_micro_batches))


def _zb_h1_orders(num_ranks: int, num_micro_batches: int) -> list[list[Action]]:
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
    return orders


def make_schedule(name: str, num_ranks: int, num_micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by its CLI name (one of SCHEDULE_NAMES)."""
    return _with_comm(name, num_ranks, num_micro_batches, virtual_stages,
                      compute_orders(name, num_ranks, num_micro_batches, virtual_stages))


def compute_orders(name: str, num_ranks: int, num_micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Each rank's compute actions of the schedule `name`, in order (its Schedule without the messages:
    `Schedule.compute_order`)."""
    if name == "interleaved-1f1b":
        return _interleaved_orders(num_ranks, num_micro_batches, virtual_stages)
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {SCHEDULE_NAMES}")
    if virtual_stages != 1:
        raise ScheduleError(f"{name} runs one stage per rank: set virtual_stages to 1 "
                            f"(got {virtual_stages}) or use interleaved-1f1b")
    return {"gpipe": _gpipe_orders, "1f1b": _one_f_one_b_orders, "zb-h1": _zb_h1_orders}[name](num_ranks,
                                                                                             num_micro_batches)


def stage_units(m, num_stages: int, stage: int) -> list[int]:
    """Indices into Transformer.units (embed = 0, layer i = i + 1, head = L + 1) that `stage` runs."""
    per_stage = m.layers // num_stages
    units = list(range(1 + stage * per_stage, 1 + (stage + 1) * per_stage))
    if stage == 0:
        units.insert(0, 0)
    if stage == num_stages - 1:
        units.append(m.layers + 1)
    return units
