"""Context parallel: every rank of the cp group holds a slice of each sequence (two chunks of the zig-zag
split, see engine/ring_attention.py) and the whole model; only attention needs the other ranks' tokens.

    In[B, T_cp, D] with T_cp = T / cp         every per-token op (norms, projections, MLP, loss) is local
    attention: Q[B, h, T_cp, d] against K/V[B, kv, T, d] that lives on all cp ranks

Two ways to bring the keys and values:

* ``ring`` (Liu et al. 2023, "Ring Attention"): cp steps; at each step a rank attends to the K/V block it
  holds while it already sends that block to the next rank and receives the previous rank's (isend/irecv,
  overlapped with the block's compute). Partial outputs merge by the log-sum-exp rule. Backward passes
  K/V around the ring again and, with them, the accumulating dK/dV of each block, which ends at its owner.

      step 0        step 1        step 2        step 3          (cp = 4, rank r holds block r at step 0)
      r0: KV0       r0: KV3       r0: KV2       r0: KV1         each arrow: isend to r+1, irecv from r-1
      r1: KV1  -->  r1: KV0  -->  r1: KV3  -->  r1: KV2

* ``allgather``: all-gather K/V once (backward: reduce-scatter dK/dV); simple, no overlap, and every rank
  holds the whole sequence's K/V.

Bytes one rank sends per attention layer per step, with kv_bytes = 2 * B * kv_heads * (T/cp) * d * 4:
    ring       (cp-1) K/V forward + (cp-1) K/V and cp dK/dV backward  = (3 cp - 2) * kv_bytes
    allgather  all_gather + reduce_scatter of cp * kv_bytes            = 2 (cp-1) * kv_bytes
plus the gradient sync of the data-parallel sharder, whose data axes include cp (the weights are
replicated over cp; core/mesh.py): at ZeRO stage 0 one all-reduce over dp x cp, 2 (n-1)/n * params * 4.

With tensor parallel a rank holds heads/tp of every attention layer and passes only those heads' K/V
around the ring; with sequence parallel its T/cp tokens are split once more over tp outside attention.

The ring's backward is written by hand (`_RingAttention.backward`): autograd cannot differentiate
through isend/irecv, and the hand-written version recomputes each block's probabilities from the saved
log-sum-exp (FlashAttention's backward) instead of keeping every block's K/V and scores alive, and can
overlap the dK/dV transfers with the next block's compute.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from core.ssd import state_correction_flops
from engine.config import MAMBA
from engine.ring_attention import (
    block_backward,
    block_forward,
    block_plan,
    contiguous_positions,
    expand_kv,
    merge,
    reduce_kv,
    zigzag_positions,
)
from engine.ssm_cp import AllToAll, Slices, StatePassing, wait_for
from engine.strategy import Plan

_TAG_KV, _TAG_DKV = 1, 2  # K/V and their gradients travel between the same ranks at the same time


class _Ring:
    """One attention layer's ring: neighbours in the cp group, the chunk size, the diagonal block's mask."""

    def __init__(self, comm, rec, name: str, positions: torch.Tensor):
        self.comm, self.rec, self.name = comm, rec, name
        self.n, self.rank = comm.size("cp"), comm.group_rank("cp")
        self.next, self.prev = (self.rank + 1) % self.n, (self.rank - 1) % self.n
        self.c = len(positions) // 2
        self.diag_mask = positions[:, None] >= positions[None, :]

    def shift(self, t: torch.Tensor, what: str, tag: int):
        """Send `t` to the next rank, receive the previous rank's into a new buffer; both in flight. Posting
        them blocks this rank for a while (gloo writes the message from the calling thread; on busy cores
        that write now and then waits a scheduler tick): a blocking span of its own, "post kv L0", so the
        layer's span around it does not read as compute."""
        buf = torch.empty_like(t)
        start = self.rec.now()
        handles = self.comm.p2p([("send", t, self.next, f"send {what} {self.name}"),
                                 ("recv", buf, self.prev, f"recv {what} {self.name}")], "cp", tag)
        self.rec.add("comm", f"post {what} {self.name}", start, self.rec.now(), group="cp")
        return buf, handles

    def block(self, s: int):
        rows, cols, causal = block_plan(self.rank, (self.rank - s) % self.n, self.c)
        return rows, cols, self.diag_mask if causal else None

    def wait(self, handles, what: str) -> None:
        """Block until this ring's transfers of `what` have arrived (engine/ssm_cp.wait_for: the time
        blocked becomes a wait span, so the layer's span around it does not read as compute)."""
        wait_for(handles, self.rec, f"wait {what} {self.name}")


class _RingAttention(torch.autograd.Function):
    """Under mixed precision the inputs are rounded to the compute dtype, as the reference's attention
    rounds them under autocast, then every block and the merge of their partial outputs and log-sum-exps
    run in fp32 (a fused attention kernel accumulates in fp32 too; a bf16 merge would lose the small
    blocks' share)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        ctx.dtypes = q.dtype, k.dtype, v.dtype
        device = q.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        q, k, v = (t.to(low).float() if low is not None else t for t in (q, k, v))
        with torch.autocast(device, enabled=False):
            out = _RingAttention._forward(ctx, q, k, v, ring)
        return out.to(low) if low is not None else out

    @staticmethod
    def _forward(ctx, q, k, v, ring: _Ring):
        scale, heads = q.shape[-1] ** -0.5, q.shape[1]
        kv = torch.stack((k, v))
        out = lse = None
        for s in range(ring.n):
            if s < ring.n - 1:
                incoming, handles = ring.shift(kv, "kv", _TAG_KV)
            rows, cols, mask = ring.block(s)
            with ring.rec.compute(f"attn {ring.name} ring {s}"):
                o_b, l_b = block_forward(q[:, :, rows], expand_kv(kv[0][:, :, cols], heads),
                                         expand_kv(kv[1][:, :, cols], heads), mask, scale)
                if s == 0:
                    out, lse = o_b, l_b
                else:
                    out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o_b, l_b)
            if s < ring.n - 1:
                ring.wait(handles, "kv")
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = _RingAttention._backward(ctx, dout.float())
        return (*(g.to(dtype) for g, dtype in zip((dq, dk, dv), ctx.dtypes, strict=True)), None)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        scale, heads, kv_heads = q.shape[-1] ** -0.5, q.shape[1], k.shape[1]
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack((k, v))
        dkv_in, dkv_handles = None, []
        for s in range(ring.n):
            if s < ring.n - 1:
                incoming, handles = ring.shift(kv, "kv", _TAG_KV)
            rows, cols, mask = ring.block(s)
            with ring.rec.compute(f"attn bwd {ring.name} ring {s}"):
                dq_b, dk_b, dv_b = block_backward(q[:, :, rows], expand_kv(kv[0][:, :, cols], heads),
                                                  expand_kv(kv[1][:, :, cols], heads), mask, scale,
                                                  lse[:, :, rows], dout[:, :, rows], delta[:, :, rows])
                dq[:, :, rows] += dq_b
                dkv = torch.zeros_like(kv)
                dkv[0][:, :, cols] = reduce_kv(dk_b, kv_heads)
                dkv[1][:, :, cols] = reduce_kv(dv_b, kv_heads)
            # This block's dK/dV so far (from the ranks it has visited) arrived during the compute above.
            if s > 0:
                ring.wait(dkv_handles, "dkv")
                dkv += dkv_in
            dkv_in, dkv_handles = ring.shift(dkv, "dkv", _TAG_DKV)
            if s < ring.n - 1:
                ring.wait(handles, "kv")
                kv = incoming
        ring.wait(dkv_handles, "dkv")  # the last hop brings this rank's own block home, complete
        return dq, dkv_in[0], dkv_in[1]


class _GatherKV(torch.autograd.Function):
    """kv[2, B, kv, T_cp, d] -> every cp rank's, stacked [cp, 2, B, kv, T_cp, d]; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, kv, comm, name: str):
        ctx.comm, ctx.name = comm, name
        full = kv.new_empty((comm.size("cp"), *kv.shape))
        comm.all_gather(full, kv.contiguous(), "cp", name=f"all_gather kv {name}")
        return full

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        ctx.comm.reduce_scatter(out, grad.contiguous(), "cp", name=f"reduce_scatter dkv {ctx.name}")
        return out, None, None


class ContextParallelPlan(Plan):
    """Points every attention layer at this rank's zig-zag positions and at ring (or all-gather)
    attention; the rank then computes on its T/cp tokens of each sequence."""

    def __init__(self, cfg, model, comm, rec):
        self.cfg, self.comm = cfg, comm
        m = cfg.model
        self.cp, self.cp_rank = comm.size("cp"), comm.group_rank("cp")
        # Attention needs the zig-zag split to balance its causal work; Mamba-2 layers alone take the
        # sequence in cp slices in order (engine/ssm_cp.py).
        split = zigzag_positions if m.has_attention else contiguous_positions
        self.positions = split(m.seq_len, self.cp, self.cp_rank).to(comm.device)
        # Every rank's positions in cp-rank order (the all-gathered K/V's keys; the all-to-all's sequence).
        self.all_positions = torch.cat([split(m.seq_len, self.cp, r) for r in range(self.cp)]).to(comm.device)
        slices = Slices(self.cp, self.cp_rank, zigzag=m.has_attention)
        for i, unit in enumerate(model.units):
            name = model.unit_names[i]
            if hasattr(unit, "attn"):
                unit.attn.positions = self.positions
                unit.attn.attend = partial(self._attend, _Ring(comm, rec, name, self.positions))
            if hasattr(unit, "mixer"):
                unit.mixer.mix = (StatePassing(unit.mixer, slices, comm, rec, name)
                                  if cfg.parallel.ssm_cp == "state" else
                                  AllToAll(unit.mixer, self.positions, self.all_positions, comm, rec, name))

    def local_tokens(self, tokens):
        return tokens[:, self.positions]

    def unit_flops(self, i: int, flops: float, sequences: int) -> float:
        """Per-token work scales with the T/cp tokens held; attention with the (query, key) pairs this
        rank's blocks compute: ring: its diagonal block plus cp-1 half blocks (the zig-zag skips the rest),
        allgather: its queries against every key (the masked part computed too, as the reference's)."""
        m, cp = self.cfg.model, self.cp
        if not 0 < i <= m.layers:
            return flops / cp
        if m.kinds[i - 1] == MAMBA:
            # state passing adds the incoming state's outputs, C_t . h: 2 N P per head and position held
            extra = self.cfg.parallel.ssm_cp == "state"
            tokens = sequences * m.seq_len / cp
            return flops / cp + extra * state_correction_flops(tokens, m.ssm_heads, m.ssm_head_dim, m.ssm_state)
        attention = 4 * sequences * m.seq_len**2 * m.heads * m.head_dim  # as in unit_forward_flops
        c = m.seq_len // (2 * cp)
        if self.cfg.parallel.cp_variant == "ring":
            pairs = (2 * c) ** 2 + (cp - 1) * 2 * c * c
        else:
            pairs = 2 * c * m.seq_len
        return (flops - attention) / cp + attention * pairs / m.seq_len**2

    def _attend(self, ring: _Ring, q, k, v):
        if self.cfg.parallel.cp_variant == "ring":
            return _RingAttention.apply(q, k, v, ring)
        full = _GatherKV.apply(torch.stack((k, v)), self.comm, ring.name)
        b, kv_heads, _, d = k.shape
        k_all, v_all = full.permute(1, 2, 3, 0, 4, 5).reshape(2, b, kv_heads, -1, d)
        mask = self.positions[:, None] >= self.all_positions[None, :]
        heads = q.shape[1]
        return F.scaled_dot_product_attention(q, expand_kv(k_all, heads), expand_kv(v_all, heads),
                                              attn_mask=mask)
