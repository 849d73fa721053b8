"""Measure this machine for the planner: what each piece of the live engine costs here.

The planner predicts a live run from op-level costs of the machine it runs on, as it predicts a cluster
from GEMM and NCCL benchmarks (planner/live.py). This module takes those measurements; it imports torch
and runs tasks on the engine's worker pools, one thread per rank, exactly as live runs do. The numbers
are raw timings; `hardware.this_machine` fits and caches them.

Three kinds of measurement:

* compute (`compute_task`, one rank alone): the engine model's own modules (engine/model.py, the Mamba-2
  mixer of engine/mamba.py) at a few shapes each, forward and backward, so the fit captures both their
  fixed per-call overhead (Python, the dispatcher, autograd: what dominates a small model on a CPU) and
  their per-FLOP or per-byte rate; plus the optimizer update per tensor, the strategies' bookkeeping
  ops, and the roofline that the hardware lesson plots (hardware/probe.py on one rank's thread: fp32
  and bf16 matmuls, a large copy).
* sharing (`compute_task` on every rank of a W-rank pool at once): how much slower the same work runs
  when W ranks share this machine's cores than with one rank on each core (the first `cpu_count()` ranks
  of the pool at once, right before and after).
* resuming (`resume_task`, on every rank of a W-rank pool): how much longer a compute segment takes when
  it starts right after the rank's own communication than when it follows other compute. A Block's
  forward after a blocking all-reduce takes ~0.2 ms more on 2 cores whatever the message size or kind
  (all-to-all and send/recv alike, and still after a 2 ms pause): the rank resumes on cold caches, as each
  tensor-parallel or expert-parallel segment of a live run does.
* communication (`comm_task`): every gloo operation the strategies use, by group size n and world W
  (the other groups of the world communicating at the same time, as a mesh does), at a few message
  sizes: blocking, each after `COMPUTE_GAP_S` of computing as in a training step (back to back they run
  2-3x faster: gloo's threads stay awake) and after a shorter and a longer gap (`SYNC_GAPS_S`), and as
  a stream of asynchronous operations; with the process CPU time each takes (gloo's threads keep a core
  busy while they move data). The ring shift (context parallel's hop) goes through the engine's own
  `Comm.p2p`, and how long posting it blocks the rank is timed too (its "post" mode). How long posting a
  pipeline message's isend holds its sender is timed on the engine's own pipeline (`pipeline_posting`).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import threading
import time
from dataclasses import asdict, replace

import torch

from engine.config import ModelConfig, RunConfig
from engine.ep import ExpertParallelPlan
from engine.mamba import Mamba2, init_mamba_
from engine.model import Attention, Block, Embed, Head, LanguageModel, MoE, RMSNorm, SwiGLU, loss_fn
from engine.optim import AdamW, adamw_
from engine.ring_attention import block_backward, block_forward, expand_kv, merge, reduce_kv, zigzag_positions
from hardware.this_machine import (
    ADAMW_STATE_SIZES,
    ADAMW_STATE_TENSOR,
    ALONE_MODE,
    ASYNC_KINDS,
    ATTENTION_LONGEST,
    BACK_TO_BACK_MODE,
    BLOCKING_MODES,
    COMM_KINDS,
    CONTENDED_CAP_S,
    PAIR_MODE,
    POST_MODE,
    RING_LONGEST,
    SYNC_GAP_KINDS,
    WIDE_PREFIX,
    WIDE_UNITS,
    early_mode,
    late_mode,
    message_loads,
    message_spinners,
)

# Message sizes of the communication sweep (bytes): the live models' collectives are 0.1-450 KB (the
# whole-gradient all-reduce of cp and ep is 427 KB), where gloo's time is mostly per operation (thread
# hand-offs, syscalls); three sizes spanning that range fit alpha and beta without extrapolating.
COMM_SIZES = (1024, 131072, 524288)
PIPELINE_POSTING_STEPS = 8  # steps of the engine's pipeline `pipeline_posting` times (the first two are warm-up)
# Calls of each operation and size (engine/calibrate.comm_task). A rank's gloo time has a heavy tail
# (a stalled thread waits a scheduler tick, ~4 ms, about once in tens of calls): means over fewer rounds
# moved a fit by up to 2x between two calibrations of this machine. With 2 ranks the calls are ~5x
# cheaper and a tenth of them stall, so they run twice the rounds (three calibrations predicted the
# default 2-rank runs 7-24 % apart with 60).
COMM_ROUNDS = 60
ASYNC_ROUNDS = 24
COMM_BLOCK = 10
CONTENDED_CHUNK_S = 25e-6  # the compute between two polls of an operation in flight (a few small matmuls)
CONTENDED_ROUNDS = 24  # with 8, two calibrations put a 2-rank all-reduce under compute at 1.74 and 0.28 ms
# COMM_KINDS, ASYNC_KINDS and SYNC_GAP_KINDS (what comm_task times) are hardware.this_machine's: its
# `comm_modes` lists every (kind, mode) timed here, and a cached file lacking one is measured again
ASYNC_BURST = 6  # asynchronous operations issued back to back before waiting (DP buckets, FSDP units)
# Two asynchronous operations of a group posted at once, against one alone, timed in the same window
# (comm_task): how much gloo's second worker thread buys. Measured here with 14 DP-sized all-reduces
# (25-100 KB) on 2 cores: 63-65 ms one after another and 44-54 ms two at a time on 4 ranks (1.2-1.5
# operations' worth in one's time, not 2), 23 and 12 ms on 2 ranks; the event simulation, which ran two at
# once at full speed, predicted the data-parallel run at 4 ranks 21-41 % fast.
PAIR_ROUNDS = 24
COMPUTE_GAP_S = 300e-6  # compute before each blocking operation: a unit of the default model takes ~0.3 ms
# A blocking operation costs more the longer its rank computed before it: gloo's threads slept that long,
# and on busy cores waking them waits for a scheduler tick more often. In an experiment here (2 cores, an
# 18 KB all-to-all, mean of 145 calls per rank) it took 0.31 ms after 50 us of compute, 0.6 after 0.3 ms,
# 0.5-1.1 after 1 ms and 1.2-1.4 after 3 ms over 2 ranks; 2.5, 2.5-2.8, 3.1-3.3 and 5-6 ms over 4. The
# calibration times blocking operations after each of SYNC_GAPS_S too ("sync" is COMPUTE_GAP_S), on
# fewer calls (SYNC_GAP_ROUNDS): single fits are noisy (one calibration put a 2-rank all-to-all at 0.82
# ms after 2 ms and 0.85 after 0.3 ms), and planner.live reads each operation at the compute before it.
SYNC_GAPS_S = {BLOCKING_MODES[0]: 50e-6, BLOCKING_MODES[2]: 2e-3}
SYNC_GAP_ROUNDS = 30
# A pipeline's messages (send_recv's "late" and "early" modes, engine/calibrate._pipeline_messages). gloo's
# point-to-point is a rendezvous, so a message moves only once its receive is posted too. Each pair's sender
# isends and computes LATE_SENDER_UNITS units of LATE_UNIT_S; its receiver either computes LATE_RECEIVER_UNITS
# units, then receives ("late": posted while the sender still computes, as a pipeline's RECV posted when its
# stage needs the tensor, long after the other stage's SEND; timed from the receive's posting), or receives
# first and waits while the sender computes those units before its isend ("early": a stage waiting for its
# input; timed one way, from the isend's posting to the receive's return, with the sender's clock reading
# carried in the message: perf_counter is the machine's monotonic clock, the same in every process); with
# one pair, a third late receive whose sender blocks in its wait right after the isend ("late0": nothing
# computing, as a stage that has sent its last activation and waits for a gradient). The roles alternate;
# 3 x LATE_WINDOW_ROUNDS timed receives per rank, size and mode, with 1 .. world / 2 pairs at once (the
# others idle; at world 2 also one pair beside a busy thread: hardware.this_machine.message_loads), each
# mode and size the mean message (`_typical_messages`). On 2 cores a 1 KB late receive took 0.6-1.1 ms
# (means) with one sender computing and 4.5-6 ms with two (the sender's gloo thread waits for a core); an
# early one 0.1-0.4 ms with one, against 0.8-1.1 ms for a ring shift of both ranks at once
# (the receiver's threads are awake and the sender writes the message from its own thread).
# The slow messages come in spells of ~0.5-1 s (one-way 1 KB messages on 2 ranks, windows of 25: mean 0.09
# ms in most, 0.5-0.9 ms in a run of them 1.5-2.1 s in); one calibration whose 1.3 s of messages fell in a
# spell put the median late receive at 1.14 ms against 0.10-0.15 for the engine's own. So the rounds are
# timed in three windows of LATE_WINDOW_ROUNDS spread over comm_task (before, between and after its other
# operations, seconds apart), and each number is over all of them.
LATE_UNIT_S = 1e-3
LATE_SENDER_UNITS, LATE_RECEIVER_UNITS = 3, 2
LATE_WINDOW_ROUNDS = 7


def comm_rounds(world: int) -> int:
    """Calls of each blocking operation and size at `world` (COMM_ROUNDS, twice that for 2 ranks)."""
    return 2 * COMM_ROUNDS if world <= 2 else COMM_ROUNDS


def _mean_s(fn, reps: int, warmup: int = 2) -> float:
    """Mean seconds per call over `reps` calls after `warmup`: the expected cost, which is what a step
    made of many such calls adds up to (a median would hide the waits of ranks sharing cores)."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _median_s(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of one call over `reps` calls after `warmup`: a machine's speed of the moment, which a
    burst of other work during part of the calls would move if it were a mean (`reference_task`)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fwd_bwd(make, reps: int) -> tuple[float, float]:
    """(forward seconds, backward seconds) of `make() -> (forward fn, backward fn)`."""
    fwd, bwd_after = make()
    t_fwd = _mean_s(fwd, reps)

    def both():
        bwd_after(fwd())

    t_both = _mean_s(both, reps)
    return t_fwd, max(0.0, t_both - t_fwd)


def _module(module, x, extra=None):
    """Forward / backward closures of a module on a leaf input that needs a gradient."""
    x = x.detach().requires_grad_(x.is_floating_point())

    def fwd():
        y = module(x) if extra is None else extra(module(x))
        return y

    def bwd(y):
        (y if y.dim() == 0 else y.sum()).backward()

    return fwd, bwd


def _reference_block():
    """Forward / backward closures of the reference Block: the engine's default layer on 2 sequences (the
    "sharing" shape of `measure_compute`, the speed check of `reference_task`)."""
    m = ModelConfig()
    return _module(Block(m), torch.randn(2, m.seq_len, m.hidden))


ANCHOR_REPS = 30  # passes of the reference Block timed between two groups of module timings (~45 ms)


class _Anchors:
    """The reference Block timed before the first group of module timings and after each group: every
    sample of a group carries the mean of the two timings around it (`anchor_s`), and
    `hardware.this_machine.fit_compute` puts each sample at one speed of the machine with it. This machine's
    speed changes in spells of a few seconds (the Block read 1.44 ms, then 2.61 and 2.48, then 1.47 again
    within a second, one process alone: most likely it moved to the other core, which ran it at 2.47-2.57
    ms against 1.56-2.20 pinned), and the module timings take about two: a spell during some of them had
    skewed those modules against the rest and against the reference timed before and after them all.
    Across a spell's edges a module's time read 0.61x and 1.81x the reference timed just before it (200
    passes), and within 4 % of one timed right after it (20 passes)."""

    def __init__(self, out: list[dict]):
        fwd, bwd = _reference_block()
        self._pass = lambda: bwd(fwd())
        self.out, self.start = out, len(out)
        self.last = self._time()

    def _time(self) -> float:
        return _median_s(self._pass, ANCHOR_REPS, warmup=1)

    def mark(self) -> None:
        """The samples added since the last mark were one group: time the anchor after them."""
        now = self._time()
        for smp in self.out[self.start:]:
            smp["anchor_s"] = (self.last + now) / 2
        self.start, self.last = len(self.out), now

    def skip(self) -> None:
        """The samples added since the last mark are ratios of timings of their own (ZB-H1's split): left as
        they are."""
        self.start = len(self.out)


def _sample(op: str, shape: dict, fwd_s: float, bwd_s: float) -> dict:
    return {"op": op, "shape": shape, "fwd_s": fwd_s, "bwd_s": bwd_s}


def _model(hidden: int, heads: int, kv_heads: int, ffn: int, seq_len: int, **kw) -> ModelConfig:
    return ModelConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, seq_len=seq_len, **kw)


# (sequences, tokens, width, experts, top_k, ep) of the expert-parallel MoE timings: the default ep runs' layer at
# ep 2 and 4, twice the experts, top-1, a wider and a longer one
EP_MOE_SHAPES = ((2, 32, 64, 4, 2, 2), (2, 32, 64, 8, 2, 4), (2, 32, 64, 8, 2, 2), (2, 16, 64, 4, 1, 2),
                 (2, 32, 128, 4, 2, 2), (2, 64, 128, 8, 2, 2))


class _LoopbackComm:
    """An ep group of `ep` ranks in one process, every peer routing the same tokens as this rank: each
    all-to-all returns what it was given (the splits of the counts this rank sends are the ones it receives).
    So the dispatch runs every tensor operation it runs in a live run, on the same number of rows; the
    exchange itself is a local copy (a few microseconds here, where the live run times it as communication)."""

    def __init__(self, ep: int):
        self.ep = ep

    def size(self, group: str) -> int:
        return self.ep if group == "ep" else 1

    def group_rank(self, group: str) -> int:
        return 0

    def all_to_all(self, out, inp, out_splits=None, in_splits=None, group="world", name=""):
        out.copy_(inp)


def _mamba_mixer(m: ModelConfig) -> Mamba2:
    """A Mamba-2 mixer with the engine's initialisation (engine/model.build_model): its decays and steps set
    the magnitudes the scan computes with, and so whether its backward meets denormal floats, which this CPU
    handles 3-5x slower. The mixer left at its constructor's A = -1 and dt = 0.69, with its conv weights
    uninitialised, timed 8-14 ms backward where the engine's took 2.4-2.8 (engine/mamba.CausalConv)."""
    mixer = Mamba2(m)
    init_mamba_(mixer)
    return mixer


class _NoPeers:
    """Comm and recorder for one cp rank's StatePassing alone (`_state_passing_sample`): every send completes at
    once and every receive brings zeros, so the layer runs each of its own tensor operations and none of the
    waiting, which the live prediction times as communication."""

    class _Done:
        def wait(self) -> None:
            pass

    def __init__(self):
        self.recorder = self

    def p2p(self, ops, group, tag):
        for op, tensor, *_ in ops:
            if op == "recv":
                tensor.zero_()
        return [self._Done()]

    def now(self) -> float:
        return time.perf_counter()

    def add(self, *span) -> None:
        pass

    def compute(self, name):
        return contextlib.nullcontext()


def _state_passing_sample(bsz: int, t: int, cp: int, zigzag: bool, rank: int, reps: int) -> dict:
    """The "mamba_state" sample: the seconds rank `rank` of `cp` spends on state passing's own work (engine/ssm_cp.py:
    the halo's slicing, each slice's decay, the chain's adds, the incoming state's outputs, the stacks and
    concatenations, their backward) over the plain mixer at the same local shape, forward and backward. The
    two are timed in turns, SSM_STATE_TURNS times, and the differences' medians kept: each is about a
    quarter of the mixer, a drift of the machine's speed between two separate timings would swamp it."""
    from engine.ssm_cp import Slices, StatePassing

    slices = Slices(cp, rank, zigzag)
    m = ModelConfig(hidden=SSM_STATE_HIDDEN, seq_len=t // cp, arch="mamba2")
    x = torch.randn(bsz, m.seq_len, m.hidden)

    def passing():
        mixer = _mamba_mixer(m)
        mixer.mix = StatePassing(mixer, slices, _NoPeers(), _NoPeers(), "calibration")
        return _module(mixer, x)

    fwd, bwd = [], []
    for _ in range(SSM_STATE_TURNS):
        f0, b0 = _fwd_bwd(lambda: _module(_mamba_mixer(m), x), max(2, reps // 3))
        f1, b1 = _fwd_bwd(passing, max(2, reps // 3))
        fwd.append(f1 - f0)
        bwd.append(b1 - b0)
    shape = {**mamba_shape(m, bsz), "slices": len(slices.mine)}
    return _sample("mamba_state", shape, max(0.0, statistics.median(fwd)), max(0.0, statistics.median(bwd)))


def _expert_parallel_moe(m: ModelConfig, ep: int) -> MoE:
    """The MoE layer of a one-layer model with engine/ep.py's plan on it, rank 0 of an ep group of `ep`
    (`_LoopbackComm`): its own E / ep experts, tokens to them through the plan's dispatch."""
    model = LanguageModel(replace(m, layers=1))
    ExpertParallelPlan(RunConfig(model=model.config), model, _LoopbackComm(ep), "dp")
    return model.units[1].mlp


def measure_compute(reps: int = 15, shapes: str = "all", then=None) -> list[dict]:
    """Timings of the engine's modules on this process (torch threads as set by the caller), each group
    anchored to the reference Block timed around it (`_Anchors`); `then()`, when given, returns one more
    group of samples, timed and anchored after the modules (the engine's own step: `compute_task`)."""
    torch.manual_seed(0)
    out = []
    if shapes == "sharing":
        # long enough (~0.3 s) that every rank's loop overlaps the others' whatever their start jitter
        m = ModelConfig()
        f, b = _fwd_bwd(_reference_block, max(reps, 200))
        return [_sample("block", {"b": 2, "t": m.seq_len, "d": m.hidden, "heads": m.heads,
                                  "kv_heads": m.kv_heads, "ffn": m.ffn}, f, b)]
    anchors = _Anchors(out)
    for m_rows, k, n in ((64, 64, 64), (64, 64, 256), (256, 64, 256), (64, 256, 64), (512, 256, 512)):
        lin = torch.nn.Linear(k, n, bias=False)
        f, b = _fwd_bwd(lambda: _module(lin, torch.randn(m_rows, k)), reps)
        out.append(_sample("linear", {"m": m_rows, "k": k, "n": n}, f, b))
    anchors.mark()
    for rows, d in ((64, 64), (256, 64), (1024, 256)):
        f, b = _fwd_bwd(lambda: _module(RMSNorm(d), torch.randn(rows, d)), reps)
        out.append(_sample("rmsnorm", {"m": rows, "d": d}, f, b))
    anchors.mark()
    # the default shape and its neighbours, and longer sequences and another head dim, so that the fit can tell
    # the scores' cost from the FLOPs' (hardware.this_machine.score_elements)
    for bsz, t, d, nq, nkv in ((2, 32, 64, 4, 2), (2, 32, 64, 2, 1), (2, 16, 64, 4, 2), (2, 64, 64, 4, 2),
                               (4, 64, 128, 4, 4), (2, 128, 64, 4, 2), (2, ATTENTION_LONGEST, 64, 4, 2),
                               (2, 128, 128, 2, 2)):
        m = _model(d, nq, nkv, 4 * d, t)
        att = Attention(m)
        att.heads, att.kv_heads = nq, nkv
        f, b = _fwd_bwd(lambda: _module(att, torch.randn(bsz, t, d)), reps)
        out.append(_sample("attention", {"b": bsz, "t": t, "d": d, "heads": nq, "kv_heads": nkv,
                                         "head_dim": d // nq}, f, b))
    anchors.mark()
    for bsz, t, d, ffn in ((2, 32, 64, 128), (2, 32, 64, 64), (2, 16, 64, 128), (4, 64, 128, 512)):
        f, b = _fwd_bwd(lambda: _module(SwiGLU(d, ffn), torch.randn(bsz, t, d)), reps)
        out.append(_sample("swiglu", {"b": bsz, "t": t, "d": d, "ffn": ffn}, f, b))
    anchors.mark()
    m = ModelConfig()
    f, b = _fwd_bwd(lambda: _module(Block(m), torch.randn(2, m.seq_len, m.hidden)), reps)
    out.append(_sample("block", {"b": 2, "t": m.seq_len, "d": m.hidden, "heads": m.heads,
                                 "kv_heads": m.kv_heads, "ffn": m.ffn}, f, b))
    anchors.mark()
    out.append(measure_zb_split())
    anchors.skip()
    for bsz, t, vocab, d in ((2, 32, 256, 64), (2, 32, 128, 64), (2, 16, 256, 64), (4, 64, 1024, 128)):
        mm = _model(d, 4, 2, 2 * d, t, vocab=vocab)
        tokens = torch.randint(0, vocab, (bsz, t))
        emb = Embed(mm)
        f, b = _fwd_bwd(lambda: (lambda: emb(tokens), lambda y: y.sum().backward()), reps)
        out.append(_sample("embed", {"b": bsz, "t": t, "vocab": vocab, "d": d}, f, b))
        head = Head(mm)
        targets = torch.randint(0, vocab, (bsz, t))
        f, b = _fwd_bwd(lambda: _module(head, torch.randn(bsz, t, d), lambda lg: loss_fn(lg, targets)), reps)
        out.append(_sample("head", {"b": bsz, "t": t, "vocab": vocab, "d": d}, f, b))
    anchors.mark()
    for bsz, t, d, experts, top_k in ((2, 32, 64, 4, 2), (2, 32, 64, 8, 2), (2, 16, 64, 4, 1)):
        m = _model(d, 4, 2, 2 * d, t, mlp="moe", experts=experts, top_k=top_k)
        f, b = _fwd_bwd(lambda: _module(MoE(m), torch.randn(bsz, t, d)), reps)
        out.append(_sample("moe", {"b": bsz, "t": t, "d": d, "ffn": 2 * d, "experts": experts,
                                   "top_k": top_k}, f, b))
    anchors.mark()
    # the MoE layer as expert parallel runs it (engine/ep.py's dispatch: sorting, counts, index ops, the local
    # experts on the rows of every ep rank), at the widths, expert counts and ep sizes of the live runs
    for bsz, t, d, experts, top_k, ep in EP_MOE_SHAPES:
        m = _model(d, 4, 2, 2 * d, t, mlp="moe", experts=experts, top_k=top_k)
        f, b = _fwd_bwd(lambda: _module(_expert_parallel_moe(m, ep), torch.randn(bsz, t, d)), reps)
        out.append(_sample("moe_ep", {"b": bsz, "t": t, "d": d, "ffn": 2 * d, "experts": experts,
                                      "top_k": top_k, "ep": ep}, f, b))
    anchors.mark()
    # the Mamba-2 mixer (engine/mamba.py) at the local shapes of the live runs: whole, tp = 2's heads and
    # groups, cp = 2 and 4's slices, a long sequence (more chunks, one scan loop step each) and a wide one
    for bsz, t, d, expand, groups in ((2, 32, 64, 2, 4), (2, 16, 64, 1, 2), (2, 8, 64, 2, 4), (2, 64, 64, 2, 4),
                                      (2, 32, 128, 2, 4)):
        m = ModelConfig(hidden=d, seq_len=t, arch="mamba2", ssm_expand=expand, ssm_groups=groups)
        f, b = _fwd_bwd(lambda: _module(_mamba_mixer(m), torch.randn(bsz, t, d)), reps)
        out.append(_sample("mamba", mamba_shape(m, bsz), f, b))
    anchors.mark()
    # what context parallel's state passing (engine/ssm_cp.StatePassing) adds to the mixer at a rank's local
    # shape: the live runs' cp = 2 and 4 slices, two zig-zag slices a rank beside attention, and a longer one
    for bsz, t, cp, zigzag, rank in SSM_STATE_SHAPES:
        out.append(_state_passing_sample(bsz, t, cp, zigzag, rank, reps))
    anchors.mark()
    # one ring step as engine/cp.py runs it: K/V expanded to the query heads (GQA), the block's attention and the
    # merge into the running output; backward: the block's gradients, reduced back onto the KV heads and written
    # into a zero dK/dV buffer. "ring_diag": the first step, the rank's own queries against its own keys under the
    # causal mask of its two zig-zag chunks (as rank 0 of 2 holds them), nothing to merge into yet
    longest = (2, 4, RING_LONGEST, RING_LONGEST, 16)
    ring_shapes = {"ring_block": ((2, 4, 16, 16, 16), (2, 4, 32, 16, 16), (2, 4, 64, 64, 16), (2, 4, 128, 128, 16),
                                  (2, 2, 64, 64, 64), longest),
                   "ring_diag": ((2, 4, 16, 16, 16), (2, 4, 64, 64, 16), (2, 4, 128, 128, 16), (2, 2, 64, 64, 64),
                                 longest)}
    for op, shapes in ring_shapes.items():
        for bsz, h, rows, cols, hd in shapes:
            out.append(_ring_step(op, bsz, h, rows, cols, hd, reps))
    anchors.mark()
    hyper = AdamW()
    for numel in (64, 4096, 65536):
        p, g, m1, m2 = (torch.randn(numel) for _ in range(4))
        m2.abs_()
        out.append(_sample("adamw", {"numel": numel}, _mean_s(lambda: adamw_(p, g, m1, m2, 3, hyper), reps),
                           0.0))
    # the same kernel as the engine's step runs it, over tensor after tensor, at state sizes that outgrow the
    # caches (hardware.this_machine.ADAMW_STATE_SIZES): each a step's median seconds over its elements
    for total in ADAMW_STATE_SIZES:
        state = [[torch.randn(ADAMW_STATE_TENSOR) for _ in range(4)] for _ in range(total // ADAMW_STATE_TENSOR)]
        for _p, _g, _m1, m2 in state:
            m2.abs_()

        def step(state=state):
            for p, g, m1, m2 in state:
                adamw_(p, g, m1, m2, 3, hyper)

        out.append(_sample("adamw_state", {"numel": total}, _median_s(step, max(5, reps * ADAMW_STATE_TENSOR // total)),
                           0.0))
        del state
    small = torch.randn(64)
    out.append(_sample("tiny_op", {"numel": 64}, _mean_s(lambda: small.add(1.0), 4 * reps), 0.0))
    out.append(_sample("copy", {"bytes": 4 * 65536}, _mean_s(lambda: torch.randn(65536).clone(), reps), 0.0))
    anchors.mark()
    if then is not None:
        out += then()
        anchors.mark()
    return out + measure_roofline()


def _ring_step(op: str, bsz: int, h: int, rows: int, cols: int, hd: int, reps: int) -> dict:
    """A "ring_block" or "ring_diag" sample (`measure_compute`)."""
    kv_heads = max(1, h // 2)
    q = torch.randn(bsz, h, rows, hd)
    kv = torch.randn(2, bsz, kv_heads, cols, hd)
    out0, lse0 = torch.randn(bsz, h, rows, hd), torch.randn(bsz, h, rows)
    scale = hd ** -0.5
    mask = None
    if op == "ring_diag":  # rank 0 of 2: zig-zag chunks 0 and 3 of a sequence of 2 x rows, its mask as _Ring's
        positions = zigzag_positions(2 * rows, 2, 0)
        mask = positions[:, None] >= positions[None, :]

    def fwd_step():
        o_b, l_b = block_forward(q, expand_kv(kv[0], h), expand_kv(kv[1], h), mask, scale)
        return (o_b, l_b) if mask is not None else merge(out0, lse0, o_b, l_b)

    lse = torch.randn(bsz, h, rows)
    dout, delta = torch.randn(bsz, h, rows, hd), torch.randn(bsz, h, rows)

    def bwd_step():
        dq_b, dk_b, dv_b = block_backward(q, expand_kv(kv[0], h), expand_kv(kv[1], h), mask, scale, lse, dout, delta)
        dkv = torch.zeros_like(kv)
        dkv[0] = reduce_kv(dk_b, kv_heads)
        dkv[1] = reduce_kv(dv_b, kv_heads)
        return dq_b, dkv

    return _sample(op, {"b": bsz, "heads": h, "rows": rows, "cols": cols, "head_dim": hd},
                   _mean_s(fwd_step, reps), _mean_s(bwd_step, reps))


# State passing's timings (`_state_passing_sample`): (sequences, whole sequence, cp, zig-zag, rank): the first
# and the last rank of cp = 2, a middle one of 4, a rank's two zig-zag slices, a longer slice
SSM_STATE_SHAPES = ((2, 32, 2, False, 0), (2, 32, 2, False, 1), (2, 32, 4, False, 1), (2, 32, 2, True, 0),
                    (2, 128, 2, False, 1))
SSM_STATE_HIDDEN = 64
SSM_STATE_TURNS = 5  # plain and state-passing mixers timed in turns; about a second a shape
ZB_SPLIT_REPS = 120  # backward passes of each kind, taking turns (against the machine's drift)


def measure_zb_split(reps: int = ZB_SPLIT_REPS) -> dict:
    """ZB-H1's split backward of the default Block (engine/pipeline/stage.WeightGradSplit) beside its
    plain backward: BI's and BW's seconds, and the plain backward's as `shape["plain_bwd_s"]`. On a small
    model the split costs more than the backward it replaces: BI walks the whole graph for the modules'
    output gradients, and BW is one autograd call per parameter module (on 2 cores 0.68 + 0.53 ms against
    0.77). The forward that records for the split (a hook on every parameter module keeps its output) is
    timed beside the plain one too, as `shape["record_fwd_s"]` and `shape["plain_fwd_s"]` (1.01 against
    0.87 ms on 2 cores)."""
    from engine.pipeline.stage import WeightGradSplit

    m = ModelConfig()
    block, bare = Block(m), Block(m)  # the plain pass runs on a Block without the split's hooks
    bare.load_state_dict(block.state_dict())
    split = WeightGradSplit(block)
    x0 = torch.randn(2, m.seq_len, m.hidden)

    def forward(record: bool):
        x = x0.detach().requires_grad_()
        if not record:
            return x, bare(x), None
        with split.record() as captured:
            y = block(x)
        return x, y, captured

    plain, bi, bw, plain_fwd, record_fwd = [], [], [], [], []
    for i in range(reps + 5):
        s = time.perf_counter()
        x, y, _ = forward(False)
        t0 = time.perf_counter()
        y.backward(torch.ones_like(y))
        t1 = time.perf_counter()
        x, y, captured = forward(True)
        t2 = time.perf_counter()
        _, work_left = split.backward_input(y, torch.ones_like(y), x, captured)
        t3 = time.perf_counter()
        split.backward_weight(work_left)
        t4 = time.perf_counter()
        if i >= 5:  # warm-up
            plain_fwd.append(t0 - s)
            record_fwd.append(t2 - t1)
            plain.append(t1 - t0)
            bi.append(t3 - t2)
            bw.append(t4 - t3)
    block.zero_grad(set_to_none=True)
    bare.zero_grad(set_to_none=True)
    shape = {"b": 2, "t": m.seq_len, "d": m.hidden, "plain_bwd_s": statistics.fmean(plain),
             "plain_fwd_s": statistics.fmean(plain_fwd), "record_fwd_s": statistics.fmean(record_fwd)}
    return _sample("zb_split", shape, statistics.fmean(bi), statistics.fmean(bw))


def mamba_shape(m: ModelConfig, sequences: int) -> dict:
    """The Mamba-2 mixer's shape as `hardware.this_machine.work("mamba", shape)` reads it."""
    return {"b": sequences, "t": m.seq_len, "d": m.hidden, "inner": m.ssm_inner, "heads": m.ssm_heads,
            "head_dim": m.ssm_head_dim, "groups": m.ssm_groups, "state": m.ssm_state, "conv": m.conv_width,
            "chunk": m.ssm_chunk}


def measure_roofline(budget_s: float = 1.0) -> list[dict]:
    """This machine's compute roof and memory slope, by the hardware lesson's own probe
    (hardware/probe.py: fp32 and bf16 matmuls, a large copy; the fastest of each)."""
    from hardware.probe import measure_this_machine

    return [{"op": "probe", "shape": {}, "fwd_s": 0.0, "bwd_s": 0.0,
             "probe": asdict(measure_this_machine(budget_s=budget_s))}]


def compute_task(ctx, reps: int = 15, shapes: str = "all", active: int | None = None) -> list[dict]:
    """Pool task: every rank measures at the same time (after a barrier), so W ranks share the cores; with
    `active`, ranks 0 .. active - 1 only (the others return nothing at once). On a one-rank pool the
    engine's own step is timed too (`engine_units`)."""
    import torch.distributed as dist

    if ctx.world > 1:
        dist.barrier()
    if active is not None and ctx.rank >= active:
        return []
    whole = ctx.world == 1 and shapes == "all"
    return measure_compute(reps, shapes, then=(lambda: engine_units(ctx)) if whole else None)


REFERENCE_REPS = 200  # timed forward + backward passes of the reference Block (~0.5 s on this machine)


def reference_task(ctx, reps: int = REFERENCE_REPS) -> list[dict]:
    """Pool task: the reference Block (the "sharing" shape), forward + backward, timed so a prediction can
    check the machine's speed on the pool of the run it predicts (engine/predict.at_speed_now), on one rank
    per core at once (after a barrier): with no more ranks than cores, every rank, each on a core of its
    own as in the run; with more, the first `cpu_count()` ranks while the others wait at a barrier
    (blocked, not computing), every core busy with one rank as the calibration's core sharing
    (`Calibration.share`) is measured against. This machine's cores do not run at one speed: pinned to each
    in turn, the Block took 1.56-2.20 ms on one and 2.47-2.57 on the other, and a rank alone ran on either,
    so a check on one rank read one core or the other from run to run.
    The median of `reps` passes: other work bursting on the machine for part of the half second moves a
    mean (one check read 1.55x the calibration's time and the run then took 0.65x of that prediction),
    and the check scales a whole prediction by it."""
    import torch.distributed as dist

    from hardware.this_machine import cpu_count

    out = []
    if ctx.world > 1:
        dist.barrier()  # the timing ranks start together
    if ctx.rank < min(ctx.world, cpu_count()):
        torch.manual_seed(0)
        fwd, bwd = _reference_block()
        out = [{"block_s": _median_s(lambda: bwd(fwd()), reps)}]
    if ctx.world > 1:
        dist.barrier()
    return out


RESUME_REPS = 200  # timed forwards of each kind; with 40, three calibrations read 0.00, 0.08 and 0.14 ms
RESUME_BLOCK = 20  # the two kinds take turns in blocks (against the machine's drift); each block's first is dropped
RESUME_BYTES = 131072  # the message of the all-reduce before each timed forward (any size costs the same)


def resume_task(ctx, reps: int = RESUME_REPS) -> list[dict]:
    """Pool task: the median time of the default Block's forward right after a blocking all-reduce over the
    world, and right after a small matmul (other compute), in alternating blocks, on every rank at once;
    `hardware.this_machine` takes the difference (the module docstring)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    m = ModelConfig()
    block, x = Block(m), torch.randn(2, m.seq_len, m.hidden)
    msg = torch.ones(RESUME_BYTES // 4)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    after = {"comm": [], "compute": []}
    dist.barrier()
    with torch.no_grad():
        for _ in range(max(1, reps // (RESUME_BLOCK - 1))):
            for what, before in (("comm", lambda: dist.all_reduce(msg)), ("compute", lambda: a @ b)):
                for i in range(RESUME_BLOCK):
                    before()
                    t0 = time.perf_counter()
                    block(x)
                    if i:  # the block's first follows the other kind
                        after[what].append(time.perf_counter() - t0)
    return [{"after_comm_s": statistics.median(after["comm"]),
             "after_compute_s": statistics.median(after["compute"])}]


def _engine_step(ctx, cfg) -> tuple[dict[str, float], float]:
    """(mean seconds of each compute span, mean step time) of the engine's step on `cfg`, after two warm-up
    steps."""
    from engine.train import run_rank

    result = run_rank(ctx, cfg, traced=True)
    by_name: dict[str, list[float]] = {}
    for span in result["spans"]:
        if span["lane"] == "compute" and span["step"] >= 2:
            by_name.setdefault(span["name"], []).append(span["end_s"] - span["start_s"])
    means = {name: statistics.mean(v) for name, v in sorted(by_name.items())}
    return means, statistics.mean(result["step_times_s"][2:])


def engine_units(ctx, steps: int = 6) -> list[dict]:
    """The engine's data-parallel step at world 1 on the default model, unit by unit (its compute spans):
    what the driver adds around each module (recorder, backward markers, activation accounting) and the
    optimizer step, measured on the engine itself rather than guessed; and the same on a wider model
    (hardware.this_machine.WIDE_UNITS, its spans' names prefixed WIDE_PREFIX), whose layers and optimizer
    step run on caches the step keeps emptying."""
    cfg = RunConfig(world=1, steps=steps)
    units, step_s = _engine_step(ctx, cfg)
    shape = asdict(cfg.model)
    # the tensors the optimizer step updates, so the planner can tell the driver's share of it per tensor
    # from the AdamW kernel's (hardware.this_machine.fit_compute)
    tensors = [p.numel() for p in LanguageModel(cfg.model).parameters()]
    wide = replace(cfg, model=replace(cfg.model, **WIDE_UNITS))
    wide_units, wide_step_s = _engine_step(ctx, wide)
    wide_units["step"] = wide_step_s
    return [_sample("engine_unit", {"name": name, **shape}, s, 0.0) for name, s in units.items()] + [
        _sample("engine_unit", {"name": WIDE_PREFIX + name, **asdict(wide.model)}, s, 0.0)
        for name, s in wide_units.items()] + [
        _sample("engine_step", shape, step_s, 0.0),
        _sample("engine_optimizer", {"tensors": len(tensors), "numel": sum(tensors)}, units["optimizer step"], 0.0)]


def posting_run(world: int, schedule: str, steps: int = PIPELINE_POSTING_STEPS) -> RunConfig:
    """The pipeline `pipeline_posting` times at `world`: pp = world, a layer per stage (per chunk) at least, 4
    micro-batches; interleaved runs 2 chunks a rank and its micro-batches in groups of pp (4, or the fewest
    multiple of the world past it)."""
    from engine.config import ParallelConfig

    chunks = 2 if schedule == "interleaved-1f1b" else 1
    return RunConfig(model=replace(ModelConfig(), layers=max(ModelConfig.layers, chunks * world)),
                     parallel=ParallelConfig(strategy="pp", schedule=schedule, virtual_stages=chunks),
                     world=world, steps=steps, micro_batches=4 if chunks == 1 else world * -(-4 // world))


def pipeline_posting(ctx, steps: int = PIPELINE_POSTING_STEPS, schedule: str = "1f1b") -> list[float]:
    """Pool task: how long posting each pipeline message's isend held this rank (seconds, every message of
    the steps after the first two), timed on the engine's own `schedule` pipeline over the whole world
    (`posting_run`; one of hardware.this_machine.POSTING_SCHEDULES): the "post send ..." spans
    engine/comm.Comm.send records. Gloo writes the message from the calling thread, and on busy cores that
    write now and then waits a scheduler tick. Timed where it happens because no stand-alone pattern
    reproduced it: one pair exchanging while the other two ranks wait held its senders 0.12 ms on average at
    world 4, two pairs at once 2.55 ms, and the engine's 1F1B and interleaved pipelines there 0.6-1.0 ms
    whether 1, 2 or 3 ranks computed as a message was posted (0.11-0.39 ms at world 2)."""
    from engine.train import run_rank

    result = run_rank(ctx, posting_run(ctx.world, schedule, steps), traced=True)
    return [span["end_s"] - span["start_s"] for span in result["spans"]
            if span["lane"] == "comm" and span["name"].startswith("post ") and span["step"] >= 2]


# -- communication --------------------------------------------------------------------------------------

def _groups(world: int, n: int) -> list[list[int]]:
    """Consecutive ranks per group, as the mesh's innermost axis lays them out."""
    return [list(range(g * n, (g + 1) * n)) for g in range(world // n)]


def comm_task(ctx, group_sizes: list[int], sizes: tuple[int, ...] = COMM_SIZES, rounds: int | None = None,
              async_rounds: int = ASYNC_ROUNDS) -> list[dict]:
    """Pool task: time every operation in COMM_KINDS (and ASYNC_KINDS as bursts) on groups of each size:
    on groups of n, every (kind, mode) of hardware.this_machine.comm_modes(world, n), no other.

    An operation's calls run in blocks of COMM_BLOCK, the kinds taking turns block by block: within a
    block each call follows one of its own kind, as a pipeline's or a ring's messages follow each other
    (a point-to-point call right after a different collective runs 2-3x slower: gloo's pair threads go
    cold), and taking turns spreads a slow spell of the machine over every kind instead of biasing
    whichever ran then (means of kind after kind moved fits by up to 2x between two calibrations).
    """
    import torch.distributed as dist

    from engine import comm as engine_comm

    rounds = comm_rounds(ctx.world) if rounds is None else rounds
    out = []
    for n in group_sizes:
        group = None
        for ranks in _groups(ctx.world, n):
            g = dist.group.WORLD if n == ctx.world else engine_comm.new_group(ranks, ctx.collective_timeout_s)
            if ctx.rank in ranks:
                group, members = g, ranks
        me = members.index(ctx.rank)
        sync = {(kind, nbytes): _comm_call(kind, n, me, members, nbytes, group)
                for kind in COMM_KINDS if not (kind == "send_recv" and n % 2) for nbytes in sizes}
        compute, compute_s, compute_cpu_s = _fixed_compute(COMPUTE_GAP_S / 2)

        def burst(call):
            # as a backward pass issues buckets: compute, issue, compute, issue ..., then wait
            works = []
            for _ in range(ASYNC_BURST):
                compute()
                works.append(call())
            _wait_all(works)

        bursts = {}
        for kind in ASYNC_KINDS:
            for nbytes in sizes:
                call = _comm_call(kind, n, me, members, nbytes, group, async_op=True)
                bursts[(kind, nbytes)] = lambda call=call: burst(call)
        messages: dict[tuple[str, int], list] = {}  # (mode, size): samples of three windows

        def time_messages() -> None:
            if n % 2 == 0:
                for load in message_loads(ctx.world):
                    spinners = message_spinners(ctx.world, load)
                    for key, samples in _pipeline_messages(me, members, group, sizes, load - spinners,
                                                           spinners).items():
                        messages.setdefault(key, []).extend(samples)

        time_messages()
        for (kind, nbytes), sums in _rounds(sync, rounds, dist, COMPUTE_GAP_S).items():
            out.append(_row(kind, n, ctx.world, nbytes, "sync", sums) | {"gap_s": COMPUTE_GAP_S})
        for (kind, nbytes), call in sync.items():
            if isinstance(call, _Shift):  # the posting of the same timed calls (after the two warm-up rounds)
                posts = call.posts[2:]
                out.append(_row(kind, n, ctx.world, nbytes, POST_MODE,
                                [sum(w for w, _ in posts), sum(c for _, c in posts), len(posts)]))
        blocking = {key: call for key, call in sync.items() if key[0] in SYNC_GAP_KINDS}
        gap_rounds = max(1, SYNC_GAP_ROUNDS * rounds // COMM_ROUNDS)
        for mode, gap_s in SYNC_GAPS_S.items():
            for (kind, nbytes), sums in _rounds(blocking, gap_rounds, dist, gap_s).items():
                out.append(_row(kind, n, ctx.world, nbytes, mode, sums) | {"gap_s": gap_s})
        # and back to back (no gap): a naive data-parallel sync's all-reduces run faster than after any compute
        # (2 ranks here, 1 KB: 0.18 ms back to back, 0.27 ms after 50 us of compute, 0.47 ms after 0.3 ms). Each
        # size in runs of its own, right after an operation of the same size, as a naive sync's parameters of one
        # shape follow one another: taking turns with the other sizes, a 1 KB all-reduce came right after one of
        # 512 KB, whose ranks finish apart, and read 722-879 us (0.41 ms alone) where the naive step's took 0.47
        for (kind, nbytes), sums in back_to_back(blocking, gap_rounds, dist).items():
            out.append(_row(kind, n, ctx.world, nbytes, BACK_TO_BACK_MODE, sums) | {"gap_s": 0.0})
        # the middle window sits here, not right before the blocking operations after a gap, which it
        # slowed: a 2-rank all-reduce after 50 us of compute read 1.35 ms on average over six calibrations
        # with it there (above the 1.3 ms it takes after 300 us), 0.94 ms over seven with it here
        time_messages()
        for (kind, nbytes), sums in _rounds(bursts, async_rounds, dist, 0.0).items():
            row = _row(kind, n, ctx.world, nbytes, "async", sums)
            out.append(row | {"burst": ASYNC_BURST, "compute_s": compute_s, "compute_cpu_s": compute_cpu_s})
        # two of a group's asynchronous operations at once, against one alone in the same blocks
        # (PAIR_ROUNDS): planner.eventsim's Collective.concurrency
        together = {}
        for kind in ASYNC_KINDS:
            for nbytes in sizes:
                one, two = (_comm_call(kind, n, me, members, nbytes, group, async_op=True) for _ in range(2))
                together[(kind, nbytes, ALONE_MODE)] = lambda one=one: one().wait()
                together[(kind, nbytes, PAIR_MODE)] = lambda one=one, two=two: _wait_all([one(), two()])
        for (kind, nbytes, mode), sums in _rounds(together, PAIR_ROUNDS, dist, COMPUTE_GAP_S).items():
            out.append(_row(kind, n, ctx.world, nbytes, mode, sums) | {"gap_s": COMPUTE_GAP_S})
        # the same operations while every rank keeps computing until they complete: how fast gloo
        # progresses under its ranks' compute (an FSDP prefetch, a DP bucket under backward)
        chunk, _, _ = _fixed_compute(CONTENDED_CHUNK_S)
        contended = {}
        for kind in ASYNC_KINDS:
            for nbytes in sizes:
                call = _comm_call(kind, n, me, members, nbytes, group, async_op=True)
                contended[(kind, nbytes)] = lambda call=call: _under_compute(call, chunk)
        for (kind, nbytes), sums in _rounds(contended, CONTENDED_ROUNDS, dist, COMPUTE_GAP_S).items():
            out.append(_row(kind, n, ctx.world, nbytes, "contended", sums))
        time_messages()
        for (mode, nbytes), sums in _typical_messages(messages).items():
            out.append(_row("send_recv", n, ctx.world, nbytes, mode, sums))
    return out


def _pipeline_messages(me: int, members: list[int], group, sizes: tuple[int, ...], pairs: int, spinners: int = 0,
                       rounds: int = LATE_WINDOW_ROUNDS) -> dict[tuple[str, int], list]:
    """{(mode, size): [(wall seconds, CPU seconds), ...]} of a pipeline's messages while the sender
    computes on (LATE_UNIT_S above): receives posted after their send (`late_mode`, timed from the posting)
    and before it (`early_mode`, timed from the isend's posting, the receiver's CPU share over its wait);
    with one pair, also receives posted after a send whose sender then blocks in its wait (`late_mode(0)`:
    no rank computing). Pairs of the group (local ranks 2i, 2i + 1) take turns sending, the sizes
    round-robin. Only the world's first `pairs` pairs (global ranks 2i, 2i + 1 for i < pairs) exchange, the
    other ranks stay idle and return nothing: `pairs` senders compute, which decides whether a gloo thread
    finds a free core to move the message on. `spinners` threads of global rank 0 keep that many cores more busy
    the whole time (hardware.this_machine.message_loads: a second load at world 2); the samples are those of
    load pairs + spinners, and late0 is timed without them. `comm_task` pools three calls' samples
    (`_typical_messages`)."""
    import torch.distributed as dist

    from engine.comm import Comm
    from engine.recorder import Recorder

    comm = Comm(Recorder(me), torch.device("cpu"), {"pp": group})
    peer = members[me ^ 1]
    active = members[me] // 2 < pairs
    unit, _, _ = _fixed_compute(LATE_UNIT_S)
    load = pairs + spinners
    dist.barrier()
    if not active:
        dist.barrier()
        return {}
    spinning = threading.Event()
    if members[me] == 0 and spinners:  # torch's kernels release the GIL: each thread keeps a core busy
        spinning.set()
        for _ in range(spinners):
            threading.Thread(target=_spin, args=(unit, spinning), daemon=True).start()
    # float64: the early messages carry the sender's clock reading in their first element
    bufs = {nbytes: (torch.ones(max(1, nbytes // 8), dtype=torch.float64),
                     torch.empty(max(1, nbytes // 8), dtype=torch.float64)) for nbytes in sizes}
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}

    def compute(units: int) -> None:
        for _ in range(units):
            unit()

    def send(msg, name: str) -> None:  # isend, compute on, then wait for it
        work = comm.send(msg, peer, name=name, async_op=True, group="pp")
        compute(LATE_SENDER_UNITS)
        work.wait()

    def timed_recv(buf, name: str) -> tuple[float, float, float]:  # (posted, returned, process CPU seconds)
        cpu0, t0 = _process_cpu_s(), time.perf_counter()
        comm.recv(buf, peer, name=name, group="pp")
        t1 = time.perf_counter()
        return t0, t1, _process_cpu_s() - cpu0

    try:
        for i in range(2 * (rounds + 1)):  # the first round of each role is a warm-up
            for nbytes, (msg, buf) in bufs.items():
                if (i + me) % 2 == 0:
                    send(msg, "send late")
                    compute(LATE_RECEIVER_UNITS)
                    msg[0] = time.perf_counter()
                    send(msg, "send early")
                    if load == 1:  # isend, then block in its wait until the late receive takes it
                        comm.send(msg, peer, name="send late", async_op=True, group="pp").wait()
                else:
                    compute(LATE_RECEIVER_UNITS)
                    t0, t1, cpu = timed_recv(buf, "recv late")
                    late = (t1 - t0, cpu)
                    t0, t1, cpu = timed_recv(buf, "recv early")
                    one_way = max(0.0, t1 - float(buf[0]))
                    share = min(1.0, cpu / max(t1 - t0, 1e-9))
                    if i >= 2:
                        samples.setdefault((late_mode(load), nbytes), []).append(late)
                        samples.setdefault((early_mode(load), nbytes), []).append((one_way, share * one_way))
                    compute(LATE_SENDER_UNITS)  # as the sender did after its late send
                    if load == 1:
                        compute(LATE_RECEIVER_UNITS)
                        t0, t1, cpu = timed_recv(buf, "recv late")
                        if i >= 2:
                            samples.setdefault((late_mode(0), nbytes), []).append((t1 - t0, cpu))
                comm.recorder.take()
    finally:  # a spinner left running (a timed-out message) would slow every later run on this worker
        spinning.clear()
    dist.barrier()
    return samples


def _spin(unit, spinning) -> None:
    """Keep a core busy with `unit` while `spinning` is set (`_pipeline_messages`' spinners)."""
    while spinning.is_set():
        unit()


def _process_cpu_s() -> float:
    """This process's CPU seconds so far, all its threads (gloo's included), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _typical_messages(samples: dict[tuple[str, int], list[tuple[float, float]]]) -> dict[tuple[str, int], list]:
    """{(mode, size): [wall seconds, CPU seconds, 1]}: the mean message of each mode and size, estimated as
    its median plus the mode's mean stall (every sample of the mode, all sizes, over its own size's median).

    A pipeline message here is a narrow body (0.1-0.2 ms on 2 cores at 1-128 KB) and a tail of stalls of a
    scheduler tick (3-4 ms) that a run pays on average: late receives of 1 KB and 128 KB, 300 each, read
    0.09-0.19 ms median and 0.6-1.2 ms mean with the sender blocked (six runs; p90 2.4-4.0 ms), 0.18-1.1 ms
    mean with it computing; the engine's interleaved 1F1B at world 2 had its late receives at 0.12-0.20 ms
    median, 1.15-1.19 ms mean with the sender idle and 0.57-0.76 with it computing. Twenty messages of one
    size put the mean anywhere in 0.09-1.5 ms (one or two stalls more or less), and the median alone
    predicted the world-2 pipeline schedules 20-50 % fast. The stall is the machine's, not the size's (the
    same at 1 KB and 128 KB), so each mode pools its sizes' samples for it (3 windows x LATE_WINDOW_ROUNDS x
    3 sizes per rank)."""
    medians = {key: _median_sample(values) for key, values in samples.items()}
    excess: dict[str, list[float]] = {}
    for (mode, nbytes), values in samples.items():
        excess.setdefault(mode, []).extend(wall - medians[(mode, nbytes)][0] for wall, _ in values)
    return {(mode, nbytes): [wall + statistics.fmean(excess[mode]), cpu, n]
            for (mode, nbytes), (wall, cpu, n) in medians.items()}


def _median_sample(values: list[tuple[float, float]]) -> list:
    """[wall seconds, CPU seconds, 1] of the median sample by wall (the two middle ones averaged)."""
    ranked = sorted(values)
    mid = len(ranked) // 2
    wall, cpu = ranked[mid] if len(ranked) % 2 else tuple((a + b) / 2 for a, b in zip(ranked[mid - 1], ranked[mid]))
    return [wall, cpu, 1]


def _under_compute(call, chunk) -> None:
    """Issue an asynchronous operation, then compute in small chunks until it has completed (or for
    CONTENDED_CAP_S at most, then wait)."""
    work = call()
    deadline = time.perf_counter() + CONTENDED_CAP_S
    while not work.is_completed() and time.perf_counter() < deadline:
        chunk()
    work.wait()


def _fixed_compute(target_s: float):
    """A fixed amount of work (small matmuls) that takes about `target_s` on this rank alone; returns the
    function, the wall seconds and the CPU seconds of one call on this thread (torch runs one thread per
    rank, engine/worker.py). Fixed work, not a wall-clock wait: when cores are shared it takes longer, as a
    training step's compute does. The CPU seconds are its solo time; the wall time is not: every rank of the
    pool sizes and times its work at once, so with more ranks than cores it reads the sharing of that moment
    (four ranks on two cores read 0.12-0.35 ms of wall for 0.12-0.15 ms of CPU, rank by rank, in one
    calibration)."""
    a, b = torch.randn(64, 64), torch.randn(64, 128)
    per = _mean_s(lambda: a @ b, 50)
    n = max(1, round(target_s / per))

    def compute():
        for _ in range(n):
            a @ b

    for _ in range(2):  # _mean_s's warm-up, outside the CPU reading
        compute()
    cpu0 = time.thread_time()
    wall_s = _mean_s(compute, 20, warmup=0)
    return compute, wall_s, (time.thread_time() - cpu0) / 20


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _rounds(calls: dict, rounds: int, dist, gap_s: float) -> dict:
    """{key: [wall seconds, CPU seconds, calls]} over `rounds` calls of each (keys (kind, size, ...)): in blocks of
    COMM_BLOCK calls of one kind (its sizes round-robin), the kinds taking turns block by block; each call
    after `gap_s` of computing (not counted); two untimed warm-up rounds first."""
    for _ in range(2):
        for call in calls.values():
            call()
    dist.barrier()
    sums = {key: [0.0, 0.0, 0] for key in calls}
    by_kind: dict[str, list] = {}
    for key, call in calls.items():
        by_kind.setdefault(key[0], []).append((key, call))
    for block in range(0, rounds, COMM_BLOCK):
        for of_kind in by_kind.values():
            for _ in range(min(COMM_BLOCK, rounds - block)):
                for key, call in of_kind:
                    _busy(gap_s)
                    cpu0 = _process_cpu_s()
                    t0 = time.perf_counter()
                    call()
                    wall = time.perf_counter() - t0
                    acc = sums[key]
                    acc[0] += wall
                    acc[1] += _process_cpu_s() - cpu0
                    acc[2] += 1
    return sums


def back_to_back(calls: dict, rounds: int, dist) -> dict:
    """`_rounds` with no gap, each message size in a run of its own (keys (kind, size)): every call right after
    one of the same size, of its kind or, where the kinds take turns, of another."""
    sums = {}
    for nbytes in sorted({key[1] for key in calls}):
        sums.update(_rounds({key: call for key, call in calls.items() if key[1] == nbytes}, rounds, dist, 0.0))
    return sums


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()


def _row(kind: str, n: int, world: int, nbytes: int, mode: str, sums: list) -> dict:
    """Mean wall and process CPU seconds of one call."""
    wall, cpu, count = sums
    return {"kind": kind, "n": n, "world": world, "bytes": nbytes, "mode": mode, "seconds": wall / count,
            "cpu_s": cpu / count}


class _Shift:
    """A ring shift exactly as engine/cp.py's ring attention makes one: through the engine's own
    `Comm.p2p` (traced, as a live run is), the send to the next rank and the receive from the previous one
    in one batch, then both waited for. It also times the posting alone (wall and this thread's CPU, per
    call): gloo writes the message from the calling thread, and on busy cores that write now and then
    waits a scheduler tick, so posting blocks the rank for part of the shift (ring_shift's "post" mode;
    the planner lets the rest run beside the ring's compute)."""

    def __init__(self, n: int, me: int, nbytes: int, group):
        from engine.comm import Comm
        from engine.recorder import Recorder

        self.rec = Recorder(me)
        self.comm = Comm(self.rec, torch.device("cpu"), {"cp": group})
        self.msg, self.buf = torch.ones(max(1, nbytes // 4)), torch.empty(max(1, nbytes // 4))
        self.nxt, self.prv = (me + 1) % n, (me - 1) % n
        self.posts: list[tuple[float, float]] = []

    def __call__(self) -> None:
        cpu0, t0 = time.thread_time(), time.perf_counter()
        handles = self.comm.p2p([("send", self.msg, self.nxt, "send kv"), ("recv", self.buf, self.prv, "recv kv")],
                                "cp", 1)
        self.posts.append((time.perf_counter() - t0, time.thread_time() - cpu0))
        for h in handles:
            h.wait()
        self.rec.take()


def _comm_call(kind: str, n: int, me: int, members: list[int], nbytes: int, group, async_op: bool = False):
    """A closure running one operation of `kind` with a message of `nbytes` (engine/comm.py's byte
    convention: the full array for gathers and reductions, this rank's input for all-to-all, the
    message for point-to-point)."""
    import torch.distributed as dist

    from engine.comm import all_gather_single, reduce_scatter_single

    numel = max(n, nbytes // 4 // n * n)
    full, shard = torch.ones(numel), torch.ones(numel // n)
    out_full, out_shard = torch.empty(numel), torch.empty(numel // n)
    issue = {"all_reduce": lambda: dist.all_reduce(full, group=group, async_op=True),
             "all_gather": lambda: all_gather_single(out_full, shard, group=group, async_op=True),
             "reduce_scatter": lambda: reduce_scatter_single(out_shard, full, group=group, async_op=True),
             "all_to_all": lambda: dist.all_to_all_single(out_full, full, group=group, async_op=True)}.get(kind)
    if issue is not None:
        # a blocking operation issued and waited for, as engine/comm.py runs every collective: gloo's own
        # blocking call (async_op=False) is another, slower path (torch 2.13, 2 ranks on 2 cores: 21 all-reduces
        # of the default model's gradients in a row, 1.14 ms each blocking, 0.65 ms issued and waited for)
        return issue if async_op else lambda: issue().wait()
    if kind == "ring_shift":  # context parallel and pipeline hops: send to the next rank, receive from the previous
        return _Shift(n, me, nbytes, group)
    msg, buf = torch.ones(max(1, nbytes // 4)), torch.empty(max(1, nbytes // 4))
    # pairs exchange one message each way, an isend and a blocking receive
    peer = members[me ^ 1]

    def send_recv():
        work = dist.isend(msg, peer, group=group)
        dist.recv(buf, peer, group=group)
        work.wait()
    return send_recv
