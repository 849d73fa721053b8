"""Parameter counts and FLOPs of a `ModelSpec`, per layer and per step.

Notation (scaling-book style): B batch, S sequence, D hidden, F MLP inner size, N query heads,
K kv heads, H head dim, V vocabulary, L layers. A matmul `In[B, D] . W[D, F]` costs 2*B*D*F FLOPs
forward and twice that backward (one matmul for the input gradient, one for the weight gradient),
so a training pass costs 3x the forward and a fully recomputed one 4x (a little less where the recomputation
drops what the backward does not read: `hardware_flops`).

Definitions (Chowdhery et al. 2022, PaLM, Appendix B):
* model FLOPs: what the model needs per step with no recomputation, 3 * forward FLOPs. MFU is
  model FLOPs per second over the chips' peak.
* hardware FLOPs: what the chips actually execute, recomputation included. HFU is hardware FLOPs per
  second over peak. Megatron-LM's "TFLOP/s per GPU" (Narayanan et al. 2021, eq. 3) is hardware FLOPs.
* attention score FLOPs (Q.K^T and P.V) are counted over the full S x S square, causal masking
  ignored, as Narayanan et al. 2021 (eq. 3) does (a sliding-window layer: twice its band,
  `windowed_square`); the simulator separately knows that a causal flash-attention kernel skips about
  half of that work. `causal=True` gives the other convention (half the square); at long context the
  two MFUs differ a lot (128K tokens: ~1.4x for Llama 3 405B).
* Mamba-2 layers (Dao & Gu 2024, arXiv 2405.21060): their projections are weight matmuls like any
  other; the SSD scan's chunk matmuls and the depthwise conv are counted like attention's score FLOPs,
  per layer, in `ssm_flops_per_token`. They are linear in the sequence: per token they depend on the
  chunk length Q, not on S.

Every total is a sum over the layers' kinds (`ModelSpec.layer_kinds`), so a hybrid's total is the sum
over its pattern of the per-layer functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.models import ATTENTION, MAMBA, MLP, ModelSpec


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one layer, split by how they shard."""

    attention: int  # Q, K, V, O projections (sharded by TP)
    mlp: int  # dense MLP, or the shared experts of an MoE layer (sharded by TP)
    experts: int  # routed experts (sharded by EP, then TP)
    router: int  # MoE gate (replicated)
    norms: int  # norm scales/biases and projection biases (replicated across TP)
    ssm: int = 0  # the Mamba-2 mixer (`MambaParams`), sharded by TP by heads and groups

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.experts + self.router + self.norms + self.ssm


@dataclass(frozen=True)
class MambaParams:
    """One Mamba-2 mixer (mamba_ssm `Mamba2`; Dao & Gu 2024 sec. 7.1, Figure 6), d = D hidden,
    e = d_inner, H heads, G groups, N state, K conv width:

        in_proj   In[T, D] . W[D, 2e + 2GN + H]     -> z (e), xBC (e + 2GN), dt (H)
        conv1d    depthwise over the e + 2GN channels of xBC: K weights + 1 bias each
        per head  dt_bias, A_log, D (the skip)      -> 3H
        norm      the gated RMSNorm over e (scale only)
        out_proj  In[T, e] . W[e, D]

    With TP t (sec. 8.1) every part splits: heads and groups go to ranks whole (t | G), so in_proj is
    column-parallel, the conv, the per-head vectors and the group-wise norm split with their channels,
    and out_proj is row-parallel. Only the layer's pre-norm (in `LayerParams.norms`) is replicated."""

    in_proj: int
    conv: int
    heads: int
    norm: int
    out_proj: int

    @property
    def matmul(self) -> int:
        return self.in_proj + self.out_proj

    @property
    def total(self) -> int:
        return self.in_proj + self.conv + self.heads + self.norm + self.out_proj


def mamba_params(m: ModelSpec) -> MambaParams:
    d, e, n, g, h = m.hidden, m.ssm_inner, m.ssm_state, m.ssm_groups, m.ssm_heads
    conv_channels = e + 2 * g * n
    return MambaParams(d * (2 * e + 2 * g * n + h), conv_channels * (m.ssm_conv + 1), 3 * h, e, e * d)


def _mlp_params(m: ModelSpec, ffn: int) -> int:
    # GELU: up D->F and down F->D; SwiGLU: gate and up D->F, down F->D (Shazeer 2020)
    return (3 if m.mlp == "swiglu" else 2) * m.hidden * ffn


def mla_up_proj_params(m: ModelSpec) -> int:
    """MLA's up-projections from the latents: W_UQ (with the RoPE part; 0 without a Q latent), W_UK, W_UV."""
    q_up = m.q_lora_rank * m.heads * (m.head_dim_ + m.rope_head_dim)
    return q_up + m.kv_lora_rank * m.heads * 2 * m.head_dim_


def attention_params(m: ModelSpec) -> int:
    d, n, k, hd = m.hidden, m.heads, m.kv_heads, m.head_dim_
    if m.is_mla:
        # DeepSeek-V2 (arXiv 2405.04434) sec. 2.1.2: W_DQ, W_UQ (with the RoPE part), W_DKV + W_KR,
        # W_UK, W_UV, W_O
        q_down = d * m.q_lora_rank if m.q_lora_rank else d * n * (hd + m.rope_head_dim)
        kv_down = d * (m.kv_lora_rank + m.rope_head_dim)
        return q_down + kv_down + mla_up_proj_params(m) + n * hd * d
    # Q: D->N*H, K and V: D->K*H each, O: N*H->D (Ainslie et al. 2023 for GQA)
    return d * n * hd + 2 * d * k * hd + n * hd * d


def kv_projection_params(m: ModelSpec) -> int:
    """The K and V projections of GQA: with tp > kv_heads each TP rank keeps whole kv heads, so these
    split only kv_heads ways (Megatron-LM replicates kv heads across TP ranks)."""
    return 0 if m.is_mla else 2 * m.hidden * m.kv_heads * m.head_dim_


def mla_down_params(m: ModelSpec) -> int:
    """MLA's down projections W_DQ and W_DKV + W_KR, which Megatron-Core duplicates on every TP rank
    (TELinear, parallel_mode "duplicated", since core_v0.14): 0 for other attention."""
    if not m.is_mla:
        return 0
    return m.hidden * (m.q_lora_rank + m.kv_lora_rank + m.rope_head_dim) if m.q_lora_rank else \
        m.hidden * (m.kv_lora_rank + m.rope_head_dim)


def layer_params_on_chip(m: ModelSpec, kind, tp: int, ep: int, etp: int) -> tuple[float, float]:
    """(dense, routed-expert) parameters of one layer held by one chip of a tp x ep layout: attention and MLP
    split tp ways, except what every TP rank keeps whole (K and V beyond kv_heads ranks, `kv_projection_params`;
    MLA's duplicated down projections, `mla_down_params`); norms and the router whole; the routed experts over
    etp x ep (planner.case.Parallel.etp)."""
    lp = layer_params(m, kind)
    kv = kv_projection_params(m) if lp.attention else 0
    whole = mla_down_params(m) if lp.attention else 0
    attention = (lp.attention - kv - whole) / tp + (kv / min(tp, m.kv_heads) if kv else 0.0) + whole
    return attention + (lp.mlp + lp.ssm) / tp + lp.router + lp.norms, lp.experts / (etp * ep)


def pre_norms(m: ModelSpec, kind) -> int:
    """The norms one layer runs on its residual stream: one per block of a sequential layer (before attention,
    before the MLP), one in a pattern layer (a single block), and one in a parallel block
    (`ModelSpec.parallel_block`), whose attention and MLP read the same normed input (MaxText's default
    DecoderLayer at 76bd53b0f: `lnx = RMSNorm(name='pre_self_attention_norm')(inputs)` feeds both)."""
    if kind in (MAMBA, ATTENTION, MLP) or m.parallel_block:
        return 1
    return 2


@lru_cache(maxsize=256)
def layer_params(m: ModelSpec, kind) -> LayerParams:
    """One layer's parameters; `kind` (planner.models): False dense, True MoE, or a pattern character."""
    d = m.hidden
    # a pattern layer is one pre-norm (RMSNorm, no biases: Mamba-2, Nemotron-H) and one block
    if kind == MAMBA:
        return LayerParams(0, 0, 0, 0, d, mamba_params(m).total)
    if kind == ATTENTION:
        return LayerParams(attention_params(m), 0, 0, 0, d)
    if kind == MLP:
        return LayerParams(0, _mlp_params(m, m.ffn), 0, 0, d)
    moe = kind
    gpt = m.gpt_style
    # GPT recipe: LayerNorms (scale + bias) and biases on every projection; Llama recipe: RMSNorms (scale)
    norms = pre_norms(m, kind) * (2 * d if gpt else d)
    if m.is_mla:
        norms += m.kv_lora_rank + m.q_lora_rank  # RMSNorms on the latents (DeepSeek-V2 config)
    if gpt:
        norms += m.heads * m.head_dim_ + 2 * m.kv_heads * m.head_dim_ + d + m.ffn + d
    if moe:
        return LayerParams(attention_params(m), m.shared_experts * _mlp_params(m, m.ffn),
                           m.experts * _mlp_params(m, m.ffn), d * m.experts, norms)
    return LayerParams(attention_params(m), _mlp_params(m, m.dense_ffn_), 0, 0, norms)


def vocab_rows(m: ModelSpec, tp: int) -> float:
    """One chip's share of the word embedding, or of an untied output projection: V/t x D parameters, the
    vocabulary split over the tp ranks (Megatron-Core's VocabParallelEmbedding and output layer)."""
    return m.vocab * m.hidden / tp


def root_params(m: ModelSpec, tp: int) -> float:
    """One chip's share of the parameters outside the layers: the word embedding and an untied output head
    (`vocab_rows` each), learned positions and the final norm: what FSDP's root unit holds beside the
    wrapped layers."""
    return vocab_rows(m, tp) * (1 if m.tied_embeddings else 2) + embedding_extras(m)


def embedding_extras(m: ModelSpec) -> int:
    """What `embedding_params` holds besides the vocabulary matrices: learned positions and the final norm."""
    return embedding_params(m) - m.vocab * m.hidden * (1 if m.tied_embeddings else 2)


def embedding_params(m: ModelSpec) -> int:
    """Input embedding plus the output projection unless tied (plus GPT's learned positions)."""
    pos = m.seq_len * m.hidden if m.gpt_style else 0
    return m.vocab * m.hidden * (1 if m.tied_embeddings else 2) + pos + m.hidden  # + final norm


@lru_cache(maxsize=256)
def kind_counts(m: ModelSpec) -> tuple:
    """((kind, number of layers), ...) in order of first appearance."""
    kinds = m.layer_kinds
    return tuple((k, kinds.count(k)) for k in m.kinds)


def total_params(m: ModelSpec) -> int:
    """The main model's parameters; multi-token prediction modules are counted apart, as DeepSeek-V3's
    report does ("671B" plus 14B of MTP module)."""
    return sum(n * layer_params(m, k).total for k, n in kind_counts(m)) + embedding_params(m)


def active_params(m: ModelSpec) -> int:
    """Parameters one token passes through: routed experts count top_k of E (DeepSeek's "37B active")."""
    def active(k) -> int:
        lp = layer_params(m, k)
        return lp.total - lp.experts + (lp.experts // m.experts) * m.top_k if lp.experts else lp.total

    return sum(n * active(k) for k, n in kind_counts(m)) + embedding_params(m)


def layer_matmul_params(m: ModelSpec, kind) -> int:
    """Weights one token multiplies by in one layer of `kind` (top_k of the routed experts)."""
    lp = layer_params(m, kind)
    per_expert = lp.experts // m.experts if lp.experts else 0
    ssm = mamba_params(m).matmul if kind == MAMBA else 0
    return lp.attention + lp.mlp + per_expert * m.top_k + lp.router + ssm


OP_SAC_ROW_PARALLEL = ("o", "down", "out_proj")  # `op_sac_matmuls` names whose partial sums leave the TP region


@lru_cache(maxsize=256)
def op_sac_matmuls(m: ModelSpec, kind) -> tuple[tuple[str, int, int, bool], ...]:
    """A layer's weight matmuls in the order its forward runs them, as torchtitan's op-level selective
    activation checkpointing counts them (training.recompute "selective-op"): (name, in, out, recomputed).

    torchtitan (parallelize_llama.py `_apply_ac_to_transformer_block` with selective_ac_option "op", its
    Llama default since 2024; distributed/activation_checkpoint.py `SelectiveAC` since) saves the outputs of
    every matmul, attention kernel and reduce-scatter of a block's forward except every second matmul,
    counted afresh in each forward, and runs everything else again before the backward: those matmuls and
    every memory-bound op. Its Llama runs q, k, v, o and then gate, up, down as separate matmuls, so k, o
    and up run again; with a GPT MLP (up, down) k, o and down. An MoE layer's router is a matmul, its
    routed experts a grouped matmul (not counted, saved) and its shared experts one MLP; MLA runs q (or q
    down, q up), kv down, kv up, o; a Mamba-2 layer in_proj and out_proj. Widths are whole (before TP)."""
    d, hd = m.hidden, m.head_dim_
    mats: list[tuple[str, int, int]] = []
    if kind == MAMBA:
        e = m.ssm_inner
        mats = [("in_proj", d, 2 * e + 2 * m.ssm_groups * m.ssm_state + m.ssm_heads), ("out_proj", e, d)]
    else:
        if kind != MLP:
            if m.is_mla:
                qk = m.heads * (hd + m.rope_head_dim)
                mats += ([("q down", d, m.q_lora_rank), ("q up", m.q_lora_rank, qk)] if m.q_lora_rank
                         else [("q", d, qk)])
                mats += [("kv down", d, m.kv_lora_rank + m.rope_head_dim),
                         ("kv up", m.kv_lora_rank, 2 * m.heads * hd)]
            else:
                mats += [("q", d, m.heads * hd), ("k", d, m.kv_heads * hd), ("v", d, m.kv_heads * hd)]
            mats.append(("o", m.heads * hd, d))
        if kind != ATTENTION:
            if kind is True:
                mats.append(("router", d, m.experts))
            ffn = m.ffn * m.shared_experts if kind is True else (m.ffn if kind else m.dense_ffn_)
            if ffn:
                mats += [("gate", d, ffn), ("up", d, ffn)] if m.mlp == "swiglu" else [("up", d, ffn)]
                mats.append(("down", ffn, d))
    return tuple((name, i, o, n % 2 == 1) for n, (name, i, o) in enumerate(mats))


def dots_saved_matmuls(m: ModelSpec, kind) -> tuple[tuple[str, int, int], ...]:
    """The weight matmuls whose outputs JAX's checkpoint_dots_with_no_batch_dims (training.recompute "dots",
    MaxText's remat_policy "minimal") keeps for one dense layer's backward: (name, in, out) in
    `op_sac_matmuls`' names. The policy makes every dot_general without batch dimensions saveable (the attention
    core's batched dots are not), and jax.checkpoint then drops the saved values the backward never reads
    (ad_checkpoint.remat_partial_eval: pe.dce_jaxpr over the staged part): the outputs that only feed the
    residual sum (`residual_output_matmuls`). jax 0.10.2's print_saved_residuals on a toy layer lists x, q, k,
    v and the MLP's up projection for a parallel block, and attention's output projection too for a
    sequential one (its sum with x feeds the MLP's norm); never the down projection."""
    dead = {"fc2": "down"}
    dropped = {dead.get(name, name) for name in residual_output_matmuls(m, kind)}
    return tuple((name, i, o) for name, i, o, _ in op_sac_matmuls(m, kind) if name not in dropped)


def op_sac_recomputed_params(m: ModelSpec, kind) -> int:
    """Weights of the matmuls op-level selective checkpointing runs again in one layer (`op_sac_matmuls`)."""
    return sum(i * o for _, i, o, again in op_sac_matmuls(m, kind) if again)


def mtp_kind(m: ModelSpec):
    """The kind of a multi-token prediction module's layer: the model's last (DeepSeek-V3: MoE)."""
    return m.layer_kinds[-1]


def mtp_proj_params(m: ModelSpec) -> int:
    """A multi-token prediction module's projection of [hidden state; next embedding], W[2D, D]."""
    return 2 * m.hidden * m.hidden


def output_heads(m: ModelSpec) -> int:
    """Output projections (and losses) per token: the model's and one per multi-token prediction module."""
    return 1 + m.mtp_layers


def matmul_flops_per_token(m: ModelSpec) -> float:
    """Forward FLOPs per token of every weight matmul (2 per weight used), logits included; each
    multi-token prediction module adds its projection, its layer and another pass through the head."""
    mtp = m.mtp_layers * (mtp_proj_params(m) + layer_matmul_params(m, mtp_kind(m))) if m.mtp_layers else 0
    return 2.0 * (sum(n * layer_matmul_params(m, k) for k, n in kind_counts(m)) + mtp
                  + output_heads(m) * m.vocab * m.hidden)


def layer_attention_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> float:
    """One attention layer's forward Q.K^T and P.V FLOPs per token, full S x S square (Narayanan et al.
    2021 eq. 3): 2 S N (qk + H), growing with the sequence."""
    s = seq_len or m.seq_len
    qk = m.head_dim_ + m.rope_head_dim
    return 2.0 * s * m.heads * (qk + m.head_dim_)


def window_band(window: int, seq_len: int) -> float:
    """The share of the S x S score square that a causal sliding window of W keys computes: each query
    scores min(position + 1, W) keys, (W S - W (W - 1) / 2) / S^2 (the causal triangle, 1/2 + 1/2S, from
    W = S on)."""
    w = min(window, seq_len)
    return (w * seq_len - w * (w - 1) / 2) / seq_len ** 2


def windowed_square(m: ModelSpec, seq_len: int | None = None) -> float:
    """The attention layers' mean share of the full square in this module's convention (causal masking
    ignored, so a causal layer counts 1): a windowed layer (`ModelSpec.sliding_window`) counts twice its
    band, the causal masking ignored alike."""
    if not m.windowed_share:
        return 1.0
    band = min(1.0, 2 * window_band(m.sliding_window, seq_len or m.seq_len))
    return 1.0 - m.windowed_share + m.windowed_share * band


def attention_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> float:
    """Every attention layer's score FLOPs per token (see `layer_attention_flops_per_token`; windowed
    layers their band, `windowed_square`), the multi-token prediction modules' layers included."""
    layers = m.attention_layers * windowed_square(m, seq_len) + m.mtp_layers
    return layer_attention_flops_per_token(m, seq_len) * layers


def ssd_chunk(m: ModelSpec, seq_len: int | None = None) -> int:
    """The SSD chunk length Q a sequence runs with: a sequence shorter than one chunk is one chunk."""
    return min(m.ssm_chunk, seq_len or m.seq_len)


@dataclass(frozen=True)
class SsdMatmul:
    """One of the chunked SSD algorithm's matmuls, once per chunk per head (or per group):
    In[rows, inner] . W[inner, cols]."""

    name: str
    per: str  # "head" or "group"
    rows: int
    inner: int
    cols: int

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.inner * self.cols


def ssd_matmuls(m: ModelSpec, seq_len: int | None = None) -> tuple[SsdMatmul, ...]:
    """Dao & Gu 2024 sec. 6 and Listing 1 (`ssd_minimal_discrete`), chunk length Q, state N, head dim P:
    within each chunk the scores C . B^T (Q x Q, once per group: mamba_ssm's `_bmm_chunk_fwd` takes
    the groups' B and C), masked by the decays and applied to x (per head); each chunk's final state
    B^T . x (N x P per head); after the recurrence over chunks, each chunk's incoming state read out
    as C . h (per head). The masks and decays are elementwise and not counted."""
    q, n, p = ssd_chunk(m, seq_len), m.ssm_state, m.ssm_head_dim
    return (SsdMatmul("ssd scores C.B^T", "group", q, n, q),
            SsdMatmul("ssd intra-chunk output", "head", q, q, p),
            SsdMatmul("ssd chunk states B^T.x", "head", n, q, p),
            SsdMatmul("ssd state output C.h", "head", q, n, p))


def ssm_layer_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> float:
    """One Mamba-2 layer's forward FLOPs per token besides its projections: the SSD chunk matmuls
    (`ssd_matmuls`, each once per chunk of Q tokens), the state recurrence between chunks (h = a h + s:
    2 N P per head per chunk) and the depthwise conv (2 K per channel of xBC). Per token that is
    2 Q (N G + P H) + 4 N P H + 2 N P H / Q + 2 K (e + 2 G N): linear in S, quadratic only in Q."""
    q = ssd_chunk(m, seq_len)
    count = {"head": m.ssm_heads, "group": m.ssm_groups}
    chunk = sum(mm.flops * count[mm.per] for mm in ssd_matmuls(m, seq_len))
    recurrence = 2.0 * m.ssm_state * m.ssm_head_dim * m.ssm_heads
    conv = 2.0 * m.ssm_conv * (m.ssm_inner + 2 * m.ssm_groups * m.ssm_state)
    return (chunk + recurrence) / q + conv


def ssm_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> float:
    """Every Mamba-2 layer's scan and conv FLOPs per token (see `ssm_layer_flops_per_token`)."""
    layers = m.layer_pattern.count(MAMBA)
    return ssm_layer_flops_per_token(m, seq_len) * layers if layers else 0.0


def layer_forward_flops_per_token(m: ModelSpec, kind, seq_len: int | None = None,
                                  causal: bool = False) -> float:
    """Forward FLOPs per token of one layer of `kind`: its weight matmuls, attention's scores, the SSD
    scan; the model's forward is the sum over its layers plus the logits."""
    flops = 2.0 * layer_matmul_params(m, kind)
    if kind in (False, True, ATTENTION):
        flops += layer_attention_flops_per_token(m, seq_len) * windowed_square(m, seq_len) * (0.5 if causal else 1.0)
    if kind == MAMBA:
        flops += ssm_layer_flops_per_token(m, seq_len)
    return flops


def forward_flops(m: ModelSpec, tokens: float, causal: bool = False) -> float:
    """`causal` counts only the unmasked half of the attention square (the other common convention)."""
    return tokens * (matmul_flops_per_token(m) + attention_flops_per_token(m) * (0.5 if causal else 1.0)
                     + ssm_flops_per_token(m))


def model_flops(m: ModelSpec, tokens: float, causal: bool = False) -> float:
    """Model FLOPs of one training step over `tokens` tokens: forward + backward, no recomputation."""
    return 3.0 * forward_flops(m, tokens, causal)


def residual_output_matmuls(m: ModelSpec, kind) -> tuple[str, ...]:
    """A layer's matmuls (planner.costs' GEMM names) whose outputs only feed the residual sum, so a backward
    needs their inputs and weights but never their outputs (planner.costs.full_recompute): the dense MLP's or
    the shared experts' down projection ("fc2"), Mamba-2's "out_proj", and attention's output projection ("o")
    where nothing else reads its sum with the residual: in an attention-only layer, or a parallel block
    (`ModelSpec.parallel_block`). In a sequential block the MLP's norm reads x + o, so "o" is live; a MoE
    layer's routed experts' outputs are live too (the combine weighs them by the router's probabilities, whose
    gradient reads them). Checked with jax 0.10.2 on a toy layer (q, k, v, scores, p.v, o, up, down): the
    jaxpr of the gradient through jax.checkpoint runs 6 of the 8 forward dot_generals again for a parallel
    block (not o, not down) and 7 for a sequential one (not down)."""
    if kind == MAMBA:
        return ("out_proj",)
    has_mlp = kind != ATTENTION and (kind is not True or m.shared_experts > 0)
    out_is_dead = kind == ATTENTION or (m.parallel_block and kind != MLP)
    return (("o",) if out_is_dead else ()) + (("fc2",) if has_mlp else ())


def residual_output_params(m: ModelSpec, kind) -> int:
    """Weights a token meets in `residual_output_matmuls`' matmuls of one layer."""
    d = m.hidden
    sizes = {"out_proj": m.ssm_inner * d, "o": m.heads * m.head_dim_ * d,
             "fc2": (m.shared_experts * m.ffn if kind is True else m.ffn if kind == MLP else m.dense_ffn_) * d}
    return sum(sizes[name] for name in residual_output_matmuls(m, kind))


def _every_layer(m: ModelSpec, per_layer) -> float:
    """`per_layer(m, kind)` summed over the model's layers and its multi-token prediction modules' layers."""
    total = sum(n * per_layer(m, k) for k, n in kind_counts(m))
    return total + (m.mtp_layers * per_layer(m, mtp_kind(m)) if m.mtp_layers else 0)


def hardware_flops(m: ModelSpec, tokens: float, recompute: str, modules: tuple[str, ...] = ("core_attn",),
                   skips_residual_outputs: bool = False) -> float:
    """FLOPs the chips execute: model FLOPs plus what recomputation repeats.

    full: every layer's forward again, the multi-token prediction modules' too (the logits are not
    recomputed), less the matmuls whose outputs only feed the residual sum (`residual_output_params`) where
    the recomputation drops them (`skips_residual_outputs`: JAX / XLA on TPU, planner.costs.full_recompute);
    selective: the matmuls of the `modules` it runs again (planner.case.RECOMPUTE_MODULES): core_attn the
    attention score/softmax part (Korthikanti et al. 2022, sec. 5), mla_up_proj MLA's up-projections, mlp the
    dense layers' MLPs, shared_experts the shared experts (the norms and activations are no matmuls);
    selective-op: every second matmul of each layer (`op_sac_matmuls`);
    dots: the attention core only (every weight matmul's output is kept: `dots_saved_matmuls`).
    """
    layers_fwd = tokens * (matmul_flops_per_token(m) - 2.0 * output_heads(m) * m.vocab * m.hidden
                           + ssm_flops_per_token(m))
    attn_fwd = tokens * attention_flops_per_token(m)
    if recompute == "full":
        if skips_residual_outputs:
            layers_fwd -= 2.0 * tokens * _every_layer(m, residual_output_params)
        return model_flops(m, tokens) + layers_fwd + attn_fwd
    if recompute == "selective":
        return model_flops(m, tokens) + tokens * _selective_flops_per_token(m, modules)
    if recompute == "selective-op":
        return model_flops(m, tokens) + 2.0 * tokens * _every_layer(m, op_sac_recomputed_params)
    if recompute == "dots":
        return model_flops(m, tokens) + attn_fwd
    return model_flops(m, tokens)


def _selective_flops_per_token(m: ModelSpec, modules: tuple[str, ...]) -> float:
    """Forward matmul FLOPs per token that selective recomputation of `modules` repeats (`hardware_flops`)."""
    out = attention_flops_per_token(m) if "core_attn" in modules else 0.0
    layers = m.layers + m.mtp_layers
    if "mla_up_proj" in modules:
        out += 2.0 * layers * mla_up_proj_params(m)
    if "mlp" in modules:  # the layers with a dense MLP: a pattern's "-" layers, an MoE model's first dense ones
        dense = m.layer_pattern.count(MLP) if m.layer_pattern else m.dense_layers if m.is_moe else m.layers
        out += 2.0 * dense * _mlp_params(m, m.dense_ffn_)
    if "shared_experts" in modules and m.is_moe:
        out += 2.0 * (layers - m.dense_layers) * m.shared_experts * _mlp_params(m, m.ffn)
    return out


def megatron_flops(m: ModelSpec, global_batch: int) -> float:
    """Narayanan et al. 2021 eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), GPT shapes with full recompute."""
    b, s, l, h, v = global_batch, m.seq_len, m.layers, m.hidden, m.vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
