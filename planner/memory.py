"""Bytes per chip: weights, gradients, optimizer state, activations and temporary buffers.

Sources:
* Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054) sec. 3 and Figure 1: mixed-precision Adam keeps
  2 bytes of fp16/bf16 weights, 2 of gradients and K = 12 of fp32 optimizer state (master weights,
  momentum, variance) per parameter; stage 1 shards the K bytes over N_d data-parallel ranks, stage 2
  also the gradients, stage 3 also the weights. Megatron-LM's distributed optimizer is stage 1.
* Korthikanti et al. 2022 (arXiv 2205.05198) sec. 4, eqs. 1-2 and Table 2: activations per layer of a
  GPT layer, sbh(34 + 5as/h) bytes; with TP t: sbh(10 + 24/t + 5as/(ht)); with TP+SP: sbh/t (34 +
  5as/h); selective recompute + SP: 34 sbh/t; full recompute: 2sbh (the layer input only). JAX's
  checkpoint_dots_with_no_batch_dims ("dots") keeps the layer input and the matmul outputs its backward reads.
  `layer_activation_bytes` generalises the terms to GQA, SwiGLU, MoE, CP and FlashAttention and
  reduces to those forms for GPT shapes (tests check it).
* Mamba-2 layers (`mamba_activation_terms`): the tensors Megatron-Core's MambaMixer (TE's fused
  pre-norm + in_proj, then mamba_ssm's causal conv and `mamba_chunk_scan_combined`, the gated RMSNorm,
  out_proj) keeps for backward, named term by term; what is an estimate is said there.
* Pipeline in-flight micro-batches (Narayanan et al. 2021 sec. 2.2; Korthikanti et al. 2022 sec. 4.2.3):
  1F1B stage i holds min(p - i, m) micro-batches, so the first stage holds p; the interleaved schedule
  holds p * (1 + (p-1)/(p v)) stage-sized micro-batches on the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from hardware.kernels import FLASH_KERNELS
from planner.case import Layout
from planner.flops import (
    OP_SAC_ROW_PARALLEL,
    dots_saved_matmuls,
    embedding_extras,
    layer_params_on_chip,
    mtp_kind,
    mtp_proj_params,
    op_sac_matmuls,
    output_heads,
    pre_norms,
    root_params,
    ssd_chunk,
    vocab_rows,
)
from planner.models import ATTENTION, MAMBA, MLP, ModelSpec
from planner.stages import Chunk, chunks_of, holds_untied_head, holds_word_embedding, stage_chunks

WEIGHT_BYTES = 2  # bf16/fp16 weights (fp8 training keeps bf16 master copies of the working weights)
GRAD_BYTES = 2  # the ZeRO paper's half-precision gradients; a layout's own: Layout.grad_bytes
# Full-size moment tensors each optimizer keeps per parameter: Adam's first and second moments; SGD's momentum;
# Adafactor none (its factored second moment is one row and one column vector per matrix, Shazeer & Stern 2018
# sec. 3, and it keeps no first moment)
OPTIMIZER_MOMENTS = {"adam": 2, "sgd": 1, "adafactor": 0}


def optimizer_state_bytes(optimizer: str = "adam", master_weights: bool = True) -> int:
    """Optimizer state bytes per parameter: the fp32 master copy and fp32 moments of mixed precision (ZeRO sec.
    3.1: K = 12 for Adam; SGD 8, Adafactor 4), or, without master weights (`master_weights` false: the
    parameters themselves in bf16), the moments alone in the parameters' dtype, as torch.optim creates them
    (torch.zeros_like(param): Adam 4, SGD 2, Adafactor 0)."""
    moments = OPTIMIZER_MOMENTS[optimizer]
    return 4 * (1 + moments) if master_weights else 2 * moments


def zero_bytes_per_param(stage: int, shards: int, optimizer: str = "adam", grad_bytes: int = GRAD_BYTES,
                         master_weights: bool = True) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per parameter, ZeRO `stage` over `shards` ranks (ZeRO Fig. 1)."""
    k = optimizer_state_bytes(optimizer, master_weights)
    w = WEIGHT_BYTES / shards if stage >= 3 else WEIGHT_BYTES
    g = grad_bytes / shards if stage >= 2 else grad_bytes
    o = k / shards if stage >= 1 else k
    return w, g, o


def in_flight_chunks(stage: int, lay: Layout, micro_batches: int) -> float:
    """Micro-batch x chunk activations stage `stage` holds at its peak (see module docstring)."""
    p, v, m = lay.pp, lay.virtual_stages, micro_batches
    if lay.pp_schedule == "gpipe":
        return m * v
    if lay.pp_schedule == "zb-h1":
        # 1F1B's first stage's peak on every stage: stage i (0-indexed) holds p - i forwards and i deferred
        # weight-gradient inputs at once (Qi et al. 2023 sec. 2.3: (p - i + 1) M_B + (i - 1) M_W for 1-indexed
        # i; the two counts' separate peaks, p - i and i + 1, never fall together), never more than m; each
        # pending one keeps less than a micro-batch's activations (M_W < M_B), so counting it whole is an
        # upper bound
        return min(p, m)
    if v > 1:
        # Megatron-LM interleaved warm-up: (p - i - 1) * 2 + (v - 1) * p micro-batch chunks, then 1 more
        return min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
    return min(p - stage, m)


def in_flight_layers(stage: int, lay: Layout, micro_batches: int, chunk_layers: list[float]) -> float:
    """Layer x micro-batch activations the stage holds at its peak; given each chunk's bytes instead of its
    layers, the bytes.

    Interleaved: Megatron-LM runs forward k on chunk (k // p) % v, so of the first W + 1 forwards
    (W the warm-up count) each chunk gets whole groups of p plus part of one; chunks differ in layer
    count when the layers do not split evenly, so the count is per chunk.
    """
    held = in_flight_chunks(stage, lay, micro_batches)
    p, v = lay.pp, lay.virtual_stages
    if v == 1 or held >= micro_batches * v:
        return held * sum(chunk_layers) / v
    groups, rest = divmod(int(held), p)
    total = 0.0
    for c, n_layers in enumerate(chunk_layers):
        count = (groups // v) * p + (p if c < groups % v else 0) + (rest if c == groups % v else 0)
        total += count * n_layers
    return total


def mamba_activation_terms(m: ModelSpec, lay: Layout) -> dict[str, float]:
    """Bytes one Mamba-2 layer keeps for backward, for one micro-batch on one chip, by tensor (bf16 unless
    said; sb = micro_batch * seq_len / cp tokens, t = tp, e = d_inner, H heads, G groups, N state, P head
    dim; the replicated terms split by t with sequence parallelism):

      layer input (pre-norm backward) and the normed input (in_proj's weight gradient)   2 x 2sbD
      in_proj output zxBCdt (the conv's input, the gate z, dt)                           2sb(2e + 2GN + H)/t
      conv output xBC after SiLU (the scan's x, B, C)                                    2sb(e + 2GN)/t
      dt's cumulative decays dA_cumsum, fp32 (mamba_ssm `MambaChunkScanCombinedFn`)      4sbH/t
      chunk states, fp32: (sb / Q) chunks x H x P x N                                    4 (sb/Q) H P N / t
      scan output y (the gated norm's input) and the norm's output (out_proj's input)    2 x 2sbe/t
      the norm's per-group reciprocal RMS, fp32                                          4sbG/t

    The chunk states are an estimate on the high side: mamba_ssm's fused chunk-scan saves x, B, C, dt
    and dA_cumsum and rebuilds the states in its backward, so they need not be held for every layer;
    they are counted because they are the tensor the CP state passing hands on (planner.costs)."""
    t, cp = lay.tp, lay.cp
    sb = lay.micro_batch * m.seq_len / cp
    sp_div = t if lay.sequence_parallel else 1
    e, g, n, h = m.ssm_inner, m.ssm_groups, m.ssm_state, m.ssm_heads
    return {
        "layer input + normed input": 2 * 2 * sb * m.hidden / sp_div,
        "in_proj output zxBCdt": 2 * sb * (2 * e + 2 * g * n + h) / t,
        "conv output xBC": 2 * sb * (e + 2 * g * n) / t,
        "dA_cumsum (fp32)": 4 * sb * h / t,
        "chunk states (fp32)": 4 * sb / ssd_chunk(m) * h * m.ssm_head_dim * n / t,
        "scan output y + norm output": 2 * 2 * sb * e / t,
        "norm rstd (fp32)": 4 * sb * g / t,
    }


def _input_and_outputs_bytes(m: ModelSpec, lay: Layout, saved) -> float:
    """bf16 bytes of a layer's input and of the outputs of its `saved` matmuls ((name, in, out), in
    `flops.op_sac_matmuls`' names): a column-parallel one's split by TP, a row-parallel one's as the reduced
    output, split by SP, the router's whole."""
    t = lay.tp
    sb = lay.micro_batch * m.seq_len / lay.cp
    sp_div = t if lay.sequence_parallel else 1
    kept = 2 * sb * m.hidden / sp_div
    for name, _, out in saved:
        kept += 2 * sb * (out / sp_div if name in OP_SAC_ROW_PARALLEL else out if name == "router" else out / t)
    return kept


def _op_sac_kept_bytes(m: ModelSpec, lay: Layout, kind) -> float:
    """What op-level selective checkpointing ("selective-op", `flops.op_sac_matmuls`) keeps of one layer,
    bf16, in the terms of `layer_activation_bytes`: the block's input, the outputs of the matmuls it saves (a
    column-parallel one's split by TP; a row-parallel one's as the reduced output, split by SP), the
    attention kernel's output and fp32 log-sum-exp, and in an MoE layer the routed experts' grouped-matmul
    outputs, top_k (n_in F + h) per token."""
    t = lay.tp
    sb = lay.micro_batch * m.seq_len / lay.cp
    kept = _input_and_outputs_bytes(m, lay, [(name, i, o) for name, i, o, again in op_sac_matmuls(m, kind)
                                             if not again])
    if kind not in (MLP, MAMBA):
        kept += (2 * sb * m.heads * m.head_dim_ + 4 * sb * m.heads) / t
    if kind is True:
        n_in = 2 if m.mlp == "swiglu" else 1
        kept += 2 * m.top_k * sb * (n_in * m.ffn + m.hidden) / t
    return kept


def layer_activation_bytes(m: ModelSpec, lay: Layout, moe, *, recompute: str | None = None,
                           dtype: str = "bf16") -> float:
    """Activation bytes one layer keeps for backward, for one micro-batch on one chip; `moe` is the layer
    kind (planner.models: False dense, True MoE, or a pattern character).

    Terms (bytes; sb = micro_batch * seq_len / cp tokens, t = tp):
      kept whole on every TP rank unless SP: inputs of the two norms, of QKV and of the MLP (4 x 2sbh),
        plus two dropout masks (2 x sbh) in the GPT recipe            -> 10sbh GPT / 8sbh Llama
        (a parallel block: its one norm's input and output, one mask  ->  5sbh GPT / 4sbh Llama)
      split by TP: Q, K, V, attention output, MLP internals           -> 24sbh/t for GPT shapes
      attention scores (materialised kernels only): softmax output, dropout mask and output, 5as^2b/t
        (without dropout, `Layout.dropout_on`, the softmax output alone: 2as^2b/t)
      FlashAttention keeps only the fp32 log-sum-exp, 4sba/t.
    A pattern's attention ("*") or MLP ("-") layer keeps its half of these (one norm input, one block
    input: 4sbh replicated); a Mamba-2 layer keeps `mamba_activation_terms`.
    fp8: Transformer Engine keeps each GEMM's input for the weight gradient as its fp8 cast (the
    column-wise fp8 copy, 1 byte: TE `Linear` / `LayerNormLinear` forward, `saved_inputmat`), so the
    inputs of QKV, fc1 and fc2 (and MLA's up-projections) count 1 byte, not 2: their bf16 originals are
    not needed by any backward (a norm's backward reads its input, a SwiGLU's or GELU's its own input).
    The attention output is the exception: a FlashAttention kernel's backward reads it, so it stays in
    bf16 beside the output projection's fp8 copy (3 bytes).
    Selective recomputation keeps only the inputs of the modules it runs again (`lay.recompute_modules`):
    core_attn the materialised scores, mla_up_proj MLA's full-width Q, K and V (the latents stay),
    layernorm the norm outputs (the QKV and MLP inputs; the norm inputs stay), mlp / shared_experts the
    MLP internals, moe_act the routed experts' activation output (fc2's input).
    """
    recompute = recompute or lay.recompute
    t, cp = lay.tp, lay.cp
    sb = lay.micro_batch * m.seq_len / cp
    h, hd = m.hidden, m.head_dim_
    q_w, kv_w = m.heads * hd, m.kv_heads * hd
    gpt = m.gpt_style
    sp_div = t if lay.sequence_parallel else 1
    if recompute == "full":
        return 2 * sb * h / sp_div  # Korthikanti et al. 2022 sec. 5: only the layer input is kept
    if recompute == "selective-op":
        return _op_sac_kept_bytes(m, lay, moe)
    if recompute == "dots":  # the layer input and the matmul outputs the backward reads; the attention core reruns
        return _input_and_outputs_bytes(m, lay, dots_saved_matmuls(m, moe))
    if moe == MAMBA:
        return sum(mamba_activation_terms(m, lay).values())
    has_attn, has_mlp = moe != MLP, moe != ATTENTION
    saved = 1 if dtype == "fp8" else 2  # bytes of a kept GEMM input (docstring)
    # each norm's input and its output, the GEMM inputs (planner.flops.pre_norms: two norms in a sequential layer,
    # one in a pattern layer or a parallel block), plus the GPT recipe's dropout masks (one per block; one over
    # the parallel block's sum)
    norms = pre_norms(m, moe)
    # a parallel block's QKV and MLP share ln(x) in bf16; under fp8 each Transformer Engine module keeps its own cast
    blocks_in = 2 if m.parallel_block and has_attn and has_mlp and saved != 2 else norms
    masks = (1 if m.parallel_block or not (has_attn and has_mlp) else 2) if gpt and lay.dropout_on(m) else 0
    replicated = sb * h * (2 * norms + saved * blocks_in + masks)
    # Q, K, V, attention output (the output projection's input; a flash kernel keeps its own bf16 copy for
    # its backward, so under fp8 it is held twice: bf16 for the kernel, fp8 for the projection)
    out_bytes = saved + (2 if saved != 2 and lay.attention in FLASH_KERNELS else 0)
    modules = lay.recompute_modules if recompute == "selective" else ()
    if "layernorm" in modules:
        replicated -= saved * blocks_in * sb * h
    qkv = 2 * sb * (q_w + 2 * kv_w) + (2 * sb * 2 * m.heads * m.rope_head_dim if m.is_mla else 0.0)
    if "mla_up_proj" in modules:
        qkv = 0.0
    attn_split = qkv + out_bytes * sb * q_w if has_attn else 0.0
    if m.is_mla and has_attn:
        # the latents, the up projections' inputs: made by the duplicated down projections, so on the sequence
        # shard under SP and whole on every TP rank without it
        replicated += saved * sb * (m.kv_lora_rank + m.q_lora_rank)
    ffn = m.ffn if moe else m.dense_ffn_
    # GELU / squared ReLU: its input and fc2's input (2 x 2sbf); SwiGLU: gate, up and down's input (3 x 2sbf);
    # plus the MLP input (a GEMM input)
    mlp_one = ((4 if m.mlp == "swiglu" else 2) + saved) * sb * ffn + saved * sb * h
    mlp_split = mlp_one - saved * sb * h if has_mlp else 0.0  # the MLP input is already counted as replicated
    if ("mlp" in modules and moe is not True) or ("shared_experts" in modules and moe is True):
        mlp_split = 0.0
    if moe is True:
        # each token's copies at its top_k experts (balanced routing), plus the shared experts
        routed = mlp_one - (saved * sb * m.ffn if "moe_act" in modules else 0.0)
        mlp_split = m.top_k * routed + m.shared_experts * mlp_split + 4 * sb * m.experts
        if not lay.experts_folded:  # split by tp, the experts keep the dispatcher's gathered input whole on a rank
            mlp_split += (t - 1) * m.top_k * saved * sb * h
    if not has_attn:
        scores = 0.0
    elif lay.attention == "materialized" and "core_attn" not in modules:
        scores = (5 if lay.dropout_on(m) else 2) * m.heads * sb * m.seq_len  # without dropout: the softmax only
    elif lay.attention in FLASH_KERNELS:
        scores = 4 * sb * m.heads
    else:
        scores = 0.0
    return replicated / sp_div + (attn_split + mlp_split + scores) / t


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> float:
    """Korthikanti et al. 2022 Table 2, per layer, for the GPT layer they analyse."""
    if mode == "none":
        return s * b * h * (34 + 5 * a * s / h)
    if mode == "tp":
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    if mode == "tp+sp":
        return s * b * h / t * (34 + 5 * a * s / h)
    if mode == "tp+sp+selective":
        return s * b * h / t * 34
    if mode == "full":
        return 2 * s * b * h
    raise ValueError(f"unknown mode {mode!r}")


@dataclass(frozen=True)
class Memory:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    temporary_bytes: float
    stage: int  # the pipeline stage this is for (the one that needs the most)

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.temporary_bytes)

    def as_dict(self) -> dict:
        return {"params": self.params_bytes, "grads": self.grads_bytes, "optimizer": self.optimizer_bytes,
                "activations": self.activations_bytes, "temporary": self.temporary_bytes,
                "total": self.total_bytes}


def stage_params(m: ModelSpec, lay: Layout, stage: int) -> tuple[float, float]:
    """(TP-sharded dense, expert) parameters held by one chip of `stage`."""
    return _stage_params(m, lay.tp, lay.ep, lay.etp, lay.pp, lay.virtual_stages, lay.pp_layout, stage)


@lru_cache(maxsize=65536)
def _stage_params(m: ModelSpec, t: int, ep: int, etp: int, pp: int, virtual: int, pp_layout: str | None,
                  stage: int) -> tuple[float, float]:
    parts = _chunk_params(m, t, ep, etp, stage_chunks(m.layers, m.mtp_layers, pp, virtual, pp_layout)[stage])
    return sum(d for d, _ in parts), sum(e for _, e in parts)


def chunk_params(m: ModelSpec, lay: Layout, stage: int) -> tuple[tuple[float, float], ...]:
    """(TP-sharded dense, expert) parameters of each of a stage's chunks on one chip, which together are the
    stage's (`stage_params`): each chunk its layers, the word embedding with the first chunk that needs it
    (its lookup, an MTP module's, or a tied head), an untied head with the loss chunk, positions and the
    final norm with the lookup's."""
    return _chunk_params(m, lay.tp, lay.ep, lay.etp, chunks_of(m, lay)[stage])


@lru_cache(maxsize=65536)
def _chunk_params(m: ModelSpec, t: int, ep: int, etp: int, chunks: tuple[Chunk, ...]
                  ) -> tuple[tuple[float, float], ...]:
    out = []
    rows_held = False  # a stage holds one copy of the word embedding (`holds_word_embedding`)

    for c in chunks:
        # its layers, an MTP module as one more of the model's last kind
        kinds = plus_layers(layer_kind_counts(m, c.first, c.layers), mtp_kind(m), c.mtp) if c.mtp else \
            layer_kind_counts(m, c.first, c.layers)
        on_chip = [(n, layer_params_on_chip(m, kind, t, ep, etp)) for kind, n in kinds]
        dense = sum(n * d for n, (d, _) in on_chip)
        moe = sum(n * e for n, (_, e) in on_chip)
        if c.mtp:
            dense += c.mtp * (mtp_proj_params(m) / t + 3 * m.hidden)  # + its two input norms and final norm
        # the word embedding (a copy on every stage that looks it up or, tied, projects with it) and an untied head
        if not rows_held and holds_word_embedding(m, (c,)):
            dense += vocab_rows(m, t)
            rows_held = True
        dense += vocab_rows(m, t) * holds_untied_head(m, (c,))
        if c.embedding:
            dense += embedding_extras(m)  # positions, final norm
        out.append((dense, moe))
    return tuple(out)


@lru_cache(maxsize=65536)
def layer_kind_counts(m: ModelSpec, first: int, count: int) -> tuple[tuple, ...]:
    """((kind, layers), ...) among layers first .. first + count - 1, kinds in the model's order, none
    with zero layers (planner.models: a kind is False dense, True MoE, or a pattern character)."""
    if not m.layer_pattern and not m.is_moe:
        return ((False, count),) if count else ()
    kinds = m.layer_kinds[first:first + count]
    return tuple((k, kinds.count(k)) for k in m.kinds if k in kinds)


def stage_groups(m: ModelSpec, lay: Layout) -> tuple[int, ...]:
    """For each stage, the first stage holding the same kinds of layers in its chunks (and the same
    embedding, MTP and output roles): stages of one group cost the same time and, holding no more
    in-flight micro-batches than the first, need no more memory."""
    return _stage_groups(m, lay.pp, lay.virtual_stages, lay.pp_layout, lay.recompute_split)


@lru_cache(maxsize=4096)
def _stage_groups(m: ModelSpec, pp: int, virtual: int, pp_layout: str | None, split: int | None) -> tuple[int, ...]:
    firsts: dict = {}
    out = []
    for i, chunks in enumerate(stage_chunks(m.layers, m.mtp_layers, pp, virtual, pp_layout)):
        # which of its layers full recomputation covers, when it covers only some (`recompute_split`)
        key = tuple((recompute_split(m, c, split), c.embedding, c.mtp, c.loss) for c in chunks)
        out.append(firsts.setdefault(key, i))
    return tuple(out)


def memory_per_chip(m: ModelSpec, lay: Layout, micro_batches: int, optimizer: str = "adam",
                    dtype: str = "bf16") -> Memory:
    """Peak bytes on the most loaded chip (max over pipeline stages); `dtype` the GEMMs' (fp8 keeps their
    inputs in 1 byte: `layer_activation_bytes`). `micro_batches` per optimizer step: a schedule holds at most
    those of one of its `lay.schedule_runs` runs."""
    micro_batches = lay.per_run(micro_batches)
    stages = chunks_of(m, lay)
    wd, gd, od = zero_bytes_per_param(lay.zero_stage, lay.dp * lay.cp, optimizer, lay.grad_bytes, lay.master_weights)
    we, ge, oe = zero_bytes_per_param(lay.zero_stage, lay.expert_dp, optimizer, lay.grad_bytes, lay.master_weights)
    best = None
    for stage in sorted(set(stage_groups(m, lay))):
        dense, moe = stage_params(m, lay, stage)
        params, grads, opt = dense * wd + moe * we, dense * gd + moe * ge, dense * od + moe * oe
        if lay.staged_zero3:
            # pipelined FSDP keeps the stage's weights gathered (bf16) and accumulates its gradients unsharded
            # in the reduction's dtype until the last backward (planner.costs' docstring; FSDP2 accumulates in
            # its reduce_dtype: _fsdp_param.py to_accumulated_grad_if_needed), fp32 or the working bf16
            # (grad_reduce_in_fp32); a group of one shard holds its weights whole already and accumulates into
            # its own gradient
            gathered = dense * (lay.dp * lay.cp > 1) + moe * (lay.expert_dp > 1)
            params += 2 * gathered
            grads += lay.grad_bytes * gathered
        room = 0.0  # what a chunk's backward has freed when it reaches a layer to recompute
        if lay.recompute_split is None:
            # an MTP module keeps what one more layer keeps
            acts = (in_flight_layers(stage, lay, micro_batches, [c.layers + c.mtp for c in stages[stage]])
                    * _per_layer_bytes(m, lay, stages[stage], dtype))
        else:
            # each chunk's first recompute_layers keep only their inputs, the others everything; the backward
            # reaches those after the others have freed theirs, the room the recomputation's buffer takes
            kept = replace(lay, recompute="none")  # how the layers beside the recomputed ones run
            split = [_split_bytes(m, lay, kept, stages[stage], c, dtype) for c in stages[stage]]
            acts = in_flight_layers(stage, lay, micro_batches, [again + rest for again, rest in split])
            room = min((rest for again, rest in split if again), default=float("inf"))
        # per-layer ZeRO-3 gathers the experts too, where an expert has replicas to shard over
        temp = _temporary_bytes(m, lay, stage, dense + moe * (lay.expert_dp > 1), dtype, room)
        if lay.logit_metrics and any(c.loss for c in stages[stage]):
            # the metrics' cross-entropies run after the backward has freed the activations (Composer): the
            # bf16 logits, their fp32 copy and its log-softmax, 10 bytes a logit, may set the peak instead
            temp = max(temp, 10 * _logits(m, lay) - acts)
        mem = Memory(params, grads, opt, acts, temp, stage)
        if best is None or mem.total_bytes > best.total_bytes:
            best = mem
    return best


def recompute_split(m: ModelSpec, c: Chunk, layers: int | None) -> tuple[tuple, tuple]:
    """A chunk's ((kind, layers), ...) split into those full recomputation covers and those that keep
    everything, when it covers only its first `layers` (`Layout.recompute_split`, Megatron-Core's block
    method); its MTP modules, which Megatron-Core does not recompute then ("block-based recompute for MTP"
    is a TODO in multi_token_prediction.py, which skips it), keep everything. `layers` None: all, none."""
    counts = layer_kind_counts(m, c.first, c.layers)
    if layers is None:
        return plus_layers(counts, mtp_kind(m), c.mtp) if c.mtp else counts, ()
    k = min(layers, c.layers)
    rest = layer_kind_counts(m, c.first + k, c.layers - k)
    return layer_kind_counts(m, c.first, k), plus_layers(rest, mtp_kind(m), c.mtp) if c.mtp else rest


def plus_layers(counts: tuple, kind, n: int) -> tuple:
    """((kind, layers), ...) with `n` more layers of `kind`."""
    merged = dict(counts)
    merged[kind] = merged.get(kind, 0) + n
    return tuple(merged.items())


def _split_bytes(m: ModelSpec, lay: Layout, kept: Layout, chunks: tuple[Chunk, ...], c: Chunk,
                 dtype: str) -> tuple[float, float]:
    """(bytes kept by a chunk's fully recomputed layers under `lay`, by its other layers under `kept`), one
    micro-batch: each layer at its own kind's bytes in a layer pattern, else at the larger kind's
    (`_per_layer_bytes`)."""
    out = []
    for part, how in zip(recompute_split(m, c, lay.recompute_split), (lay, kept), strict=True):
        if m.layer_pattern:
            out.append(sum(n * layer_activation_bytes(m, how, kind, dtype=dtype) for kind, n in part))
        else:
            out.append(sum(n for _, n in part) * _per_layer_bytes(m, how, chunks, dtype))
    return out[0], out[1]


def _per_layer_bytes(m: ModelSpec, lay: Layout, chunks: tuple[Chunk, ...], dtype: str) -> float:
    """What one layer of a stage keeps, one micro-batch: the larger kind's (dense or MoE), or a pattern's mean."""
    if m.layer_pattern:
        return _mean_layer_bytes(m, lay, chunks, dtype)
    return max(layer_activation_bytes(m, lay, k, dtype=dtype) for k in {False, m.is_moe})


def _mean_layer_bytes(m: ModelSpec, lay: Layout, chunks: tuple[Chunk, ...], dtype: str) -> float:
    """A pattern's stage holds layers of different kinds: the mean of its layers' activation bytes (each
    in-flight micro-batch holds all of a chunk's layers)."""
    total = layers = 0.0
    for c in chunks:
        for kind, n in layer_kind_counts(m, c.first, c.layers):
            total += n * layer_activation_bytes(m, lay, kind, dtype=dtype)
            layers += n
    return total / max(1.0, layers)


def _logits(m: ModelSpec, lay: Layout) -> float:
    """Logits of one micro-batch on one chip of the loss stage: (b s/cp) x V/t."""
    return lay.micro_batch * m.seq_len / lay.cp * m.vocab / lay.tp


def _temporary_bytes(m: ModelSpec, lay: Layout, stage: int, stage_params: float, dtype: str,
                     room: float = 0.0) -> float:
    """Buffers alive at the peak besides the kept activations:
    * the layer being back-propagated with full, op-level selective or "dots" recomputation holds its
      recomputed activations (the whole layer's less what it keeps anyway), less the `room` the backward
      has freed before it gets there (full recomputation of only some layers: the others' activations);
    * the loss stage's fp32 logits and their gradient, (b s/cp) x V/t x 8 bytes (Korthikanti sec. 4.3
      counts the output layer too), or with a fused cross-entropy (`cross_entropy` "fused") the bf16 logits
      and their bf16 gradient, 4 bytes; once per output head (multi-token prediction adds heads);
    * ZeRO-3 all-gathers the current and the prefetched layer's weights whole (FSDP prefetch), and keeps
      the parameters outside the layers (`root_params`: embedding, head) gathered from the lookup through
      the backward (FSDP's root unit); under pipeline parallelism they stay whole and are counted with the
      weights.
    """
    temp = 0.0
    if lay.recompute in ("full", "selective-op", "dots"):
        kinds = m.kinds if m.layer_pattern else (m.is_moe,)
        # what the recomputation adds to the activations the layer already keeps
        temp += max(0.0, max(layer_activation_bytes(m, lay, k, recompute="none", dtype=dtype)
                             - layer_activation_bytes(m, lay, k, dtype=dtype) for k in kinds) - room)
    chunks = chunks_of(m, lay)[stage]
    if any(c.loss for c in chunks):
        per_logit = 4 if lay.cross_entropy == "fused" else 8
        # freed once the loss's backward has handed the head its gradient, before any layer recomputes
        temp = max(temp, output_heads(m) * per_logit * _logits(m, lay))
    if lay.layer_zero3:
        layers = max(1, sum(c.layers + c.mtp for c in chunks))
        root = root_params(m, lay.tp)  # one stage: ZeRO-3 layers are unstaged
        temp += WEIGHT_BYTES * (2 * (stage_params - root) / layers + root)
    return temp
