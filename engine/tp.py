"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) and sequence parallel (Korthikanti et al. 2022).

Each matmul pair of a block is split over the tp ranks so that only one all-reduce is needed per pair.
The first matmul is split by its output columns, the second by its input rows:

    column-parallel:  In[B, S, D] . W_in[D, F_tp]  -> H[B, S, F_tp]          (no communication)
    row-parallel:     H[B, S, F_tp] . W_out[F_tp, D] -> Out[B, S, D]{U_tp}     (partial sums: all-reduce)

              W_in split by columns              W_out split by rows
             +------+------+------+             +-------------------+
    In  .    | W_0  | W_1  | W_2  |   ->  H_r . |       W_0         |  -> partial Out_r
   [B,S,D]   |      |      |      |             +-------------------+
             +------+------+------+             |       W_1         |     Out = sum_r Out_r
              rank 0 rank 1 rank 2              +-------------------+     (all-reduce over tp)
                                                |       W_2         |
                                                +-------------------+

What is split where (torch's nn.Linear stores W as [out, in], so "columns of W_in" are its rows):

    attention   wq, wk, wv column-parallel by heads, wo row-parallel: a rank computes heads/tp query heads
                and the KV heads they read (GQA groups stay on one rank). With tp > kv_heads a KV head is
                replicated on tp/kv_heads neighbouring ranks and its gradient summed over them.
    SwiGLU      w1 (gate), w3 (up) column-parallel by ffn, w2 (down) row-parallel.
    embedding   vocabulary-parallel: rank r owns rows [r V/tp, (r+1) V/tp) of the table; a token outside
                them looks up zeros, and the all-reduce over tp fills in the owner's row.
                    Tok[B, S] . E[V_tp, D] -> X[B, S, D]{U_tp}
    output      column-parallel by the vocabulary: X[B, S, D] . W[D, V_tp] -> Logits[B, S, V_tp], and the
                cross entropy never gathers the logits (Megatron's vocab_parallel_cross_entropy): the max
                and the sum of exponentials are all-reduced over tp, as is the target's logit, which only
                its owner has.

The regions are entered with `copy_to_tp` (f) and left with `reduce_from_tp` (g), engine/tp_comm.py.
Per layer that is one all-reduce of B*S*D forward and one backward for attention and for the MLP:
4 all-reduces of b*s*h per layer per micro-batch (Korthikanti et al. 2022, section 4.2.2), plus one for the
embedding (forward) and one for the output layer's input (backward); see `tp_comm_bytes`.

Sequence parallel (`sequence_parallel=True`): between the regions (RMSNorms, residual adds) the
activations are split along the sequence, X[B, S_tp, D]. The region is entered with an all-gather of the
sequence and left with a reduce-scatter, whose ring bytes add up to the all-reduce they replace, while
every rank now stores 1/tp of the norms' and residuals' activations. A norm's weight then only sees
S/tp positions on each rank, so its gradient is summed over tp (one all-reduce of D floats per norm).
Megatron also re-gathers the column layer's input in backward instead of storing it whole; this engine
keeps it, so the bytes stay exactly equal to plain TP.

MoE layers are not split over tp (their experts are split over ep instead, engine/ep.py): the block's
attention is tensor parallel and its MoE runs on the tokens every tp rank holds, whole. Without sequence
parallel those are the same tokens on every tp rank, which then compute the same MoE output (as in
Megatron-LM with expert-tensor-parallel size 1 and no sequence parallel); with it each rank routes its own
S/tp positions, and the MoE weights' gradients are summed over tp like the norms'.

A plan applied to an unchanged model: `TensorParallelPlan` swaps the model's leaves (linears, the
embedding, the norms) for their tp versions, with the same parameter names, before the data-parallel
sharder (engine/strategy.py) sees the now tp-local parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ATTENTION, MAMBA, RunConfig
from engine.model import Attention, Block, LanguageModel, MambaBlock, MoE, RMSNorm
from engine.strategy import Plan
from engine.tp_comm import TP, copy_to_tp, gather_from_sp, reduce_from_tp, scatter_to_sp, sum_over_replicas
from hardware.collectives import ring_sent_bytes

ROWS, COLS, REPLICATED = "rows", "cols", "replicated"  # how a parameter [out, in] is split over tp


class TPGroup:
    """This rank's place in its tp group and how regions are entered and left."""

    def __init__(self, comm, sequence_parallel: bool):
        self.comm, self.sp = comm, sequence_parallel
        self.size, self.rank = comm.size(TP), comm.group_rank(TP)

    def enter(self, x, where: str):
        return gather_from_sp(x, self.comm, where) if self.sp else copy_to_tp(x, self.comm, where)

    def exit(self, x, where: str):
        return scatter_to_sp(x, self.comm, where) if self.sp else reduce_from_tp(x, self.comm, where)

    def rows(self, w: torch.Tensor, parts: int | None = None, part: int | None = None) -> nn.Parameter:
        """This rank's block of rows of w (or block `part` of `parts`)."""
        parts, part = parts or self.size, self.rank if part is None else part
        n = w.shape[0] // parts
        return nn.Parameter(w.detach()[part * n: (part + 1) * n].clone())

    def cols(self, w: torch.Tensor) -> nn.Parameter:
        n = w.shape[1] // self.size
        return nn.Parameter(w.detach()[:, self.rank * n: (self.rank + 1) * n].clone())


class ColumnParallelLinear(nn.Module):
    """In[B, S, D] . W[D, F_tp] -> H[B, S, F_tp]. Its input is already the region's (entered once for all
    the column layers reading it: q, k, v or gate, up, as Megatron's fused QKV does)."""

    def __init__(self, weight: nn.Parameter, tp: TPGroup, replica: tuple[int, int] | None = None,
                 where: str = ""):
        super().__init__()
        self.weight, self.tp, self.replica, self.where = weight, tp, replica, where

    def forward(self, x):
        w = self.weight
        if self.replica is not None:
            w = sum_over_replicas(w, self.tp.comm, *self.replica, self.where)
        return F.linear(x, w)


class RowParallelLinear(nn.Module):
    """H[B, S, F_tp] . W[F_tp, D] -> Out[B, S, D]{U_tp}, then leaves the region (all-reduce, or a
    reduce-scatter of the sequence with sequence parallel)."""

    def __init__(self, weight: nn.Parameter, tp: TPGroup, where: str):
        super().__init__()
        self.weight, self.tp, self.where = weight, tp, where

    def forward(self, h):
        return self.tp.exit(F.linear(h, self.weight), self.where)


class EnterRegionNorm(RMSNorm):
    """The RMSNorm in front of a tp region, then the region's entry (`enter=False`: in front of an MoE
    layer, which is no tp region). With sequence parallel the norm runs on this rank's S/tp positions and
    its weight's gradient is summed over tp."""

    def __init__(self, norm: RMSNorm, tp: TPGroup, where: str, enter: bool = True):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight, self.tp, self.where, self.enter = norm.weight, tp, where, enter

    def forward(self, x):
        w = copy_to_tp(self.weight, self.tp.comm, f"{self.where} norm") if self.tp.sp else self.weight
        # RMSNorm.forward (Zhang & Sennrich 2019, eq. 4) with that weight
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w
        return self.tp.enter(y, self.where) if self.enter else y


class SequenceShardLinear(nn.Module):
    """A whole (not split) linear layer run on this rank's S/tp positions under sequence parallel: its
    weight's gradient covers only those positions, so it is summed over tp (as the norms' are)."""

    def __init__(self, weight: nn.Parameter, tp: TPGroup, where: str):
        super().__init__()
        self.weight, self.tp, self.where = weight, tp, where

    def forward(self, x):
        return F.linear(x, copy_to_tp(self.weight, self.tp.comm, self.where))


class VocabParallelEmbedding(nn.Module):
    """Tok[B, S] . E[V_tp, D] -> X[B, S, D]{U_tp}: look up the tokens this rank owns, zeros elsewhere,
    and leave the region (all-reduce, or reduce-scatter to X[B, S_tp, D] with sequence parallel)."""

    def __init__(self, weight: nn.Parameter, tp: TPGroup):
        super().__init__()
        self.weight, self.tp = weight, tp

    def forward(self, tokens):
        rows = self.weight.shape[0]
        local = tokens - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.exit(x.masked_fill(outside[..., None], 0.0), "embed")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of Logits[N, V_tp] without gathering them (Megatron's
    vocab_parallel_cross_entropy): loss_i = log sum_v exp(x_iv - m_i) - (x_i,target - m_i), m_i = max_v x_iv.
    Backward is local: softmax minus the one-hot target, on this rank's vocabulary slice."""

    @staticmethod
    def forward(ctx, logits, targets, tp):
        v_tp = logits.shape[1]
        row_max = logits.detach().max(dim=-1).values
        tp.comm.all_reduce(row_max, TP, name="all_reduce loss max", op="max")
        shifted = logits.detach() - row_max[:, None]
        local = targets - tp.rank * v_tp
        mine = (local >= 0) & (local < v_tp)
        local = local.clamp(0, v_tp - 1)
        exp = shifted.exp()
        # one all-reduce for both per-token sums: sum of exponentials, and the target's shifted logit
        sums = torch.stack([exp.sum(-1), shifted.gather(1, local[:, None]).squeeze(1) * mine])
        tp.comm.all_reduce(sums, TP, name="all_reduce loss sum-exp and target logit")
        ctx.save_for_backward(exp.div_(sums[0][:, None]), local, mine)
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(g.shape[0], device=g.device), local] -= mine.to(g.dtype)
        return g * (grad / g.shape[0]), None, None


def vocab_parallel_cross_entropy(logits, targets, tp: TPGroup):
    return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), tp)


class TensorParallelPlan(Plan):
    """Swaps an unchanged `Transformer`'s leaves for tp versions holding this rank's shards (same
    parameter names), computes the loss on vocabulary-sharded logits, and maps tp-local tensors back to
    full ones for verification. Applied to the whole model first (it needs the embedding and the head)."""

    def __init__(self, model: LanguageModel, comm, sequence_parallel: bool, cp: int = 1):
        self.tp = TPGroup(comm, sequence_parallel)
        self.config, self.cp = model.config, cp
        self.split: dict[str, tuple[str, int]] = {}  # name -> (ROWS|COLS|REPLICATED, replicas per row block)
        self._differing: list[str] = []  # what the last full_state found differing (copies_differing)
        m = model.config
        units = model.units
        units[0].tok = VocabParallelEmbedding(self._rows("units.0.tok.weight", units[0].tok.weight), self.tp)
        for i, block in enumerate(units[1:-1], start=1):
            self._block(f"units.{i}", f"L{i - 1}", block, m)
        head = units[-1]
        head.norm = self._norm(f"units.{len(units) - 1}.norm", "head", head.norm)
        head.out = ColumnParallelLinear(self._rows(f"units.{len(units) - 1}.out.weight", head.out.weight),
                                        self.tp)

    def _rows(self, name, w, replicas: int = 1) -> nn.Parameter:
        self.split[name] = (ROWS, replicas)
        parts = self.tp.size // replicas
        return self.tp.rows(w, parts, self.tp.rank // replicas)

    def _cols(self, name, w) -> nn.Parameter:
        self.split[name] = (COLS, 1)
        return self.tp.cols(w)

    def _norm(self, prefix: str, where: str, norm: RMSNorm) -> EnterRegionNorm:
        self.split[f"{prefix}.weight"] = (REPLICATED, 1)
        return EnterRegionNorm(norm, self.tp, where)

    def _block(self, prefix: str, label: str, block: Block | MambaBlock, m) -> None:
        if isinstance(block, MambaBlock):
            self._mamba(prefix, label, block)
            return
        attn, mlp = block.attn, block.mlp
        block.attn_norm = self._norm(f"{prefix}.attn_norm", f"{label} attn", block.attn_norm)
        self._attention(f"{prefix}.attn", label, attn, m)
        if isinstance(mlp, MoE):
            self._moe(prefix, label, block)
            return
        block.mlp_norm = self._norm(f"{prefix}.mlp_norm", f"{label} mlp", block.mlp_norm)
        mlp.w1 = ColumnParallelLinear(self._rows(f"{prefix}.mlp.w1.weight", mlp.w1.weight), self.tp)
        mlp.w3 = ColumnParallelLinear(self._rows(f"{prefix}.mlp.w3.weight", mlp.w3.weight), self.tp)
        w2 = self._cols(f"{prefix}.mlp.w2.weight", mlp.w2.weight)
        mlp.w2 = RowParallelLinear(w2, self.tp, f"{label} mlp")

    def _moe(self, prefix: str, label: str, block: Block) -> None:
        """An MoE layer stays whole on every tp rank (module docstring); with sequence parallel its
        weights' gradients are summed over tp."""
        self.split[f"{prefix}.mlp_norm.weight"] = (REPLICATED, 1)
        block.mlp_norm = EnterRegionNorm(block.mlp_norm, self.tp, f"{label} mlp", enter=False)
        moe = block.mlp
        self.split[f"{prefix}.mlp.router.weight"] = (REPLICATED, 1)
        for e, expert in enumerate(moe.experts):
            for proj in ("w1", "w3", "w2"):
                self.split[f"{prefix}.mlp.experts.{e}.{proj}.weight"] = (REPLICATED, 1)
        if not self.tp.sp:
            return
        moe.router = SequenceShardLinear(moe.router.weight, self.tp, f"{label} router")
        for e, expert in enumerate(moe.experts):
            for proj in ("w1", "w3", "w2"):
                lin = getattr(expert, proj)
                setattr(expert, proj, SequenceShardLinear(lin.weight, self.tp, f"{label} expert {e} {proj}"))

    def _mamba(self, prefix: str, label: str, block: MambaBlock) -> None:
        """A Mamba-2 layer split by heads (Dao & Gu 2024 sec. 8): z, x, dt and the per-head parameters by
        heads, B and C (and their conv) by groups, the gated norm by groups, all whole on this rank; only
        out_proj's partial sums leave the region, one all-reduce forward (and the f's one backward)."""
        block.norm = self._norm(f"{prefix}.norm", f"{label} mamba", block.norm)
        mixer, p = block.mixer, f"{prefix}.mixer"
        for proj in ("in_z", "in_x", "in_b", "in_c", "in_dt"):
            weight = self._rows(f"{p}.{proj}.weight", getattr(mixer, proj).weight)
            setattr(mixer, proj, ColumnParallelLinear(weight, self.tp))
        for conv in ("conv_x", "conv_b", "conv_c"):
            for kind in ("weight", "bias"):
                module = getattr(mixer, conv)
                setattr(module, kind, self._rows(f"{p}.{conv}.{kind}", getattr(module, kind)))
        for name in ("dt_bias", "A_log", "D"):
            setattr(mixer, name, self._rows(f"{p}.{name}", getattr(mixer, name)))
        mixer.out_norm.weight = self._rows(f"{p}.out_norm.weight", mixer.out_norm.weight)
        mixer.heads, mixer.groups = mixer.heads // self.tp.size, mixer.groups // self.tp.size
        mixer.out_norm.groups = mixer.groups
        mixer.out_proj = RowParallelLinear(self._cols(f"{p}.out_proj.weight", mixer.out_proj.weight), self.tp,
                                           f"{label} mamba")

    def _attention(self, prefix: str, label: str, attn: Attention, m) -> None:
        n = self.tp.size
        replicas = max(1, n // m.kv_heads)  # ranks sharing one KV head when tp > kv_heads
        attn.heads, attn.kv_heads = m.heads // n, max(1, m.kv_heads // n)  # the unchanged forward, local
        attn.wq = ColumnParallelLinear(self._rows(f"{prefix}.wq.weight", attn.wq.weight), self.tp)
        replica = (self.tp.rank // replicas, m.kv_heads) if replicas > 1 else None
        for proj in ("wk", "wv"):
            w = self._rows(f"{prefix}.{proj}.weight", getattr(attn, proj).weight, replicas)
            setattr(attn, proj, ColumnParallelLinear(w, self.tp, replica, f"{label} {proj}"))
        wo = self._cols(f"{prefix}.wo.weight", attn.wo.weight)
        attn.wo = RowParallelLinear(wo, self.tp, f"{label} attn")

    # -- the plan's hooks (engine/strategy.Plan) --------------------------------------------------------
    def loss(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.tp)

    def unit_flops(self, i: int, flops: float, sequences: int) -> float:
        """A rank computes 1/tp of every split matmul; an MoE layer without sequence parallel is computed
        whole on every tp rank, on the tokens this rank holds (1/cp of each sequence)."""
        m, n = self.config, self.tp.size
        if not (m.mlp == "moe" and 0 < i <= m.layers and m.kinds[i - 1] == ATTENTION) or self.tp.sp:
            return flops / n
        moe = 2.0 * sequences * m.seq_len / self.cp * (m.hidden * m.experts + m.top_k * 3 * m.hidden * m.ffn)
        return (flops - moe) / n + moe

    def full_state(self, state: dict) -> dict:
        self._differing = []
        return {quantity: self.unshard(tensors, quantity) for quantity, tensors in state.items()}

    def copies_differing(self) -> list[str]:
        return list(self._differing)

    # -- verification: tp-local tensors back to full ones ----------------------------------------------
    def unshard(self, tensors: dict[str, torch.Tensor], quantity: str = "") -> dict[str, torch.Tensor]:
        """Collective over tp (untraced): every rank calls it with the same names in the same order. A KV head
        repeated on several ranks (tp > kv_heads) is kept once; its copies must agree (`copies_differing`)."""
        comm, n = self.tp.comm, self.tp.size
        out = {}
        with comm.untraced():
            for name in sorted(tensors):
                t = tensors[name]
                kind, replicas = self.split[name]
                if kind == REPLICATED:
                    out[name] = t
                    continue
                parts = torch.empty(n, *t.shape, dtype=t.dtype, device=t.device)
                comm.all_gather(parts, t.contiguous(), TP)
                if kind == ROWS:
                    if replicas > 1 and not all(torch.equal(parts[i], parts[i - i % replicas]) for i in range(n)):
                        self._differing.append(f"{quantity} {name}")
                    out[name] = torch.cat(list(parts[::replicas]), dim=0)
                else:
                    out[name] = torch.cat(list(parts), dim=1)
        return out


def tp_comm_bytes(cfg: RunConfig) -> dict[str, int]:
    """Bytes one rank sends over the tp group per optimizer step, by cause (fp32, ring algorithm).

    Per micro-batch of b sequences of s tokens, hidden h, L layers, A = b*s*h*4 bytes:
      blocks   4 L all-reduces of A (attention and MLP, forward g and backward f; Korthikanti et al. 2022
               section 4.2.2) -- with sequence parallel 4 L (all-gather + reduce-scatter), the same bytes;
               a Mamba-2 layer is one region: 2 (Dao & Gu 2024 sec. 8)
      embed    1 all-reduce of A forward (sp: reduce-scatter forward, all-gather backward)
      head     1 all-reduce of A backward, the output layer's f (sp: all-gather forward, reduce-scatter back)
      loss     all-reduces of b*s floats (max) and 2*b*s floats (sum-exp, target logit)
      kv       with tp > kv_heads: per layer, the wk and wv gradients padded to kv_heads heads
      norms    sequence parallel only: one RMSNorm weight gradient of h floats per norm outside a region
               (2 per attention layer, 1 per Mamba-2 layer, the head's)
    """
    m, n = cfg.model, cfg.parallel.degree("tp", cfg.world)
    tokens = cfg.micro_batch_size * m.seq_len
    act = tokens * m.hidden * 4
    attention, mamba = m.kinds.count(ATTENTION), m.kinds.count(MAMBA)
    out = {
        "blocks": (4 * attention + 2 * mamba) * ring_sent_bytes("all_reduce", act, n),
        "embed": ring_sent_bytes("all_reduce", act, n),
        "head": ring_sent_bytes("all_reduce", act, n),
        "loss": ring_sent_bytes("all_reduce", tokens * 4, n) + ring_sent_bytes("all_reduce", 2 * tokens * 4, n),
        "kv": (2 * attention * ring_sent_bytes("all_reduce", m.kv_heads * m.head_dim * m.hidden * 4, n)
               if n > m.kv_heads else 0),
        "norms": ((2 * attention + mamba + 1) * ring_sent_bytes("all_reduce", m.hidden * 4, n)
                  if cfg.parallel.sequence_parallel else 0),
    }
    return {k: v * cfg.micro_batches for k, v in out.items()}
