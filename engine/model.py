"""A small Llama-style decoder, readable in one file, deterministic from a seed.

    tokens[B, T] -> embed -> L x Block(RMSNorm -> rotary GQA attention -> RMSNorm -> SwiGLU or MoE) -> Head

or, with `arch` mamba2 or hybrid, some or all layers a MambaBlock (RMSNorm -> Mamba-2 mixer, engine/mamba.py).

The model is a flat list of *units* (embed, L0 .. L{n-1}, head). Every strategy runs the same units in
the same order; sharded strategies swap in their own parameter tensors with `torch.func.functional_call`,
so the model code knows nothing about parallelism (the torchtitan habit: a strategy is a plan applied to
an unchanged model).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from core.moe import expert_capacity
from engine.config import MAMBA, ModelConfig, data_seed, unit_forward_flops  # noqa: F401 - unit_forward_flops re-exported
from engine.mamba import Mamba2, init_mamba_


class RMSNorm(nn.Module):
    # Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4.
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Su et al. 2021, "RoFormer", eq. 34: frequency theta^(-2i/d) for pair i.
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x, cos, sin):
    """x[B, h, T, d]: rotate each (even, odd) pair by its position's angle."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    """Causal attention with grouped KV heads (Ainslie et al. 2023, "GQA"): each KV head serves
    heads/kv_heads query heads.

    Two hooks let a strategy drive the unchanged module: `positions` (the absolute token positions of
    this rank's rows, for rotary; None means 0..T-1) and `attend(q[B,h,T,d], k[B,kv,T,d], v) -> y[B,h,T,d]`
    (context parallel replaces it with ring attention; K/V arrive with kv_heads heads, not repeated).
    """

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = m.heads, m.kv_heads, m.head_dim
        self.wq = nn.Linear(m.hidden, m.heads * m.head_dim, bias=False)
        self.wk = nn.Linear(m.hidden, m.kv_heads * m.head_dim, bias=False)
        self.wv = nn.Linear(m.hidden, m.kv_heads * m.head_dim, bias=False)
        self.wo = nn.Linear(m.heads * m.head_dim, m.hidden, bias=False)
        cos, sin = rotary_tables(m.seq_len, m.head_dim, m.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.positions: torch.Tensor | None = None

    def attend(self, q, k, v):
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        pos = slice(t) if self.positions is None else self.positions
        q = apply_rotary(q, self.cos[pos], self.sin[pos])
        k = apply_rotary(k, self.cos[pos], self.sin[pos])
        y = self.attend(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    # Shazeer 2020, "GLU Variants Improve Transformer", eq. 6 (FFN_SwiGLU).
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route(logits, top_k: int):
    """logits[N, E] -> (weights[N, k], chosen[N, k]): the k largest logits, softmax over them (Mixtral).
    A stable sort puts equal logits in expert order, so exact ties go to the lower expert index, the
    same way on every rank and in the reference (topk leaves the order of ties unspecified)."""
    values, order = logits.sort(dim=-1, descending=True, stable=True)
    return values[..., :top_k].softmax(dim=-1), order[..., :top_k]


def capacity_keep(chosen, experts: int, capacity: int):
    """chosen[S, T, k] -> keep[S, T, k] (bool). The group is one sequence: each expert accepts its first
    `capacity` assignments in priority order, all first choices before any second choice and earlier
    tokens first (GShard's Algorithm 1 order); the rest are dropped (their expert output is zero)."""
    s, t, k = chosen.shape
    slot_major = chosen.transpose(1, 2).reshape(s, k * t)
    onehot = F.one_hot(slot_major, experts)
    rank_in_expert = (onehot.cumsum(dim=1) * onehot).sum(-1) - 1  # 0 for an expert's first assignment
    return (rank_in_expert < capacity).view(s, k, t).transpose(1, 2).contiguous()


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Shazeer et al. 2017; softmax over the chosen k as in Mixtral).

    No auxiliary loss. Without a capacity factor every token reaches its k experts, so a token's output
    does not depend on which other tokens share its batch. With one, each expert takes at most
    `expert_capacity` tokens per sequence: still independent of the other sequences, so any split of
    the batch into whole sequences (dp, ep) computes exactly what the whole batch computes.
    """

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.top_k = m.top_k
        self.capacity_factor = m.capacity_factor
        self.router = nn.Linear(m.hidden, m.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(m.hidden, m.ffn) for _ in range(m.experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        # The router in fp32 whatever the compute precision (Megatron-Core's --moe-router-dtype fp32): a bf16
        # logit rounds differently when the batch is split differently, and a near-tie then flips a
        # token's experts, which no tolerance can absorb.
        with torch.autocast(flat.device.type, enabled=False):
            weights, chosen = route(self.router(flat.float()), self.top_k)
        keep = torch.ones_like(chosen, dtype=torch.bool)
        if self.capacity_factor is not None:
            cap = expert_capacity(self.capacity_factor, x.shape[1], self.top_k, len(self.experts))
            keep = capacity_keep(chosen.view(*x.shape[:2], -1), len(self.experts), cap).view_as(chosen)
        return self.dispatch(flat, weights, chosen, keep).view_as(x)

    def dispatch(self, flat, weights, chosen, keep):
        """flat[N, D] -> sum over each token's kept choices of weight * expert(token): out[N, D].
        The hook expert parallel replaces with its all-to-all exchange."""
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            # An expert that no token chose still runs (on zero rows), so every parameter gets a
            # gradient on every rank and gradient hooks fire the same way everywhere.
            token, slot = ((chosen == e) & keep).nonzero(as_tuple=True)
            out = out.index_add(0, token, (expert(flat[token]) * weights[token, slot, None]).to(out.dtype))
        return out


class Block(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(m.hidden)
        self.attn = Attention(m)
        self.mlp_norm = RMSNorm(m.hidden)
        self.mlp = MoE(m) if m.mlp == "moe" else SwiGLU(m.hidden, m.ffn)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MambaBlock(nn.Module):
    """A Mamba-2 model's layer: x + Mamba2(RMSNorm(x)) (Dao & Gu 2024 sec. 7; no MLP)."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(m.hidden)
        self.mixer = Mamba2(m)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class Embed(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(m.vocab, m.hidden)

    def forward(self, tokens):
        return self.tok(tokens)


class Head(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(m.hidden)
        self.out = nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


class LanguageModel(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.config = m
        layers = (MambaBlock(m) if kind == MAMBA else Block(m) for kind in m.kinds)
        self.units = nn.ModuleList([Embed(m), *layers, Head(m)])

    @property
    def unit_names(self) -> list[str]:
        return ["embed", *(f"L{i}" for i in range(self.config.layers)), "head"]

    @property
    def global_units(self) -> list[int]:
        """The full model's index of each unit (a pipeline stage holds some: engine/pipeline/stage.StageModel)."""
        return list(range(len(self.units)))

    def global_name(self, name: str) -> str:
        return name

    def forward(self, tokens):
        x = tokens
        for unit in self.units:
            x = unit(x)
        return x


def build_model(m: ModelConfig, seed: int) -> LanguageModel:
    """The same weights on every rank and in the reference: built on CPU from `seed`, then moved."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LanguageModel(m)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02)
    init_mamba_(model)
    torch.random.set_rng_state(gen_state)
    return model


def mixed_precision(dtype: str, device_type: str):
    """The context every unit's forward runs in. "bfloat16": torch.autocast, the weights kept in fp32 (as
    are their gradients and Adam's state) and cast to bf16 for each matmul, which computes in bf16, as
    mixed-precision training does (Micikevicius et al. 2018; Megatron-LM's --bf16); elementwise work (norms,
    the residual stream) stays in the precision of its inputs. "float32": no change."""
    if dtype == "bfloat16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_fn(logits, targets):
    """Mean next-token cross entropy over the tokens of this batch, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def global_batch(m: ModelConfig, seed: int, step: int, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets of one optimizer step, the same on every rank."""
    gen = torch.Generator().manual_seed(data_seed(seed, step))
    data = torch.randint(0, m.vocab, (sequences, m.seq_len + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def micro_batch_rows(batch_index: int, micro_batch: int, micro_batches: int, size: int) -> slice:
    """The rows of the global batch one rank computes in one micro-batch: part `batch_index` of the
    batch's sequences (core/mesh.py), cut into `micro_batches` micro-batches of `size` sequences."""
    first = (batch_index * micro_batches + micro_batch) * size
    return slice(first, first + size)


def param_count(m: ModelConfig) -> int:
    return sum(p.numel() for p in LanguageModel(m).parameters())
