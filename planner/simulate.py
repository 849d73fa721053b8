"""The step simulator: per-stage costs, the pipeline schedule's step time, and a breakdown.

A step on the most loaded pipeline stage s, with m micro-batches and v model chunks per stage:

    T_pipe = m * S_max + (sum_i S_i - S_max) / v   (S_i: forward + backward of one micro-batch on stage i)

For equal stages this is (m + (p-1)/v) * S: the 1F1B bubble fraction (p-1)/m (Narayanan et al. 2021,
sec. 2.2.1) and the interleaved one (p-1)/(v m) (sec. 2.2.2); GPipe has the same bubble as 1F1B
(Huang et al. 2019) but keeps all m micro-batches in memory. ZB-H1 (Qi et al. 2023 sec. 2.1) defers the
weight-gradient matmuls W into the drain, so each stage adds F + B - 2W instead of S = F + B to the
fill and drain: bubble (p-1)(F + B_input - W). Unequal stages (the embedding on the first chunk,
multi-token prediction modules and the output heads on the last, or a run's own split: planner.stages)
make the slowest stage pace the steady state. That closed form is what the search ranks layouts with;
the step time itself runs the schedule pass by pass with each chunk's own costs (planner.passes), which
the closed form matches for equal chunks and misses either way where chunks differ (11 % short for
DeepSeek-V3's 61 layers on 16 stages of 3 chunks; 19 % long where a heavy first stage's warm-up hides the
other stages' fill). Then

    step = T_pipe + exposed data-parallel gradient sync + optimizer update

(per rank after its last pass, planner.passes.tails; the step ends with the last rank's).

The first and last chunks carry the embedding and the output heads with their TP collectives (the
vocabulary-parallel lookup's reduction, the head's input gradient, the cross-entropy's reductions:
costs.vocab_parallel_comms). A word embedding shared across stages (tied to the head, or looked up again
by multi-token-prediction modules on the last stage) has its gradient summed between them after the flush
(`tied_embedding_sync_s`), a part of the gradient sync that nothing hides.

Overlap (the recipe fields of `planner.case`, per layer in `planner.costs`):
* TP/SP collectives, the CP K/V ring, EP all-to-alls, ZeRO-3 gathers: costs.py.
* DP gradient reduction (`grad_reduce_overlap`): bucketed under the backward of the last micro-batch
  (PyTorch DDP, Li et al. 2020; Megatron-Core overlap_grad_reduce); the last bucket (one layer, and on
  the first stage the word embedding, whose gradient is finished last: `edge_bucket_share`) can never
  hide. Off (Megatron-LM 2021-22's "local" DDP): after the backward, exposed. ZeRO-1/2's parameter
  all-gather after the update hides under the next step's first forward (`param_gather_overlap`), but for
  its first bucket, which that forward waits for. The sync's own passes over the gradient buffer (zeroing,
  NaN check, scaling: `grad_buffer_passes_s`) run on the compute stream and add to the step.
  ZeRO-3 under pipeline parallelism gathers a stage's weights once per run of the schedule, under its
  first forward, and reduce-scatters its accumulated gradients once, by hand after the last backward:
  exposed (planner.costs' docstring).
  Hidden communication slows the compute it runs beside (costs.overlap_slowdown: on GPUs).
* Gradient accumulation around the schedule (`schedule_runs` r): the schedule runs r times over m/r
  micro-batches each, filling and draining every time: T_pipe = r * T_pipe(m/r).
* Gradient accumulation across micro-batches (`grad_accum_fusion`): inside the weight-gradient GEMMs
  (Megatron-LM since 2022), or a memory-bound pass over the stage's gradients in every micro-batch's
  backward (`grad_accumulation_s`).
* Pipeline sends: one per chunk boundary, each direction, sized b*s*h/t with the scatter/gather
  optimisation (Narayanan et al. 2021 sec. 4.1), on the link between the stages (NVLink or the
  network, `costs.topology`). Each pass waits for its input to arrive (Megatron's batched
  send/receive pairs; the engine's blocking receives): one transfer per pass, every schedule, so the
  interleaved schedule's v-fold transfers show; two with `pp_p2p` "sequential" (DeepSpeed's 1F1B, whose
  send and receive block one after the other). DeepSpeed's warm-up and drain passes pay one each, which
  this counts as two: about 2p + 4 transfers a step too many (a simulation of its TrainSchedule; ~0.2 %
  of BLOOM's and MT-NLG's steps). Megatron-Core's overlap_p2p_comm, which can hide some
  of them behind another chunk when the schedule has slack, is not modelled (the schedule simulated
  with tiny transfers already puts 2 (p-1) to 7 p of them on the critical path, core.schedules).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hardware import kernels
from hardware.chips import Chip
from hardware.collectives import ring_sent_bytes
from planner import costs, passes
from planner.case import Case, Layout
from planner.flops import hardware_flops, model_flops, output_heads, vocab_rows
from planner.memory import (
    Memory,
    chunk_params,
    layer_kind_counts,
    memory_per_chip,
    recompute_split,
    stage_groups,
    stage_params,
)
from planner.models import ModelSpec
from planner.stages import chunks_of, holds_word_embedding

WGRAD_BYTES = 2  # a weight-gradient GEMM writes its gradient in bf16 / fp16 (fp8 recipes too: Transformer Engine)
BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "zero3_comm", "pp_comm",
                  "bubble", "dp_comm", "optimizer")
COMM_PART = {"tp": "tp_comm", "cp": "cp_comm", "ep": "ep_comm", "dp": "zero3_comm"}


def grad_buffer_passes_s(params: float, lay: Layout, chip: Chip, dp_group: int) -> float:
    """Seconds a step spends on the compute stream passing over the gradient buffer that a data-parallel
    all-reduce or ZeRO-1 reduce-scatter syncs once per step, each of `params` gradients of
    `Layout.grad_bytes`: Megatron-Core zeroes it before the step (ParamAndGradBuffer.reset: grad_data.zero_(),
    1 write), and before each bucket's collective takes its norm to refuse NaNs (check_for_nan_in_grad,
    which Megatron-LM's --no-check-for-nan-in-loss-and-grad leaves on: 1 read) and scales it by 1/dp in
    place (gradient_scaling_factor, average_in_collective being off by default: 1 read, 1 write)
    (megatron/core/distributed/param_and_grad_buffer.py at core_r0.8.0 and today). DeepSpeed and PyTorch DDP
    also divide in place and zero or refill their buckets; their count is taken as Megatron-Core's, and so is
    the NaN check, which Megatron-Bridge's performance recipes switch off (ddp.check_for_nan_in_grad false:
    a quarter of these bytes too many for its runs; no case field says it). None without data parallelism
    (Megatron-Core would still zero and check its buffer; PyTorch's optimizers set the gradients to None),
    with ZeRO-2 or ZeRO-3 (whose gradients are reduced as they come: costs.fsdp_copy_bytes has FSDP's own
    passes), or on a TPU (XLA fuses the scaling into the update)."""
    if dp_group <= 1 or lay.zero_stage >= 2 or lay.layer_zero3 or chip.kind != "gpu":
        return 0.0
    return kernels.pointwise_s(chip, params * 4 * lay.grad_bytes)


def grad_accumulation_s(params: float, micro_batches: int, acc: int, chip: Chip, cast: bool = False) -> float:
    """Seconds per micro-batch, on average over the step, that accumulating the weight gradients of
    `params` takes without `grad_accum_fusion`: an elementwise pass per micro-batch into an accumulator of
    `acc` bytes (Layout.grad_bytes). Into an fp32 one (Megatron-LM's main_grad.add_(param.grad) hook,
    DeepSpeed's BF16_Optimizer hp_grad.add_), every micro-batch reads the new gradient and reads and writes the
    accumulator: 2 + 4 + 4 bytes per parameter; with `cast` (`grad_accum_cast`: DeepSpeed's BF16_Optimizer
    first casts the gradient to fp32 in a copy of its own, lp.grad.to(hp_grad.dtype)) that copy is written and
    read again: 4 + 4 more. In the working precision (Megatron-LM 2021's default for fp16): autograd adds
    into the .grad in place from the second micro-batch on, 2 + 2 + 2 bytes."""
    widened = cast and acc > WGRAD_BYTES
    passes = micro_batches if acc > WGRAD_BYTES else micro_batches - 1
    nbytes = params * (WGRAD_BYTES + 2 * acc + (2 * acc if widened else 0)) * passes / max(1, micro_batches)
    return kernels.pointwise_s(chip, nbytes)


@dataclass(frozen=True)
class ChunkCost:
    fwd_s: float  # forward of one micro-batch through the chunk, exposed comm included
    bwd_s: float  # backward (and recomputation), exposed comm included
    parts: dict  # seconds by BREAKDOWN_KEYS kind for fwd + bwd of one micro-batch
    layers: int
    p2p_s: float  # the pipeline transfers included in each of fwd_s and bwd_s (`pipeline_p2p_s`)
    layer_costs: tuple  # ((LayerCost, count), ...) of the layers in the chunk
    wgrad_s: float  # weight-gradient part of bwd_s (deferrable under ZB-H1)
    # TP's collectives of the chunk's embedding and output head (costs.vocab_parallel_comms), (forward,
    # backward): their exposed parts are in fwd_s and bwd_s
    end_comms: tuple = ((), ())

    def ep_hidden_s(self, direction: str) -> float:
        """Expert all-to-all time hidden under another micro-batch's compute in one pass, "fwd" or "bwd"
        (`ep_comm_overlap`); the backward's with a full recomputation's repeated ones."""
        def comms(lc):
            return lc.fwd_comms if direction == "fwd" else lc.bwd_comms + lc.recompute_comms
        return sum(n * (c.time_s - c.exposed_s) for lc, n in self.layer_costs for c in comms(lc) if c.group == "ep")

    def showing_ep(self) -> ChunkCost:
        """The chunk as a pass with no other micro-batch beside it runs it: every expert all-to-all
        exposed (`unpaired_ep_s`)."""
        def shown(comms):
            return tuple(replace(c, exposed_s=c.time_s) if c.group == "ep" else c for c in comms)

        extra_f, extra_b = self.ep_hidden_s("fwd"), self.ep_hidden_s("bwd")
        layers = tuple((replace(lc, fwd_comms=shown(lc.fwd_comms), bwd_comms=shown(lc.bwd_comms)), n)
                       for lc, n in self.layer_costs)
        parts = {**self.parts, "ep_comm": self.parts["ep_comm"] + extra_f + extra_b}
        return replace(self, fwd_s=self.fwd_s + extra_f, bwd_s=self.bwd_s + extra_b, parts=parts,
                       layer_costs=layers)


@dataclass(frozen=True)
class StageCost:
    chunks: list[ChunkCost]
    dp_exposed_s: float  # gradient sync not hidden under the last backward
    dp_total_s: float
    optimizer_s: float
    params: float  # parameters on one chip of this stage (TP/EP-sharded, before ZeRO)
    # the shared word embedding's gradient all-reduced between the stages that hold a copy, after their
    # gradient sync (`tied_embedding_sync_s`); 0 on the other stages
    tied_sync_s: float = 0.0
    grad_passes_s: float = 0.0  # the gradient buffer's zeroing, NaN check and scaling (grad_buffer_passes_s)
    # of dp_total_s, what runs around the step's end (the sync under the last backward, the weights' gather
    # under the next forward), not inside every micro-batch's backward (ZeRO-2's reduce-scatters)
    dp_step_s: float = 0.0

    @property
    def fwd_s(self) -> float:
        return sum(c.fwd_s for c in self.chunks)

    @property
    def bwd_s(self) -> float:
        return sum(c.bwd_s for c in self.chunks)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def wgrad_s(self) -> float:
        return sum(c.wgrad_s for c in self.chunks)

    @property
    def ep_hidden_s(self) -> float:
        """Expert all-to-all time hidden under another micro-batch's compute, forward + backward of one
        micro-batch through the stage (`ep_comm_overlap`)."""
        return sum(ch.ep_hidden_s("fwd") + ch.ep_hidden_s("bwd") for ch in self.chunks)


@dataclass(frozen=True)
class StepResult:
    case: Case
    layout: Layout
    chip: Chip
    micro_batches: int
    step_time_s: float
    pipeline_s: float
    breakdown: dict  # seconds by BREAKDOWN_KEYS; sums to step_time_s
    stages: list[StageCost]
    memory: Memory
    model_flops: float  # per step, all chips
    hardware_flops: float
    fits: bool
    extra: dict = field(default_factory=dict)

    @property
    def num_chips(self) -> int:
        return self.layout.num_chips

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (Chowdhery et al. 2022, App. B)."""
        return self.model_flops / (self.step_time_s * self.num_chips * self._peak)

    @property
    def mfu_causal(self) -> float:
        """MFU with causal attention counted as half the S x S square (planner.flops docstring)."""
        tokens = self.case.training.global_batch * self.case.model.seq_len
        flops = model_flops(self.case.model, tokens, causal=True)
        return flops / (self.step_time_s * self.num_chips * self._peak)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.step_time_s * self.num_chips * self._peak)

    @property
    def tflops_per_chip(self) -> float:
        """Hardware TFLOP/s per chip, recomputation included: what Megatron-LM reports."""
        return self.hardware_flops / (self.step_time_s * self.num_chips) / 1e12

    @property
    def model_tflops_per_chip(self) -> float:
        return self.model_flops / (self.step_time_s * self.num_chips) / 1e12

    @property
    def _peak(self) -> float:
        return self.chip.peak_flops_per_s(self.case.training.dtype)


def _chunk(chip: Chip, layer_costs: tuple, extra_fwd: float, extra_bwd: float, p2p_s: float,
           end_comms: tuple = ((), ())) -> ChunkCost:
    """`layer_costs`: ((LayerCost, number of layers), ...) of the chunk's layers; `end_comms` the TP
    collectives of its embedding and output head, (forward, backward), whose hidden parts slow the compute
    beside them (`costs.charged_s`)."""
    parts = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    fwd = bwd = 0.0
    for lc, n in layer_costs:
        again = lc.recompute_comms
        f = lc.fwd_compute_s + sum(c.exposed_s for c in lc.fwd_comms)
        b = lc.bwd_compute_s + lc.recompute_s + sum(c.exposed_s for c in lc.bwd_comms + again)
        fwd += n * f
        bwd += n * b
        parts["compute"] += n * (lc.fwd_compute_s + lc.bwd_compute_s)
        parts["recompute"] += n * lc.recompute_s
        for c in lc.fwd_comms + lc.bwd_comms + again:
            parts[COMM_PART[c.group]] += n * c.exposed_s
    ends = []
    for ops in end_comms:
        slowed = sum(costs.charged_s(chip, c.time_s, c.exposed_s) - c.exposed_s for c in ops)
        for c in ops:
            parts[COMM_PART[c.group]] += c.exposed_s
        ends.append((slowed, sum(c.exposed_s for c in ops)))
    extra_fwd += ends[0][0]
    extra_bwd += ends[1][0]
    fwd += extra_fwd + p2p_s + ends[0][1]
    bwd += extra_bwd + p2p_s + ends[1][1]
    parts["compute"] += extra_fwd + extra_bwd
    parts["pp_comm"] += 2 * p2p_s
    return ChunkCost(fwd, bwd, parts, sum(n for _, n in layer_costs), p2p_s, layer_costs,
                     sum(lc.wgrad_s * n for lc, n in layer_costs), tuple(tuple(ops) for ops in end_comms))


def stage_costs(case: Case, lay: Layout, chip: Chip) -> list[StageCost]:
    m, tr = case.model, case.training
    micro_batches = tr.global_batch // (lay.dp * lay.micro_batch)
    node = case.cluster.chips_per_node or chip.scaleup_domain
    by_kind = {k: costs.layer_cost(m, lay, chip, tr.dtype, k, node) for k in m.kinds}
    # under full recomputation of only some layers per chunk (training.recompute_layers), the others keep everything
    keeps_all = by_kind
    if lay.recompute_split is not None:
        kept = replace(lay, recompute="none")
        keeps_all = {k: costs.layer_cost(m, kept, chip, tr.dtype, k, node) for k in m.kinds}
    logits_f, logits_b = costs.logits_cost(m, lay, chip, tr.dtype)
    embed_s = costs.embedding_s(m, lay, chip)
    vocab_comms = costs.vocab_parallel_comms(m, lay, chip, tr.dtype, node)
    no_comms = ((), ())
    embed_comms, head_comms = vocab_comms.get("embedding", no_comms), vocab_comms.get("head", no_comms)
    # per-layer ZeRO-3's gather and reduce-scatter of the parameters outside the layers, once a micro-batch
    root_comms = costs.zero3_root_comms(m, lay, chip, node) if lay.layer_zero3 and lay.dp * lay.cp > 1 else no_comms
    mtp_f, mtp_b = costs.mtp_extra_cost(m, lay, chip, tr.dtype)
    pass_p2p_s = pipeline_p2p_s(m, lay, chip, node)
    grad_bytes = lay.grad_bytes
    dp_group = lay.dp * lay.cp
    dense_topo = costs.data_topology(chip, lay, node) if dp_group > 1 else None
    # an expert's gradient skips its ep (and etp) ranks
    expert_topo = costs.expert_data_topology(chip, lay, node) if lay.expert_dp > 1 else None

    plan = chunks_of(m, lay)
    tied_s, holders = tied_embedding_sync_s(m, lay, chip, node, plan)
    chunk_cache: dict = {}
    groups = stage_groups(m, lay)
    by_rep: dict[int, StageCost] = {}
    for i in sorted(set(groups)):
        chunks = []
        for piece in plan[i]:
            ef = eb = 0.0
            # the TP collectives of the embedding lookups (the model's and each MTP module's) and the heads
            lookups = int(piece.embedding) + piece.mtp
            heads = output_heads(m) if piece.loss else 0
            ends = tuple(lookups * embed_comms[d] + (root_comms[d] if piece.embedding else ()) + heads * head_comms[d]
                         for d in (0, 1))
            if piece.embedding:
                ef += embed_s
                eb += embed_s
            if piece.mtp:  # each module: one more layer of the model's last kind and its own small ops
                ef += piece.mtp * mtp_f
                eb += piece.mtp * mtp_b
            if piece.loss:  # the output head, once for the model and once per MTP module
                ef += heads * logits_f
                eb += heads * logits_b
            # its layers (MTP modules among them), those full recomputation covers and the rest
            again, rest = recompute_split(m, piece, lay.recompute_split)
            key = (again, rest, ef, eb, lookups, heads, piece.embedding)  # all the chunk's cost depends on
            if key not in chunk_cache:
                again_costs = tuple((by_kind[k], n) for k, n in again)
                rest_costs = tuple((keeps_all[k], n) for k, n in rest)
                if piece.embedding and piece.layers and root_comms[0]:  # whichever part holds the first layer
                    if again:
                        again_costs = _first_layer_in_view(m, piece.first, again, by_kind, chip)
                    else:
                        rest_costs = _first_layer_in_view(m, piece.first, rest, keeps_all, chip)
                chunk_cache[key] = _chunk(chip, again_costs + rest_costs, ef, eb, pass_p2p_s, ends)
            chunks.append(chunk_cache[key])
        dense_p, expert_p = stage_params(m, lay, i)
        dp_total = dp_step = exposed = per_micro_batch = 0.0
        if not lay.layer_zero3:
            layers_here = max(1, sum(ch.layers for ch in chunks))
            last_bwd = sum(ch.bwd_s for ch in chunks)
            dense_edge = edge_bucket_share(m, lay, any(p.embedding for p in plan[i]), dense_p, layers_here)

            windows = chunk_sync_windows(chunks, lay, i)
            per_chunk = chunk_params(m, lay, i) if windows else ()

            def hidden_under_bwd(sync: float, edge: float, part: int = 0, step_end: bool = True,
                                 ahead: float = 0.0) -> float:
                """What the gradient sync costs the step: what shows (at least the last bucket's, `edge` of
                it), and what hides under the backward slows it; at the step's end, under the interleaved
                schedule, chunk by chunk (`chunk_sync_windows`), each its share of the `part` (0 dense, 1
                expert) parameters. `ahead`: seconds of another sync on the same links in the same window."""
                shown = max(sync - max(0.0, last_bwd * (1 - 1 / layers_here) - ahead), sync * edge)
                if windows and step_end:
                    left = [max(0.0, w - ahead) for w in windows]
                    shown = max(sync * edge, _queued(sync, [p[part] for p in per_chunk], left))
                return costs.charged_s(chip, sync, shown if lay.grad_reduce_overlap else sync)

            def hidden_under_fwd(gather: float, edge: float, ahead: float = 0.0) -> float:
                """The updated weights' gather under the next step's forward (`param_gather_overlap`), likewise:
                the first forward waits for the first bucket's. Megatron-Core gathers one bucket ahead (each
                launched once the previous is waited for: distrib_optimizer.py _finish_param_sync_helper, "we
                can't pre-launch all-gathers for all buckets at once"), so under the interleaved schedule too
                a chunk's weights arrive during its own first forward."""
                shown = max(gather - max(0.0, sum(ch.fwd_s for ch in chunks) - ahead), gather * edge)
                return costs.charged_s(chip, gather, shown if lay.param_gather_overlap else gather)

            # the experts' sync and gather run in the same windows as the dense ones (Megatron-Core launches both
            # buffers' buckets as the backward makes them), on the same links where both groups leave the node
            # or both stay in it: they queue there
            shared = dense_topo is not None and expert_topo is not None and \
                costs.crosses_network(dp_group, costs.data_stride(lay), chip, node) == \
                costs.crosses_network(lay.expert_dp, lay.expert_dp_stride, chip, node)
            ahead_sync = ahead_gather = 0.0
            for part, (topo, n_params, edge) in enumerate(((dense_topo, dense_p, dense_edge),
                                                           (expert_topo, expert_p, 1 / layers_here))):
                if topo is None or not n_params:
                    continue
                nbytes = n_params * grad_bytes
                if lay.zero_stage == 0:
                    sync = costs.comm_s(topo, "all_reduce", nbytes)
                    gather = 0.0
                else:
                    sync = costs.comm_s(topo, "reduce_scatter", nbytes)
                    gather = costs.comm_s(topo, "all_gather", n_params * 2)
                if lay.zero_stage == 2 and micro_batches > 1:
                    # ZeRO-2 keeps only its gradient shard, so every micro-batch's gradients are
                    # reduce-scattered as they are produced (DeepSpeed stage 2), not once per step
                    per_micro_batch += hidden_under_bwd(sync, edge, step_end=False, ahead=ahead_sync)
                    dp_total += micro_batches * sync + gather
                    dp_step += gather
                elif lay.staged_zero3:
                    exposed += sync  # after the last backward: nothing left to hide it under
                    dp_total += sync + gather
                    dp_step += sync + gather
                else:
                    exposed += hidden_under_bwd(sync, edge, part, ahead=ahead_sync)
                    dp_total += sync + gather
                    dp_step += sync + gather
                exposed += hidden_under_fwd(gather, edge, ahead_gather)
                if shared:
                    ahead_sync, ahead_gather = ahead_sync + sync, ahead_gather + gather
            if per_micro_batch:  # each chunk's backward reduce-scatters its own parameters' gradients
                shares = [d + e for d, e in chunk_params(m, lay, i)]
                chunks = [_plus_backward(ch, "dp_comm", per_micro_batch * s / sum(shares))
                          for ch, s in zip(chunks, shares)]
        if not lay.grad_accum_fusion:
            # the gradient this chip keeps between micro-batches: the stage's whole (ZeRO-0/1, ZeRO-3 under
            # pipeline parallelism), or the shard ZeRO-2/3 reduce-scatters every micro-batch to
            whole = lay.zero_stage < 2 or lay.staged_zero3
            kept = dense_p + expert_p if whole else dense_p / dp_group + expert_p / lay.expert_dp
            chunks[0] = _plus_backward(chunks[0], "compute",
                                       grad_accumulation_s(kept, micro_batches, lay.grad_bytes, chip,
                                                           lay.grad_accum_cast))
        opt = costs.optimizer_step_s(dense_p, expert_p, lay, chip, tr.optimizer)
        tied = tied_s if i in holders else 0.0
        passes = grad_buffer_passes_s(dense_p + expert_p, lay, chip, dp_group)
        by_rep[i] = StageCost(chunks, exposed, dp_total, opt, dense_p + expert_p, tied, passes, dp_step)
    return [by_rep[g] for g in groups]


def chunk_sync_windows(chunks: list[ChunkCost], lay: Layout, rank: int) -> list[float] | None:
    """Under Megatron-Core's interleaved 1F1B each model chunk syncs its own gradients (a DDP buffer per
    chunk), once its last micro-batch's backward is done, so each hides under the backward left after it,
    not only under one micro-batch's (schedules.py forward_backward_pipelining_with_interleaving, at
    core_r0.8.0 and since): the seconds after chunk c's sync is launched, for each of the stage's chunks c;
    None for the other schedules, whose one chunk's buckets go out as its last backward produces them
    (planner.simulate.stage_costs).

    Backward: micro-batches go round in groups of p per chunk, so the last group runs p backwards of chunk
    v - 1, then of v - 2, ..., then of 0, all in the cool-down (rank r's warm-up, 2 (p - 1 - r) + (v - 1) p
    chunk-forwards, is at least the (v - 1) p that follow chunk v - 1's last backward). Chunk c's sync is
    started (grad_sync_func, the chunk's start_grad_sync) r backwards after its last one ("delay ... grad
    reductions in all but first PP stage", --delay-grad-reduce, on by default; since 2024 --align-grad-reduce),
    leaving p x (backwards of chunks 0 .. c - 1) less those r."""
    v, p = len(chunks), lay.pp
    if v == 1 or lay.pp_schedule != "interleaved-1f1b":
        return None
    # the r backwards of the delay are chunk c - 1's (r < p of them)
    return [max(0.0, p * sum(ch.bwd_s for ch in chunks[:c]) - rank * chunks[c - 1].bwd_s) if c else 0.0
            for c in range(v)]


def _queued(total: float, params: list[float], windows: list[float]) -> float:
    """What shows of `total` seconds of a stage's gradient syncs split over its chunks by their `params` and
    run one after another on the same links, chunk c's with `windows[c]` of compute after its launch (growing
    with c): they go out from the last chunk down, and what is still queued once chunk c's is launched, its
    own and those of chunks below it, must fit in the compute left after it. What shows is the most that
    the syncs of chunks 0 .. c overrun window c."""
    whole = sum(params) or 1.0
    shown = queued = 0.0
    for share, window in zip(params, windows, strict=True):
        queued += total * share / whole
        shown = max(shown, queued - window)
    return shown


def edge_bucket_share(m: ModelSpec, lay: Layout, embedding: bool, params: float, layers: int) -> float:
    """The share of a stage's dense gradients in its last bucket, which its backward finishes last, so
    that their reduction shows whole; in the first, the one the next step's first forward waits for: one
    layer's, and on the stage with the embedding lookup its V/t x D rows besides. Buckets fill in reverse
    order of the parameters (Megatron-Core's param_and_grad_buffer, PyTorch DDP), so the word embedding,
    the model's first parameter, lands in the last bucket, and its gradient is complete only after the
    lookup's backward, the last op of the step's backward (tied to the head, the head's half arrives
    first)."""
    rows = vocab_rows(m, lay.tp) if embedding else 0.0
    if params <= 0:
        return 1 / layers
    return min(1.0, (rows + (params - rows) / layers) / params)


def tied_embedding_sync(m: ModelSpec, lay: Layout, plan) -> tuple[list[int], float]:
    """(the pipeline stages that hold a copy of a shared word embedding, the bytes of its gradient each
    sums with the others): a copy for the lookup, for multi-token-prediction modules' lookups or for an
    output head tied to it (stages.holds_word_embedding), V/t x D gradients of `Layout.grad_bytes`; no
    stages when one holds every use."""
    holders = [i for i, chunks in enumerate(plan) if holds_word_embedding(m, chunks)]
    if len(holders) < 2:
        return [], 0.0
    return holders, vocab_rows(m, lay.tp) * lay.grad_bytes


def tied_embedding_sync_s(m: ModelSpec, lay: Layout, chip: Chip, node: int, plan) -> tuple[float, list[int]]:
    """(seconds, the stages that pay them) of summing the shared word embedding's gradient between the
    stages that hold a copy (`tied_embedding_sync`), after their gradient sync and before the optimizer
    step, with nothing left to hide it: Megatron-Core's finalize_model_grads (_allreduce_word_embedding_grads
    over the embedding group, the first and last stage by default_embedding_ranks) all-reduces the main
    gradient, as DeepSpeed's pipeline engine does in its ReduceTiedGrads step; any framework that keeps
    one weight on two stages has to."""
    holders, nbytes = tied_embedding_sync(m, lay, plan)
    if not holders:
        return 0.0, []
    pp_stride = lay.mesh.stride("pp")
    stride = pp_stride * (holders[1] - holders[0] if len(holders) == 2 else 1)
    if chip.kind == "gpu" and pp_stride * lay.pp <= node and node % (pp_stride * lay.pp) == 0:
        stride = 1  # every pipeline group lies in one node, so the holders meet on its switch wherever they sit
    topo = costs.topology(chip, len(holders), stride, node)
    return costs.comm_s(topo, "all_reduce", nbytes), holders


def _first_layer_in_view(m: ModelSpec, first: int, counts: tuple, by_kind: dict, chip: Chip) -> tuple:
    """((LayerCost, layers), ...) of a chunk whose first layer follows the embedding lookup under per-layer
    ZeRO-3: that layer apart (`costs.zero3_first_layer`: nothing but the lookup to hide its gather under,
    nothing but the lookup's backward after its reduce-scatter), the others as they are."""
    ((kind, _),) = layer_kind_counts(m, first, 1)
    rest = tuple((by_kind[k], n - (k == kind)) for k, n in counts if n - (k == kind))
    return ((costs.zero3_first_layer(by_kind[kind], chip), 1),) + rest


def _plus_backward(chunk: ChunkCost, part: str, seconds: float) -> ChunkCost:
    """The chunk with `seconds` more in each micro-batch's backward, counted as `part` (a micro-batch's
    backward on a stage ends with its first chunk)."""
    parts = dict(chunk.parts)
    parts[part] += seconds
    return replace(chunk, bwd_s=chunk.bwd_s + seconds, parts=parts)


def pipeline_p2p_s(m: ModelSpec, lay: Layout, chip: Chip, node: int) -> float:
    """The pipeline communication on one pass's critical path: one transfer of a micro-batch's activation
    (or its gradient) across a stage boundary, the send of this pass and the receive of the next exchanged
    at once; two with `pp_p2p` "sequential" (DeepSpeed's PipelineEngine blocks on each in turn).

    With tp > 1 each rank of the tp group sends only its 1/t slice over the inter-stage link and the
    receiving stage re-assembles the whole activation with an all-gather over the tp group (Narayanan
    et al. 2021 sec. 4.1, the scatter/gather optimisation); with sequence parallelism the activation is
    already sequence-split, and the slice is what the next stage needs.
    """
    if lay.pp == 1:
        return 0.0
    act_bytes = lay.micro_batch * m.seq_len / lay.cp * m.hidden * costs.ACT_BYTES
    topo = costs.topology(chip, lay.pp, lay.mesh.stride("pp"), node)
    seconds = costs.comm_s(topo, "p2p", act_bytes / lay.tp)
    if lay.tp > 1 and not lay.sequence_parallel:
        seconds += costs.comm_s(costs.topology(chip, lay.tp, 1, node), "all_gather", act_bytes)
    return seconds * (2 if lay.pp_p2p == "sequential" else 1)


def comm_group_sizes(lay: Layout) -> dict[str, int]:
    """The ranks of each group a layer's collectives run over, by CommOp.group: the data-parallel ones over dp x cp
    (a dense weight's gradient is summed over every rank that read other tokens)."""
    return {"tp": lay.tp, "cp": lay.cp, "ep": lay.ep, "dp": lay.dp * lay.cp}


def sent_bytes_per_step(res: StepResult, stage: int = 0) -> dict[str, float]:
    """Bytes one chip of pipeline stage `stage` sends per optimizer step over each mesh axis (ring
    algorithms: hardware.collectives.ring_sent_bytes): every layer's collectives (planner/costs.py's own
    records, a full recomputation's repeated ones too) per micro-batch, the gradient sync (and ZeRO's
    weight all-gather) once per step, and the pipeline's activations and their gradients per micro-batch
    and chunk boundary (with tp, each rank sends its 1/tp slice and the receivers all-gather it)."""
    m, lay = res.case.model, res.layout
    n = comm_group_sizes(lay)
    out = {axis: 0.0 for axis in ("tp", "cp", "ep", "dp", "pp")}
    st = res.stages[stage]
    for chunk in st.chunks:
        for lc, count in chunk.layer_costs:
            ops = lc.fwd_comms + lc.bwd_comms + lc.recompute_comms
            for op in ops:
                out[op.group] += res.micro_batches * count * op.sent_bytes(n[op.group])
        for op in chunk.end_comms[0] + chunk.end_comms[1]:
            out[op.group] += res.micro_batches * op.sent_bytes(n[op.group])
    holders, tied_bytes = tied_embedding_sync(m, lay, chunks_of(m, lay))
    if stage in holders:
        out["pp"] += ring_sent_bytes("all_reduce", tied_bytes, len(holders))
    if not lay.layer_zero3:
        dense_p, expert_p = stage_params(m, lay, stage)
        grad_bytes = lay.grad_bytes
        for params, group in ((dense_p, n["dp"]), (expert_p, lay.expert_dp)):
            if lay.zero_stage == 0:
                out["dp"] += ring_sent_bytes("all_reduce", params * grad_bytes, group)
            else:
                gathers = lay.schedule_runs if lay.staged_zero3 else 1  # pipelined FSDP: once per run
                syncs = res.micro_batches if lay.zero_stage == 2 else gathers
                out["dp"] += syncs * ring_sent_bytes("reduce_scatter", params * grad_bytes, group)
                out["dp"] += gathers * ring_sent_bytes("all_gather", params * 2, group)
    if lay.pp > 1:
        act_bytes = lay.micro_batch * m.seq_len / lay.cp * m.hidden * costs.ACT_BYTES
        v = lay.virtual_stages
        sends = (v if stage < lay.pp - 1 else v - 1) + (v if stage > 0 else v - 1)  # forward + backward
        out["pp"] += res.micro_batches * sends * act_bytes / lay.tp
        if lay.tp > 1 and not lay.sequence_parallel:
            out["tp"] += res.micro_batches * sends * ring_sent_bytes("all_gather", act_bytes, lay.tp)
    return {axis: b for axis, b in out.items() if b}


def pipeline_time_s(stage_totals: list[float], micro_batches: int, virtual: int,
                    fill_s: list[float] | None = None) -> float:
    """T_pipe = m * S_max + (sum F - F_crit) / v, F_i = S_i except for ZB-H1 (module docstring)."""
    s_max = max(stage_totals)
    fill = fill_s if fill_s is not None else stage_totals
    crit = stage_totals.index(s_max)
    return micro_batches * s_max + (sum(fill) - fill[crit]) / virtual


def simulate(case: Case, lay: Layout, chip: Chip, memory: Memory | None = None, exact: bool = True) -> StepResult:
    """Step time, breakdown, FLOPs and memory of `case` run with layout `lay` on `chip`: the pipeline run
    pass by pass (planner.passes), or with `exact` False by the closed form (`pipeline_time_s`, what the
    search ranks with)."""
    m, tr = case.model, case.training
    micro_batches = tr.global_batch // (lay.dp * lay.micro_batch)
    stages = stage_costs(case, lay, chip)
    groups = stage_groups(m, lay)
    rep_total = {i: stages[i].total_s for i in set(groups)}
    totals = [rep_total[g] for g in groups]
    fill = None
    if lay.pp_schedule == "zb-h1":
        rep_fill = {i: max(0.0, stages[i].total_s - 2 * stages[i].wgrad_s) for i in rep_total}
        fill = [rep_fill[g] for g in groups]
    runs = lay.schedule_runs  # each run of the schedule fills and drains the pipeline
    crit = max(range(len(stages)), key=lambda i: totals[i])
    ep_unpaired = runs * unpaired_ep_s(stages, lay, crit, lay.per_run(micro_batches))
    if exact and lay.pp > 1:
        clocks = passes.run(stages, lay, micro_batches).clocks
    else:
        closed = runs * pipeline_time_s(totals, lay.per_run(micro_batches), lay.virtual_stages, fill) + ep_unpaired
        slack = [_slack(st, i, lay) for i, st in enumerate(stages)]
        # staged ZeRO-3 waits between runs for what of each run's sync its slack does not cover
        clocks = [closed - s + ((runs - 1) * max(0.0, st.dp_exposed_s - s) if lay.staged_zero3 else 0.0)
                  for st, s in zip(stages, slack)]
    t_pipe = max(clocks)
    ends = passes.tails(stages, clocks)
    last = max(range(len(stages)), key=lambda i: ends[i].end_s)
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    for ch in stages[crit].chunks:
        for k, v in ch.parts.items():
            breakdown[k] += micro_batches * v
    # the pipeline past the slowest stage's own passes: its unpaired all-to-alls, then the bubble
    ep_shown = min(ep_unpaired, max(0.0, t_pipe - micro_batches * totals[crit]))
    breakdown["ep_comm"] += ep_shown
    breakdown["bubble"] = t_pipe - micro_batches * totals[crit] - ep_shown
    if lay.staged_zero3:  # the waits between runs for each run's reduce-scatter and gather (planner.passes)
        gaps = min(breakdown["bubble"], (runs - 1) * stages[last].dp_exposed_s)
        breakdown["dp_comm"] += gaps
        breakdown["bubble"] -= gaps
    # the last rank's tail, each part as far as it runs past the pipeline's end
    tail = ends[last]
    for key, (start, end) in (("dp_comm", tail.sync), ("pp_comm", tail.tied_wait), ("pp_comm", tail.tied),
                              ("compute", tail.passes), ("optimizer", tail.optimizer)):
        breakdown[key] += max(0.0, end - max(start, t_pipe))
    step = max(t_pipe, tail.end_s)
    tokens = tr.global_batch * m.seq_len
    mem = memory or memory_per_chip(m, lay, micro_batches, tr.optimizer, tr.dtype)
    node = case.cluster.chips_per_node or chip.scaleup_domain
    flops = model_flops(m, tokens)
    again = hardware_flops(m, tokens, lay.recompute, lay.recompute_modules, costs.recompute_drops_dead_code(chip))
    if lay.recompute_split is not None:  # only some layers run again: their share of what all would
        layers = [(lc, n) for st in stages for ch in st.chunks for lc, n in ch.layer_costs]
        share = (sum(n * lc.full_recompute_flops for lc, n in layers if lc.recompute == "full")
                 / sum(n * lc.full_recompute_flops for lc, n in layers))
        again = flops + share * (again - flops)
    return StepResult(case, lay, chip, micro_batches, step, t_pipe, breakdown, stages, mem, flops, again,
                      mem.total_bytes <= usable_hbm_bytes(chip),
                      {"critical_stage": crit, "chips_per_node": node})


def _slack(stage: StageCost, i: int, lay: Layout) -> float:
    """The closed form's end of stage i's last pass before the pipeline's: i chunk backwards (each stage's
    last backward hands its input gradient to the stage before it)."""
    return i * stage.bwd_s / lay.virtual_stages


def unpaired_ep_s(stages: list[StageCost], lay: Layout, crit: int, micro_batches: int) -> float:
    """Expert all-to-all that overlapping with another micro-batch cannot hide, one run of the schedule
    whose slowest stage is `crit`. The overlap (DeepSeek-V3's DualPipe; Megatron-Core's
    overlap_moe_expert_parallel_comm, its "combined 1F1B") runs one micro-batch's forward beside another's
    backward, so it exists only in the steady state: a stage's warm-up forwards and the first steady
    forward run before any backward, and as many backwards drain alone at the end. Those are the chunk
    passes before its first backward (planner.passes.unpaired_count: warm-up + 1), each showing its
    all-to-all whole: the slowest stage's add to its own m passes, and the other stages' passes that make
    up the fill and drain (sum_i S_i - S_max) / v are all of that kind. Without pipeline stages that is
    the first forward and the last backward; one micro-batch hides nothing. The step runs those passes
    with their all-to-all whole (planner.passes); this is the part of it the breakdown counts as ep_comm."""
    if not (lay.ep_comm_overlap and lay.ep > 1):
        return 0.0
    own = passes.unpaired_count(crit, lay, micro_batches) * stages[crit].ep_hidden_s
    fill = sum(s.ep_hidden_s for i, s in enumerate(stages) if i != crit)
    return (own + fill) / lay.virtual_stages


USABLE_HBM_FRACTION = 0.95  # CUDA/XLA runtime, NCCL buffers and allocator fragmentation take ~5% (estimate)


def usable_hbm_bytes(chip: Chip) -> float:
    return chip.hbm_bytes * USABLE_HBM_FRACTION
