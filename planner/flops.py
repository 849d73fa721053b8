"""Parameter counts and FLOPs of a `ModelSpec`, per layer and per step.

Notation (scaling-book style): B batch, S sequence, D hidden, F MLP inner size, N query heads,
K kv heads, H head dim, V vocabulary, L layers. A matmul `In[B, D] . W[D, F]` costs 2*B*D*F FLOPs
forward and twice that backward (one matmul for the input gradient, one for the weight gradient),
so a training pass costs 3x the forward and a fully recomputed one 4x.

Definitions (Chowdhery et al. 2022, PaLM, Appendix B):
* model FLOPs: what the model needs per step with no recomputation, 3 * forward FLOPs. MFU is
  model FLOPs per second over the chips' peak.
* hardware FLOPs: what the chips actually execute, recomputation included. HFU is hardware FLOPs per
  second over peak. Megatron-LM's "TFLOP/s per GPU" (Narayanan et al. 2021, eq. 3) is hardware FLOPs.
* attention score FLOPs (Q.K^T and P.V) are counted over the full S x S square, causal masking
  ignored, as Narayanan et al. 2021 (eq. 3) does; the simulator separately knows that a causal
  flash-attention kernel skips about half of that work. `causal=True` gives the other convention
  (half the square); at long context the two MFUs differ a lot (128K tokens: ~1.4x for Llama 3 405B).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.models import ModelSpec


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one Transformer layer, split by how they shard."""

    attention: int  # Q, K, V, O projections (sharded by TP)
    mlp: int  # dense MLP, or the shared experts of an MoE layer (sharded by TP)
    experts: int  # routed experts (sharded by EP, then TP)
    router: int  # MoE gate (replicated)
    norms: int  # norm scales/biases and projection biases (replicated across TP)

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.experts + self.router + self.norms


def _mlp_params(m: ModelSpec, ffn: int) -> int:
    # GELU: up D->F and down F->D; SwiGLU: gate and up D->F, down F->D (Shazeer 2020)
    return (3 if m.mlp == "swiglu" else 2) * m.hidden * ffn


def attention_params(m: ModelSpec) -> int:
    d, n, k, hd = m.hidden, m.heads, m.kv_heads, m.head_dim_
    if m.is_mla:
        # DeepSeek-V2 (arXiv 2405.04434) sec. 2.1.2: W_DQ, W_UQ (with the RoPE part), W_DKV + W_KR,
        # W_UK, W_UV, W_O
        q = (d * m.q_lora_rank + m.q_lora_rank * n * (hd + m.rope_head_dim)) if m.q_lora_rank \
            else d * n * (hd + m.rope_head_dim)
        kv = d * (m.kv_lora_rank + m.rope_head_dim) + m.kv_lora_rank * n * 2 * hd
        return q + kv + n * hd * d
    # Q: D->N*H, K and V: D->K*H each, O: N*H->D (Ainslie et al. 2023 for GQA)
    return d * n * hd + 2 * d * k * hd + n * hd * d


def kv_projection_params(m: ModelSpec) -> int:
    """The K and V projections of GQA: with tp > kv_heads each TP rank keeps whole kv heads, so these
    split only kv_heads ways (Megatron-LM replicates kv heads across TP ranks)."""
    return 0 if m.is_mla else 2 * m.hidden * m.kv_heads * m.head_dim_


@lru_cache(maxsize=256)
def layer_params(m: ModelSpec, moe: bool) -> LayerParams:
    """One layer's parameters; `moe` picks an MoE layer, else a dense one."""
    d = m.hidden
    gpt = m.mlp == "gelu"
    # GPT recipe: LayerNorm (scale + bias) x2 and biases on every projection; Llama recipe: RMSNorm x2
    norms = 4 * d if gpt else 2 * d
    if m.is_mla:
        norms += m.kv_lora_rank + m.q_lora_rank  # RMSNorms on the latents (DeepSeek-V2 config)
    if gpt:
        norms += m.heads * m.head_dim_ + 2 * m.kv_heads * m.head_dim_ + d + m.ffn + d
    if moe:
        return LayerParams(attention_params(m), m.shared_experts * _mlp_params(m, m.ffn),
                           m.experts * _mlp_params(m, m.ffn), d * m.experts, norms)
    return LayerParams(attention_params(m), _mlp_params(m, m.dense_ffn_), 0, 0, norms)


def embedding_params(m: ModelSpec) -> int:
    """Input embedding plus the output projection unless tied (plus GPT's learned positions)."""
    pos = m.seq_len * m.hidden if m.mlp == "gelu" else 0
    return m.vocab * m.hidden * (1 if m.tied_embeddings else 2) + pos + m.hidden  # + final norm


def total_params(m: ModelSpec) -> int:
    dense = m.layers - m.moe_layers
    return (dense * layer_params(m, False).total + m.moe_layers * layer_params(m, True).total
            + embedding_params(m))


def active_params(m: ModelSpec) -> int:
    """Parameters one token passes through: routed experts count top_k of E (DeepSeek's "37B active")."""
    moe = layer_params(m, True)
    moe_active = moe.total - moe.experts + (moe.experts // m.experts) * m.top_k if m.is_moe else 0
    dense = m.layers - m.moe_layers
    return dense * layer_params(m, False).total + m.moe_layers * moe_active + embedding_params(m)


def matmul_flops_per_token(m: ModelSpec) -> float:
    """Forward FLOPs per token of every weight matmul (2 per weight used), logits included."""
    moe = layer_params(m, True)
    dense = layer_params(m, False)
    per_expert = moe.experts // m.experts if m.is_moe else 0
    moe_w = moe.attention + moe.mlp + per_expert * m.top_k + moe.router
    dense_w = dense.attention + dense.mlp
    return 2.0 * ((m.layers - m.moe_layers) * dense_w + m.moe_layers * moe_w + m.vocab * m.hidden)


def attention_flops_per_token(m: ModelSpec, seq_len: int | None = None) -> float:
    """Forward Q.K^T and P.V FLOPs per token over the full S x S square (Narayanan et al. 2021 eq. 3)."""
    s = seq_len or m.seq_len
    qk = m.head_dim_ + m.rope_head_dim
    return 2.0 * s * m.heads * (qk + m.head_dim_) * m.layers


def forward_flops(m: ModelSpec, tokens: float, causal: bool = False) -> float:
    """`causal` counts only the unmasked half of the attention square (the other common convention)."""
    return tokens * (matmul_flops_per_token(m) + attention_flops_per_token(m) * (0.5 if causal else 1.0))


def model_flops(m: ModelSpec, tokens: float, causal: bool = False) -> float:
    """Model FLOPs of one training step over `tokens` tokens: forward + backward, no recomputation."""
    return 3.0 * forward_flops(m, tokens, causal)


def hardware_flops(m: ModelSpec, tokens: float, recompute: str) -> float:
    """FLOPs the chips execute: model FLOPs plus what recomputation repeats.

    full: every layer's forward again (the logits are not recomputed); selective: only the attention
    score/softmax part (Korthikanti et al. 2022, sec. 4.2).
    """
    layers_fwd = tokens * (matmul_flops_per_token(m) - 2.0 * m.vocab * m.hidden)
    attn_fwd = tokens * attention_flops_per_token(m)
    if recompute == "full":
        return model_flops(m, tokens) + layers_fwd + attn_fwd
    if recompute == "selective":
        return model_flops(m, tokens) + attn_fwd
    return model_flops(m, tokens)


def megatron_flops(m: ModelSpec, global_batch: int) -> float:
    """Narayanan et al. 2021 eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), GPT shapes with full recompute."""
    b, s, l, h, v = global_batch, m.seq_len, m.layers, m.hidden, m.vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
