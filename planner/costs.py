"""What one layer costs on one chip, for one micro-batch: its GEMMs, attention, memory-bound ops and the
communication of every strategy, with what of it the recipe hides under compute.

Everything here is a pure function of the model, the layout (which carries the recipe, `planner.case`)
and the chip. Single operations cost what `hardware.kernels` (GEMMs by shape, attention kernels, memory-
bound kernels) and `hardware.collectives` (alpha-beta with the measured pipeline fill) say; those take
their efficiencies from op-level benchmarks recorded in `hardware/chips.toml`. No constant here is
chosen on end-to-end step times; each carries its derivation or source.

A layer, In[T, D] with T = micro_batch * seq_len / cp tokens on this chip and t = tp:

    GEMMs   qkv  In[T, D] . W[D, (N + 2K)H / t]      o    A[T, NH / t] . W[NH / t, D]
            fc1  In[T, D] . W[D, n_in F / t]         fc2  H[T, F / t] . W[F / t, D]
            backward: dgrad (same M, K and N swapped) and wgrad (K = T) per GEMM
    attention  FlashAttention (causal half of the scores) or materialised scores: two batched GEMMs
            per head and a softmax over HBM (Narayanan et al. 2021 eq. 3 counts the full square)
    memory-bound ops  norms, residual adds, activations, rotary, dropout (`_elementwise`)

Communication (each a `CommOp` with its time alone on its links and the part the pass waits for):

* TP (Shoeybi et al. 2019; Korthikanti et al. 2022 sec. 4.2.2), V = T * D * 2 bytes. Without SP two
  all-reduces forward (after o and fc2), exposed, and two backward (the input gradients of qkv and fc1),
  each under its layer's wgrad GEMM (`tp_grad_allreduce_overlap`, Megatron-LM's async all-reduce) or after it.
  With SP: all-gather before qkv and fc1, reduce-scatter after o and fc2; backward reduce-scatters the
  column layers' input gradients, re-gathers their inputs for the weight gradients (Megatron-LM keeps
  only the sharded input) and all-gathers the row layers' output gradients. Megatron-LM always runs the
  backward re-gather under the dgrad GEMM and the input-gradient reduction under the wgrad GEMM; with
  `tp_comm_overlap` (the layout's, else the chip's: `tp_overlaps`) the others are pipelined with their
  GEMM in t chunks (collective matmul, Wang et al. 2023; Transformer Engine userbuffers): only one chunk
  shows, max(0, c - g) + min(c, g) / t, and the GEMM runs as t GEMMs of T / t rows, each less efficient
  than the whole (`_chunked_gemm_times`).
  The embedding and the output head are vocabulary-parallel: `vocab_parallel_comms` (their chunk's). MLA
  gathers its latents for the up projections instead of the layer's input (`_column_widths`).
* CP ring (Liu et al. 2023; Megatron-Core): cp - 1 K/V transfers forward, K/V and dK/dV backward, each
  hidden under one step's block of attention (1/cp of the layer's attention with the zig-zag split).
* Mamba-2 layers (TP by heads, CP by state passing or all-to-all): `_mamba_layer_cost`.
* EP (Lepikhin et al. 2020): dispatch and combine all-to-alls of T * top_k rows of D per direction,
  exposed unless `ep_comm_overlap` (another micro-batch's compute, DeepSeek-V3's DualPipe, Megatron-Core's
  combined 1F1B: each dispatch and combine under the block of the other pass it is paired with,
  `paired_ep_exposed_s`; only in the schedule's steady state: planner.simulate.unpaired_ep_s). With
  `ep_dispatch` "deepep" a token crosses the network once per destination node (`expert_nodes_per_token`,
  fewer still with group-limited routing) and reaches its experts there over NVLink.
* ZeRO-3 / FSDP (Rajbhandari et al. 2020 sec. 5.3): each layer's weights all-gathered forward and
  backward, gradients reduce-scattered; prefetched one layer ahead (`param_gather_overlap`), so a gather
  hides under the previous layer's compute; in the backward the gather and the reduce-scatter share the
  data-parallel links and add up, unless the gather is issued only once the layer above has its gradients
  (`fsdp_backward_prefetch` "post", Composer's BACKWARD_POST): then every layer's backward waits for its
  own gather. The parameters outside the layers (embedding, head, final norm) are gathered before the
  lookup and reduce-scattered after its backward, in full view (`zero3_root_comms`, on the first chunk),
  and so are the first layer's gather and reduce-scatter (`zero3_first_layer`).
  Under pipeline parallelism (torch.distributed.pipelining, the schedule
  torchtitan runs FSDP with) a stage's weights stay gathered through all its micro-batches and its
  gradients accumulate unsharded: PipelineStage turns FSDP's resharding and gradient sync off for every
  backward but the last (`backward_maybe_with_nosync`) and torchtitan does not reshard after forward
  when pp > 1. So a layer's passes carry no ZeRO-3 collectives there: planner.simulate charges one
  gather and one reduce-scatter per step, planner.memory the whole weights and gradients.

Overlapped communication still costs compute: while NCCL kernels run beside them, GEMMs and attention
run 18.9 % slower on average (Lee et al. 2025, "Characterizing Compute-Communication Overlap in GPU-
Accelerated Distributed Deep Learning", arXiv 2507.03114: GPT and Llama models on 4 A100s, H100s, MI250s
or MI210s; max 40 %). Each hidden second of communication adds `overlap_slowdown(chip)` seconds of compute.
The mechanism is the GPU's: NCCL's kernels occupy streaming multiprocessors beside the GEMMs. A TPU moves
collective data with its DMA engines over ICI while the TensorCore computes ([SB] Part 2: the TensorCore,
its MXUs and "multiple DMA engines"); no TPU measurement of the slowdown is published, so none is charged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from core.mesh import cp_chain_hops, cp_chain_sends
from hardware import kernels
from hardware.chips import Chip, get_chip
from hardware.collectives import Hierarchy, Topology, deduplicated_all_to_all_s, group_topology, ring_sent_bytes
from planner.case import Layout, default_tp_overlap
from planner.flops import (
    layer_forward_flops_per_token,
    layer_params,
    layer_params_on_chip,
    op_sac_matmuls,
    op_sac_recomputed_params,
    pre_norms,
    residual_output_matmuls,
    root_params,
    ssd_chunk,
    ssd_matmuls,
    window_band,
    windowed_square,
)
from planner.models import ATTENTION, MAMBA, MLP, ModelSpec

OVERLAP_SLOWDOWN = 0.189  # arXiv 2507.03114 abstract: overlapped compute 18.9 % slower on average (GPUs)


def overlap_slowdown(chip: Chip) -> float:
    """Seconds of compute one hidden second of communication adds on `chip` (module docstring)."""
    return OVERLAP_SLOWDOWN if chip.kind == "gpu" else 0.0


def charged_s(chip: Chip, total: float, exposed: float) -> float:
    """What `total` seconds of communication cost a step when `exposed` of them show: those, plus the compute
    the hidden rest slows (`overlap_slowdown`)."""
    return exposed + overlap_slowdown(chip) * (total - exposed)


def recompute_drops_dead_code(chip: Chip) -> bool:
    """Whether a full recomputation on `chip` leaves out what the backward does not read (`full_recompute`): on a
    TPU the step is one XLA program built by JAX."""
    return chip.kind == "tpu"


def full_recompute(chip: Chip, m: ModelSpec, kind, fwd_s: float, fwd_comms, gemms: list[_Gemm],
                   gemm_fwd: dict[str, float]) -> tuple[float, tuple[str, ...], float]:
    """What a full recomputation of a layer of `kind` runs again before its backward: (seconds, the GEMMs it
    leaves out, whose TP collectives it does not repeat either (`CommOp.gemm`), their FLOPs), from the forward's
    `fwd_s` and its collectives `fwd_comms`.

    PyTorch (torch.utils.checkpoint, Megatron's recompute) calls the layer's forward again: every kernel and
    every collective of it but a ZeRO-3 gather (`LayerCost.recompute_comms`: the backward's gather serves it), so
    not the compute that gather's hidden part slowed (`overlap_slowdown`) either. JAX's jax.checkpoint stages
    the recomputation as a jaxpr and removes from it everything the backward does not use (ad_checkpoint.py
    remat_partial_eval: pe.dce_jaxpr "keeping only instantiated outputs which are unknown";
    `recompute_drops_dead_code`): the GEMMs whose outputs only feed the residual sum
    (planner.flops.residual_output_matmuls), and the TP reductions of their partial sums, are not run again.
    For PaLM 540B (a parallel block) that leaves 65 % of the layer matmuls; the paper counts 75 % recomputed for
    its own policy (Chowdhery et al. 2022, Appendix B)."""
    fwd_s -= overlap_slowdown(chip) * sum(c.hidden_s for c in fwd_comms if c.group == "dp")
    if not recompute_drops_dead_code(chip):
        return fwd_s, (), 0.0
    dead = tuple(g for g in residual_output_matmuls(m, kind) if g in gemm_fwd)
    return (fwd_s - sum(gemm_fwd[g] for g in dead), dead,
            sum(2.0 * g.m * g.k * g.n * g.batch for g in gemms if g.name in dead))


# The classes a step's compute kernels fall into (LayerCost.by_class, planner.api.compute_by_class): GEMMs, the
# attention core (flash kernels, or materialised scores with their softmax), the SSM scan, memory-bound kernels
# (norms, activations, rotary, residuals, casts, the loss), the optimizer
KERNEL_CLASSES = ("gemm", "attention", "ssm scan", "memory-bound", "optimizer")
CAUSAL_FLASH_FRACTION = 0.5  # a causal flash kernel skips the masked upper triangle (Dao 2023, sec. 3.1)
WINDOWED_KERNELS = ("flash", "flash3")  # the flash kernels that skip the key blocks outside a sliding window
# a norm's HBM bytes per element of its bf16 input: forward reads x and writes y, backward reads x and dy and
# writes dx (planner.costs._elementwise; Korthikanti et al. 2022's norm terms)
NORM_FWD_BYTES, NORM_BWD_BYTES = 4, 6
ACT_BYTES = 2  # bf16 activations (fp8 recipes keep bf16 activations between GEMMs: Transformer Engine)
FP32_CE_BYTES = (38, 14)  # HBM bytes per logit of the unfused fp32 cross-entropy, forward and backward (logits_cost)
# Bytes per parameter of the update: Adam reads fp32 master, m, v, grad and writes master, m, v and the bf16
# copy (4*4 + 4*3 + 2 = 30); SGD with momentum 4*3 + 4*2 = 20; Adafactor reads master and grad, writes
# master and the bf16 copy, and its row/column statistics are negligible (4*2 + 4 + 2 = 14)
OPTIMIZER_STEP_BYTES = {"adam": 30, "sgd": 20, "adafactor": 14}
# Without master weights (`master_weights` false) every tensor of the update is bf16: Adam reads the weight, m, v
# and grad and writes the weight, m and v (2*4 + 2*3 = 14); SGD 2*3 + 2*2 = 10; Adafactor 2*2 + 2 = 6
BF16_OPTIMIZER_STEP_BYTES = {"adam": 14, "sgd": 10, "adafactor": 6}
# Adam as a loop of PyTorch elementwise ops over fp32 tensors (`optimizer_fused` false; Composer's DecoupledAdamW,
# composer/optim/decoupled_weight_decay.py adamw at v0.16.4): exp_avg.mul_ (read 4, write 4) .add_(grad) (8 + 4),
# exp_avg_sq.mul_ (4 + 4) .addcmul_(grad, grad) (8 + 4), sqrt (4 + 4), / sqrt(bias correction) (4 + 4), .add_(eps)
# (4 + 4), param.addcdiv_ (12 + 4): 80 bytes; its weight decay (param.mul_, 4 + 4) is skipped at weight_decay 0, as
# llm-foundry's benchmark YAMLs set it, and FSDP casts the fp32 weights to bf16 when it gathers them (no copy here).
# torch.optim.AdamW(foreach=True), torchtitan's until 2025-02-24 (6e4988550 made fused the default), moves the same
# 80: _foreach_mul_ for the decay (8), lerp_ (12), mul_ and addcmul_ (8 + 12), sqrt, div_, add_ (8 each), addcdiv_ (16)
UNFUSED_ADAM_BYTES = 80


def matmul_s(chip: Chip, dtype: str, m: float, k: float, n: float) -> float:
    """Seconds of `In[M, K] . W[K, N]` (hardware.kernels, the one GEMM model)."""
    return kernels.matmul_s(chip, dtype, m, k, n)


def comm_s(topo: Topology, kind: str, nbytes: float) -> float:
    """A collective's time on `topo` (hardware.collectives, measured pipeline fill included)."""
    if nbytes <= 0 or topo.n == 1:
        return 0.0
    return topo.cost_s(kind, nbytes)


def pipelined_exposed_s(comm: float, compute: float, chunks: int) -> float:
    """What a collective pipelined with its GEMM in `chunks` pieces adds to the GEMM: the first (or last)
    chunk cannot overlap, and a collective longer than the GEMM shows its excess (collective matmul)."""
    return max(0.0, comm - compute) + min(comm, compute) / max(1, chunks)


def tpu_slices(chip: Chip, num_chips: int) -> int:
    """The slices of a TPU job that does not say: one where a slice holds the chips, else the fewest equal
    slices that each have a slice shape (`slice_shape`; a multislice job's slices are alike: MaxText's dcn_*
    axes; PaLM's 6144 chips were two pods' 3072)."""
    fewest = -(-num_chips // math.prod(chip.torus_shape))  # a slice holds at most the largest slice's chips
    return next(s for s in divisors(num_chips) if s >= fewest and slice_shape(chip, num_chips // s))


def divisors(n: int, up_to: int | None = None) -> list[int]:
    """The divisors of n, in order. With `up_to`, only those <= it, by walking 1 .. up_to; else from n's
    prime factors by trial division, which stops once what is left is 1 or prime (n may be huge: 10^15
    factors at once, a large prime still walks to its square root)."""
    if up_to is not None:
        return [d for d in range(1, min(n, up_to) + 1) if n % d == 0]
    powers, rest, p = {}, n, 2
    while p * p <= rest:
        while rest % p == 0:
            powers[p] = powers.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        powers[rest] = powers.get(rest, 0) + 1
    out = [1]
    for p, e in powers.items():
        out = [d * p ** k for d in out for k in range(e + 1)]
    return sorted(out)


def tpu_slice_shape(chip: Chip, num_chips: int) -> tuple[int, ...]:
    """The torus of a TPU slice of `num_chips`: the largest slice (chips.toml's torus_shape) when it needs it,
    else the most cube-like slice with axes that are multiples of 4 (2 for tiny slices) inside it, as Cloud
    TPU slice shapes go (v5p: 4x4x4 = 64 chips, 4x4x8, 4x8x8, 8x8x8, ... 16x16x24). A multislice job
    (`tpu_slices`, or the case's cluster.slices) runs one per slice, and a group larger than a slice crosses
    the data-center network (collectives.group_topology)."""
    pod = tuple(chip.torus_shape)
    if num_chips >= math.prod(pod):
        return pod
    return slice_shape(chip, num_chips) or pod


def slice_shape(chip: Chip, num_chips: int) -> tuple[int, ...] | None:
    """The most cube-like slice of `num_chips` inside the largest (`tpu_slice_shape`), None where no shape
    with axes that are multiples of 4 (2 for tiny slices) holds them (e.g. 37 chips, or 3000 on a v5p)."""
    pod = tuple(chip.torus_shape)
    if num_chips > math.prod(pod):
        return None
    step = 4 if num_chips >= 4 ** len(pod) else 2 if num_chips >= 2 ** len(pod) else 1
    best = None
    for shape in _factorisations(num_chips, len(pod)):
        if all(a % step == 0 for a in shape) and all(a <= b for a, b in zip(sorted(shape), sorted(pod))):
            if best is None or sorted(shape, reverse=True) < sorted(best, reverse=True):
                best = shape
    return best


def _factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in _factorisations(n // d, k - 1)
            if d <= rest[0]]


# Identical GPUs are not equally fast: their power management runs each at its own clocks. Across whole
# clusters the spread between the fastest and the slowest is 8 % of the median on average (Sinha et al.,
# "Not All GPUs Are Created Equal", arXiv 2208.11035v3, whose figures these are; the SC22 abstract gives others:
# GEMM-bound and other kernels on >90 % of the GPUs of five clusters, NVIDIA and AMD; max 22 %, outliers 1.5x
# slower). Inside one 8-GPU node, with all eight at their power limit as in training, the sustained matmul rate
# (MSMF) of 5 rounds on every GPU spans 4.5 % on H200 (1405-1527 MHz) and 10.4 % on B200 ([MLE]
# compute/accelerator/benchmarks, "alone vs all-8 concurrent", branch fast-mamf at 082816f; chips.toml). Sinha et
# al.'s applications stress different parts of the GPU, compute- and memory-bound alike, so the pace applies to
# every kernel. A synchronous step waits for its slowest GPU:
# taking the table's rates as the median GPU's, a job on one node runs at 1 - 0.045 / 2 of them (H200's
# spread: the 700 W generation; B200's larger one, its 1000 W board sharing power and cooling, is not told
# apart), a job across nodes at 1 - 0.08 / 2. TPUs: no measurement, 1.
GPU_SPREAD_IN_NODE = 0.045
GPU_SPREAD_IN_CLUSTER = 0.08


def slowest_chip_pace(chip: Chip, num_chips: int, chips_per_node: int | None) -> float:
    """The share of its table rates a job's slowest chip reaches (the module comment above)."""
    if chip.kind != "gpu" or num_chips <= 1:
        return 1.0
    spread = GPU_SPREAD_IN_NODE if num_chips <= (chips_per_node or chip.scaleup_domain) else GPU_SPREAD_IN_CLUSTER
    return 1.0 - spread / 2


def case_chip(cluster) -> Chip:
    """The chip of a case's cluster (planner.case.Cluster) as the cluster wires it (`cluster_chip`)."""
    return cluster_chip(get_chip(cluster.chip), cluster.num_chips, cluster.chips_per_node,
                        cluster.network_bytes_per_s, cluster.slices)


@lru_cache(maxsize=256)
def cluster_chip(chip: Chip, num_chips: int, chips_per_node: int | None,
                 network_bytes_per_s: float | None = None, slices: int | None = None) -> Chip:
    """The chip as this cluster wires it: a GPU node of `chips_per_node`, a TPU slice of `num_chips` (of
    num_chips / `slices` on a multislice job), its share of the scale-out network where the cluster states
    one, and the pace of its slowest chip."""
    if network_bytes_per_s is not None:
        chip = replace(chip, scaleout_bytes_per_s=network_bytes_per_s)
    pace = slowest_chip_pace(chip, num_chips, chips_per_node)
    if chip.kind == "tpu":
        shape = tpu_slice_shape(chip, num_chips // (slices or tpu_slices(chip, num_chips)))
        return replace(chip, torus_shape=shape, scaleup_domain=math.prod(shape), pace=pace)
    if chips_per_node and chips_per_node != chip.scaleup_domain:
        return replace(chip, scaleup_domain=chips_per_node, pace=pace)
    return replace(chip, pace=pace) if pace != chip.pace else chip


def group_links_chip(chip: Chip, group: int, job_chips: int) -> Chip:
    """The chip a lesson costs a `group`-chip group on (a table row, a bound meter; `cluster_chip`): a TPU's is
    the slice a job of `job_chips` (the sidebar's mesh, at least the group) takes, small slices not wrapping
    round; a GPU's is a job of the group alone, its node as the chip table has it."""
    return cluster_chip(chip, max(group, job_chips) if chip.kind == "tpu" else group, None)


@lru_cache(maxsize=4096)
def topology(chip: Chip, n: int, stride: int, chips_per_node: int) -> Topology:
    """The group's topology; a case's `chips_per_node` overrides the chip's scale-up domain."""
    if chips_per_node != chip.scaleup_domain and chip.kind == "gpu":
        chip = replace(chip, scaleup_domain=chips_per_node)
    return group_topology(chip, n, stride, achievable=True)


def data_stride(lay: Layout) -> int:
    """How far apart the members of the dense layers' data-parallel group (`data_topology`) are."""
    return lay.mesh.group_stride(("dp", "cp", "ep"))


def data_topology(chip: Chip, lay: Layout, chips_per_node: int) -> Topology:
    """The group a dense weight's gradient is summed over (and ZeRO shards it over): every data-parallel rank
    of the dense layers, dp x cp, in the mesh's rank order (core/mesh.py: the ep ranks among them)."""
    return topology(chip, lay.dp * lay.cp, data_stride(lay), chips_per_node)


def expert_data_topology(chip: Chip, lay: Layout, chips_per_node: int) -> Topology:
    """The group a routed expert's gradient is summed over (and ZeRO shards it over): its replicas,
    `Layout.expert_dp` ranks `Layout.expert_dp_stride` apart."""
    return topology(chip, lay.expert_dp, lay.expert_dp_stride, chips_per_node)


def crosses_network(n: int, stride: int, chip: Chip, chips_per_node: int) -> bool:
    """Whether a group of n ranks `stride` apart leaves the scale-up domain (NVLink node, TPU slice)."""
    domain = chips_per_node if chip.kind == "gpu" else chip.scaleup_domain
    return n > 1 and n * stride > domain


@dataclass(frozen=True)
class CommOp:
    """One collective of a pass: `time_s` alone on its links, `exposed_s` of it the pass waits for."""

    group: str  # mesh axis: "tp", "cp", "ep", "dp"
    name: str
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | p2p
    nbytes: float  # hardware.collectives' convention (the full array for gathers and reductions), one op
    time_s: float
    exposed_s: float
    count: int = 1  # ops of `nbytes` in time_s run one after another (ring steps, chain hops)
    gemm: str = ""  # the GEMM whose input it gathers or whose partial sums it reduces (TP collectives)
    sends: int | None = None  # ops of `nbytes` the busiest rank sends, where not `count`: a chain's hops run
    # on different ranks (core.mesh.cp_chain_sends), each rank's conv halo beside the others'

    def sent_bytes(self, n: int) -> float:
        """Bytes the busiest of the group's n ranks sends for this op (all its ops)."""
        return (self.count if self.sends is None else self.sends) * ring_sent_bytes(self.kind, self.nbytes, n)

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.time_s - self.exposed_s)


def _sum_exposed(ops: tuple[CommOp, ...], group: str) -> float:
    return sum(c.exposed_s for c in ops if c.group == group)


@dataclass(frozen=True)
class LayerCost:
    """Seconds one chip spends on one layer for one micro-batch, by kind, and the FLOPs behind them.

    Compute includes the slowdown that hidden communication causes (module docstring)."""

    fwd_compute_s: float  # GEMMs + attention + memory-bound ops of the forward
    bwd_compute_s: float  # the backward (no recomputation)
    recompute_s: float  # forward work repeated before the backward (selective or full)
    fwd_comms: tuple[CommOp, ...]
    bwd_comms: tuple[CommOp, ...]
    fwd_flops: float
    tp_bytes: float  # bytes of one TP collective's array
    wgrad_s: float  # the weight-gradient GEMMs inside bwd_compute_s (what ZB-H1 defers)
    # forward + backward seconds by kernel class (KERNEL_CLASSES), before recomputation and before the slowdown
    # hidden communication causes: what a trace of the chip's kernels sums to, class by class
    by_class: tuple[tuple[str, float], ...] = ()
    recompute_skips: tuple[str, ...] = ()  # GEMMs a full recomputation leaves out, TP collectives too (full_recompute)
    recompute_skipped_flops: float = 0.0  # forward GEMM FLOPs it leaves out (full_recompute)
    recompute: str = "none"  # the layout's recompute mode the layer was costed under (training.recompute)
    recompute_reruns: tuple[str, ...] = ()  # under "selective", the GEMMs whose TP collectives run again with them

    @property
    def tp_fwd_s(self) -> float:
        return _sum_exposed(self.fwd_comms, "tp")

    @property
    def tp_bwd_s(self) -> float:
        return _sum_exposed(self.bwd_comms, "tp")

    @property
    def cp_fwd_s(self) -> float:
        return _sum_exposed(self.fwd_comms, "cp")

    @property
    def cp_bwd_s(self) -> float:
        return _sum_exposed(self.bwd_comms, "cp")

    @property
    def ep_fwd_s(self) -> float:
        return _sum_exposed(self.fwd_comms, "ep")

    @property
    def ep_bwd_s(self) -> float:
        return _sum_exposed(self.bwd_comms, "ep")

    @property
    def zero3_fwd_s(self) -> float:
        return _sum_exposed(self.fwd_comms, "dp")

    @property
    def zero3_bwd_s(self) -> float:
        return _sum_exposed(self.bwd_comms, "dp")

    @property
    def full_recompute_flops(self) -> float:
        """FLOPs a full recomputation runs again: the forward's, less the GEMMs it leaves out."""
        return self.fwd_flops - self.recompute_skipped_flops

    @property
    def recompute_comms(self) -> tuple[CommOp, ...]:
        """What the recomputation repeats of the forward's communication: under "full" its TP / CP / EP
        collectives (not the ZeRO-3 gathers, which the backward does anyway), less those whose results it
        does not need (full_recompute); under "selective" the TP collectives of the modules it runs again
        (`recompute_reruns`: MLA's up projections, an MLP); op lists and dots recompute what lies between
        collectives."""
        if self.recompute == "selective":
            return tuple(c for c in self.fwd_comms if c.group == "tp" and c.gemm in self.recompute_reruns)
        if self.recompute != "full":
            return ()
        return tuple(c for c in self.fwd_comms if c.group != "dp" and c.gemm not in self.recompute_skips)


def layer_cost(m: ModelSpec, lay: Layout, chip: Chip, dtype: str, moe, chips_per_node: int) -> LayerCost:
    """One layer's costs; `moe` is the layer kind (planner.models: False dense, True MoE, or a pattern
    character). Memoised on the layout fields a layer sees (layouts differing only in pp, schedule,
    ZeRO-0/1/2 or how many layers full recomputation covers share them, which keeps the search fast; so
    do ZeRO-3 layouts under pp, whose layers carry no ZeRO-3 collectives: `Layout.staged_zero3`)."""
    z3 = lay.layer_zero3
    ssm_cp = lay.ssm_cp if m.has_ssm and lay.cp > 1 else "state"
    key = replace(lay, pp=1, pp_schedule="1f1b", virtual_stages=1, pp_layout=None, recompute_layers=None,
                  zero_stage=3 if z3 else 0,
                  dp=lay.dp if z3 else lay.ep, grad_reduce_overlap=True, ssm_cp=ssm_cp,  # dp only matters to ZeRO-3
                  tp_comm_overlap=tp_overlaps(lay, chip, m))
    if moe == MAMBA:
        return _mamba_layer_cost(m, key, chip, dtype, chips_per_node)
    return _layer_cost(m, key, chip, dtype, moe, chips_per_node)


@dataclass(frozen=True)
class _Gemm:
    name: str
    m: float
    k: float
    n: float
    batch: float = 1.0


def _gemms(m: ModelSpec, lay: Layout, moe, tokens: float) -> tuple[list[_Gemm], list[_Gemm]]:
    """(attention projections, MLP) GEMMs of one layer's forward on one chip; a pattern's attention
    ("*") or MLP ("-") layer has only its half."""
    t, h, hd = lay.tp, m.hidden, m.head_dim_
    kv_local = max(1.0, m.kv_heads / t)  # tp > kv_heads keeps a whole KV head per rank (Megatron-LM)
    if moe == MLP:
        attn = []
    elif m.is_mla:
        qk = hd + m.rope_head_dim
        # the down projections are duplicated on every TP rank (Megatron-Core's MLA: TELinear, parallel_mode
        # "duplicated"), over the rank's sequence shard under sequence parallelism, else over all T tokens
        local = tokens / t if lay.sequence_parallel else tokens
        attn = ([_Gemm("q down", local, h, m.q_lora_rank), _Gemm("q up", tokens, m.q_lora_rank, m.heads * qk / t)]
                if m.q_lora_rank else [_Gemm("q", tokens, h, m.heads * qk / t)])
        attn += [_Gemm("kv down", local, h, m.kv_lora_rank + m.rope_head_dim),
                 _Gemm("kv up", tokens, m.kv_lora_rank, 2 * m.heads * hd / t),
                 _Gemm("o", tokens, m.heads * hd / t, h)]
    else:
        attn = [_Gemm("qkv", tokens, h, (m.heads / t + 2 * kv_local) * hd),
                _Gemm("o", tokens, m.heads * hd / t, h)]
    if moe == ATTENTION:
        return attn, []
    n_in = 2 if m.mlp == "swiglu" else 1
    ffn = m.ffn if moe else m.dense_ffn_
    mlp = []
    dense_mats = m.shared_experts if moe is True else 1
    if dense_mats:
        mlp += [_Gemm("fc1", tokens, h, dense_mats * n_in * ffn / t), _Gemm("fc2", tokens, dense_mats * ffn / t, h)]
    if moe is True:
        # routed experts: the token copies of an etp group over E / ep local experts (balanced routing),
        # grouped: T * top_k rows split etp ways (Parallel.etp = tp); or, the tp ranks folded into ep (etp 1),
        # the T / tp tokens of a rank's sequence shard, each expert whole
        local, e = m.experts / lay.ep, lay.etp
        rows = max(1.0, tokens * e / t * m.top_k * lay.ep / m.experts)
        # the router scores the layer's input: the rank's sequence shard under SP (which MoE under tp needs)
        mlp += [_Gemm("router", tokens / t if lay.sequence_parallel else tokens, h, m.experts),
                _Gemm("experts fc1", rows, h, n_in * ffn / e, local),
                _Gemm("experts fc2", rows, ffn / e, h, local)]
    return attn, mlp


def _attention_columns(m: ModelSpec, attn_g: list[_Gemm]) -> list[str]:
    """The attention GEMMs that read the TP region's gathered input: qkv; in MLA the up projections (and q
    itself without a q rank), whose inputs are the latents the duplicated down projections made on the
    sequence shard (Megatron-Core's MLA gathers those, not the hidden states)."""
    if not attn_g:
        return []
    if m.is_mla:
        return ["q up" if m.q_lora_rank else "q", "kv up"]
    return [attn_g[0].name]


def _column_widths(m: ModelSpec) -> dict[str, float]:
    """Per token, the width of what MLA's column GEMMs gather, over the hidden size (`_attention_columns`):
    the q latent and the kv latent. (Megatron-Core's scheme; torchtitan's DeepSeek-V3 plan gathers the hidden
    states before attention and replicates the down projections over every token, as for other models.)"""
    if not m.is_mla:
        return {}
    return {"q up": m.q_lora_rank / m.hidden, "kv up": m.kv_lora_rank / m.hidden}


def _shared_rope_key_comms(m: ModelSpec, lay: Layout, topo: Topology, act_bytes: float
                           ) -> tuple[list[CommOp], list[CommOp]]:
    """MLA's shared rotary key under sequence parallelism, gathered on its own over TP before attention
    (gather_from_sequence_parallel_region: a plain collective, never pipelined) and its gradient reduce-
    scattered back: rope_head_dim wide, both in full view. Without SP it is replicated: nothing."""
    if not (m.is_mla and lay.sequence_parallel):
        return [], []
    nbytes = act_bytes * m.rope_head_dim / m.hidden
    ag, rs = comm_s(topo, "all_gather", nbytes), comm_s(topo, "reduce_scatter", nbytes)
    return ([CommOp("tp", "tp all-gather (rotary key)", "all_gather", nbytes, ag, ag, gemm="kv up")],
            [CommOp("tp", "tp reduce-scatter (rotary key grad)", "reduce_scatter", nbytes, rs, rs, gemm="kv up")])


def _fwd_s(chip, dtype, g: _Gemm) -> float:
    return g.batch * kernels.matmul_s(chip, dtype, g.m, g.k, g.n)


def _dgrad_s(chip, dtype, g: _Gemm) -> float:
    return g.batch * kernels.matmul_s(chip, dtype, g.m, g.n, g.k)


def _wgrad_s(chip, dtype, g: _Gemm) -> float:
    return g.batch * kernels.matmul_s(chip, dtype, g.k, g.m, g.n)


def _gemm_times(chip, dtype, gemms: list[_Gemm]) -> tuple[dict, dict, dict]:
    """Seconds of each GEMM by name: forward, input gradient, weight gradient."""
    return ({g.name: _fwd_s(chip, dtype, g) for g in gemms}, {g.name: _dgrad_s(chip, dtype, g) for g in gemms},
            {g.name: _wgrad_s(chip, dtype, g) for g in gemms})


# Transformer Engine's userbuffers overlap (transformer_engine/pytorch/module/base.py get_default_config, and
# common/comm_gemm_overlap): the column GEMMs' forward and the row GEMMs' input gradient by "ring_exchange",
# num_splits = tp, not aggregated: tp GEMMs of T / tp rows, one per ring step (CommOverlapP2PBase::
# split_overlap_ag); the row GEMMs' forward by "pipeline", num_splits 4: four GEMMs of all T rows and a
# quarter of the output features each, reduce-scattered one by one (CommOverlapBase::split_overlap_rs).
# XLA's collective matmul on a TPU decomposes both ways over the tp ring steps, by rows.
RS_PIPELINE_SPLITS = 4


def row_forward_splits(chip: Chip, t: int) -> int:
    """How many pieces a row GEMM's forward and its reduce-scatter are pipelined in (RS_PIPELINE_SPLITS)."""
    return RS_PIPELINE_SPLITS if chip.kind == "gpu" else t


def _chunked_gemm_times(chip, dtype, gemms: list[_Gemm], column: list[str], row: list[str], gemm_fwd: dict,
                        gemm_dgrad: dict, t: int) -> tuple[dict, dict]:
    """(forward, input-gradient) seconds by GEMM name when TP's collectives are pipelined with the GEMMs
    (`tp_comm_overlap`): each pipelined GEMM runs in pieces (RS_PIPELINE_SPLITS' note), and a smaller GEMM
    reaches less of the chip (hardware.kernels' shape curve): the column GEMMs' forward and the row GEMMs'
    input gradient as t GEMMs of T / t rows, the row GEMMs' forward as `row_forward_splits` GEMMs (on a GPU,
    of all T rows and a quarter of the outputs; on a TPU of T / t rows). torch's async TP decomposes like
    the ring exchange."""
    fwd, dgrad = dict(gemm_fwd), dict(gemm_dgrad)
    pieces = row_forward_splits(chip, t)
    for g in gemms:
        if g.name in column:
            fwd[g.name] = t * g.batch * kernels.matmul_s(chip, dtype, g.m / t, g.k, g.n)
        if g.name in row:
            rows, outputs = (g.m, g.n / pieces) if chip.kind == "gpu" else (g.m / pieces, g.n)
            fwd[g.name] = pieces * g.batch * kernels.matmul_s(chip, dtype, rows, g.k, outputs)
            dgrad[g.name] = t * g.batch * kernels.matmul_s(chip, dtype, g.m / t, g.n, g.k)
    return fwd, dgrad


def _elementwise(m: ModelSpec, lay: Layout, moe, tokens: float) -> dict[str, float]:
    """HBM bytes of one layer's memory-bound ops on one chip, by kernel class and direction.

    Per token (h hidden, f the MLP width on this chip, sp = t with sequence parallel, else 1), bf16:
      GPT recipe (Megatron-LM 2021-22): 2 LayerNorms, read x + write y: fwd 8h/sp; backward reads x and
        dy and writes dx: 12h/sp (norm kernels); 2 bias-dropout-adds, read x, residual, write y, mask:
        14h/sp, backward reads dy and the mask, writes dx: 10h/sp; bias-GELU over f: fwd 4f, bwd 6f.
      Llama recipe: 2 RMSNorms as above; 2 residual adds (read 2, write 1): 12h/sp both ways; rotary on
        q and k: 4 (N + K) H / t both ways; SwiGLU reads gate and up, writes their product: 6f, backward
        reads gate, up and dy, writes two gradients: 10f; squared ReLU as GELU, 4f and 6f.
      A pattern's attention or MLP layer has one norm and one residual add, and only its block's terms.
      A parallel block (`ModelSpec.parallel_block`) runs one norm for both branches (planner.flops.pre_norms)
        and adds both outputs to the residual in one pass (MaxText's DecoderLayer, one XLA fusion: read the
        two outputs and the residual, write the sum): forward 8h/sp for the adds where a sequential block's
        two cost 12h/sp (GPT recipe: one dropout over the sum, 9h/sp for 14h/sp; eager, each op apart, x + a
        + m is two adds: 12h/sp, GPT two biases, two adds, one dropout, 25h/sp for 30h/sp). Its backward sums
        the two branches' input gradients before the norm and adds the residual's after it, a sequential
        block's two adds: unchanged.
      MoE: the token copies are permuted to their experts and back, each a gather that reads and writes
        the k copies (Megatron-Core's moe_utils permute, an index_select, and unpermute, a scatter-add):
        2 x (2 + 2) k h per token each way, of the tp group's gathered tokens where tp splits the experts,
        of the rank's own sequence shard (/sp) where the experts fold the tp ranks (etp 1: no gather).
    With `fusion` "eager" (PyTorch eager modules, no compiler) each op of a module is its own kernel:
      Llama recipe: the RMSNorms and the rotary embedding cost what Liger-Kernel measured for the Hugging
        Face modules (key "eager_*": effective bytes at peak bandwidth, hardware.kernels.EAGER_BYTES, per
        element of the norm's input and of q and k); SwiGLU is silu (read 2, write 2) then a product
        (read 4, write 2): 10f, backward the product's two gradients (read 4, write 2 each) and silu's
        (read 4, write 2): 18f; squared ReLU 8f and 12f; a GELU (no bias) one native kernel, 4f and 6f.
      GPT recipe: LayerNorm and GELU are single native kernels either way; the bias, dropout and residual
        add run apart: 15h/sp forward (bias 4, dropout 5, add 6) and 10h/sp backward per block, bias then
        GELU 8f both ways.
    Without dropout (`lay.dropout_on`, the recipe's "dropout"; PyTorch skips a dropout of p = 0) the GPT recipe's
    blocks keep the bias and residual adds: fused 6h/sp forward (read both, write the sum) and nothing backward
    (the residual passes its gradient on; the bias gradient comes with the weight gradient), eager 10h/sp and the
    bias gradient's pass, 5h/sp.
    """
    t = lay.tp
    sp = t if lay.sequence_parallel else 1
    h, hd = m.hidden, m.head_dim_
    blocks = 1 if moe in (ATTENTION, MLP) else 2
    norms = pre_norms(m, moe)
    shared = m.parallel_block and blocks == 2  # both branches' outputs join the residual in one add
    eager = lay.fusion == "eager"
    if moe is True:
        ffn = m.ffn * (m.top_k + m.shared_experts) / t
        routed = m.ffn * m.top_k / t
    else:
        ffn = 0.0 if moe == ATTENTION else m.dense_ffn_ / t
        routed = 0.0
    out = {"norm_fwd": norms * NORM_FWD_BYTES * h / sp, "norm_bwd": norms * NORM_BWD_BYTES * h / sp}
    if m.gpt_style:
        act_fwd = 8 if eager else 4
        if lay.dropout_on(m):
            residual_fwd = (25 if eager else 9) if shared else blocks * (15 if eager else 7)
            residual_bwd = blocks * (10 if eager else 5)
        else:  # no mask: the bias and residual adds; backward the bias gradient's pass when eager
            residual_fwd = (20 if eager else 8) if shared else blocks * (10 if eager else 6)
            residual_bwd = blocks * 5 if eager else 0
        act_bwd = 8 if eager else 6
        out["point_fwd"] = residual_fwd * h / sp + act_fwd * ffn
        out["point_bwd"] = residual_bwd * h / sp + act_bwd * ffn
    else:
        if moe == MLP:
            rope_elements = 0.0
        elif m.is_mla:  # MLA rotates only each query head's decoupled part and the one shared key
            rope_elements = m.rope_head_dim * (m.heads / t + 1)
        else:
            rope_elements = (m.heads + m.kv_heads) * hd / t
        if m.mlp == "swiglu":
            act_fwd, act_bwd = (10, 18) if eager else (6, 10)
        elif m.mlp == "relu2":
            act_fwd, act_bwd = (8, 12) if eager else (4, 6)
        else:  # GELU without a bias (layer_style "llama"): one native kernel either way
            act_fwd, act_bwd = 4, 6
        rope = 0.0 if eager else 4 * rope_elements
        out["point_fwd"] = (8 if shared and not eager else blocks * 6) * h / sp + rope + act_fwd * ffn
        out["point_bwd"] = blocks * 6 * h / sp + rope + act_bwd * ffn
        if eager:
            norm_elements = norms * h / sp
            out["norm_fwd"] = out["norm_bwd"] = 0.0
            out["eager_fwd"] = (kernels.EAGER_BYTES["norm_fwd"] * norm_elements
                                + kernels.EAGER_BYTES["rope_fwd"] * rope_elements)
            out["eager_bwd"] = (kernels.EAGER_BYTES["norm_bwd"] * norm_elements
                                + kernels.EAGER_BYTES["rope_bwd"] * rope_elements)
            out["eager_norm_fwd"] = kernels.EAGER_BYTES["norm_fwd"] * norm_elements
    if moe is True:  # experts folded into ep: each rank permutes its own sequence shard's tokens
        permute = 8 * m.top_k * h / (sp if lay.experts_folded else 1)
        if lay.ep_dispatch == "all_to_all" and m.experts > lay.ep:
            # the NCCL all-to-all dispatcher permutes twice each way: by destination rank before the exchange,
            # then by local expert after it, and back before the combine (Megatron-Core's MoEAlltoAllTokenDispatcher,
            # sort_chunks_by_idxs, "Permutation 2: Sort tokens by local expert", where a rank holds several)
            permute *= 2
        out["point_fwd"] += permute
        out["point_bwd"] += permute
        # the MoE block's own (`moe_sides`): the experts' activation and the permutations, each way
        out["moe_point_fwd"] = act_fwd * ffn + permute
        out["moe_point_bwd"] = act_bwd * ffn + permute
    # parts of point_fwd and eager_fwd that selective recomputation may run again (`_selective_recompute_s`)
    out["act_fwd_routed"] = act_fwd * routed
    out["act_fwd_dense"] = act_fwd * (ffn - routed)
    return {k: v * tokens for k, v in out.items()}


def _memory_bound_s(chip: Chip, ew: dict[str, float], gemms: list[_Gemm], dtype: str,
                    casts: str = "fused") -> tuple[float, float]:
    """(forward, backward) seconds of a layer's memory-bound ops from their HBM bytes by kernel class
    (`_elementwise`'s keys: norm_*, point_*, and eager_* with fusion "eager"), and the casts of fp8 GEMMs
    In[M, K] . W[K, N] (`casts`, planner.case.FP8_CASTS):
      fused    Transformer Engine: the activation input forward and the output gradient backward, each
               cast once, its transposed copy (what Hopper's fp8 GEMMs need for the other pass) written by
               the same kernel (fp8_cast_transpose_fused): read 2 + write 1 + 1 bytes per element; each weight
               is cast once per step (Megatron's first micro-batch), not charged
      dynamic  torchao.float8, tensorwise dynamic scaling (torchtitan's Float8Linear): every cast is an amax
               pass (read 2) and a scaled cast (read 2, write 1), 5 bytes per element: forward the input
               (MK) and the weight (KN); backward the output gradient for each of its two GEMMs (2 MN),
               the weight again for the input gradient and the input again for the weight gradient (the
               GEMMs want other layouts, cast from the saved bf16 tensors: matmul_with_hp_or_float8_args).
               On torchao's published H100 examples (torchao/float8 README, a float8 linear's forward +
               backward against bf16) this gives 1.43x for In[4096, 8192] . W[8192, 16384], measured 1.39x,
               and 0.87x for In[1024, 2048] . W[2048, 1024], measured 0.80x. With FSDP's float8
               all-gather the forward's weight cast runs on the shard before gathering: not modelled,
               the casts are charged whole."""
    point_fwd, point_bwd = ew["point_fwd"], ew["point_bwd"]
    if dtype == "fp8" and casts == "dynamic":
        point_fwd += sum(5 * (g.m * g.k + g.k * g.n) * g.batch for g in gemms)
        point_bwd += sum(5 * (2 * g.m * g.n + g.k * g.n + g.m * g.k) * g.batch for g in gemms)
    elif dtype == "fp8":
        point_fwd += sum(4 * g.m * g.k * g.batch for g in gemms)
        point_bwd += sum(4 * g.m * g.n * g.batch for g in gemms)
    return (kernels.norm_s(chip, ew["norm_fwd"]) + kernels.pointwise_s(chip, point_fwd)
            + kernels.eager_s(chip, ew.get("eager_fwd", 0.0)),
            kernels.norm_s(chip, ew["norm_bwd"], backward=True) + kernels.pointwise_s(chip, point_bwd)
            + kernels.eager_s(chip, ew.get("eager_bwd", 0.0)))


def tp_collective_bytes(m: ModelSpec, lay: Layout) -> float:
    """The array of one TP collective: the layer's activation In[T, D], T the chip's tokens of a micro-batch."""
    return lay.micro_batch * m.seq_len / lay.cp * m.hidden * ACT_BYTES


def tp_overlaps(lay: Layout, chip: Chip, m: ModelSpec) -> bool:
    """Whether TP's collectives are pipelined with their GEMMs: the layout's choice, else what a current
    framework does there (planner.case.default_tp_overlap: the chip's, chips.toml, but not for MLA on GPUs)."""
    return default_tp_overlap(chip, m) if lay.tp_comm_overlap is None else lay.tp_comm_overlap


# The routed experts' GEMMs: their TP collectives are the token dispatcher's own all-gather and
# reduce-scatter (plain NCCL collectives, autograd's backward of each the other), not pipelined with the
# GEMMs: Megatron-Core's experts are TEGroupedLinear modules, which have no userbuffers path
# (custom_layers/transformer_engine.py at core_r0.8.0 passes them no ub_overlap flags)
DISPATCHED = ("experts fc1", "experts fc2")


# Under fp8 a sequence-parallel all-gather moves the GEMM's input already cast to fp8, one byte an element: Transformer
# Engine's LayerNormLinear writes the norm's output as fp8 (uint8) and all-gathers that, and re-gathers the saved
# fp8 copy in backward (transformer_engine/pytorch/module/layernorm_linear.py, `ln_out_dtype = torch.uint8 if fp8`
# before `gather_along_first_dim`); a row-parallel layer's output gradient is cast to e5m2 before its all-gather
# (TE's grad_output_preprocess; torchao's Float8RowwiseParallel for torchtitan, whose Float8ColwiseParallel casts
# the input before redistributing it). Reduce-scatters sum in bf16. The routed experts' token all-gathers (the MoE
# dispatcher's, DISPATCHED) move bf16 tokens, quantized inside the grouped GEMM.
FP8_GATHER_SHARE = 0.5


def tp_gather_share(dtype: str) -> float:
    """The share of a TP collective's bf16 bytes its sequence-parallel all-gathers move (FP8_GATHER_SHARE)."""
    return FP8_GATHER_SHARE if dtype == "fp8" else 1.0


def _tp_comms(lay: Layout, topo: Topology, column: list[str], row: list[str], gemm_fwd: dict, gemm_dgrad: dict,
              gemm_wgrad: dict, act_bytes: float, copies: dict[str, float] | None = None, rs_splits: int = 0,
              gather_share: float = 1.0) -> tuple[list[CommOp], list[CommOp]]:
    """TP's collectives around the column-parallel GEMMs that read a region's input and the row-parallel
    ones whose partial sums leave it (module docstring): (forward, backward). `lay` is layer_cost's key, whose
    tp_comm_overlap is already resolved (tp_overlaps). Each GEMM's collectives move `act_bytes`, times its
    `copies` where given (routed experts: the top_k copies of every token). A row GEMM's forward reduce-
    scatter is pipelined in `rs_splits` pieces (`row_forward_splits`; 0: t); the routed experts' collectives
    (DISPATCHED) are never pipelined, and their gathered input is kept for the weight gradient. An all-gather
    moves `gather_share` of the bytes (FP8_GATHER_SHARE under fp8), the dispatcher's all of them."""
    t, overlap = lay.tp, lay.tp_comm_overlap
    fwd: list[CommOp] = []
    bwd: list[CommOp] = []
    nbytes = {g: act_bytes * (copies or {}).get(g, 1.0) for g in (*column, *row)}
    if lay.sequence_parallel:
        gathered = {g: b * (1.0 if g in DISPATCHED else gather_share) for g, b in nbytes.items()}
        ag = {g: comm_s(topo, "all_gather", b) for g, b in gathered.items()}
        rs = {g: comm_s(topo, "reduce_scatter", b) for g, b in nbytes.items()}

        def piped(g: str) -> bool:
            return overlap and g not in DISPATCHED

        for g in column:  # forward: all-gather the sequence, then the column GEMM
            exp = pipelined_exposed_s(ag[g], gemm_fwd[g], t) if piped(g) else ag[g]
            fwd.append(CommOp("tp", f"tp all-gather ({g})", "all_gather", gathered[g], ag[g], exp, gemm=g))
        for g in row:  # forward: the row GEMM's partial sums reduce-scattered
            exp = pipelined_exposed_s(rs[g], gemm_fwd[g], rs_splits or t) if piped(g) else rs[g]
            fwd.append(CommOp("tp", f"tp reduce-scatter ({g})", "reduce_scatter", nbytes[g], rs[g], exp, gemm=g))
        for g in row:  # backward: the output gradient all-gathered before the dgrad GEMM
            exp = pipelined_exposed_s(ag[g], gemm_dgrad[g], t) if piped(g) else ag[g]
            bwd.append(CommOp("tp", f"tp all-gather ({g} grad)", "all_gather", gathered[g], ag[g], exp, gemm=g))
        for g in column:  # backward: input re-gathered under dgrad, its gradient reduced under wgrad
            if g in DISPATCHED:  # the all-gather's backward, after the experts' GEMMs
                bwd.append(CommOp("tp", f"tp reduce-scatter ({g} grad)", "reduce_scatter", nbytes[g], rs[g], rs[g],
                                  gemm=g))
                continue
            bwd.append(CommOp("tp", f"tp all-gather ({g} input)", "all_gather", gathered[g], ag[g],
                              max(0.0, ag[g] - gemm_dgrad[g]), gemm=g))
            bwd.append(CommOp("tp", f"tp reduce-scatter ({g} grad)", "reduce_scatter", nbytes[g], rs[g],
                              max(0.0, rs[g] - gemm_wgrad[g]), gemm=g))
    else:
        ar = {g: comm_s(topo, "all_reduce", b) for g, b in nbytes.items()}
        for g in row:
            fwd.append(CommOp("tp", f"tp all-reduce ({g})", "all_reduce", nbytes[g], ar[g], ar[g], gemm=g))
        for g in column:  # the input gradient's all-reduce under the wgrad GEMM (async TP all-reduce)
            exp = max(0.0, ar[g] - gemm_wgrad[g]) if overlap or lay.tp_grad_allreduce_overlap else ar[g]
            bwd.append(CommOp("tp", f"tp all-reduce ({g} grad)", "all_reduce", nbytes[g], ar[g], exp, gemm=g))
    return fwd, bwd


def _zero3_comms(lay: Layout, chip: Chip, chips_per_node: int, on_chip: tuple[float, float], fwd_s: float,
                 bwd_s: float, fwd_comms: list[CommOp], bwd_comms: list[CommOp]
                 ) -> tuple[CommOp, tuple[CommOp, CommOp]]:
    """ZeRO-3's weight all-gathers and gradient reduce-scatter of one layer (module docstring): the forward's
    gather, and the backward's re-gather and reduce-scatter, which share the backward's window (what of the
    two shows is the reduce-scatter's first: it runs last), or with `fsdp_backward_prefetch` "post" the gather
    shows whole and the reduce-scatter has the window to itself."""
    cp, data = lay.cp, data_stride(lay)
    topo = data_topology(chip, lay, chips_per_node)
    # the layer's weights on this chip: the dense ones over the data-parallel group, the local experts over their
    # own replicas (`Layout.expert_dp`), none where an expert has no other (AutoModel leaves those out of FSDP)
    dense_bytes, expert_bytes = 2 * on_chip[0], 2 * on_chip[1] * (lay.expert_dp > 1)
    w_bytes = dense_bytes + expert_bytes
    ag = comm_s(topo, "all_gather", dense_bytes)
    rs = comm_s(topo, "reduce_scatter", dense_bytes * lay.grad_bytes / 2)  # the bf16 weights' gradients
    if expert_bytes:
        experts = expert_data_topology(chip, lay, chips_per_node)
        ag += comm_s(experts, "all_gather", expert_bytes)
        rs += comm_s(experts, "reduce_scatter", expert_bytes * lay.grad_bytes / 2)
    # the ring of CP, when it runs on the same links, competes for the window
    shared = lay.cp > 1 and crosses_network(cp, lay.mesh.stride("cp"), chip, chips_per_node) == \
        crosses_network(lay.dp * cp, data, chip, chips_per_node)
    fwd_window = fwd_s - (sum(c.time_s for c in fwd_comms if c.group == "cp") if shared else 0.0)
    bwd_window = bwd_s - (sum(c.time_s for c in bwd_comms if c.group == "cp") if shared else 0.0)
    overlap = lay.param_gather_overlap
    if not overlap:
        ag_shown, rs_shown = ag, rs
    elif lay.fsdp_backward_prefetch == "post":
        # the gather is issued once the layer above (whose backward runs first) has its gradients, so this
        # layer's backward waits for all of it; its reduce-scatter then runs under the next layer's backward
        ag_shown, rs_shown = ag, max(0.0, rs - max(0.0, bwd_window))
    else:
        shown = max(0.0, ag + rs - max(0.0, bwd_window))
        rs_shown = min(rs, shown)
        ag_shown = shown - rs_shown
    return (CommOp("dp", "zero-3 all-gather", "all_gather", w_bytes, ag,
                   max(0.0, ag - max(0.0, fwd_window)) if overlap else ag),
            (CommOp("dp", "zero-3 all-gather (backward)", "all_gather", w_bytes, ag, ag_shown),
             CommOp("dp", "zero-3 reduce-scatter", "reduce_scatter", w_bytes * lay.grad_bytes / 2, rs, rs_shown)))


def zero3_first_layer(lc: LayerCost, chip: Chip) -> LayerCost:
    """The model's first layer under per-layer ZeRO-3: its forward gather has only the embedding lookup
    before it to hide under and its reduce-scatter only the lookup's backward after it, so both show whole
    (the root unit's own gather and reduce-scatter, `zero3_root_comms`, run beside them), and the compute
    their hidden parts had slowed (`overlap_slowdown`) is given back."""
    slow = overlap_slowdown(chip)

    def shown(ops: tuple[CommOp, ...], name: str) -> tuple[tuple[CommOp, ...], float]:
        given_back = sum(slow * c.hidden_s for c in ops if c.name == name)
        return tuple(replace(c, exposed_s=c.time_s) if c.name == name else c for c in ops), given_back

    fwd, fwd_back = shown(lc.fwd_comms, "zero-3 all-gather")
    bwd, bwd_back = shown(lc.bwd_comms, "zero-3 reduce-scatter")
    return replace(lc, fwd_comms=fwd, bwd_comms=bwd, fwd_compute_s=lc.fwd_compute_s - fwd_back,
                   bwd_compute_s=lc.bwd_compute_s - bwd_back)


def fsdp_copy_bytes(lay: Layout) -> tuple[float, float]:
    """HBM bytes per gathered weight that a ZeRO-3 layer's implementation (`lay.fsdp_impl`, planner.case's
    FSDP_IMPLS) moves on the compute stream besides its collectives, (forward, backward) of one micro-batch:
      fsdp2     each gather's copy-out, read 2 + write 2, both passes; the backward's reduce-scatter input
                filled from the bf16 gradients, read 2 + write grad_bytes
      fsdp1     backward only: the views' bf16 gradients concatenated into the flat gradient (2 + 2), cast
                to the reduction's precision where it differs (2 + grad_bytes) and divided in place before the
                reduce-scatter (2 x grad_bytes)
      in-place  none
    Only a layer that gathers (`Layout.layer_zero3`) pays them: under pipeline parallelism the weights stay
    gathered, and `layer_cost` prices such layers without ZeRO-3."""
    gb = lay.grad_bytes
    fsdp1_bwd = 4.0 + (2.0 + gb if gb != 2 else 0.0) + 2.0 * gb
    return {"fsdp2": (4.0, 4.0 + 2.0 + gb), "fsdp1": (0.0, fsdp1_bwd), "in-place": (0.0, 0.0)}[lay.fsdp_impl]


def _with_zero3_and_slowdown(lay: Layout, chip: Chip, chips_per_node: int, on_chip: tuple[float, float],
                             fwd_s: float, bwd_s: float,
                             fwd_comms: list[CommOp], bwd_comms: list[CommOp]) -> tuple[float, float, float]:
    """A layer's passes once its ZeRO-3 collectives (`_zero3_comms`, when it gathers its weights) join its other
    communication in `fwd_comms` / `bwd_comms`, and every hidden second of them all slows its compute
    (`overlap_slowdown`): (forward s, backward s, the bytes of weights it gathers, 0 without ZeRO-3)."""
    gathered = 0.0
    if lay.zero_stage == 3 and lay.dp * lay.cp > 1:
        zf, zb = _zero3_comms(lay, chip, chips_per_node, on_chip, fwd_s, bwd_s, fwd_comms, bwd_comms)
        fwd_comms.append(zf)
        bwd_comms.extend(zb)
        gathered = zf.nbytes
    slow = overlap_slowdown(chip)
    return (fwd_s + slow * sum(c.hidden_s for c in fwd_comms), bwd_s + slow * sum(c.hidden_s for c in bwd_comms),
            gathered)


def _plus_fsdp_copies(chip: Chip, lay: Layout, gathered_bytes: float, fwd_s: float,
                      bwd_s: float) -> tuple[float, float]:
    """A ZeRO-3 layer's passes with its implementation's copies (`fsdp_copy_bytes`) of its `gathered_bytes` of
    bf16 weights, copy-like kernels on the compute stream; added after the recomputation is priced, which runs
    on the backward's gather."""
    fwd_b, bwd_b = fsdp_copy_bytes(lay)
    weights = gathered_bytes / 2
    return fwd_s + kernels.pointwise_s(chip, fwd_b * weights), bwd_s + kernels.pointwise_s(chip, bwd_b * weights)


def expert_nodes_per_token(m: ModelSpec, ep: int, ranks_per_node: int) -> float:
    """Expected number of nodes a token's top_k experts sit on, for an EP group of `ep` ranks,
    `ranks_per_node` of them per node, with balanced routing: k uniform draws over the C nodes it may use
    hit C (1 - (1 - 1/C)^k) distinct ones. C is every node of the group, or with group-limited routing the
    nodes that hold its expert_groups_per_token (M) groups: M x the nodes one group spans, or, where a node
    holds g whole groups, the expected distinct nodes of M groups drawn from G, N (1 - C(G - g, M) / C(G, M))
    for N nodes. DeepSeek-V3 on 8 nodes of 8 ranks: C = 4, 3.6 nodes per token for top-8."""
    nodes = max(1.0, ep / ranks_per_node)
    if m.expert_groups:
        experts_per_node = m.experts / ep * ranks_per_node
        groups, chosen = m.expert_groups, m.expert_groups_per_token
        per_node = experts_per_node * groups / m.experts  # groups a node holds
        if per_node <= 1:
            nodes = min(nodes, chosen / per_node)
        elif per_node == int(per_node) and groups == int(nodes) * int(per_node):
            nodes *= 1.0 - math.comb(groups - int(per_node), chosen) / math.comb(groups, chosen)
        else:  # groups straddling nodes unevenly: at most one node per chosen group
            nodes = min(nodes, float(chosen))
    return nodes * (1.0 - (1.0 - 1.0 / nodes) ** m.top_k)


@dataclass(frozen=True)
class MoeSides:
    """A MoE layer's compute on one chip for one micro-batch, split where the expert-parallel overlap
    splits it (`paired_ep_exposed_s`): the MoE block (the routed and shared experts' GEMMs, their activation
    and the token permutations) and the rest of the layer (attention, the norms, the router: "attention"),
    forward, input gradient and weight gradient."""

    attention_fwd_s: float
    moe_fwd_s: float
    attention_bwd_s: float  # input and weight gradients
    moe_dgrad_s: float
    moe_wgrad_s: float


def moe_sides(chip: Chip, ew: dict[str, float], moe_gemms: list[str], gemm_fwd: dict, gemm_dgrad: dict,
              gemm_wgrad: dict, fwd_s: float, bwd_s: float) -> MoeSides:
    """`fwd_s` and `bwd_s` (the layer's compute) split into its MoE block and the rest (MoeSides)."""
    moe_fwd = sum(gemm_fwd[n] for n in moe_gemms) + kernels.pointwise_s(chip, ew["moe_point_fwd"])
    moe_dgrad = sum(gemm_dgrad[n] for n in moe_gemms) + kernels.pointwise_s(chip, ew["moe_point_bwd"])
    moe_wgrad = sum(gemm_wgrad[n] for n in moe_gemms)
    return MoeSides(max(0.0, fwd_s - moe_fwd), moe_fwd, max(0.0, bwd_s - moe_dgrad - moe_wgrad), moe_dgrad,
                    moe_wgrad)


def paired_ep_exposed_s(fwd_a2a: float, bwd_a2a: float, sides: MoeSides) -> tuple[float, float]:
    """(forward's, backward's) expert all-to-all seconds that show when one micro-batch's forward runs beside
    another's backward (`ep_comm_overlap`): each direction's dispatch and combine, half of its all-to-all
    time each, hide only under the compute the schedule runs beside them. Megatron-Core's
    overlap_moe_expert_parallel_comm ("combined 1F1B") runs, per layer, on its communication and compute
    streams (NVIDIA/Megatron-LM PR 2719's description of the schedule):

        phase 1   combine backward        beside  attention forward (and the router after it)
        phase 2   dispatch forward, then  beside  MoE input gradient, its weight gradient, then MoE forward
                  dispatch backward
        phase 3   combine forward         beside  attention backward

    each phase waiting for the last; DeepSeek-V3's DualPipe pairs the same blocks (DeepSeek-V3 report,
    sec. 3.2.1 and fig. 4). Phases 1 and 3 last their longer stream. Phase 2 has two dependencies across
    its streams: the backward's dispatch sends the MoE input gradient, so it starts once that is done, and
    the MoE forward computes on what the forward's dispatch brings, so it starts once that arrives:

        phase 2 = max(max(dispatch_f, dgrad) + dispatch_b, max(dgrad + wgrad, dispatch_f) + moe_f)

    What a phase lasts beyond its compute shows: phase 1's is the backward's, phase 3's the forward's, and
    phase 2's the forward's as far as its dispatch alone outlasts the MoE input and weight gradients, the rest
    the backward's. Hiding the whole all-to-all under the whole of the other pass's compute instead can hide
    what a phase cannot (a dispatch longer than the block beside it)."""
    dispatch_f = combine_f = fwd_a2a / 2
    dispatch_b = combine_b = bwd_a2a / 2
    dgrad, wgrad, moe_f = sides.moe_dgrad_s, sides.moe_wgrad_s, sides.moe_fwd_s
    phase2 = max(max(dispatch_f, dgrad) + dispatch_b, max(dgrad + wgrad, dispatch_f) + moe_f)
    shown2 = max(0.0, phase2 - (dgrad + wgrad + moe_f))
    fwd2 = min(shown2, max(0.0, dispatch_f - dgrad - wgrad))
    fwd = fwd2 + max(0.0, combine_f - sides.attention_bwd_s)
    bwd = shown2 - fwd2 + max(0.0, combine_b - sides.attention_fwd_s)
    return fwd, bwd


def ring_kv_bytes(m: ModelSpec, lay: Layout) -> float:
    """One step of the CP ring: this chip's K and V shard (kv heads split by TP, whole heads kept)."""
    tokens = lay.micro_batch * m.seq_len / lay.cp
    kv_width = m.heads * m.head_dim_ if m.is_mla else m.kv_heads * m.head_dim_
    return 2 * tokens * kv_width / min(lay.tp, m.kv_heads if not m.is_mla else lay.tp) * ACT_BYTES


def window_skips_keys(m: ModelSpec, lay: Layout) -> bool:
    """Whether the model's sliding windows save attention work under this layout: a flash kernel with a window
    (WINDOWED_KERNELS), no context parallelism (the K/V ring still passes every shard), a window shorter than
    the sequence (_layer_cost says how)."""
    return bool(m.windowed_share) and m.sliding_window < m.seq_len and lay.cp == 1 and lay.attention in WINDOWED_KERNELS


@lru_cache(maxsize=65536)  # the memo `layer_cost` promises: the search asks for the same layers thousands of times
def _layer_cost(m: ModelSpec, lay: Layout, chip: Chip, dtype: str, moe,
                chips_per_node: int) -> LayerCost:
    t, cp = lay.tp, lay.cp
    tokens = lay.micro_batch * m.seq_len / cp  # tokens of one micro-batch on this chip's sequence shard
    h, hd = m.hidden, m.head_dim_
    lp = layer_params(m, moe)
    attn_g, mlp_g = _gemms(m, lay, moe, tokens)
    gemms = attn_g + mlp_g

    # Attention core: per head Q[T, qk] . K^T[qk, S] and P[T, S] . V[S, H] for T local queries
    heads_local = m.heads / t if attn_g else 0.0
    qk_dim = hd + m.rope_head_dim
    score_flops = 2.0 * tokens * m.seq_len * heads_local * (qk_dim + hd)  # full square, forward
    if not attn_g:
        attn_fwd_s = attn_bwd_s = 0.0
    elif lay.attention in kernels.FLASH_KERNELS:
        computed = CAUSAL_FLASH_FRACTION if m.causal else 1.0  # a causal kernel skips the masked half
        attn_fwd_s, attn_bwd_s = kernels.flash_attention_s(chip, score_flops * computed, m.seq_len / cp,
                                                           lay.attention, hd)
        if window_skips_keys(m, lay):
            # a windowed layer's kernel skips every key block outside the band (FlashAttention-2's window_size,
            # from 2.3; cuDNN's and FlashAttention-3's sliding window): each query scores min(position + 1, W)
            # keys. A row of query tiles then visits about W / tile + 1 key tiles, the last one masked, as the
            # rows of a causal sequence of 2W do on average: the band runs at the kernels' rate for 2W tokens
            # (an extrapolation below 512, the benchmarks' shortest). The Triton kernel has no window (it
            # masks through a bias over the whole triangle); under context parallelism the K/V ring still
            # passes every shard; materialised scores are computed over the whole square, then masked: none
            # of them saves anything
            band = window_band(m.sliding_window, m.seq_len)
            keys = min(2 * m.sliding_window, m.seq_len)
            w_fwd, w_bwd = kernels.flash_attention_s(chip, score_flops * band, keys, lay.attention, hd)
            share = m.windowed_share  # the layers' mean: a stage's layers are costed alike
            attn_fwd_s = (1 - share) * attn_fwd_s + share * w_fwd
            attn_bwd_s = (1 - share) * attn_bwd_s + share * w_bwd
    else:
        # two batched GEMMs per head, then per score (bf16), the fused scale-mask-softmax (a row-reduction
        # kernel): forward it reads the scores and writes the probabilities, backward it reads the
        # probabilities and their gradient and writes the scores' (4 and 6 bytes); with a causal mask
        # (Megatron's scaled_upper_triang_masked_softmax) it reads only the lower triangle and writes zeros
        # above it (3 and 4 bytes). In the GPT recipe dropout reads every score and writes it and a mask
        # (5 bytes, pointwise, both ways). Both softmax passes are row-local, one warp per row held in
        # registers (Megatron's scaled_masked_softmax kernels), so the backward runs at the forward's rate, not
        # at a norm backward's (which also reduces its weight gradient across rows): PyTorch's own softmax
        # backward moves its bytes faster than its forward (Liger-Kernel's tables, B200, bf16 rows of 4096 at
        # B x T = 8192: forward 0.104 ms for 4 bytes an element, backward 0.075 ms for 6)
        batch = lay.micro_batch * heads_local
        q_rows = m.seq_len / cp
        qk_g, pv_g = _Gemm("scores", q_rows, qk_dim, m.seq_len, batch), _Gemm("pv", q_rows, m.seq_len, hd, batch)
        scores = tokens * m.seq_len * heads_local
        dropout = kernels.pointwise_s(chip, 5 * scores) if lay.dropout_on(m) else 0.0
        softmax_fwd, softmax_bwd = (3, 4) if m.causal else (4, 6)
        attn_fwd_s = _fwd_s(chip, "bf16", qk_g) + _fwd_s(chip, "bf16", pv_g) \
            + kernels.norm_s(chip, softmax_fwd * scores) + dropout
        attn_bwd_s = (sum(f(chip, "bf16", g) for g in (qk_g, pv_g) for f in (_dgrad_s, _wgrad_s))
                      + kernels.norm_s(chip, softmax_bwd * scores) + dropout)

    ew = _elementwise(m, lay, moe, tokens)
    ew_fwd_s, ew_bwd_s = _memory_bound_s(chip, ew, gemms, dtype, lay.fp8_casts)

    gemm_fwd, gemm_dgrad, gemm_wgrad = _gemm_times(chip, dtype, gemms)
    # the GEMMs whose TP collective is pipelined with them (`_tp_comms`): the column GEMMs read the input
    # gathered, and the row GEMMs' partial sums leave reduce-scattered, region by region
    # (experts that fold the tp ranks into ep have no TP collective: `Layout.experts_folded`)
    experts = () if lay.experts_folded else DISPATCHED
    column = _attention_columns(m, attn_g) + [g for g in ("fc1", *experts[:1]) if g in gemm_fwd]
    row = (["o"] if attn_g else []) + [g for g in ("fc2", *experts[1:]) if g in gemm_fwd]
    if t > 1 and lay.sequence_parallel and lay.tp_comm_overlap:
        gemm_fwd, gemm_dgrad = _chunked_gemm_times(chip, dtype, gemms, [g for g in column if g not in DISPATCHED],
                                                   [g for g in row if g not in DISPATCHED], gemm_fwd, gemm_dgrad, t)
    fwd_s = sum(gemm_fwd.values()) + attn_fwd_s + ew_fwd_s
    wgrad_s = sum(gemm_wgrad.values())
    bwd_s = sum(gemm_dgrad.values()) + wgrad_s + attn_bwd_s + ew_bwd_s

    by_class = (("gemm", sum(gemm_fwd.values()) + sum(gemm_dgrad.values()) + wgrad_s),
                ("attention", attn_fwd_s + attn_bwd_s), ("memory-bound", ew_fwd_s + ew_bwd_s))
    fwd_comms: list[CommOp] = []
    bwd_comms: list[CommOp] = []

    # -- TP ------------------------------------------------------------------------------------------------
    act_bytes = tp_collective_bytes(m, lay)
    if t > 1:
        topo = topology(chip, t, lay.mesh.stride("tp"), chips_per_node)
        # the GEMMs that read a region's input (entered once: q, k, v or gate and up share it) and those
        # whose partial sums leave it
        # the routed experts' own: Megatron-Core's token dispatcher all-gathers the dispatched token copies
        # (T * top_k rows on a rank, balanced routing) over TP before the experts and reduce-scatters their
        # output after (moe/token_dispatcher.py, gather_from_sequence_parallel_region), beside the shared
        # experts' collectives on the layer's T rows
        copies = {**_column_widths(m), **({"experts fc1": m.top_k, "experts fc2": m.top_k} if moe is True else {})}
        f, b = _tp_comms(lay, topo, column, row, gemm_fwd, gemm_dgrad, gemm_wgrad, act_bytes, copies,
                         row_forward_splits(chip, t), tp_gather_share(dtype))
        rope_f, rope_b = _shared_rope_key_comms(m, lay, topo, act_bytes) if attn_g else ([], [])
        fwd_comms += f + rope_f
        bwd_comms += b + rope_b

    # -- CP ring -----------------------------------------------------------------------------------------------
    if cp > 1 and attn_g:
        topo = topology(chip, cp, lay.mesh.stride("cp"), chips_per_node)
        kv_bytes = ring_kv_bytes(m, lay)
        step = comm_s(topo, "p2p", kv_bytes)
        fwd_comms.append(CommOp("cp", "cp k/v ring", "p2p", kv_bytes, (cp - 1) * step,
                                (cp - 1) * max(0.0, step - attn_fwd_s / cp), cp - 1))
        bwd_comms.append(CommOp("cp", "cp k/v + dk/dv ring", "p2p", 2 * kv_bytes, (cp - 1) * 2 * step,
                                (cp - 1) * max(0.0, 2 * step - attn_bwd_s / cp), cp - 1))

    # -- EP ------------------------------------------------------------------------------------------------------
    if moe is True and lay.ep > 1:
        topo = topology(chip, lay.ep, lay.etp, chips_per_node)  # ep's stride: past its etp ranks
        rows_bytes = tokens * m.top_k * h * ACT_BYTES / t
        if lay.ep_dispatch == "deepep":
            # DeepEP sends a token once to each rank that holds any of its experts (is_token_in_rank in its
            # layout kernel, csrc/kernels/legacy), and across nodes once to each node first
            rank_bytes = rows_bytes / m.top_k * expert_nodes_per_token(m, lay.ep, 1)
            if isinstance(topo, Hierarchy):
                node_bytes = rows_bytes / m.top_k * expert_nodes_per_token(m, topo.n, topo.domain_size)
                a2a = 2 * deduplicated_all_to_all_s(topo, rank_bytes, node_bytes)
            else:
                a2a = 2 * comm_s(topo, "all_to_all", rank_bytes)
            rows_bytes = rank_bytes  # what the rank sends
        else:
            a2a = 2 * comm_s(topo, "all_to_all", rows_bytes)
        fwd_shown = bwd_shown = a2a
        if lay.ep_comm_overlap:
            # the router runs with attention (Megatron-Core's post-attention node), the experts in the MoE block
            sides = moe_sides(chip, ew, [g.name for g in mlp_g if g.name != "router"], gemm_fwd, gemm_dgrad,
                              gemm_wgrad, fwd_s, bwd_s)
            fwd_shown, bwd_shown = paired_ep_exposed_s(a2a, a2a, sides)
        fwd_comms.append(CommOp("ep", "ep dispatch + combine", "all_to_all", rows_bytes, a2a, fwd_shown, 2))
        bwd_comms.append(CommOp("ep", "ep dispatch + combine (grad)", "all_to_all", rows_bytes, a2a, bwd_shown, 2))

    # -- ZeRO-3 / FSDP, and what the hidden communication slows ----------------------------------------------
    on_chip = layer_params_on_chip(m, moe, t, lay.ep, lay.etp)
    fwd_s, bwd_s, gathered = _with_zero3_and_slowdown(lay, chip, chips_per_node, on_chip, fwd_s, bwd_s, fwd_comms,
                                                      bwd_comms)

    skipped, skipped_flops = (), 0.0
    if lay.recompute == "full":
        recompute_s, skipped, skipped_flops = full_recompute(chip, m, moe, fwd_s, fwd_comms, gemms, gemm_fwd)
    elif lay.recompute == "selective":
        recompute_s = _selective_recompute_s(chip, lay, moe, gemm_fwd, attn_fwd_s, ew)
    elif lay.recompute == "selective-op":
        recompute_s = _op_sac_recompute_s(m, moe, gemm_fwd, ew_fwd_s)
    elif lay.recompute == "dots":
        # JAX's checkpoint_dots_with_no_batch_dims (planner.flops.dots_saved_matmuls): no weight matmul, hence no
        # TP collective, runs again; the attention core (batched dots or a kernel) and the memory-bound ops do.
        # Charged whole: JAX also drops the last residual add (its output only feeds the next layer), about
        # 0.2 % of MaxText's 32B step; a context-parallel K/V ring that reruns with the attention is not charged
        recompute_s = attn_fwd_s + ew_fwd_s
    else:
        recompute_s = 0.0
    if gathered:
        fwd_s, bwd_s = _plus_fsdp_copies(chip, lay, gathered, fwd_s, bwd_s)

    flops = 2.0 * tokens * (lp.attention + lp.mlp) / t + score_flops * windowed_square(m)
    if moe is True:
        flops += 2.0 * tokens * m.top_k * lp.experts / m.experts / t
    return LayerCost(fwd_s, bwd_s, recompute_s, tuple(fwd_comms), tuple(bwd_comms), flops, act_bytes, wgrad_s,
                     by_class, skipped, skipped_flops, lay.recompute, selective_reruns(lay, moe))


def _selective_recompute_s(chip: Chip, lay: Layout, moe, gemm_fwd: dict[str, float], attn_fwd_s: float,
                           ew: dict[str, float]) -> float:
    """The forward work Megatron-Core's selective recomputation runs again before a layer's backward, by
    module (`lay.recompute_modules`, planner.case.RECOMPUTE_MODULES):
      core_attn       the attention core, whatever kernel computes it (Korthikanti et al. 2022 sec. 5;
                      Megatron-Core runs it through _checkpointed_attention_forward, flash and cuDNN kernels
                      included; the default module)
      mla_up_proj     MLA's q and kv up-projection GEMMs
      layernorm       the pre-norms
      mlp             a dense layer's MLP GEMMs and activation; shared_experts the same in an MoE layer
      moe_act         the routed experts' activation
    The TP collectives of the modules it runs again run again with them (`selective_reruns`, charged with the
    layer's `recompute_comms`). (torchtitan's "selective" is another policy, op-level SAC: every second matmul
    and the memory-bound ops again, the case format's "selective-op".)"""
    mods = lay.recompute_modules
    out = attn_fwd_s if "core_attn" in mods else 0.0
    if "mla_up_proj" in mods:
        out += gemm_fwd.get("q up", 0.0) + gemm_fwd.get("kv up", 0.0)
    if "layernorm" in mods:
        out += kernels.norm_s(chip, ew["norm_fwd"]) + kernels.eager_s(chip, ew.get("eager_norm_fwd", 0.0))
    if ("mlp" in mods and moe is not True) or ("shared_experts" in mods and moe is True):
        out += gemm_fwd.get("fc1", 0.0) + gemm_fwd.get("fc2", 0.0) + kernels.pointwise_s(chip, ew["act_fwd_dense"])
    if "moe_act" in mods:
        out += kernels.pointwise_s(chip, ew["act_fwd_routed"])
    return out


def selective_reruns(lay: Layout, moe) -> tuple[str, ...]:
    """The GEMMs whose TP collectives Megatron-Core's selective recomputation runs again with their modules: MLA's
    up projections (with their gathers of the latents), a dense layer's MLP or an MoE layer's shared experts
    (`_selective_recompute_s`); none for the others (core_attn, layernorm and moe_act lie between collectives)."""
    mods = lay.recompute_modules if lay.recompute == "selective" else ()
    out: tuple[str, ...] = ()
    if "mla_up_proj" in mods:
        out += ("q up", "kv up")
    if ("mlp" in mods and moe is not True) or ("shared_experts" in mods and moe is True):
        out += ("fc1", "fc2")
    return out


def _op_sac_recompute_s(m: ModelSpec, kind, gemm_fwd: dict[str, float], memory_bound_fwd_s: float,
                        extra_fwd_s: float = 0.0) -> float:
    """What torchtitan's op-level selective checkpointing runs again before a layer's backward: every
    second matmul (`flops.op_sac_matmuls`; their share of the layer's weight-matmul FLOPs taken from the
    forward time of its GEMMs, routed experts left out, saved) and every memory-bound op of the forward,
    plus `extra_fwd_s` of other unsaved kernels (a Mamba-2 layer's scan)."""
    share = op_sac_recomputed_params(m, kind) / max(1, sum(i * o for _, i, o, _ in op_sac_matmuls(m, kind)))
    dense_s = sum(v for name, v in gemm_fwd.items() if not name.startswith("experts"))
    return share * dense_s + memory_bound_fwd_s + extra_fwd_s


STATE_BYTES = 4  # SSD states are kept and passed in fp32 (mamba_ssm ssd_combined: states_in_fp32=True)


def ssm_state_bytes(m: ModelSpec, lay: Layout) -> float:
    """One hop of the CP state chain: the final SSM state of this chip's slice, H/t x P x N per sequence."""
    return lay.micro_batch * m.ssm_heads / lay.tp * m.ssm_head_dim * m.ssm_state * STATE_BYTES


def ssm_halo_bytes(m: ModelSpec, lay: Layout) -> float:
    """The causal conv's halo: the previous slice's last (conv - 1) positions of xBC's local channels."""
    channels = (m.ssm_inner + 2 * m.ssm_groups * m.ssm_state) / lay.tp
    return lay.micro_batch * (m.ssm_conv - 1) * channels * ACT_BYTES


def ssm_alltoall_bytes(m: ModelSpec, lay: Layout) -> tuple[float, float]:
    """(in, out) buffers of the CP all-to-alls on one chip: xBC and dt into the scan, y out of it, for
    the chip's T tokens and local channels (hardware.collectives' convention: the local buffer)."""
    tokens = lay.micro_batch * m.seq_len / lay.cp
    xbc_dt = (m.ssm_inner + 2 * m.ssm_groups * m.ssm_state + m.ssm_heads) / lay.tp
    return tokens * xbc_dt * ACT_BYTES, tokens * m.ssm_inner / lay.tp * ACT_BYTES


def _bmm_s(chip: Chip, rows: float, k: float, n: float) -> float:
    """A batched bf16 GEMM whose tiles spread over its batch as well as its rows: the chip fills as for
    one GEMM of batch x M rows (the tile grid is the same), each tile still running K deep."""
    return kernels.matmul_s(chip, "bf16", rows, k, n)


@lru_cache(maxsize=65536)
def _mamba_layer_cost(m: ModelSpec, lay: Layout, chip: Chip, dtype: str, chips_per_node: int) -> LayerCost:
    """One Mamba-2 layer (planner.models), In[T, D] with T = micro_batch * seq_len / cp and t = tp:

        in_proj   In[T, D] . W[D, (2e + 2GN + H) / t]       out_proj  Y[T, e / t] . W[e / t, D]
        conv      depthwise over (e + 2GN) / t channels: memory-bound (read + write, SiLU fused)
        SSD       `flops.ssd_matmuls` as batched GEMMs over the chunks and local heads / groups (the
                  Triton kernels are tensor-core bmms: mamba_ssm `_bmm_chunk_fwd`, `_chunk_state_fwd`,
                  `_chunk_scan_fwd`), against the bytes those kernels move through HBM (roofline: the
                  slower of the two); the backward runs each bmm's two gradient bmms and rebuilds the
                  chunk states once more (mamba_ssm's `_mamba_chunk_scan_combined_bwd`), moving about
                  twice the forward's bytes
        norms     the pre-norm (RMSNorm over D) and the gated RMSNorm over e / t: fwd reads y, z and
                  writes 6e/t bytes per token, bwd reads y, z, dy and writes two gradients, 10e/t

    Communication:
    * TP (Dao & Gu 2024 sec. 8.1): heads and whole groups per rank, so in_proj is column-parallel and
      out_proj row-parallel: one all-reduce forward, one backward, of In[T, D]; with SP the same
      all-gather / reduce-scatter pair as a Transformer block (`_tp_comms`).
    * CP "state": each rank scans its slice from a zero state; the true incoming state then passes
      rank to rank in sequence order, H/t x P x N fp32 per sequence per hop, cp - 1 hops in a chain
      (2 (cp - 1) beside attention layers, whose zig-zag split sends it out and back) that no compute
      can hide (each rank waits for the previous one's state before it can pass on its own); each rank
      then adds C . (decay h_in) to its outputs (one more state-output bmm). The conv
      needs the previous slice's last conv - 1 positions (one hop, all ranks at once). Backward: the
      state gradients chain back the other way, and the halo's gradient returns.
    * CP "alltoall" (Megatron-Core's Mamba context parallel; Ulysses-style, Jacobs et al. 2023):
      xBC and dt go from sequence-sharded to head-sharded before the conv and the scan, y comes back
      after; two all-to-alls forward and two backward, on the critical path.
    * ZeRO-3 as for any layer (`_zero3_comms`)."""
    t, cp, b = lay.tp, lay.cp, lay.micro_batch
    tokens = b * m.seq_len / cp
    h, e, g, n, p = m.hidden, m.ssm_inner, m.ssm_groups, m.ssm_state, m.ssm_head_dim
    alltoall = cp > 1 and lay.ssm_cp == "alltoall"
    gemms = [_Gemm("in_proj", tokens, h, (2 * e + 2 * g * n + m.ssm_heads) / t), _Gemm("out_proj", tokens, e / t, h)]
    gemm_fwd, gemm_dgrad, gemm_wgrad = _gemm_times(chip, dtype, gemms)
    if t > 1 and lay.sequence_parallel and lay.tp_comm_overlap:  # Megatron-Core's mixer: TE's fc1 / fc2 overlap
        gemm_fwd, gemm_dgrad = _chunked_gemm_times(chip, dtype, gemms, ["in_proj"], ["out_proj"], gemm_fwd,
                                                   gemm_dgrad, t)

    # the scan: the state variant runs the local slice with H/t heads; the all-to-all one the whole
    # sequence with H/(t cp) heads (the same work)
    seq = m.seq_len if alltoall else m.seq_len / cp
    split = t * cp if alltoall else t
    q = ssd_chunk(m, int(seq))
    chunks = b * seq / q
    heads, groups = m.ssm_heads / split, g / split
    count = {"head": heads, "group": groups}
    bmms = [_Gemm(mm.name, mm.rows, mm.inner, mm.cols, chunks * count[mm.per]) for mm in ssd_matmuls(m, int(seq))]
    if cp > 1 and not alltoall:
        bmms.append(_Gemm("cp state correction C.h_in", q, n, p, chunks * heads))
    # HBM bytes of the forward kernels: x, B, C, dt read by both the chunk-state and the chunk-scan
    # kernel, y written; C.B^T written and read back; the fp32 chunk states written, read and rewritten
    # by the state passing, read by the scan
    scan_tokens = b * seq
    scan_bytes = (ACT_BYTES * scan_tokens * (2 * (p * heads + 2 * n * groups + heads) + p * heads)
                  + 2 * ACT_BYTES * chunks * groups * q * q + 4 * STATE_BYTES * chunks * heads * p * n)
    scan_fwd_s = max(sum(_bmm_s(chip, x.batch * x.m, x.k, x.n) for x in bmms), kernels.pointwise_s(chip, scan_bytes))
    grads = sum(_bmm_s(chip, x.batch * x.m, x.n, x.k) + _bmm_s(chip, x.batch * x.k, x.m, x.n) for x in bmms)
    rebuild = _bmm_s(chip, bmms[2].batch * bmms[2].m, bmms[2].k, bmms[2].n)  # the chunk states, recomputed
    scan_bwd_s = max(grads + rebuild, kernels.pointwise_s(chip, 2 * scan_bytes))

    sp = t if lay.sequence_parallel else 1
    conv_channels = (e + 2 * g * n) / t
    ew = {"norm_fwd": tokens * (NORM_FWD_BYTES * h / sp + 6 * e / t),
          "norm_bwd": tokens * (NORM_BWD_BYTES * h / sp + 10 * e / t),
          "point_fwd": tokens * (6 * h / sp + 4 * conv_channels),  # residual add; conv read + write
          "point_bwd": tokens * (6 * h / sp + 6 * conv_channels)}  # conv: read x and dy, write dx
    ew_fwd_s, ew_bwd_s = _memory_bound_s(chip, ew, gemms, dtype, lay.fp8_casts)

    fwd_s = sum(gemm_fwd.values()) + scan_fwd_s + ew_fwd_s
    wgrad_s = sum(gemm_wgrad.values())
    bwd_s = sum(gemm_dgrad.values()) + wgrad_s + scan_bwd_s + ew_bwd_s
    by_class = (("gemm", sum(gemm_fwd.values()) + sum(gemm_dgrad.values()) + wgrad_s),
                ("ssm scan", scan_fwd_s + scan_bwd_s), ("memory-bound", ew_fwd_s + ew_bwd_s))

    fwd_comms: list[CommOp] = []
    bwd_comms: list[CommOp] = []
    act_bytes = tp_collective_bytes(m, lay)
    if t > 1:
        topo = topology(chip, t, lay.mesh.stride("tp"), chips_per_node)
        f, bw = _tp_comms(lay, topo, ["in_proj"], ["out_proj"], gemm_fwd, gemm_dgrad, gemm_wgrad, act_bytes,
                          rs_splits=row_forward_splits(chip, t),
                          gather_share=tp_gather_share(dtype))
        fwd_comms += f
        bwd_comms += bw
    if cp > 1:
        topo = topology(chip, cp, lay.mesh.stride("cp"), chips_per_node)
        if alltoall:
            into, out = ssm_alltoall_bytes(m, lay)
            a_in, a_out = comm_s(topo, "all_to_all", into), comm_s(topo, "all_to_all", out)
            fwd_comms += [CommOp("cp", "cp all-to-all xBC, dt (sequence -> heads)", "all_to_all", into, a_in, a_in),
                          CommOp("cp", "cp all-to-all y (heads -> sequence)", "all_to_all", out, a_out, a_out)]
            bwd_comms += [CommOp("cp", "cp all-to-all dy (sequence -> heads)", "all_to_all", out, a_out, a_out),
                          CommOp("cp", "cp all-to-all dxBC, ddt (heads -> sequence)", "all_to_all", into, a_in,
                                 a_in)]
        else:
            hop_bytes, halo_bytes = ssm_state_bytes(m, lay), ssm_halo_bytes(m, lay)
            # beside attention the slices are zig-zagged: the chain goes out to the last rank and back
            zigzag = m.attention_layers > 0
            hops, sends = cp_chain_hops(cp, zigzag), cp_chain_sends(cp, zigzag)
            chain = hops * comm_s(topo, "p2p", hop_bytes)
            halo = comm_s(topo, "p2p", halo_bytes)  # a rank's halos go to different peers, side by side
            fwd_comms += [CommOp("cp", "cp conv halo", "p2p", halo_bytes, halo, halo, sends=sends),
                          CommOp("cp", "cp ssm state chain", "p2p", hop_bytes, chain, chain, hops, sends=sends)]
            bwd_comms += [CommOp("cp", "cp ssm state-gradient chain", "p2p", hop_bytes, chain, chain, hops,
                                 sends=sends),
                          CommOp("cp", "cp conv halo (grad)", "p2p", halo_bytes, halo, halo, sends=sends)]
    fwd_s, bwd_s, gathered = _with_zero3_and_slowdown(lay, chip, chips_per_node,
                                                      layer_params_on_chip(m, MAMBA, t, 1, lay.etp), fwd_s, bwd_s,
                                                      fwd_comms, bwd_comms)
    # "selective" recomputes the core attention (Megatron-Core's core_attn, _layer_cost): a Mamba layer has none;
    # "selective-op" its out_proj, the scan (custom kernels, not saved) and the memory-bound ops
    skipped, skipped_flops = (), 0.0
    if lay.recompute == "full":
        recompute_s, skipped, skipped_flops = full_recompute(chip, m, MAMBA, fwd_s, fwd_comms, gemms, gemm_fwd)
    elif lay.recompute == "selective-op":
        recompute_s = _op_sac_recompute_s(m, MAMBA, gemm_fwd, ew_fwd_s, scan_fwd_s)
    else:
        recompute_s = 0.0
    if gathered:
        fwd_s, bwd_s = _plus_fsdp_copies(chip, lay, gathered, fwd_s, bwd_s)
    flops = tokens * layer_forward_flops_per_token(m, MAMBA) / t
    return LayerCost(fwd_s, bwd_s, recompute_s, tuple(fwd_comms), tuple(bwd_comms), flops, act_bytes, wgrad_s,
                     by_class, skipped, skipped_flops, lay.recompute)


def logits_cost(m: ModelSpec, lay: Layout, chip: Chip, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of the output projection and the cross-entropy on the last stage
    (`logits_by_class`, summed)."""
    parts = logits_by_class(m, lay, chip, dtype).values()
    return sum(f for f, _ in parts), sum(b for _, b in parts)


def logits_by_class(m: ModelSpec, lay: Layout, chip: Chip, dtype: str) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds of the output projection ("gemm") and the cross-entropy ("memory-bound")
    on the last stage.

    In[T, D] . W[D, V/t], then the loss over the T x V/t logits (`lay.cross_entropy`, planner.case's
    CROSS_ENTROPY):
      fp32   Megatron-Core's vocab_parallel_cross_entropy (tensor_parallel/cross_entropy.py), kernel by
             kernel over the logits: forward the fp32 upcast (read 2, write 4), the row max (read 4), the max
             subtracted in place (read 4, write 4), exp in place (4 + 4), the row sum (4), the division into the
             softmax kept for the backward (4 + 4): FP32_CE_BYTES[0] = 38; backward the softmax times the
             loss gradient in place (4 + 4) and the cast back to bf16 (4 + 2): FP32_CE_BYTES[1] = 14. Each
             pass streams whole rows at the copy rate. torchtitan's cross_entropy(pred.float()) costs the
             same in all: PyTorch's fp32 cross-entropy measures 20.1 bytes per logit at peak bandwidth forward
             and 24.4 backward (hardware.kernels.EAGER_BYTES); with its two casts (6 bytes each at the copy
             rate) that is 58.2 bytes at peak on an H100 (copy rate 0.876 of peak), and these 52 at the copy rate
             are 59.4; on an A100 (0.81) 59.3 and 64.2.
      fused  flash-attention's csrc/xentropy kernels: the forward reads each bf16 logit twice (the row's
             max, then its sum of exponentials) and writes one loss and one log-sum-exp per token, a row
             reduction; the backward reads each logit once and writes its gradient, a pointwise pass:
             4 + 4 bytes per logit.
    Then `lay.logit_metrics` cross-entropies for the trainer's logged metrics (planner.case's RECIPE_DEFAULTS),
    each torch.nn.CrossEntropyLoss on the bf16 logits under autocast: the upcast to fp32 (read 2, write 4 at
    the copy rate) and PyTorch's fp32 cross-entropy forward as measured (EAGER_BYTES "ce_fwd"); Composer runs
    them after the micro-batch's backward, so they are charged there.
    """
    tokens = lay.micro_batch * m.seq_len / lay.cp
    g = _logits_gemm(m, lay)
    logits = tokens * m.vocab / lay.tp
    if lay.cross_entropy == "fused":
        fwd_ce_s = kernels.norm_s(chip, 2 * ACT_BYTES * logits)
        bwd_ce_s = kernels.pointwise_s(chip, 2 * ACT_BYTES * logits)
    else:
        fwd_ce_s, bwd_ce_s = (kernels.pointwise_s(chip, b * logits) for b in FP32_CE_BYTES)
    if lay.logit_metrics:
        bwd_ce_s += lay.logit_metrics * (kernels.pointwise_s(chip, (ACT_BYTES + 4) * logits)
                                         + kernels.eager_s(chip, kernels.EAGER_BYTES["ce_fwd"] * logits))
    return {"gemm": (_fwd_s(chip, dtype, g), _dgrad_s(chip, dtype, g) + _wgrad_s(chip, dtype, g)),
            "memory-bound": (fwd_ce_s, bwd_ce_s)}


def zero3_root_comms(m: ModelSpec, lay: Layout, chip: Chip, chips_per_node: int
                     ) -> tuple[tuple[CommOp, ...], tuple[CommOp, ...]]:
    """Per-layer ZeRO-3's collectives of the parameters outside the layers (`flops.root_params`: the
    embedding, the head, the final norm), one micro-batch, (forward, backward): gathered before the
    embedding lookup, with no compute before it to hide under, and reduce-scattered after the lookup's
    backward, the micro-batch's last, so both show whole. torchtitan wrapped them in the root unit
    (fully_shard(model) after its blocks), which FSDP keeps gathered from the lookup through the head
    (a root's reshard_after_forward does not apply); Composer's FSDP1 root and DeepSpeed's ZeRO-3 module
    hooks gather and reduce them at the same two points. torchtitan since 83e694105 (2025-07-28) gives the
    embedding and [norm, output] units of their own, so the head's reduce-scatter runs first in the backward
    and can hide: this charges the older root, which the held-out torchtitan runs used, and is up to
    twice what a current torchtitan shows for an untied head."""
    topo = data_topology(chip, lay, chips_per_node)
    params = root_params(m, lay.tp)
    ag, rs = comm_s(topo, "all_gather", 2 * params), comm_s(topo, "reduce_scatter", params * lay.grad_bytes)
    return ((CommOp("dp", "zero-3 all-gather (embedding, head)", "all_gather", 2 * params, ag, ag),),
            (CommOp("dp", "zero-3 reduce-scatter (embedding, head)", "reduce_scatter", params * lay.grad_bytes,
                    rs, rs),))


def _logits_gemm(m: ModelSpec, lay: Layout) -> _Gemm:
    """The output projection of one micro-batch on one chip: In[T, D] . W[D, V/t]."""
    return _Gemm("logits", lay.micro_batch * m.seq_len / lay.cp, m.hidden, m.vocab / lay.tp)


def vocab_parallel_comms(m: ModelSpec, lay: Layout, chip: Chip, dtype: str, chips_per_node: int
                         ) -> dict[str, tuple[tuple[CommOp, ...], tuple[CommOp, ...]]]:
    """TP's collectives around the vocabulary-parallel embedding and output head, one micro-batch:
    {"embedding": (forward, backward), "head": (forward, backward)}; empty without TP. Megatron-Core shards
    both over the vocabulary (VocabParallelEmbedding and the ColumnParallelLinear output layer,
    tensor_parallel/layers.py), as torchtitan's TP plan does:
      embedding  each rank looks up the rows of its vocabulary shard and the partial activations are summed:
                 an all-reduce forward, or with SP a reduce-scatter forward and an all-gather of its gradient
                 backward; but with learned absolute positions (the gpt layer style), which are added to the
                 whole sum, the all-reduce and then the scatter to the sequence shards, whose backward
                 all-gathers (LanguageModelEmbedding.reduce_scatter_embeddings, models/common/embeddings/
                 language_model_embedding.py); no GEMM to hide any of them under
      head       a column-parallel GEMM In[T, D] . W[D, V/t] (`_tp_comms`): without SP its input gradient is
                 all-reduced under the weight-gradient GEMM (`tp_grad_allreduce_overlap`) or after it; with SP
                 its input is all-gathered forward (and again under the backward's dgrad GEMM) and its input
                 gradient reduce-scattered under the wgrad GEMM. On GPUs never pipelined with the GEMM:
                 Megatron-Core's output layer is not a Transformer Engine module (tp_comm_buffer_name "Not
                 used"), so userbuffers leave it out; on TPUs as the layers' (`tp_overlaps`: XLA's collective
                 matmul does not tell the output projection apart)
      the loss   the vocabulary-parallel cross-entropy's reductions over the tp ranks, forward, each waited
                 for: `lay.cross_entropy` "fp32" (vocab_parallel_cross_entropy, tensor_parallel/
                 cross_entropy.py) all-reduces the row max, the target logit and the sum of exponentials, 4
                 bytes a token each; "fused" (Transformer Engine's triton cross_entropy, Megatron-Bridge's
                 cross_entropy_fusion_impl "te") all-gathers 3 floats a token
    """
    t = lay.tp
    if t == 1:
        return {}
    topo = topology(chip, t, lay.mesh.stride("tp"), chips_per_node)
    tokens = lay.micro_batch * m.seq_len / lay.cp
    act_bytes = tp_collective_bytes(m, lay)
    plain = replace(lay, tp_comm_overlap=chip.kind == "tpu" and tp_overlaps(lay, chip, m))
    zero = {"embedding": 0.0}
    positions_after_sum = m.gpt_style and lay.sequence_parallel
    embed_lay = replace(plain, tp_comm_overlap=False, sequence_parallel=lay.sequence_parallel and not m.gpt_style)
    embed = _tp_comms(embed_lay, topo, [], ["embedding"], zero, zero, zero, act_bytes)
    if positions_after_sum:  # the scatter to the sequence shards is local; its backward all-gathers
        ag = comm_s(topo, "all_gather", act_bytes)
        embed[1].append(CommOp("tp", "tp all-gather (embedding grad)", "all_gather", act_bytes, ag, ag,
                               gemm="embedding"))
    g = _logits_gemm(m, lay)
    f, b = _tp_comms(plain, topo, ["logits"], [], {"logits": _fwd_s(chip, dtype, g)},
                     {"logits": _dgrad_s(chip, dtype, g)}, {"logits": _wgrad_s(chip, dtype, g)}, act_bytes)
    if lay.cross_entropy == "fused":
        stats = 12 * tokens * t  # the gathered array: 3 fp32 a token from each rank
        gather = comm_s(topo, "all_gather", stats)
        loss = [CommOp("tp", "tp all-gather (loss statistics)", "all_gather", stats, gather, gather)]
    else:
        one = comm_s(topo, "all_reduce", 4 * tokens)
        loss = [CommOp("tp", f"tp all-reduce (loss {what})", "all_reduce", 4 * tokens, one, one)
                for what in ("max", "target logit", "sum of exponentials")]
    return {"embedding": (tuple(embed[0]), tuple(embed[1])), "head": (tuple(f + loss), tuple(b))}


def mtp_extra_cost(m: ModelSpec, lay: Layout, chip: Chip, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of one multi-token prediction module's own ops, beside its layer (costed as
    a layer of the model's last kind) and its pass through the output head (`logits_cost`): the next tokens'
    embedding, RMSNorms of the hidden state and of that embedding, their concatenation, the projection
    In[T, 2D] . W[2D, D/t] (DeepSeek-V3 sec. 2.2, Megatron-Core's column-parallel eh_proj; the TP
    collective beside it is left out) and the module's final RMSNorm."""
    tokens = lay.micro_batch * m.seq_len / lay.cp
    sp = lay.tp if lay.sequence_parallel else 1
    g = _Gemm("mtp proj", tokens, 2 * m.hidden, m.hidden / lay.tp)
    norm_fwd, norm_bwd = (3 * b * m.hidden / sp * tokens for b in (NORM_FWD_BYTES, NORM_BWD_BYTES))
    concat = 2 * 2 * m.hidden * ACT_BYTES / sp * tokens  # read and write both halves
    embed = embedding_s(m, lay, chip)
    fwd = _fwd_s(chip, dtype, g) + kernels.norm_s(chip, norm_fwd) + kernels.pointwise_s(chip, concat) + embed
    bwd = (_dgrad_s(chip, dtype, g) + _wgrad_s(chip, dtype, g) + kernels.norm_s(chip, norm_bwd, backward=True)
           + kernels.pointwise_s(chip, concat) + embed)
    return fwd, bwd


def embedding_s(m: ModelSpec, lay: Layout, chip: Chip) -> float:
    """The embedding lookup (read the rows, write the activations), forward; the backward's scatter-add
    moves as much."""
    tokens = lay.micro_batch * m.seq_len / lay.cp
    return kernels.pointwise_s(chip, 2 * ACT_BYTES * tokens * m.hidden / (lay.tp if lay.sequence_parallel else 1))


def optimizer_step_s(dense_params: float, expert_params: float, lay: Layout, chip: Chip, optimizer: str) -> float:
    """The optimizer update is memory-bound: `OPTIMIZER_STEP_BYTES` per locally updated parameter
    (a multi-tensor fused Adam reaches the copy bandwidth: PyTorch PR 119842's times, fused Adam 3.578 ms on a
    1/128 shard of Llama-2-70B on a 500 W H100, come to ~89 % of it by this byte count), or with
    `optimizer_fused` false Adam's elementwise ops one by one (`UNFUSED_ADAM_BYTES`); without master weights
    (`master_weights` false) over bf16 tensors (`BF16_OPTIMIZER_STEP_BYTES`)."""
    if lay.zero_stage >= 1:  # each shards over its data-parallel group (an expert's: Layout.expert_dp)
        local = dense_params / (lay.dp * lay.cp) + expert_params / lay.expert_dp
    else:
        local = dense_params + expert_params
    unfused = optimizer == "adam" and not lay.optimizer_fused
    if lay.master_weights:
        per_param = UNFUSED_ADAM_BYTES if unfused else OPTIMIZER_STEP_BYTES[optimizer]
    else:  # the same passes over bf16 tensors: half the bytes of the fp32 loop
        per_param = UNFUSED_ADAM_BYTES / 2 if unfused else BF16_OPTIMIZER_STEP_BYTES[optimizer]
    return kernels.pointwise_s(chip, local * per_param)
