"""What one layer costs on one chip, for one micro-batch: compute, memory-bound ops and collectives.

Everything here is a pure function of the model, the layout and the chip. Times use `hardware/`
(peak FLOP/s and HBM bandwidth from `hardware.chips`, collective times from
`hardware.collectives.group_topology`) and two planner-side curves, global per chip kind (GPU, TPU),
never tuned per case:

* matmul efficiency by shape. `chip.matmul_efficiency` is what a large, well-shaped matmul reaches;
  each dimension d of `In[M, K] . W[K, N]` multiplies it by d / (d + d_half): a dimension much larger
  than d_half fills the matrix units, one near d_half leaves them half idle (tile and wave
  quantisation: NVIDIA, "Matrix Multiplication Background" guide, sec. "Dimension Quantization Effects";
  on TPUs the 128x128 MXU is the tile, [SB] Part 2). d_half = 128 on GPUs (cuBLAS's large-GEMM CTA
  tiles are 128 or 256 wide) and on TPUs (the MXU edge).
* link efficiency by message size: a collective of V bytes reaches `chip.link_efficiency` x
  V / (V + v_half) of the link (NCCL's bus bandwidth climbs towards its plateau over a few MB:
  nccl-tests PERFORMANCE.md curves; the alpha term of `hardware.collectives` covers only the latency).
  v_half = 1 MB on GPUs, 256 kB on TPUs (estimates).

Memory-bound ("elementwise") ops are counted as bytes moved through HBM per layer, from the op list of
the layer recipe (see `elementwise_bytes`), at `chip.hbm_bw(achievable=True)` times
ELEMENTWISE_EFFICIENCY (kernels with reductions, RNG and masks run below a plain copy).

Calibration. d_half (GPU), ELEMENTWISE_EFFICIENCY and BWD_ELEMENTWISE_RATIO were chosen once, as three
global numbers for every chip, from a small grid (d_half 64/96/128, elementwise 0.6-1.0, backward
ratio 2-3) against the 18 published A100 runs (bench/bench_planner.py prints the table); nothing is
set per case. The residual pattern is an era effect the model does not try to capture: Megatron-LM's
2021 pipelined runs (Narayanan et al.) come out 4-8 % fast, its 2022 runs (Korthikanti et al.) and
the 2021 single-stage runs 0-6 % slow.

Layer recipes. A GELU model is run the way Megatron-LM ran GPT in 2021-22 (Narayanan et al. 2021,
Korthikanti et al. 2022): LayerNorm, biases, dropout, fused bias-GELU, and attention scores
materialised (fused scale-mask-softmax + dropout). A SwiGLU model is run the Llama way: RMSNorm, no
biases or dropout, RoPE, and FlashAttention (Dao 2023). `training.attention` overrides the kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from hardware.chips import Chip
from hardware.collectives import Topology, group_topology
from planner.case import Layout
from planner.flops import layer_params
from planner.models import ModelSpec

D_HALF = {"gpu": 128, "tpu": 128, "cpu": 16}  # matmul dimension at half efficiency (estimate)
V_HALF_BYTES = {"gpu": 1e6, "tpu": 256e3, "cpu": 64e3}  # message size at half link efficiency (estimate)
FLASH_BWD_RATIO = 2.5  # FlashAttention backward does 5 matmuls to the forward's 2 (Dao 2023, sec. 3.1)
CAUSAL_FLASH_FRACTION = 0.5  # a causal flash kernel skips the masked upper triangle (Dao 2023, sec. 3.1)
ELEMENTWISE_EFFICIENCY = 0.8  # fused norm/softmax/dropout kernels reach ~0.8 of a plain copy's bandwidth
BWD_ELEMENTWISE_RATIO = 2.0  # a backward elementwise op reads the saved input and the output gradient
                              # and writes the input gradient: ~2x the forward's traffic (estimate)
OPTIMIZER_STEP_BYTES = {"adam": 30, "sgd": 20}  # Adam reads fp32 master, m, v, grad; writes master, m,
                                                 # v and the bf16 copy: 4*3+2 + 4*3+2 ~ 30 bytes/param


def default_attention(m: ModelSpec) -> str:
    """The attention kernel of the model's recipe (module docstring)."""
    return "materialized" if m.mlp == "gelu" else "flash"


def overlaps_grad_reduce(m: ModelSpec) -> bool:
    """Whether the recipe hides the data-parallel gradient reduction under the backward.

    Megatron-LM 2021-22 (the GPT recipe) all-reduced gradients after the last backward ("local" DDP);
    bucketed overlap (PyTorch DDP, Li et al. 2020; Megatron-Core overlap_grad_reduce) is the modern
    default of the Llama recipe.
    """
    return m.mlp != "gelu"


def matmul_s(chip: Chip, dtype: str, M: float, K: float, N: float) -> float:
    """Roofline time of `In[M, K] . W[K, N]` with the size-dependent efficiency (module docstring)."""
    d_half = D_HALF[chip.kind]
    size = (M / (M + d_half)) * (K / (K + d_half)) * (N / (N + d_half))
    flops = 2.0 * M * K * N
    compute_s = flops / (chip.peak_flops_per_s(dtype, achievable=True) * size)
    memory_s = 2.0 * (M * K + K * N + M * N) / chip.hbm_bw(achievable=True)  # [SB] Part 1 roofline
    return max(compute_s, memory_s)


def comm_s(topo: Topology, chip: Chip, kind: str, nbytes: float) -> float:
    """A collective's time on `topo` with the message-size efficiency curve applied."""
    if nbytes <= 0 or topo.n == 1:
        return 0.0
    return topo.cost_s(kind, nbytes) * (nbytes + V_HALF_BYTES[chip.kind]) / nbytes


def tpu_slice_shape(chip: Chip, num_chips: int) -> tuple[int, ...]:
    """The torus a TPU job of `num_chips` runs on: the whole pod when it needs it, else the most
    cube-like slice with axes that are multiples of 4 (2 for tiny slices) inside the pod, as Cloud TPU
    slice shapes go (v5p: 4x4x4 = 64 chips, 4x4x8, 4x8x8, 8x8x8, ... 16x20x28)."""
    pod = tuple(chip.torus_shape)
    if num_chips >= math.prod(pod):
        return pod
    step = 4 if num_chips >= 4 ** len(pod) else 2 if num_chips >= 2 ** len(pod) else 1
    best = None
    for shape in _factorisations(num_chips, len(pod)):
        if all(a % step == 0 for a in shape) and all(a <= b for a, b in zip(sorted(shape), sorted(pod))):
            if best is None or sorted(shape, reverse=True) < sorted(best, reverse=True):
                best = shape
    return best or pod


def _factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in _factorisations(n // d, k - 1)
            if d <= rest[0]]


@lru_cache(maxsize=256)
def cluster_chip(chip: Chip, num_chips: int, chips_per_node: int | None) -> Chip:
    """The chip as this cluster wires it: a GPU node of `chips_per_node`, a TPU slice of `num_chips`."""
    if chip.kind == "tpu":
        shape = tpu_slice_shape(chip, num_chips)
        return replace(chip, torus_shape=shape, scaleup_domain=math.prod(shape))
    if chips_per_node and chips_per_node != chip.scaleup_domain:
        return replace(chip, scaleup_domain=chips_per_node)
    return chip


@lru_cache(maxsize=4096)
def topology(chip: Chip, n: int, stride: int, chips_per_node: int) -> Topology:
    """The group's topology; a case's `chips_per_node` overrides the chip's scale-up domain."""
    if chips_per_node != chip.scaleup_domain and chip.kind == "gpu":
        chip = replace(chip, scaleup_domain=chips_per_node)
    return group_topology(chip, n, stride, achievable=True)


@dataclass(frozen=True)
class LayerCost:
    """Seconds one chip spends on one layer for one micro-batch, by kind, and the FLOPs behind them."""

    fwd_compute_s: float  # matmuls + attention + memory-bound ops of the forward
    bwd_compute_s: float  # the backward (no recomputation)
    recompute_s: float  # forward work repeated before the backward (selective or full)
    tp_fwd_s: float  # exposed TP/SP collectives in the forward (and in a full recompute, again)
    tp_bwd_s: float
    cp_fwd_s: float  # exposed part of the context-parallel K/V ring
    cp_bwd_s: float
    ep_fwd_s: float  # expert-parallel all-to-all (dispatch + combine)
    ep_bwd_s: float
    zero3_fwd_s: float  # exposed part of ZeRO-3 parameter all-gathers (prefetched under compute)
    zero3_bwd_s: float
    fwd_flops: float
    tp_bytes: float  # bytes one TP collective moves (full array)
    wgrad_s: float  # the weight-gradient matmuls inside bwd_compute_s (what ZB-H1 defers)


def elementwise_bytes(m: ModelSpec, lay: Layout, moe: bool, sb: float) -> tuple[float, float]:
    """HBM bytes of the forward's memory-bound ops on one chip: (outside attention, attention scores).

    GPT recipe (per token, bytes; h hidden, f ffn, a heads, t tp; SP divides the first group by t):
      2 LayerNorms: read + write 2h each -> 8h; 2 fused bias-dropout-adds: read 2h + 2h, write 2h + 1h
      mask -> 14h; fused bias-GELU over f/t: read + write -> 4f/t;
      scores (per token, a/t heads x s keys): fused scale-mask-softmax read + write 4, dropout read 2,
      write 2 + 1 mask -> 9 a s / t.
    Llama recipe: 2 RMSNorms 8h, 2 residual adds (read 4h, write 2h) 12h, RoPE on Q and K
      (read + write) 4(a + kv)d/t, SwiGLU (read gate and up, write product) 6f/t; no score traffic.
    """
    t = lay.tp
    sp = t if lay.sequence_parallel else 1
    ffn = m.ffn if moe else m.dense_ffn_
    ffn_tokens = (m.top_k + m.shared_experts) if moe else 1
    if m.mlp == "gelu":
        outside = sb * (22 * m.hidden / sp + 4 * ffn * ffn_tokens / t)
    else:
        outside = sb * (20 * m.hidden / sp + 4 * (m.heads + m.kv_heads) * m.head_dim_ / t
                        + 6 * ffn * ffn_tokens / t)
    scores = 9 * sb * m.heads * m.seq_len / t if lay.attention == "materialized" else 0.0
    return outside, scores


def layer_cost(m: ModelSpec, lay: Layout, chip: Chip, dtype: str, moe: bool,
               chips_per_node: int) -> LayerCost:
    """One layer's costs; memoised on the layout fields a layer sees (layouts differing only in pp,
    schedule or ZeRO-0/1/2 share them, which keeps the search fast)."""
    z3 = lay.zero_stage == 3
    return _layer_cost_cached(m, lay.tp, lay.cp, lay.ep, lay.micro_batch, lay.sequence_parallel,
                              lay.attention, lay.recompute, z3, lay.dp if z3 else 1, chip, dtype, moe,
                              chips_per_node)


@lru_cache(maxsize=65536)
def _layer_cost_cached(m: ModelSpec, tp: int, cp: int, ep: int, micro_batch: int, sp: bool, attention: str,
                       recompute: str, z3: bool, dp: int, chip: Chip, dtype: str, moe: bool,
                       chips_per_node: int) -> LayerCost:
    lay = Layout(dp=dp, tp=tp, pp=1, cp=cp, ep=ep, micro_batch=micro_batch, zero_stage=3 if z3 else 0,
                 recompute=recompute, sequence_parallel=sp, attention=attention)
    return _layer_cost(m, lay, chip, dtype, moe, chips_per_node)


def _layer_cost(m: ModelSpec, lay: Layout, chip: Chip, dtype: str, moe: bool,
                chips_per_node: int) -> LayerCost:
    t, cp = lay.tp, lay.cp
    tokens = lay.micro_batch * m.seq_len / cp  # tokens of one micro-batch on this chip's sequence shard
    h, hd = m.hidden, m.head_dim_
    lp = layer_params(m, moe)
    hbm = chip.hbm_bw(achievable=True) * ELEMENTWISE_EFFICIENCY

    def mm(M, K, N):
        return matmul_s(chip, dtype, M, K, N)

    # Attention projections: In[T, D] . W_qkv[D, (N+2K)H / t] and O[T, NH / t] . W_o[NH / t, D]
    if m.is_mla:
        qk = hd + m.rope_head_dim
        proj_s = (mm(tokens, h, m.q_lora_rank) + mm(tokens, m.q_lora_rank, m.heads * qk / t)
                  if m.q_lora_rank else mm(tokens, h, m.heads * qk / t))
        proj_s += mm(tokens, h, m.kv_lora_rank + m.rope_head_dim) \
            + mm(tokens, m.kv_lora_rank, 2 * m.heads * hd / t) + mm(tokens, m.heads * hd / t, h)
        kv_width = m.heads * hd  # MLA expands the latent to full heads before attention
    else:
        proj_s = mm(tokens, h, (m.heads + 2 * m.kv_heads) * hd / t) + mm(tokens, m.heads * hd / t, h)
        kv_width = m.kv_heads * hd
    qk_dim = hd + m.rope_head_dim
    # Scores: per head, Q[T, H] . K^T[H, S] and P[T, S] . V[S, H] (Narayanan et al. 2021 eq. 3 counts
    # the full S x S); a causal flash kernel skips the masked half.
    heads_local = m.heads / t
    per_head_s = mm(tokens, qk_dim, m.seq_len) + mm(tokens, m.seq_len, hd)
    outside_bytes, score_bytes = elementwise_bytes(m, lay, moe, tokens)
    if lay.attention == "flash":
        attn_s = heads_local * per_head_s * CAUSAL_FLASH_FRACTION
        attn_bwd_s = attn_s * FLASH_BWD_RATIO
    else:
        attn_s = heads_local * per_head_s + score_bytes / hbm
        attn_bwd_s = 2 * heads_local * per_head_s + BWD_ELEMENTWISE_RATIO * score_bytes / hbm

    # MLP: dense or shared experts In[T, D] . W_in[D, kF / t] . W_out[F / t, D]; routed experts get
    # T * top_k token copies spread over E / ep local experts (balanced routing).
    n_in = 2 if m.mlp == "swiglu" else 1
    ffn = m.ffn if moe else m.dense_ffn_
    mlp_s = 0.0
    dense_mats = (m.shared_experts if moe else 1)
    if dense_mats:
        mlp_s += dense_mats * (mm(tokens, h, n_in * ffn / t) + mm(tokens, ffn / t, h))
    if moe:
        local_experts = m.experts / lay.ep
        per_expert_tokens = max(1.0, tokens * m.top_k * lay.ep / m.experts)
        mlp_s += local_experts * (mm(per_expert_tokens, h, n_in * ffn / t)
                                  + mm(per_expert_tokens, ffn / t, h))
        mlp_s += mm(tokens, h, m.experts)  # router

    fwd_matmul_s = proj_s + mlp_s
    fwd_s = fwd_matmul_s + attn_s + outside_bytes / hbm
    bwd_s = 2 * fwd_matmul_s + attn_bwd_s + BWD_ELEMENTWISE_RATIO * outside_bytes / hbm
    if lay.recompute == "full":
        recompute_s = fwd_s
    elif lay.recompute == "selective" and lay.attention == "materialized":
        recompute_s = attn_s  # Korthikanti et al. 2022 sec. 4.2: recompute only the attention core
    else:
        recompute_s = 0.0

    # TP (Megatron, Shoeybi et al. 2019 sec. 3): two all-reduces of [T, D] forward and two backward;
    # with SP each becomes an all-gather + reduce-scatter of the same array (Korthikanti sec. 4.2.2),
    # equal bytes on a ring. Not overlapped with compute in Megatron-LM 2021-22.
    act_bytes = tokens * h * 2
    tp_s = 0.0
    if t > 1:
        topo = topology(chip, t, 1, chips_per_node)
        one = (comm_s(topo, chip, "all_gather", act_bytes) + comm_s(topo, chip, "reduce_scatter", act_bytes)
               if lay.sequence_parallel else comm_s(topo, chip, "all_reduce", act_bytes))
        tp_s = 2 * one

    # CP: ring attention passes K and V (cp - 1 steps) under the score computation, and dK, dV back
    # in the backward (Liu et al. 2023, Ring Attention; Megatron-Core context parallel). Each transfer
    # hides under one step's block only: with the zig-zag split every step computes 1/cp of the
    # local attention, and slack of one step cannot cover another's transfer.
    cp_fwd = cp_bwd = 0.0
    if cp > 1:
        topo = topology(chip, cp, t, chips_per_node)
        kv_bytes = 2 * tokens * kv_width / t * 2
        ring_step = comm_s(topo, chip, "p2p", kv_bytes)
        cp_fwd = (cp - 1) * max(0.0, ring_step - attn_s / cp)
        cp_bwd = (cp - 1) * max(0.0, 2 * ring_step - attn_bwd_s / cp)

    # EP: dispatch and combine all-to-alls of T * top_k token copies of D (GShard, Lepikhin et al.
    # 2020); tokens are split over TP ranks as with SP. Not overlapped.
    ep_s = 0.0
    if moe and lay.ep > 1:
        topo = topology(chip, lay.ep, t, chips_per_node)
        ep_s = 2 * comm_s(topo, chip, "all_to_all", tokens * m.top_k * h * 2 / t)

    # ZeRO-3 / FSDP (Rajbhandari et al. 2019 sec. 5.3): all-gather the layer's weights before its
    # forward and backward, reduce-scatter its gradients after; prefetched under the layer's compute.
    z3_fwd = z3_bwd = 0.0
    if lay.zero_stage == 3 and lay.dp * cp > 1:
        topo = topology(chip, lay.dp * cp, t, chips_per_node)
        w_bytes = 2 * ((lp.attention + lp.mlp) / t + lp.norms + lp.router)
        w_bytes += 2 * lp.experts / (t * lay.ep)  # local experts, gathered over their own replicas
        ag = comm_s(topo, chip, "all_gather", w_bytes)
        rs = comm_s(topo, chip, "reduce_scatter", w_bytes * 2)  # fp32 gradient reduction
        z3_fwd = max(0.0, ag - fwd_s)
        z3_bwd = max(0.0, ag + rs - bwd_s)

    flops = (2.0 * tokens * (lp.attention + lp.mlp) / t
             + 2.0 * tokens * m.seq_len * heads_local * (qk_dim + hd))
    if moe:
        flops += 2.0 * tokens * m.top_k * lp.experts / m.experts / t
    return LayerCost(fwd_s, bwd_s, recompute_s, tp_s, tp_s, cp_fwd, cp_bwd, ep_s, ep_s,
                     z3_fwd, z3_bwd, flops, act_bytes, fwd_matmul_s)


def logits_cost(m: ModelSpec, lay: Layout, chip: Chip, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of the output projection and the fp32 cross-entropy on the last stage.

    In[T, D] . W[D, V/t], then softmax + loss over fp32 logits: read/write 4 bytes x V/t per token,
    about three passes (max, exp-sum, gradient), Megatron's vocab-parallel cross-entropy.
    """
    tokens = lay.micro_batch * m.seq_len / lay.cp
    mm_s = matmul_s(chip, dtype, tokens, m.hidden, m.vocab / lay.tp)
    ce_s = 3 * 8 * tokens * m.vocab / lay.tp / chip.hbm_bw(achievable=True)
    return mm_s + ce_s, 2 * mm_s + ce_s


def optimizer_step_s(params_per_chip: float, lay: Layout, chip: Chip, optimizer: str) -> float:
    """The optimizer update is memory-bound: `OPTIMIZER_STEP_BYTES` per locally updated parameter."""
    shards = lay.dp * lay.cp if lay.zero_stage >= 1 else 1
    return params_per_chip / shards * OPTIMIZER_STEP_BYTES[optimizer] / chip.hbm_bw(achievable=True)
