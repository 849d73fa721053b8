"""The planner's prediction of a live engine run on this machine, from this machine's calibration.

For the exact model, mesh, strategy, schedule, micro-batches and steps of an `engine` run, every rank's
step is written out as the engine executes it (the same units, the same collectives on the same groups,
synchronous or asynchronous, the same pipeline actions) with each operation's cost taken from
`hardware.this_machine.Calibration`: the engine's modules by shape, the driver's own overhead per unit,
gloo's measured time per operation, group size and world, and how the cores are shared. The ranks are
then simulated together (`planner.eventsim`): a collective starts when its last member posts it, a
receive waits for its send, computing ranks share the cores (as many cores' worth as the world's ranks
were measured to get together: `Calibration.cores`). Compute that starts right after the rank
waited on its communication (a blocking collective, a wait, a receive) takes the calibrated `resume_s`
longer: the rank resumes on cold caches.

    pred = predict(cfg, calibration)
    pred.step_time_s, pred.breakdown_s, pred.timeline          # one step, in the engine's span format

`cfg` is an `engine.config.RunConfig` (read by attribute; the planner does not import the engine's run
machinery). Byte counts follow engine/comm.py (fp32 tensors; the full array for gathers and reductions).

Context parallel's ring attention (engine/cp.py) runs as the engine runs it: each hop's K/V shift in
flight beside the block's compute, the dK/dV of backward sent on after each block and waited for after the
next one, and posting a hop holds the rank for the calibrated posting (gloo writes the message from the
calling thread). DP's gradient buckets leave as soon as their last gradient exists, in the middle of a
layer's backward (engine/dp.py's hooks). Two asynchronous operations of one group in flight together get
through what the calibration timed two of them posted at once getting through (`_Costs.concurrency`).

A Mamba-2 layer (engine/mamba.py) is its norm, the mixer's input projections, the conv and scan, then
in_z, the gated norm and out_proj: one tp region (heads split, whole groups per rank), and under cp the
scan crosses ranks as engine/ssm_cp.py does it: the conv's halo in one batch of messages, then the states
in a chain in sequence order (rank r waits for r - 1), reversed in backward; or two all-to-alls each way.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from core.buckets import plan_buckets
from core.mesh import Mesh, cp_slice_owners, group_key
from core.moe import kept_share
from core.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    RECV,
    SEND,
    make_schedule,
    stage_units,
)
from core.timeline import Timeline, bubble_spans, intersection_seconds, kind_label, span_kind, union_seconds
from hardware.collectives import ring_sent_bytes
from hardware.this_machine import (
    ATTENTION_LONGEST,
    BACK_TO_BACK_MODE,
    BLOCKING_MODES,
    GLOO_THREADS,
    POST_MODE,
    RING_LONGEST,
    WIDE_UNITS,
    Calibration,
    CalibrationError,
    comm_key,
    early_mode,
    late_mode,
    log_position,
    scan_steps,
    score_elements,
    work,
)
from planner.eventsim import Collective, Compute, Recv, Send, Wait, simulate

F32 = 4
MAMBA = "M"  # a Mamba-2 layer's letter in ModelConfig.kinds (engine/config.MAMBA)
# Small tensor operations the strategies add around the modules (counted from engine/*.py): each costs
# one calibrated tiny-op call.
TP_REGION_OPS = 2  # f/g autograd function + contiguous copy, per region entry or exit
SP_RESHAPE_OPS = 3  # permute / reshape / empty around a sequence all-gather or reduce-scatter
VOCAB_PARALLEL_OPS = 12  # masks, shifts, gathers of the vocabulary-parallel embedding and cross entropy
RING_STEP_OPS = 2  # the query rows' slicing and the in-place write of one ring step (the rest is timed)
FLAT_VIEW_OPS = 2  # per parameter: the flat buffer's view and reshape (ZeRO / FSDP functional_call)
SSM_ALLTOALL_OPS = 12  # reshapes, permutes, the concatenation and both reorderings around the all-to-alls


@dataclass
class LivePrediction:
    step_time_s: float
    breakdown_s: dict[str, float]
    timeline: Timeline
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "breakdown_s": self.breakdown_s, "notes": self.notes,
                "source": "planner.live on this machine's calibration", "timeline": self.timeline.to_dict()}


def _params(m, tp: int = 1, ep: int = 1, ep_rank: int = 0) -> list[list[tuple[str, int]]]:
    """(name, numel) of the parameters this rank holds, per unit, in the engine model's order
    (engine/model.py; tp shards as engine/tp.py splits them; ep keeps its experts)."""
    d, hd = m.hidden, m.hidden // m.heads
    kv_local = max(1, m.kv_heads // tp)
    units = [[("tok", m.vocab // tp * d)]]
    for kind in m.kinds:
        if kind == MAMBA:
            units.append(_mamba_params(m, tp))
            continue
        block = [("attn_norm", d), ("wq", m.heads // tp * hd * d), ("wk", kv_local * hd * d),
                 ("wv", kv_local * hd * d), ("wo", d * m.heads // tp * hd), ("mlp_norm", d)]
        if m.mlp == "moe":
            block.append(("router", m.experts * d))
            for _e in range(m.experts // ep):
                block += [("w1", m.ffn * d), ("w3", m.ffn * d), ("w2", d * m.ffn)]
        else:
            block += [("w1", m.ffn // tp * d), ("w3", m.ffn // tp * d), ("w2", d * m.ffn // tp)]
        units.append(block)
    units.append([("norm", d), ("out", m.vocab // tp * d)])
    return units


def _mamba_params(m, tp: int) -> list[tuple[str, int]]:
    """A MambaBlock's parameters in its order (engine/model.py, engine/mamba.py): the norm whole, the
    rest split by heads or whole groups over tp (engine/tp.py's _mamba)."""
    d, di, gn, nh, w = m.hidden, m.ssm_inner // tp, m.ssm_groups * m.ssm_state // tp, m.ssm_heads // tp, m.conv_width
    return [("norm", d), ("dt_bias", nh), ("A_log", nh), ("D", nh), ("in_z", di * d), ("in_x", di * d),
            ("in_b", gn * d), ("in_c", gn * d), ("in_dt", nh * d), ("conv_x.weight", di * w), ("conv_x.bias", di),
            ("conv_b.weight", gn * w), ("conv_b.bias", gn), ("conv_c.weight", gn * w), ("conv_c.bias", gn),
            ("out_norm", di), ("out_proj", d * di)]


class _Costs:
    """Solo (one core) seconds of the engine's pieces on this machine, from the calibration."""

    def __init__(self, cal: Calibration, cfg):
        self.cal, self.cfg, self.m = cal, cfg, cfg.model
        self._async_cache: dict = {}
        self._pair_sizes: dict[str, list[int]] = {}  # send_recv mode -> the group sizes timed in it (`_pair_size`)
        # the calibration times resuming and gaps with every rank computing at once; the programs count
        # one core's seconds (the simulator stretches them where ranks share the cores)
        self.share = cal.share(cfg.world)
        self.sizes = frozenset(cal.measured_sizes(cfg.world))  # the group sizes timed at this world (`_size`)
        self.resume_s = cal.resume_s.get(cfg.world, 0.0) / self.share
        self.tiny = self.compute_fit("tiny_op").fwd(0)
        ref, b = type(cfg.model)(), type(cfg)().micro_batch_size
        self.driver_fwd, self.cold_fwd, self.ends_fwd = self._driver(cal.engine_units, ref, b, True)
        self.driver_bwd, self.cold_bwd, self.ends_bwd = self._driver(cal.engine_units, ref, b, False)
        # the optimizer's elements in a run against the kernel's pace: (the default model's elements, where it is 1,
        # the wide one's, its pace there), `_in_run`
        self.state_pace: tuple[int, int, float] | None = None
        # what a layer of this run's size adds in a run over the default model's driver (`_in_run`): the caches it
        # finds emptied, which a segment resuming after the rank's communication finds too (`_Rank.cold_credit`)
        self.extra_fwd = self.extra_bwd = 0.0
        self._in_run(ref, b)

    def _driver(self, units: dict[str, float], ref, b: int, fwd: bool) -> tuple[float, float, dict[str, float]]:
        """What the engine's driver adds around a unit (recorder span, backward markers, activation
        accounting), from its own step at world 1 on the default model `ref` (`b` sequences; engine/
        calibrate.engine_units) against the modules alone at that shape: per layer, and for the embedding
        and the head of their own. A layer right after another of the same pass runs warm; the first of a
        run of layers (after the embedding, a backward, a message) runs on code and data that went cold,
        and takes the first layer's time over the next's (forward L0 after the embedding against L1 after
        L0; backward the last layer, after the head, against the others): 1.31 against 1.14 ms forward on
        the 2-core machine this was built on, 1.39 against 1.41 backward. An older calibration without
        the per-unit timings: a layer's mean, and half of it around the embedding and the head.
        Returns (a warm layer's overhead, a cold layer's extra, {"embed": ..., "head": ...}) of one pass."""
        shape = _Shape(b, ref.seq_len, ref.hidden, ref.heads, ref.kv_heads, ref.ffn)
        tokens, word = b * ref.seq_len, "fwd" if fwd else "bwd"
        modules = self._block(shape, fwd, head_dim=ref.hidden // ref.heads)
        layers = [units.get(f"{word} L{i}") for i in range(ref.layers)]
        if None in layers or not layers:
            blocks = [v for k, v in units.items() if k.startswith(f"{word} L")]
            driver = max(0.0, statistics.fmean(blocks) - modules) if blocks else 0.0
            return driver, 0.0, {"embed": driver / 2, "head": driver / 2}
        first, rest = (layers[0], layers[1:]) if fwd else (layers[-1], layers[:-1])
        warm = statistics.fmean(rest) if rest else first
        driver = max(0.0, warm - modules)
        alone = {"embed": self.embed(tokens, fwd, ref.hidden), "head": self.head(tokens, ref.vocab, fwd, ref.hidden)}
        ends = {unit: max(0.0, units.get(f"{word} {unit}", 0.0) - s) for unit, s in alone.items()}
        return driver, max(0.0, first - warm), ends

    def _in_run(self, ref, b: int) -> None:
        """A layer in a run, and the optimizer step after a forward and backward, on caches the step keeps
        emptying (hardware.this_machine.WIDE_UNITS): the engine's own step on the wide model gives a layer's
        driver there (its layers against their modules) and how much slower the optimizer's elements go than
        `adamw` says (`state_pace`). This run's layers take the driver interpolated in log size (`log_position`)
        between the default model's and the wide one's, by the weights of one layer on this rank, the wide one's
        beyond; the optimizer its pace likewise by the elements it updates (`adamw`). A calibration without the
        wide step changes nothing."""
        units = self.cal.wide_units
        if not units:
            return
        wide = replace(ref, **WIDE_UNITS)
        tp, ep = (self.cfg.parallel.degree(axis, self.cfg.world) for axis in ("tp", "ep"))

        def layer(m, tp: int = 1, ep: int = 1) -> int:  # elements of one layer on a rank
            return sum(n for _, n in _params(m, tp, ep)[1])

        t = log_position(layer(self.m, tp, ep), layer(ref), layer(wide))
        self.extra_fwd = (self._driver(units, wide, b, True)[0] - self.driver_fwd) * t
        self.extra_bwd = (self._driver(units, wide, b, False)[0] - self.driver_bwd) * t
        self.driver_fwd += self.extra_fwd
        self.driver_bwd += self.extra_bwd
        numels = [n for unit in _params(wide) for _, n in unit]
        f, driver = self.compute_fit("adamw"), self.compute_fit("optimizer_driver")
        kernel = f.fwd_per_unit_s * sum(numels) * self.cal.adamw_slowdown(sum(numels))
        if "optimizer step" in units and kernel > 0:
            pace = max(0.0, units["optimizer step"] - len(numels) * (f.fwd_fixed_s + driver.fwd(0))) / kernel
            self.state_pace = (sum(n for unit in _params(ref) for _, n in unit), sum(numels), pace)

    def compute_fit(self, op: str):
        """The calibration's fit of `op`; a file without it (measured before it was) says so."""
        if op not in self.cal.compute:
            raise CalibrationError(f"this machine's calibration has no timing of {op}; measure it again")
        return self.cal.compute[op]

    def fit(self, op: str, shape: dict, fwd: bool, items: float = 0.0) -> float:
        """Seconds of `op` at `shape`: its fit at the shape's work and items (`items`, else the attention scores
        it computes: hardware.this_machine.score_elements, 0 for modules without)."""
        f = self.compute_fit(op)
        w, n = work(op, shape), items or score_elements(op, shape)
        return f.fwd(w, n) if fwd else f.bwd(w, n)

    def _block(self, s: _Shape, fwd: bool, norm_rows: int | None = None, head_dim: int | None = None) -> float:
        rows = norm_rows if norm_rows is not None else s.b * s.t
        norm = 2 * self.fit("rmsnorm", {"m": rows, "d": s.d}, fwd)
        att = self.fit("attention", {"b": s.b, "t": s.t, "d": s.d, "heads": s.heads, "kv_heads": s.kv,
                                     "head_dim": head_dim or self.m.hidden // self.m.heads}, fwd)
        mlp = self.fit("swiglu", {"b": s.b, "t": s.t, "d": s.d, "ffn": s.ffn}, fwd)
        glue = self.compute_fit("block_glue")
        return norm + att + mlp + (glue.fwd(0) if fwd else glue.bwd(0))

    def block(self, s: _Shape, fwd: bool, norm_rows: int | None = None) -> float:
        return self._block(s, fwd, norm_rows) + (self.driver_fwd if fwd else self.driver_bwd)

    def attention_core(self, s: _Shape, fwd: bool) -> float:
        """The scaled-dot-product part of the attention fit: its scores' FLOPs at the fitted rate and the
        scores themselves at theirs."""
        f = self.compute_fit("attention")
        scores = score_elements("attention", {"b": s.b, "heads": s.heads, "t": s.t})
        flops = 4.0 * scores * (self.m.hidden // self.m.heads)
        return (flops * f.fwd_per_unit_s + scores * f.fwd_per_item_s if fwd
                else flops * f.bwd_per_unit_s + scores * f.bwd_per_item_s)

    def ring_block(self, b: int, heads: int, rows: int, cols: int, fwd: bool, diagonal: bool = False) -> float:
        """One ring step's block: the first (`diagonal`) is the rank's own keys under the causal mask, with
        nothing to merge into yet (engine/cp.py), its own fit."""
        shape = {"b": b, "heads": heads, "rows": rows, "cols": cols, "head_dim": self.m.hidden // self.m.heads}
        return self.fit("ring_diag" if diagonal else "ring_block", shape, fwd) + RING_STEP_OPS * self.tiny

    def moe(self, b: int, t: int, ep: int, fwd: bool, kept: float = 1.0) -> float:
        """An MoE layer on `b` x `t` tokens of this rank: the module alone ("moe") or, over an ep group of `ep`
        ranks, as engine/ep.py runs it ("moe_ep": its dispatch around the E / ep local experts, timed so; the
        all-to-alls are the program's). Balanced routing brings back as many rows as the rank sends, each
        token's top_k copies, of which a capacity factor keeps `kept` (core.moe.kept_share)."""
        m = self.m
        shape = {"b": b, "t": t, "d": m.hidden, "ffn": m.ffn, "experts": m.experts, "top_k": m.top_k * kept,
                 "ep": ep}
        return self.fit("moe_ep" if ep > 1 else "moe", shape, fwd, items=m.experts // ep)

    def mamba(self, shape: dict, steps: int, fwd: bool) -> tuple[float, float, float]:
        """(input projections x, B, C, dt; conv, scan and gated norm; in_z and out_proj) of the Mamba-2 mixer
        at `shape` with `steps` chunk steps of its scan: the mixer's fit, less its linears as the linear
        fit times them, so the pieces can sit either side of the scan's communication."""
        rows, d = shape["b"] * shape["t"], shape["d"]
        gn = shape["groups"] * shape["state"]

        def linear(k: int, n: int) -> float:
            return self.fit("linear", {"m": rows, "k": k, "n": n}, fwd)

        into = sum(linear(d, n) for n in (shape["inner"], gn, gn, shape["heads"]))
        out = linear(d, shape["inner"]) + linear(shape["inner"], d)
        whole = self.fit("mamba", shape, fwd, items=steps)
        return into, max(0.0, whole - into - out), out

    def embed(self, tokens: int, fwd: bool, hidden: int | None = None) -> float:
        return self.fit("embed", {"b": 1, "t": tokens, "d": hidden or self.m.hidden}, fwd)

    def head(self, tokens: int, vocab: int, fwd: bool, hidden: int | None = None) -> float:
        return self.fit("head", {"b": 1, "t": tokens, "d": hidden or self.m.hidden, "vocab": vocab}, fwd)

    def adamw(self, numels: list[int]) -> float:
        """The optimizer step over tensors of `numels`: the AdamW kernel's fit and the engine's step around
        it, per tensor (hardware.this_machine.fit_compute's optimizer_driver). Each element at the step's own
        pace: its state, all of the tensors', streams through the caches once (`Calibration.adamw_slowdown`)."""
        f, driver = self.compute_fit("adamw"), self.compute_fit("optimizer_driver")
        slowdown = self.cal.adamw_slowdown(sum(numels))
        if self.state_pace is not None:
            default, wide, pace = self.state_pace
            slowdown *= 1.0 + (pace - 1.0) * log_position(sum(numels), default, wide)
        return sum(f.fwd_fixed_s + f.fwd_per_unit_s * n * slowdown + driver.fwd(0) for n in numels)

    def comm(self, kind: str, n: int, nbytes: float, mode: str = "sync", gap_s: float | None = None,
             after_collective: bool = False) -> float:
        """Seconds of one operation; a blocking one ("sync") after `gap_s` of the rank's compute (one
        core's seconds) reads the calibration at that gap (engine/calibrate.SYNC_GAPS_S), else at the
        calibration's usual gap; `after_collective`: the rank's last communication was a blocking collective
        (below the shortest measured gap it then reads toward the back-to-back timing)."""
        if n <= 1:
            return 0.0
        size = self._size(n)
        fit = self.cal.comm_fit(self.cfg.world, kind, size, mode)
        if mode == "async" and fit.burst:
            return self._async_op_s(kind, size, nbytes, fit)
        if mode == "sync" and gap_s is not None:
            return self._after_gap_s(kind, size, nbytes, gap_s * self.share, fit, after_collective)
        return fit.seconds(nbytes)

    def _after_gap_s(self, kind: str, n: int, nbytes: float, gap_s: float, fit, after_collective: bool) -> float:
        """A blocking operation after `gap_s` of compute: linear in log(gap) between the two measured gaps
        around it, the nearest measured one outside them; right after another blocking collective (no compute
        between) as the calibration timed them back to back, and below the shortest measured gap linear
        between the two (after a wait or a message, not a collective, at the shortest measured gap)."""
        by_gap = {f.gap_s: f for f in (self.cal.comm.get(comm_key(self.cfg.world, kind, n, mode))
                                       for mode in BLOCKING_MODES) if f is not None and f.gap_s > 0}
        if len(by_gap) < 2:
            return fit.seconds(nbytes)
        fits = [by_gap[g] for g in sorted(by_gap)]
        b2b = self.cal.comm.get(comm_key(self.cfg.world, kind, n, BACK_TO_BACK_MODE))
        if b2b is not None and after_collective and gap_s < fits[0].gap_s:
            x = max(0.0, gap_s) / fits[0].gap_s
            return (1 - x) * b2b.seconds(nbytes) + x * fits[0].seconds(nbytes)
        g = min(max(gap_s, fits[0].gap_s), fits[-1].gap_s)
        lo, hi = next((lo, hi) for lo, hi in zip(fits, fits[1:]) if g <= hi.gap_s)
        x = math.log(g / lo.gap_s) / math.log(hi.gap_s / lo.gap_s)
        return (1 - x) * lo.seconds(nbytes) + x * hi.seconds(nbytes)

    def contended_s(self, kind: str, n: int, nbytes: float) -> float | None:
        """An asynchronous operation's duration while its ranks compute (math.inf: it waits for them to
        stop), or None when the calibration did not measure it (older files)."""
        if n <= 1:
            return None
        key = comm_key(self.cfg.world, kind, self._size(n), "contended")
        fit = self.cal.comm.get(key)
        if fit is None:
            return None
        return math.inf if fit.stalls else fit.seconds(nbytes)

    def concurrency(self, kind: str, n: int, nbytes: float) -> float:
        """Operations' worth of work two asynchronous operations of a group in flight together get through
        in the time of one (planner.eventsim.Collective.concurrency): as the calibration timed two posted at
        once against one alone (`Calibration.pair_speedup`), between 1 and GLOO_THREADS; GLOO_THREADS for a
        calibration without it (engine/calibrate.PAIR_ROUNDS has what it was measured against)."""
        speedup = self.cal.pair_speedup(self.cfg.world, kind, self._size(n), nbytes) if n > 1 else None
        return GLOO_THREADS if speedup is None else min(GLOO_THREADS, max(1.0, speedup))

    def post(self, kind: str, n: int, nbytes: float):
        """The calibrated posting of a point-to-point batch (engine/calibrate._Shift's "post" mode): the part
        of the operation that blocks the rank that posts it, or None when not measured (older files)."""
        if n <= 1:
            return None
        key = comm_key(self.cfg.world, kind, self._size(n), POST_MODE)
        return self.cal.comm.get(key)

    def message_s(self, group: int, nbytes: float) -> float | tuple[float, ...]:
        """A point-to-point message's delivery from its isend when its receive is already waiting: the
        calibrated early messages of a pair (send_recv's early modes: one way, the sender computing on) with
        1, 2, ... senders computing at once (planner.eventsim.Send picks by the load on the cores then). A
        calibration that predates them gives the ring shift of the group's ranks instead (each sends to its
        next and receives from its previous one after compute: 3-7x the early message on 2 cores, as both
        ranks post at once and wait for each other's threads)."""
        early = self._by_senders_s(group, nbytes, self.cal.early_fits, early_mode)
        return early if early else self.comm("ring_shift", group, nbytes)

    def late_s(self, group: int, nbytes: float) -> tuple[float, ...] | None:
        """A point-to-point message whose receive is posted after its send: the calibrated late receive of a
        pair (send_recv's late modes: the transfer from the receive's posting, the sender computing) with 1,
        2, ... senders computing at once (planner.eventsim.Send picks by the load on the cores then), or None
        when the calibration predates them (older files: the message's own time then)."""
        return self._by_senders_s(group, nbytes, self.cal.late_fits, late_mode)

    def post_s(self, group: int, nbytes: float) -> float | None:
        """How long posting a pipeline message's isend holds its sender (timed in the engine's own pipeline
        at this world: hardware.this_machine.fit_posting), or None for a group of one or a calibration
        without it."""
        fit = self.cal.send_post_fit(self.cfg.world, self.cfg.parallel.schedule) if group > 1 else None
        return fit.seconds(nbytes) if fit else None

    def idle_late_s(self, group: int, nbytes: float) -> float | None:
        """A late receive while no rank computes (send_recv's late0: the sender blocked in its wait), or
        None when the calibration predates it (`late_s` then)."""
        size = self._pair_size(group, late_mode(0))
        fit = self.cal.idle_late_fit(self.cfg.world, size) if size else None
        return fit.seconds(nbytes) if fit else None

    def _by_senders_s(self, group: int, nbytes: float, fits_of, mode) -> tuple[float, ...] | None:
        """A pair's calibrated messages of `mode` (Calibration.late_fits / early_fits) at the nearest group size
        timed, by senders computing; None for a group of one or a calibration without them."""
        size = self._pair_size(group, mode(1))
        fits = fits_of(self.cfg.world, size) if size else None
        return tuple(f.seconds(nbytes) for f in fits) if fits else None

    def _pair_size(self, group: int, mode: str) -> int | None:
        """The group size whose send_recv `mode` the calibration timed for a message in a group of `group`: its
        own, or for an odd group (engine/calibrate times messages between pairs of ranks of even groups) the
        pairs'; None for a group of one (no messages) or none timed (the caller's ring-shift reading)."""
        if group <= 1:
            return None
        if mode not in self._pair_sizes:  # read once per prediction, not per message
            self._pair_sizes[mode] = self.cal.kind_sizes(self.cfg.world, "send_recv", mode)
        sizes = self._pair_sizes[mode]
        return group if group in sizes else 2 if group % 2 and 2 in sizes else None

    def _async_op_s(self, kind: str, n: int, nbytes: float, fit) -> float:
        """The duration of one asynchronous operation that makes this simulator reproduce the measured
        burst (each of `fit.burst` operations issued after one fixed compute, then all waited for,
        on every rank of the world at once): a bisection on the operation's duration, from the blocking
        operation's time (its "sync" fit) up.

        The floor: an asynchronous operation runs the same gloo algorithm as the blocking one, so once
        nothing computes beside it, it takes no less. A burst whose compute alone accounts for its time
        says nothing about its operations: with 4 ranks on 2 cores the six bursts' compute (0.3-0.9 ms
        each, shared) came to 3.6-6.6 ms against a measured burst of about that, and the bisection put a
        2-rank all-reduce at 0-0.4 ms in four calibrations of five, against 1.5-1.6 ms blocking. The
        data-parallel all-reduces a 2 x 2 mesh runs after its pipeline flush, with nothing computing,
        were then predicted at about 1 ms in all and measured at 8-13 ms."""
        key = (kind, n, round(nbytes))
        if key in self._async_cache:
            return self._async_cache[key]
        floor = self.cal.comm_fit(self.cfg.world, kind, n, "sync").seconds(nbytes)
        w, target = self.cfg.world, fit.seconds(nbytes)
        # the compute between the operations as one rank alone runs it: its CPU seconds where the calibration
        # recorded them; else its wall time over the world's sharing (read while every rank timed its own)
        solo = fit.compute_cpu_s or fit.compute_s / self.cal.share(w)
        cpu = self.cpu(kind, n, "sync")
        contended = self.contended_s(kind, n, nbytes)
        concurrency = self.concurrency(kind, n, nbytes)

        def simulated(d: float) -> float:
            progs = {}
            for rank in range(w):
                group = tuple(range(rank // n * n, rank // n * n + n))
                ops = []
                for j in range(fit.burst):
                    ops += [Compute("c", solo), Collective("x", group, "dp", d, handle=f"h{j}", cpu=cpu,
                                                           contended_s=contended, concurrency=concurrency)]
                progs[rank] = ops + [Wait(f"h{j}") for j in range(fit.burst)]
            return max(simulate(progs, cores=self.cal.cores(w))[1].values())

        if target <= floor or simulated(floor) >= target:
            self._async_cache[key] = floor
            return floor
        lo, hi = floor, target
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if simulated(mid) < target else (lo, mid)
        self._async_cache[key] = (lo + hi) / 2
        return self._async_cache[key]

    def cpu(self, kind: str, n: int, mode: str = "sync") -> float:
        if n <= 1:
            return 0.0
        return self.cal.comm_fit(self.cfg.world, kind, self._size(n), mode).cpu_fraction

    def _size(self, n: int) -> int:
        """`n`, where the calibration timed groups of `n` at the run's world (engine.predict measures every group
        size a run uses); else no prediction: a group of another size is another operation (a world-8 run's
        groups of 4 had been priced as groups of 8, silently)."""
        if n in self.sizes:
            return n
        raise CalibrationError(f"this machine's calibration has no timing of groups of {n} at world "
                               f"{self.cfg.world}; measure it again with this run (python -m engine run ... --predict)")



@dataclass(frozen=True)
class _Shape:
    b: int
    t: int
    d: int
    heads: int
    kv: int
    ffn: int


class _Rank:
    """One rank's program, built in the engine's order."""

    def __init__(self, rank: int, costs: _Costs):
        self.rank, self.costs, self.ops = rank, costs, []
        self.mb: int | None = None
        self._n = 0
        self.since_comm = 0.0  # one core's compute seconds since the rank's last communication
        self.compute_scale = 1.0  # the share of a unit's backward a pass runs (ZB-H1's split halves)
        self._resumes = False  # the rank has waited on its communication since it last computed
        self._after_collective = False  # its last communication was a blocking collective
        # seconds of cold caches the current layer already pays (`_Costs.extra_fwd`): its segments that resume
        # after communication find the same caches emptied, and pay `resume_s` only beyond it
        self.cold_credit = 0.0

    def compute(self, name: str, seconds: float) -> None:
        seconds *= self.compute_scale
        if seconds > 0:
            # the first compute after the rank waited on its own communication resumes on cold caches
            # (engine/calibrate.resume_task)
            if self._resumes:
                seconds += max(0.0, self.costs.resume_s - self.cold_credit)
                self.cold_credit = max(0.0, self.cold_credit - self.costs.resume_s)
                self._resumes = False
            self.ops.append(Compute(name, seconds, self.mb))
            self.since_comm += seconds

    def comm_op(self, op) -> None:
        """Append a communication operation (built here or by the caller: a pipeline or state-passing
        message, a posting)."""
        self.ops.append(op)
        self.since_comm = 0.0
        self._after_collective = isinstance(op, Collective) and op.handle is None
        # it blocks the rank: a wait, a receive, a blocking collective (not a send or an asynchronous one)
        if isinstance(op, (Wait, Recv)) or self._after_collective:
            self._resumes = True

    def coll(self, name: str, group: tuple[int, ...], axis: str, kind: str, nbytes: float, asyn: bool = False,
             mode: str | None = None) -> str | None:
        n = len(group)
        if n <= 1:
            return None
        mode = mode or ("async" if asyn else "sync")
        self._n += 1
        handle = f"h{self._n}" if asyn else None
        seconds = self.costs.comm(kind, n, nbytes, mode, gap_s=None if asyn else self.since_comm,
                                  after_collective=self._after_collective)
        # the span's bytes are what one rank sends, as the engine records them (engine/comm.py); a ring
        # shift sends its whole message
        sent = ring_sent_bytes("p2p" if kind == "ring_shift" else kind, int(nbytes), n)
        self.comm_op(Collective(name, group, axis, seconds, sent, handle, self.costs.cpu(kind, n, mode),
                                self.mb, self.costs.contended_s(kind, n, nbytes) if asyn else None,
                                self.costs.concurrency(kind, n, nbytes) if asyn else GLOO_THREADS))
        return handle

    def send(self, name: str, dst: int, key: tuple, n: int, nbytes: float, group: str) -> str:
        """An isend among `n` ranks (planner.eventsim.Send: it moves once its receive is posted, the
        calibrated late receive after that); posting it holds the rank for the calibrated posting ("post
        send act s0": gloo writes the message from the calling thread; the engine's 1F1B and GPipe at worlds
        2 and 4 were held 0.17-0.18 ms median, 0.44-0.96 ms mean per send). Returns the handle a Wait blocks
        on until it has arrived."""
        self._n += 1
        handle = f"h{self._n}"
        self.comm_op(Send(name, dst, key, self.costs.message_s(n, nbytes), int(nbytes), group, self.mb, handle,
                          self.costs.late_s(n, nbytes), self.costs.idle_late_s(n, nbytes),
                          self.costs.post_s(n, nbytes)))
        return handle

    def wait(self, handle: str | None) -> None:
        if handle is not None:
            self.comm_op(Wait(handle))


def predict(cfg, cal: Calibration) -> LivePrediction:
    """One optimizer step of `cfg` on this machine (see the module docstring)."""
    costs = _Costs(cal, cfg)
    axes = cfg.parallel.axes(cfg.world)
    mesh = Mesh(axes)
    stage = cfg.parallel.stage
    grad_axes = mesh.grad_axes()
    # The data-parallel sharder's groups (engine/dp.py, flat.py): at stage 0 one all-reduce over every
    # data axis (an expert's weights: every data axis but ep, in buckets of their own, none when no other
    # rank holds a replica); with ZeRO the shard axis, then the shards' replicas over the other data axes.
    # Under ZeRO an MoE unit has two flat buffers where ep > 1 (engine/flat.py, one per gradient group): the
    # experts' shard is summed over the data axes but ep and the shard axis, none when there are no others.
    sync_axes = grad_axes if stage == 0 else (mesh.shard_axis(),)
    expert_axes = mesh.grad_axes(expert=True) if stage == 0 else sync_axes
    replica_axes = mesh.shard_replica_axes(grad_axes) if stage > 0 else ()
    expert_replica_axes = mesh.shard_replica_axes(mesh.grad_axes(expert=True)) if stage > 0 else ()

    def group_of(rank: int, axes) -> tuple[int, ...]:
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if mesh.degree(a) > 1)
        return tuple(mesh.group_of(rank, axes)) if axes else (rank,)

    # the engine's names of the gradients' reduction groups (core.mesh.group_key of their axes)
    group_names = {"dp": group_key(tuple(a for a in sync_axes if mesh.degree(a) > 1)) or "dp",
                   "dp expert": group_key(expert_axes) or "dp"}
    programs = {}
    for rank in range(cfg.world):
        r = _Rank(rank, costs)
        g = {axis: group_of(rank, axis) for axis in ("tp", "cp", "ep", "pp")}
        g["dp"], g["replicas"] = group_of(rank, sync_axes), group_of(rank, replica_axes)
        g["dp expert"] = group_of(rank, expert_axes)
        g["replicas expert"] = group_of(rank, expert_replica_axes)
        _Program(cfg, costs, r, g, mesh, {"dp": group_key(replica_axes), "dp expert": group_key(expert_replica_axes)},
                 group_names).build()
        programs[rank] = r.ops
    if len(cal.rank_pace) == cfg.world:
        # each rank's compute at the speed it ran the reference Block at right before the run (the fits are at
        # the slowest's): on 2 cores here one ran it up to 1.6x faster than the other
        programs = {rank: [replace(op, seconds=op.seconds * cal.rank_pace[rank]) if isinstance(op, Compute) else op
                           for op in ops] for rank, ops in programs.items()}
    timeline, ends = simulate(programs, cores=cal.cores(cfg.world))
    step = max(ends.values())
    if cfg.pp > 1:  # as engine/run.py marks a measured pipeline's bubbles (waits are gaps otherwise)
        timeline.extend(bubble_spans(timeline))
    timeline.meta.update(world=cfg.world, strategy=cfg.parallel.strategy, steps=1, predicted_from="calibration")
    notes = []
    cp = mesh.degree("cp")
    if cp > 1 and cfg.parallel.cp_variant == "ring" and cfg.model.has_attention and \
            costs.post("ring_shift", cp, 1.0) is None:
        notes.append("this machine's calibration predates the timing of a ring shift's posting, which blocks "
                     "the rank: calibrate again (bench --remeasure) to predict it")
    return LivePrediction(step, breakdown(timeline, step), timeline, notes + extrapolation_notes(cfg, cp))


def extrapolation_notes(cfg, cp: int) -> list[str]:
    """Where the run's attention is larger than any the calibration timed (ATTENTION_LONGEST, RING_LONGEST): the
    prediction extrapolates the fits there, and says how far they carried on the machine this was built on."""
    m = cfg.model
    if not m.has_attention:
        return []
    if cp > 1 and cfg.parallel.cp_variant == "ring":
        rows = 2 * (m.seq_len // (2 * cp))  # the first step's block: the rank's two zig-zag chunks
        if rows > RING_LONGEST:
            return [f"its ring-attention blocks are up to {rows} x {rows} scores a head, larger than the "
                    f"{RING_LONGEST} x {RING_LONGEST} this machine's calibration timed: the prediction extrapolates "
                    "there, and on 2 cores 512 x 512 blocks took 2-4x its figure (their temporaries outgrow the "
                    "caches)"]
    elif m.seq_len > ATTENTION_LONGEST:
        return [f"its attention runs over {m.seq_len:,} tokens, longer than the {ATTENTION_LONGEST} this machine's "
                "calibration timed: the prediction extrapolates there (on 2 cores it read attention over 512-1,024 "
                "tokens 1.1-1.5x slow)"]
    return []


def breakdown(timeline: Timeline, step_s: float) -> dict[str, float]:
    """Seconds of the slowest rank's step by kind: compute, communication it waited for (by axis), and
    idle: the rest (pipeline bubbles, waits for peers or asynchronous operations)."""
    out: dict[str, float] = {}
    last = max(timeline.ranks, key=lambda r: max((s.end_s for s in timeline.for_rank(r)), default=0.0))
    for s in timeline.for_rank(last):
        if s.lane == "idle" or s.is_async:
            continue
        if s.lane == "compute":
            key = "optimizer" if s.name == "optimizer step" else "compute"
        else:
            key = f"{s.group or 'world'}_comm"
        out[key] = out.get(key, 0.0) + s.duration_s
    if step_s - sum(out.values()) > 1e-9:
        out["idle"] = step_s - sum(out.values())
    return out


# the time a rank spends on no blocking span: waits for peers and asynchronous operations, and the driver's own
# Python between spans (a 1-process run has no peers and still shows some: "waiting for a peer" had said so)
WAITING = "waiting or untraced time (peers, asynchronous operations, the driver between spans)"


def _label(kind: str, group: str) -> str:
    if kind in ("forward", "backward", "optimizer"):
        return f"{kind} compute"
    if kind == "other compute":
        return kind
    return f"gloo {kind_label(kind)}" + (f" ({group})" if group else "")


def per_step_by_kind(timeline: Timeline, skip_first: bool = True) -> dict[str, float]:
    """Seconds per rank per step spent on each kind of work (core.timeline.span_kind; communication by
    kind and group): what the rank's step is made of, so idle time and asynchronous operations (which
    run beside it, their spans including their time in gloo's queue) are left out, and the time a rank
    spends on no blocking span, in a blocking receive, or in a wait inside a layer's span (an idle span
    there: the engine's ring attention and Mamba state passing mark the time they block on their
    transfers) counts as WAITING. A measured run's first step (warm-up) is skipped when there are later
    ones."""
    if skip_first:
        timeline = timeline.after_warm_up()
    keep = {s.step for s in timeline.spans}
    ranks = max(1, len(timeline.ranks))
    out: dict[str, float] = {}

    def blocking(s) -> bool:  # a blocking receive is a wait for a peer, whatever the engine names it
        return s.lane != "idle" and not s.is_async and span_kind(s) != "send/recv"

    def inside(c, s) -> bool:
        return c is not s and s.start_s <= c.start_s and c.end_s <= s.end_s and c.duration_s < s.duration_s

    for rank in timeline.ranks:
        of_rank = timeline.for_rank(rank)
        spans = [s for s in of_rank if blocking(s) and s.step in keep]
        computes = [s for s in spans if s.lane == "compute"]
        # waits inside a compute span (pipeline bubbles lie between them, and are idle time anyway)
        waits = [w for w in of_rank if w.lane == "idle" and w.step in keep and any(inside(w, s) for s in computes)]
        for step in keep:  # waiting: the step's time on no blocking span (peers, asynchronous operations)
            in_step = [s for s in of_rank if s.step == step and s.lane != "idle"]
            if in_step:
                window = max(s.end_s for s in in_step) - min(s.start_s for s in in_step)
                busy_spans = [(s.start_s, s.end_s) for s in in_step if blocking(s)]
                busy = union_seconds(busy_spans) - intersection_seconds(
                    busy_spans, [(w.start_s, w.end_s) for w in waits if w.step == step])
                out[WAITING] = out.get(WAITING, 0.0) + max(0.0, window - busy) / ranks / len(keep)
        for s in spans:
            seconds = s.duration_s
            if s.lane == "compute":
                # a layer's span encloses its ring steps, the blocking collectives and the waits in it:
                # the compute is what is left, each second counted once
                seconds -= union_seconds([(c.start_s, c.end_s) for c in spans + waits if inside(c, s)])
            key = _label(span_kind(s), s.group if s.lane == "comm" else "")
            out[key] = out.get(key, 0.0) + seconds / ranks / len(keep)
    return out


def step_spread_words(step_times_s: list[float], predicted_s: float | None = None) -> str | None:
    """The run's steps after the warm-up (step 0), fastest to slowest, and where the prediction falls among
    them, in words; None with fewer than two such steps. A step-time error compares the prediction with
    the steps' mean, and on a few shared cores one run's steps spread widely (a cp all-gather run at world
    2 on this 2-core machine: 17.0-32.9 ms, mean 24.5, predicted 25.1), so the spread says how far one
    error can be read."""
    steps = step_times_s[1:]
    if len(steps) < 2:
        return None
    lo, hi = min(steps), max(steps)
    text = f"its {len(steps)} steps after the warm-up took {lo * 1e3:.1f} to {hi * 1e3:.1f} ms"
    if predicted_s is None:
        return text
    faster = sum(t < predicted_s for t in steps)
    if faster == 0:
        where = "below every one of them"
    elif faster == len(steps):
        where = "above every one of them"
    else:
        where = f"between them ({faster} of the {len(steps)} {'was' if faster == 1 else 'were'} faster)"
    return f"{text}; the prediction, {predicted_s * 1e3:.1f} ms, lies {where}"


NEGLIGIBLE_S = 5e-6  # under this a kind of work prints as 0.00 ms: compare says the prediction (or the run) has none


def compare(predicted: Timeline, measured: Timeline, top: int = 3) -> list[dict]:
    """Where a measured run differs most from its prediction: per kind of work, the seconds per rank per
    step of each, largest absolute difference first (at most `top`, only those over 10 % and 50 us)."""
    p, m = per_step_by_kind(predicted), per_step_by_kind(measured)
    rows = []
    for key in set(p) | set(m):
        ps, ms = p.get(key, 0.0), m.get(key, 0.0)
        if abs(ms - ps) < 50e-6 or abs(ms - ps) < 0.1 * max(ps, ms):
            continue
        # a few microseconds of prediction (the event simulation's rounding) is none: no 1e9x ratios; and none
        # measured is said so, not "took 0.0x its predicted time (0.00 ms against 0.18 ms)"
        has = ps >= NEGLIGIBLE_S
        ratio = ms / ps if has else math.inf
        if not has:
            text = f"{key} took {ms * 1e3:.2f} ms per rank per step; the prediction has none"
        elif ms < NEGLIGIBLE_S:
            text = f"{key}: the prediction has {ps * 1e3:.2f} ms per rank per step; the run measured none"
        else:
            text = (f"{key} took {ratio:.1f}x its predicted time ({ms * 1e3:.2f} ms against {ps * 1e3:.2f} ms "
                    "per rank per step)")
        rows.append({"what": key, "predicted_s": ps, "measured_s": ms, "ratio": ratio, "text": text})
    rows.sort(key=lambda r: -abs(r["measured_s"] - r["predicted_s"]))
    return rows[:top]


class _Program:
    """Writes one rank's step as the engine runs it (engine/train.py, engine/pipeline/executor.py, the plans
    and the sharder)."""

    def __init__(self, cfg, costs: _Costs, r: _Rank, g: dict, mesh: Mesh, replicas_groups: dict[str, str],
                 group_names: dict[str, str]):
        self.cfg, self.c, self.r, self.g, self.mesh = cfg, costs, r, g, mesh
        # the engine's names of the groups the shards' replicas span, for a dense and an expert flat buffer
        self.replicas_groups = replicas_groups
        self.shard_axis = mesh.shard_axis()  # the group ZeRO shards over, by the engine's name (engine/flat.py)
        # the engine's names of the gradients' reduction groups (core.mesh.group_key of their axes)
        self.group_names = group_names
        p, m = cfg.parallel, cfg.model
        self.m = m
        self.tp = len(g["tp"])
        self.cp = len(g["cp"])
        self.ep = len(g["ep"])
        self.dp = len(g["dp"])
        self.pp = len(g["pp"])
        self.sp = p.sequence_parallel
        self.stage = p.stage
        self.strategy = p.strategy
        self.b = cfg.micro_batch_size
        self.t_local = m.seq_len // self.cp  # tokens of a sequence this rank holds
        # an MoE layer's tokens on this rank: no tp region (engine/tp.py), so all of them, or under sequence
        # parallel its S/tp positions; and the share of their expert copies a capacity factor keeps (balanced,
        # per sequence as engine/model.MoE groups them)
        self.moe_seq = self.t_local // (self.tp if self.sp else 1)  # of each sequence
        self.moe_tokens = self.b * self.moe_seq
        self.kept = kept_share(m.capacity_factor, self.moe_seq, m.top_k, m.experts) if m.mlp == "moe" else 1.0
        ep_rank = g["ep"].index(r.rank) if self.ep > 1 else 0
        self.params = _params(m, self.tp, self.ep, ep_rank)
        # an MoE block's experts are its parameters after the router (_params' order)
        self.expert_keys: set[tuple[int, int]] = set()
        for u, unit in enumerate(self.params):
            names = [n for n, _ in unit]
            if "router" in names:
                self.expert_keys |= {(u, j) for j in range(names.index("router") + 1, len(unit))}
        self.unit_names = ["embed", *(f"L{i}" for i in range(m.layers)), "head"]
        self.held = list(range(len(self.unit_names)))  # units this rank holds (a pipeline stage: fewer)
        self.flat = self.stage in (1, 2, 3)
        self.pending: list[str | None] = []
        # DP's gradient buckets during the last micro-batch's backward (_grads_ready)
        self.bucket_plan: list[tuple[str, list[tuple[int, int]], int]] = []
        self.bucket_of: dict[tuple[int, int], int] = {}
        self.bucket_left: list[int] = []
        self.counting_grads = True  # a pipeline counts only its last micro-batch's weight gradients (_pipeline)
        self.gathered: dict[int, list[str | None]] = {}
        self.done_gather: set[int] = set()
        self.last_unit: str | None = None  # the kind of unit this rank's program ran last (_cold)

    # -- per-unit compute and the collectives inside a unit ---------------------------------------------
    def _unit(self, i: int) -> tuple[str, int, float, float]:
        """Unit i's span name, its tokens on this rank, its activation bytes, and the flat-buffer views."""
        tokens = self.b * self.t_local
        flat_extra = FLAT_VIEW_OPS * len(self.params[i]) * self.c.tiny if self.flat else 0.0
        return self.unit_names[i], tokens, tokens * self.m.hidden * F32, flat_extra

    def unit_fwd(self, i: int) -> None:
        r, c, m = self.r, self.c, self.m
        name, tokens, act, flat_extra = self._unit(i)
        if i == 0:
            self.last_unit = "fwd embed"
            r.compute(f"fwd {name}", c.embed(tokens, True) + c.ends_fwd["embed"] + flat_extra
                      + (VOCAB_PARALLEL_OPS / 2 * c.tiny if self.tp > 1 else 0.0))
            if self.tp > 1:
                self._tp_exit(act, "embed")
            return
        if i == m.layers + 1:
            tp_entry = self.tp > 1
            if tp_entry:
                self._tp_enter(act, "head")
            self.last_unit = "fwd head"
            r.compute(f"fwd {name}", c.head(tokens, m.vocab // self.tp, True) + c.ends_fwd["head"] + flat_extra
                      + (VOCAB_PARALLEL_OPS * c.tiny if self.tp > 1 else 0.0))
            if self.tp > 1:  # vocabulary-parallel cross entropy: the max, then the sums
                r.coll("all_reduce loss max", self.g["tp"], "tp", "all_reduce", tokens * F32)
                r.coll("all_reduce loss sum-exp and target logit", self.g["tp"], "tp", "all_reduce",
                       2 * tokens * F32)
            return
        self._block(i, name, tokens, act, True, flat_extra + self._cold(True))

    def _cold(self, fwd: bool) -> float:
        """The first layer of a run of layers in one pass runs cold (`_Costs._driver`)."""
        kind = "fwd layer" if fwd else "bwd layer"
        cold = self.last_unit != kind
        self.last_unit = kind
        return (self.c.cold_fwd if fwd else self.c.cold_bwd) if cold else 0.0

    def _block(self, i: int, name: str, tokens: int, act: float, fwd: bool, flat_extra: float) -> None:
        # a layer's caches are emptied once: its own extra covers its resumes after communication up to that much
        self.r.cold_credit = max(0.0, self.c.extra_fwd if fwd else self.c.extra_bwd)
        self._layer(i, name, tokens, act, fwd, flat_extra)
        self.r.cold_credit = 0.0

    def _layer(self, i: int, name: str, tokens: int, act: float, fwd: bool, flat_extra: float) -> None:
        r, c, m = self.r, self.c, self.m
        if m.kinds[i - 1] == MAMBA:
            self._mamba_block(i, name, tokens, act, fwd, flat_extra)
            return
        t = self.tp
        heads, kv = m.heads // t, max(1, m.kv_heads // t)
        ffn = m.ffn // t if m.mlp == "dense" else m.ffn
        shape = _Shape(self.b, self.t_local, m.hidden, heads, kv, ffn)
        norm_rows = tokens // t if self.sp else tokens
        label = f"{'fwd' if fwd else 'bwd'} {name}"
        if fwd and t == 1 and self.cp == 1 and m.mlp == "dense":
            r.compute(label, c.block(shape, fwd) + flat_extra)
            return
        # the unit's work split around its collectives, in the order the engine runs them
        attn_part = c.fit("attention", {"b": self.b, "t": self.t_local, "d": m.hidden, "heads": heads,
                                        "kv_heads": kv, "head_dim": m.hidden // m.heads}, fwd)
        norm = c.fit("rmsnorm", {"m": norm_rows, "d": m.hidden}, fwd)
        glue = c.compute_fit("block_glue")
        rest = (glue.fwd(0) if fwd else glue.bwd(0)) + (c.driver_fwd if fwd else c.driver_bwd) + flat_extra
        moe = m.mlp == "moe"
        if moe:  # no tp region (engine/tp.py): every tp rank runs it whole, on its own S/tp positions under sp
            mlp = c.moe(self.b, self.moe_seq, self.ep, fwd, self.kept)
        else:
            mlp = c.fit("swiglu", {"b": self.b, "t": self.t_local, "d": m.hidden, "ffn": ffn}, fwd)
        ring = self.cp > 1 and self.cfg.parallel.cp_variant == "ring"
        if ring:
            attn_part -= c.attention_core(shape, fwd)
        # backward runs the output projection first, then the attention core, then the q, k, v projections
        wo = min(attn_part, c.fit("linear", {"m": tokens, "k": heads * (m.hidden // m.heads), "n": m.hidden}, fwd))
        if fwd:
            r.compute(label, norm + rest / 2)
            self._tp_enter(act, f"{name} attn")
            r.compute(label, attn_part - wo)
            self._cp_attention(name, shape, True)
            r.compute(label, wo)
            self._tp_exit(act, f"{name} attn")
            r.compute(label, norm + rest / 2)
            if not moe:
                self._tp_enter(act, f"{name} mlp")
            self._ep_mlp(name, mlp, self.moe_tokens if moe else tokens, True)
            if not moe:
                self._tp_exit(act, f"{name} mlp")
        else:
            # the weights' gradients as the engine's backward produces them (DP's buckets leave on them)
            if not moe:
                self._tp_exit_bwd(act, f"{name} mlp")
            self._ep_mlp(name, mlp, self.moe_tokens if moe else tokens, False)
            if moe and self.tp > 1 and self.sp:  # each MoE weight's gradient summed over tp (SequenceShardLinear)
                self._moe_weight_grads(name)
            self._grads_ready(i, ("w1", "w3", "w2", "router"))
            if not moe:
                self._tp_enter_bwd(act, f"{name} mlp")
            r.compute(label, norm + rest / 2)
            self._grads_ready(i, ("mlp_norm",))
            self._tp_exit_bwd(act, f"{name} attn")
            r.compute(label, wo)
            self._grads_ready(i, ("wo",))
            self._cp_attention(name, shape, False)
            r.compute(label, attn_part - wo)
            self._grads_ready(i, ("wq", "wk", "wv"))
            self._tp_kv_replicas(name)
            self._tp_enter_bwd(act, f"{name} attn")
            r.compute(label, norm + rest / 2)
            if self.sp:  # the two norms' weight gradients, summed over tp (engine/tp.py names them by block)
                for norm in ("mlp", "attn"):
                    r.coll(f"all_reduce {name} {norm} norm grad", self.g["tp"], "tp", "all_reduce", m.hidden * F32)

    # -- a Mamba-2 layer (engine/model.MambaBlock; engine/tp.py's _mamba, engine/ssm_cp.py) -------------
    def _mamba_shape(self) -> dict:
        """The mixer as this rank runs it: tp's heads and groups, the tokens it holds."""
        m, t = self.m, self.tp
        return {"b": self.b, "t": self.t_local, "d": m.hidden, "inner": m.ssm_inner // t, "heads": m.ssm_heads // t,
                "head_dim": m.ssm_head_dim, "groups": m.ssm_groups // t, "state": m.ssm_state, "conv": m.conv_width,
                "chunk": m.ssm_chunk}

    def _mamba_block(self, i: int, name: str, tokens: int, act: float, fwd: bool, flat_extra: float) -> None:
        r, c, m = self.r, self.c, self.m
        label, where = f"{'fwd' if fwd else 'bwd'} {name}", f"{name} mamba"
        shape = self._mamba_shape()
        # the scan's chunk loop: over the whole sequence, or over the slices this rank holds (state passing)
        whole = self.cp == 1 or self.cfg.parallel.ssm_cp == "alltoall"
        steps = scan_steps({**shape, "t": m.seq_len}) if whole else scan_steps(shape)
        into, scan, out = c.mamba(shape, steps, fwd)
        norm = c.fit("rmsnorm", {"m": tokens // self.tp if self.sp else tokens, "d": m.hidden}, fwd)
        rest = c.tiny + (c.driver_fwd if fwd else c.driver_bwd) + flat_extra  # the residual add, the driver
        if fwd:
            r.compute(label, norm + rest / 2)
            self._tp_enter(act, where)
            r.compute(label, into)
            self._ssm_mix(name, label, shape, scan, True)
            r.compute(label, out)
            self._tp_exit(act, where)
            r.compute(label, rest / 2)
        else:
            self._tp_exit_bwd(act, where)
            r.compute(label, out + rest / 2)
            self._grads_ready(i, ("out_proj", "out_norm", "in_z"))
            self._ssm_mix(name, label, shape, scan, False)
            self._grads_ready(i, ("dt_bias", "A_log", "D", "conv_x.weight", "conv_x.bias", "conv_b.weight",
                                  "conv_b.bias", "conv_c.weight", "conv_c.bias"))
            r.compute(label, into)
            self._grads_ready(i, ("in_x", "in_b", "in_c", "in_dt"))
            self._tp_enter_bwd(act, where)
            r.compute(label, norm + rest / 2)
            if self.sp:  # the norm's weight gradient, summed over tp
                r.coll(f"all_reduce {name} mamba norm grad", self.g["tp"], "tp", "all_reduce", m.hidden * F32)

    def _ssm_mix(self, name: str, label: str, s: dict, scan_s: float, fwd: bool) -> None:
        """The conv and scan (`Mamba2.mix`), and under cp its messages (engine/ssm_cp.py)."""
        if self.cp == 1:
            self.r.compute(label, scan_s)
            return
        if self.cfg.parallel.ssm_cp == "alltoall":
            self._ssm_alltoall(name, label, s, scan_s, fwd)
        else:
            self._ssm_state_passing(name, label, s, scan_s, fwd)

    def _ssm_alltoall(self, name: str, label: str, s: dict, scan_s: float, fwd: bool) -> None:
        """Sequence shards to head shards (x, B, C, dt), the whole sequence's scan, and back (y); backward
        the gradients the same way in reverse. Bytes: this rank's input of each all-to-all."""
        r = self.r
        tokens = s["b"] * s["t"]
        inputs = tokens * (s["inner"] + 2 * s["groups"] * s["state"] + s["heads"]) * F32
        outputs = tokens * s["inner"] * F32
        first, second = (("scan inputs", inputs), ("scan outputs", outputs)) if fwd else \
            (("scan outputs", outputs), ("scan inputs", inputs))
        suffix = "" if fwd else " bwd"
        r.compute(label, SSM_ALLTOALL_OPS / 2 * self.c.tiny)
        r.coll(f"all_to_all {first[0]} {name}{suffix}", self.g["cp"], "cp", "all_to_all", first[1])
        r.compute(f"scan {name} whole sequence, {s['heads'] // self.cp} heads" if fwd else label, scan_s)
        r.coll(f"all_to_all {second[0]} {name}{suffix}", self.g["cp"], "cp", "all_to_all", second[1])
        r.compute(label, SSM_ALLTOALL_OPS / 2 * self.c.tiny)

    def _slices(self) -> tuple[list[int], list[int], int]:
        """(owner cp rank of every slice of the sequence, this rank's own slices in order, its cp rank): cp
        slices in order, or 2 cp zig-zagged beside attention layers (engine/ssm_cp.Slices)."""
        n, me = self.cp, self.g["cp"].index(self.r.rank)
        owner = cp_slice_owners(n, self.m.has_attention)
        return owner, [g for g, o in enumerate(owner) if o == me], me

    def _ssm_state_passing(self, name: str, label: str, s: dict, scan_s: float, fwd: bool) -> None:
        """Forward: the conv halo in one batch, every own slice scanned from zero, the states in a chain in
        sequence order (receive from the previous slice's holder, add, send on), the outputs corrected.
        Backward: the correction's, the chain reversed, the scan's, then the halo's gradients in a batch."""
        r, c, cp = self.r, self.c, self.g["cp"]
        owner, mine, me = self._slices()
        halo_bytes = s["b"] * (s["conv"] - 1) * (s["inner"] + 2 * s["groups"] * s["state"]) * F32
        state_bytes = s["b"] * s["heads"] * s["head_dim"] * s["state"] * F32
        # state passing's own work over the plain mixer's (its fit: each slice's conv and scan past the first,
        # the decays, the chain's adds, the incoming state's outputs), half before the chain, half after
        extra = c.fit("mamba_state", s, fwd, items=len(mine) - 1) / 2
        phase = "fwd" if fwd else "bwd"

        def before(g: int) -> int | None:
            return owner[g - 1] if g > 0 else None

        def after(g: int) -> int | None:
            return owner[g + 1] if g + 1 < len(owner) else None

        def halo() -> None:
            # forward: each slice's tail to the next slice's holder; backward: its gradient back
            src_of, dst_of = (before, after) if fwd else (after, before)
            what = "conv halo" if fwd else "dhalo"
            sent = []
            for g in mine:
                dst = dst_of(g)
                if dst is not None and dst != me:
                    sent.append(r.send(f"send {what} {name}", cp[dst], (name, what, phase, r.mb, g), len(cp),
                                       halo_bytes, "cp"))
            for g in mine:
                src = src_of(g)
                if src is not None and src != me:
                    key_slice = g - 1 if fwd else g + 1
                    r.comm_op(Recv(f"recv {what} {name}", cp[src], (name, what, phase, r.mb, key_slice), "cp",
                                   r.mb))
            for handle in sent:  # the batch's sends are waited for with its receives (engine/ssm_cp._Halo)
                r.wait(handle)

        def chain() -> None:
            what = "state" if fwd else "dstate"
            order = mine if fwd else list(reversed(mine))
            src_of, dst_of = (before, after) if fwd else (after, before)
            for g in order:
                src = src_of(g)
                if src is not None and src != me:
                    r.comm_op(Recv(f"recv {what} {name}", cp[src], (name, what, r.mb, g), "cp", r.mb))
                dst = dst_of(g)
                if dst is not None and dst != me:
                    nxt = g + 1 if fwd else g - 1
                    # the rank waits for its send (engine/ssm_cp._StateChain): until the next holder receives
                    r.wait(r.send(f"send {what} {name}", cp[dst], (name, what, r.mb, nxt), len(cp), state_bytes, "cp"))

        if fwd:
            halo()
            r.compute(f"scan {name} own slices", scan_s + extra)
            chain()
            r.compute(f"scan {name} correct with incoming state", extra)
        else:
            r.compute(label, extra)
            chain()
            r.compute(label, scan_s + extra)
            halo()

    def unit_bwd(self, i: int) -> None:
        r, c, m = self.r, self.c, self.m
        name, tokens, act, flat_extra = self._unit(i)
        if i == 0:
            if self.tp > 1:
                self._tp_exit_bwd(act, "embed")
            self.last_unit = "bwd embed"
            r.compute(f"bwd {name}", c.embed(tokens, False) + c.ends_bwd["embed"] + flat_extra)
            return
        if i == m.layers + 1:
            self.last_unit = "bwd head"
            r.compute(f"bwd {name}", c.head(tokens, m.vocab // self.tp, False) + c.ends_bwd["head"] + flat_extra)
            if self.tp > 1:
                self._tp_enter_bwd(act, "head")
                if self.sp:
                    r.coll("all_reduce head norm grad", self.g["tp"], "tp", "all_reduce", m.hidden * F32)
            return
        self._block(i, name, tokens, act, False, flat_extra + self._cold(False))

    # -- tensor parallel regions (engine/tp_comm.py) -----------------------------------------------------
    def _tp_enter(self, act: float, where: str) -> None:
        if self.tp > 1 and self.sp:
            self.r.compute(f"fwd {where}", SP_RESHAPE_OPS * self.c.tiny)
            self.r.coll(f"all_gather {where}", self.g["tp"], "tp", "all_gather", act)

    def _tp_exit(self, act: float, where: str) -> None:
        self._tp_reduce("fwd", act, where)

    def _tp_reduce(self, phase: str, act: float, where: str) -> None:
        """Sum a region's partial outputs (forward exit) or input gradients (backward entry) over tp."""
        if self.tp == 1:
            return
        self.r.compute(f"{phase} {where}", TP_REGION_OPS * self.c.tiny)
        name = where if phase == "fwd" else f"{where} grad"
        if self.sp:
            self.r.coll(f"reduce_scatter {name}", self.g["tp"], "tp", "reduce_scatter", act)
        else:
            self.r.coll(f"all_reduce {name}", self.g["tp"], "tp", "all_reduce", act)

    def _tp_exit_bwd(self, act: float, where: str) -> None:
        if self.tp > 1 and self.sp:
            self.r.coll(f"all_gather {where} grad", self.g["tp"], "tp", "all_gather", act)

    def _tp_enter_bwd(self, act: float, where: str) -> None:
        self._tp_reduce("bwd", act, where)

    def _tp_kv_replicas(self, name: str) -> None:
        m = self.m
        if self.tp > m.kv_heads:
            hd = m.hidden // m.heads
            slots = m.kv_heads * hd * m.hidden * F32
            for proj in ("wk", "wv"):
                self.r.coll(f"all_reduce {name} {proj} replica grad", self.g["tp"], "tp", "all_reduce", slots)

    def _moe_weight_grads(self, name: str) -> None:
        """Under sequence parallel an MoE layer's router and every expert's weights see only this rank's S/tp
        positions: each gradient is summed over tp (engine/tp.py's SequenceShardLinear), the experts' in the
        order their backward runs (the last expert's first), then the router's."""
        m = self.m
        for e in reversed(range(m.experts // self.ep)):
            for proj in ("w2", "w3", "w1"):
                self.r.coll(f"all_reduce {name} expert {e} {proj} grad", self.g["tp"], "tp", "all_reduce",
                            m.hidden * m.ffn * F32)
        self.r.coll(f"all_reduce {name} router grad", self.g["tp"], "tp", "all_reduce", m.experts * m.hidden * F32)

    # -- context parallel (engine/cp.py) -------------------------------------------------------------
    def _cp_attention(self, name: str, s: _Shape, fwd: bool) -> None:
        if self.cp == 1:
            return
        r, c, m = self.r, self.c, self.m
        hd = m.hidden // m.heads
        kv_bytes = 2 * self.b * max(1, m.kv_heads // self.tp) * self.t_local * hd * F32  # this rank's KV heads
        n = self.cp
        chunk = self.t_local // 2
        if self.cfg.parallel.cp_variant != "ring":
            kind, what = ("all_gather", "kv") if fwd else ("reduce_scatter", "dkv")  # engine/cp.py's names
            r.coll(f"{kind} {what} {name}", self.g["cp"], "cp", kind, n * kv_bytes)
            return
        # As _RingAttention runs it: each step's K/V shift in flight during the step's block; backward, the
        # block's dK/dV so far leave after it (also in flight), the previous step's are waited for after
        # the next block's compute, the last hop's after the loop.
        dkv = None
        for step in range(n):
            rows, cols = (2 * chunk, 2 * chunk) if step == 0 else (2 * chunk, chunk)
            shift = self._ring_shift("kv", name, kv_bytes) if step < n - 1 else None
            if fwd:
                r.compute(f"attn {name} ring {step}", c.ring_block(self.b, s.heads, rows, cols, True, step == 0))
            else:
                r.compute(f"attn bwd {name} ring {step}", c.ring_block(self.b, s.heads, rows, cols, False, step == 0))
                if dkv is not None:
                    r.wait(dkv)
                    r.compute(f"bwd {name}", c.tiny)  # dkv += the incoming dK/dV
                dkv = self._ring_shift("dkv", name, kv_bytes)
            r.wait(shift)
        r.wait(dkv)

    def _ring_shift(self, what: str, name: str, nbytes: float) -> str | None:
        """One hop of the ring (engine/cp._Ring.shift): the shift runs for its calibrated time from when it
        is posted, beside the rank's compute, and posting it holds the rank for the calibrated posting
        ("post kv L0", as the engine's trace marks it: gloo writes the message from the calling thread);
        returns the shift's handle."""
        r, c, n = self.r, self.c, self.cp
        handle = r.coll(f"send/recv {what} {name}", self.g["cp"], "cp", "ring_shift", nbytes, asyn=True)
        post = c.post("ring_shift", n, nbytes)
        post_s = min(c.comm("ring_shift", n, nbytes, "async"), post.seconds(nbytes)) if post is not None else 0.0
        if post_s > 0:  # a blocking operation of this rank alone: it starts when posted
            # no cpu of its own: the shift's cpu_fraction (process CPU over its whole time) includes the posting
            r.comm_op(Collective(f"post {what} {name}", (r.rank,), "cp", post_s, 0, None, 0.0, r.mb))
        return handle

    # -- expert parallel (engine/ep.py) ----------------------------------------------------------------
    def _ep_mlp(self, name: str, mlp_s: float, tokens: int, fwd: bool) -> None:
        r, m = self.r, self.m
        label = f"{'fwd' if fwd else 'bwd'} {name}"
        if self.ep == 1:
            r.compute(label, mlp_s)
            return
        rows = tokens * m.top_k * self.kept * m.hidden * F32  # every token's top_k copies that its experts keep
        if fwd:
            r.compute(label, mlp_s * 0.15)  # router and routing before the exchange
            r.coll(f"all_to_all counts {name}", self.g["ep"], "ep", "all_to_all", m.experts * 8)
            r.coll(f"all_to_all dispatch {name}", self.g["ep"], "ep", "all_to_all", rows)
            r.compute(label, mlp_s * 0.85)
            r.coll(f"all_to_all combine {name}", self.g["ep"], "ep", "all_to_all", rows)
        else:
            r.coll(f"all_to_all combine {name} bwd", self.g["ep"], "ep", "all_to_all", rows)
            r.compute(label, mlp_s)
            r.coll(f"all_to_all dispatch {name} bwd", self.g["ep"], "ep", "all_to_all", rows)

    # -- the data-parallel sharder (engine/dp.py, zero.py, fsdp.py) ---------------
    def _buckets(self, units: list[int] | None = None) -> list[tuple[str, list[tuple[int, int]], int]]:
        """DP's buckets as engine/dp.py makes them (core.buckets.plan_buckets, on the engine's group names)
        over the parameters of `units` (None: every unit; a pipeline rank's strategy sees only its stage's):
        (their reduction group: "dp", or "dp expert" for experts' weights, which skip ep; the (unit,
        parameter index) each holds; its bytes). An expert no other rank holds a replica of is in none."""
        kind: dict[str, str] = {}  # the engine's group name -> this program's group ("dp" / "dp expert")
        items = []
        for u in range(len(self.params)) if units is None else units:
            for j, (_, n) in enumerate(self.params[u]):
                group = "dp expert" if (u, j) in self.expert_keys else "dp"
                name = self.group_names[group] if len(self.g[group]) > 1 else None
                if name is not None:
                    kind.setdefault(name, group)
                items.append(((u, j), n * F32, name))
        sizes = {key: nbytes for key, nbytes, _ in items}
        return [(kind[name], keys, sum(sizes[k] for k in keys))
                for name, keys in plan_buckets(items, self.cfg.parallel.bucket_bytes)]

    def _open_buckets(self, units: list[int] | None = None) -> None:
        """The buckets wait for their gradients: from now on each one leaves when its last one exists."""
        self.bucket_plan = self._buckets(units)
        self.bucket_of = {key: b for b, (_, members, _) in enumerate(self.bucket_plan) for key in members}
        self.bucket_left = [len(members) for _, members, _ in self.bucket_plan]

    def _grads_ready(self, i: int, names: tuple[str, ...] | None = None, forward_order: bool = False) -> None:
        """The backward has produced the gradients of unit i's parameters `names` (None: all that are left):
        each bucket whose last gradient this was is all-reduced now (engine/dp.py's post-accumulate hooks),
        so a bucket leaves in the middle of a layer's backward as soon as its weights' gradients exist."""
        if not self.bucket_left or not self.counting_grads:
            return
        ready = [j for j, (param, _) in enumerate(self.params[i])
                 if (i, j) in self.bucket_of and (names is None or param in names)]
        done = []
        for key in ready:
            b = self.bucket_of.pop((i, key))
            self.bucket_left[b] -= 1
            if self.bucket_left[b] == 0:
                done.append(b)
        # buckets hold parameters in reverse order: gradients made in forward order fill the later ones first
        for b in sorted(done, reverse=forward_order):
            group, members, nbytes = self.bucket_plan[b]
            # no copy: the gradients are views of the bucket's flat buffer (engine/dp.py)
            self.pending.append(self.r.coll(f"all_reduce bucket {b}", self.g[group], self.group_names[group],
                                            "all_reduce", nbytes, asyn=True))

    def build(self) -> None:
        if self.pp > 1:
            self._pipeline()
        else:
            self._plain()
        self._finish_and_step()

    def _plain(self) -> None:
        r, cfg = self.r, self.cfg
        n_units = len(self.unit_names)
        for mb in range(cfg.micro_batches):
            r.mb = mb
            last = mb == cfg.micro_batches - 1
            for i in range(n_units):
                self._before_forward(i)
                self.unit_fwd(i)
                self._after_forward(i)
            if self.stage == 0 and self.dp > 1 and cfg.parallel.dp_comm == "bucketed" and last:
                self._open_buckets()
            for i in reversed(range(n_units)):
                self._before_backward(i)
                self.unit_bwd(i)
                self._grads_ready(i)
                self._grad_ready(i, last)
            self.bucket_left = []
        r.mb = None

    def _neighbour(self, i: int, step: int) -> int | None:
        """The next unit this rank holds in forward (step 1) or backward (step -1) order, for prefetch."""
        k = self.held.index(i) + step
        return self.held[k] if 0 <= k < len(self.held) else None

    def _before_forward(self, i: int) -> None:
        if self.stage == 3 and self.dp > 1:
            self._unshard(i)
            nxt = self._neighbour(i, 1)
            if self.cfg.parallel.prefetch and nxt is not None:
                self._unshard(nxt)
            self._wait_gathered(i)

    def _after_forward(self, i: int) -> None:
        if self.stage == 3 and i != self.held[-1]:
            self.done_gather.discard(i)

    def _before_backward(self, i: int) -> None:
        if self.stage == 3 and self.dp > 1:
            self._unshard(i)
            prv = self._neighbour(i, -1)
            if self.cfg.parallel.prefetch and prv is not None:
                self._unshard(prv)
            self._wait_gathered(i)

    def _wait_gathered(self, i: int) -> None:
        for handle in self.gathered.pop(i, []):
            self.r.wait(handle)
        self.done_gather.add(i)

    def _flat_buffers(self, i: int) -> list[tuple[int, str]]:
        """Unit i's flat buffers as engine/flat.py makes them, one per gradient group: (bytes, padded to a
        multiple of the shard group; "dp" or "dp expert", whose replicas its shard's gradient is summed over).
        Where ep > 1 an MoE unit's experts skip ep, so they have a buffer of their own (the dense weights'
        first, as the unit's parameters come)."""
        numels: dict[str, int] = {}
        for j, (_, n) in enumerate(self.params[i]):
            kind = "dp expert" if self.ep > 1 and (i, j) in self.expert_keys else "dp"
            numels[kind] = numels.get(kind, 0) + n
        return [(-(-numel // self.dp) * self.dp * F32, kind) for kind, numel in numels.items()]

    def _unshard(self, i: int) -> None:
        if i in self.gathered or i in self.done_gather:
            return
        self.gathered[i] = [self.r.coll(f"all_gather {self.unit_names[i]}", self.g["dp"], self.shard_axis,
                                        "all_gather", nbytes, asyn=True) for nbytes, _ in self._flat_buffers(i)]

    def _grad_ready(self, i: int, last: bool) -> None:
        if self.dp == 1:
            return
        if self.stage == 3:
            self.done_gather.discard(i)
            self.pending += [self.r.coll(f"reduce_scatter {self.unit_names[i]}", self.g["dp"], self.shard_axis,
                                         "reduce_scatter", nbytes, asyn=True) for nbytes, _ in self._flat_buffers(i)]
        elif self.stage in (1, 2) and (self.stage == 2 or last):
            self.pending += [self.r.coll("reduce_scatter grads", self.g["dp"], self.shard_axis, "reduce_scatter",
                                         nbytes, asyn=True) for nbytes, _ in self._flat_buffers(i)]

    def _finish_and_step(self) -> None:
        r, c, cfg = self.r, self.c, self.cfg
        for h in self.pending:
            r.wait(h)
        held = [self.params[u] for u in self.held]
        all_params = [n for unit in held for _, n in unit]
        if self.stage == 0 and self.dp > 1:
            if cfg.parallel.dp_comm == "naive":  # each parameter over its own group (experts: not over ep)
                for u in reversed(self.held):
                    for j in reversed(range(len(self.params[u]))):
                        group = "dp expert" if (u, j) in self.expert_keys else "dp"
                        if len(self.g[group]) > 1:
                            r.coll("all_reduce", self.g[group], self.group_names[group], "all_reduce",
                                   self.params[u][j][1] * F32)
            # one division per bucket and one per parameter in none (engine/dp.py finish_grads; naive: no buckets)
            plan = self._buckets(self.held) if cfg.parallel.dp_comm != "naive" else []
            in_buckets = sum(len(members) for _, members, _ in plan)
            r.compute("finish grads", (len(plan) + len(all_params) - in_buckets) * c.tiny)
        buffers = [buf for u in self.held for buf in self._flat_buffers(u)] if self.flat else []
        # engine/flat.py finish_grads, whatever dp: each buffer's sum of parts and the division of those with no
        # replicas, then each shard's gradient summed over its replicas (HSDP, cp, ep) where any, then divided
        replicated = [(nbytes, kind, replicas) for nbytes, kind in buffers
                      if len(replicas := self.g["replicas expert" if kind == "dp expert" else "replicas"]) > 1]
        if self.flat:
            r.compute("finish grads", (2 * len(buffers) - len(replicated)) * c.tiny)
        for nbytes, kind, replicas in replicated:
            r.coll("all_reduce grad shards", replicas, self.replicas_groups[kind], "all_reduce", nbytes // self.dp)
        if replicated:  # only a flat buffer has replicas to sum over
            r.compute("finish grads", len(replicated) * c.tiny)
        opt = c.adamw([nbytes // F32 // self.dp for nbytes, _ in buffers] if self.flat else all_params)
        r.compute("optimizer step", opt)
        if self.stage in (1, 2) and self.dp > 1:
            for nbytes, _ in buffers:
                r.coll("all_gather params", self.g["dp"], self.shard_axis, "all_gather", nbytes)

    # -- pipeline (engine/pipeline/executor.py) -----------------------------------------------------------------------
    def _pipeline(self) -> None:
        r, cfg, m = self.r, self.cfg, self.m
        v = cfg.parallel.virtual_stages
        sched = make_schedule(cfg.parallel.schedule, self.pp, cfg.micro_batches, v)
        pp_rank = self.g["pp"].index(r.rank)
        num_stages = sched.num_stages
        tokens = self.b * (m.seq_len // self.tp if self.sp else m.seq_len) // self.cp
        boundary = tokens * m.hidden * F32

        def units(stage: int) -> list[int]:
            return stage_units(m, num_stages, stage)

        self.held = sorted({u for c in range(v) for u in units(sched.stage_of(pp_rank, c))})
        # a forward that records for ZB-H1's split (a hook keeps every parameter module's output) costs what
        # the calibration measured of it over the plain forward (engine/calibrate.measure_zb_split)
        record = self.c.compute_fit("zb_record").fwd(1.0) if sched.split_backward else 1.0
        sends = []
        if self.stage == 0 and self.dp > 1 and cfg.parallel.dp_comm == "bucketed":
            # the last micro-batch's gradients fill the buckets (engine/dp.py counts only those)
            self._open_buckets(self.held)
        for a in sched.actions[pp_rank]:
            r.mb = a.micro_batch
            last = a.micro_batch == cfg.micro_batches - 1
            if a.kind == SEND:
                sends.append(r.send(f"send {a.tensor} s{a.stage}", self.g["pp"][a.peer], a.message, self.pp,
                                    boundary, "pp"))
            elif a.kind == RECV:
                r.comm_op(Recv(f"recv {a.tensor} s{a.stage}", self.g["pp"][a.peer], a.message, "pp", a.micro_batch))
            elif a.kind == FORWARD:
                for u in units(a.stage):
                    self._before_forward(u)
                    self._stage_unit(u, True, f"F s{a.stage}", record)
                    self._after_forward(u)
            else:  # B, or ZB-H1's input (BI) and weight (BW) halves of it
                # ZB-H1's halves cost what the calibration measured of the split (engine/calibrate.
                # measure_zb_split: on a small model more than the backward they replace), every unit
                # as the default Block
                share = 1.0
                if a.kind != BACKWARD:
                    zb = self.c.compute_fit("zb_split")
                    share = zb.fwd(1.0) if a.kind == BACKWARD_INPUT else zb.bwd(1.0)
                # engine/dp.py's buckets count the weight gradients of the last micro-batch only: a fused
                # backward's as autograd makes them, inside each unit; ZB-H1's input half makes none, and its
                # weight half (engine/pipeline/stage.py backward_weight) makes them module by module in forward
                # order, each unit's all at once here
                weights = a.kind == BACKWARD_WEIGHT
                for u in units(a.stage) if weights else reversed(units(a.stage)):
                    self.counting_grads = last and a.kind == BACKWARD
                    if not weights:
                        self._before_backward(u)
                    self._stage_unit(u, False, f"{a.kind} s{a.stage}", share)
                    self.counting_grads = True
                    if a.kind != BACKWARD_INPUT:  # a bucket's launch runs inside the pass, as in the engine
                        before = len(r.ops)
                        self._grad_ready_pp(u, last, forward_order=weights)
                        self._label_compute(before, f"{a.kind} s{a.stage}")
        r.mb = None
        for handle in sends:  # the executor waits for its isends after the last action
            r.wait(handle)

    def _stage_unit(self, u: int, fwd: bool, label: str, share: float = 1.0) -> None:
        """A unit inside a pipeline pass: its compute and collectives, under the pass's span name."""
        before = len(self.r.ops)
        self.r.compute_scale = share
        try:
            (self.unit_fwd if fwd else self.unit_bwd)(u)
        finally:
            self.r.compute_scale = 1.0
        self._label_compute(before, label)

    def _label_compute(self, before: int, label: str) -> None:
        """The compute this rank's program gained since op `before` runs inside the pass `label` (the engine
        times a pass as one span, whatever it calls)."""
        for op in self.r.ops[before:]:
            if isinstance(op, Compute):
                op.name = label

    def _grad_ready_pp(self, u: int, last: bool, forward_order: bool = False) -> None:
        """The strategy over dp sees the stage's units as a model of their own (engine/pipeline/executor.py)."""
        if self.dp == 1:
            return
        if self.stage == 0 and self.cfg.parallel.dp_comm == "bucketed" and last:
            # the stage's buckets, as engine/dp.py plans them over the stage's parameters
            self._grads_ready(u, forward_order=forward_order)
        elif self.stage in (1, 2, 3):
            self._grad_ready(u, last)


