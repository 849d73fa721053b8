"""The communication of tensor and sequence parallelism: four conjugate autograd functions.

Megatron-LM (Shoeybi et al. 2019, section 3, figure 3) brackets every tensor-parallel region with two
operations that are each other's transpose:

    copy_to_tp      "f"   forward: identity                     backward: all-reduce over tp
    reduce_from_tp  "g"   forward: all-reduce over tp           backward: identity

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) keeps the activations outside the region
split along the sequence and swaps each all-reduce for its two halves:

    gather_from_sp  "g"   forward: all-gather the sequence      backward: reduce-scatter the sequence
    scatter_to_sp   "g-bar" forward: reduce-scatter the sequence  backward: all-gather the sequence

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes on the wire are the same;
what changes is that everything outside the region (norms, residual adds) holds S/tp of the sequence.

`sum_over_replicas` is the backward of a KV head replicated on several tp ranks (when tp > kv_heads):
each copy's gradient only covers the query heads of its rank, so the copies' gradients are summed.

Activations are [B, S, D]; the sequence is dim 1. Every operation is one `engine.comm` call on the
"tp" group, so it appears in the trace as a comm span.
"""

from __future__ import annotations

import torch

TP = "tp"  # the mesh axis (process group) every operation here talks over


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, where):
        ctx.comm, ctx.where = comm, where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # autograd may still own `grad`: reduce a private copy
        ctx.comm.all_reduce(grad, TP, name=f"all_reduce {ctx.where} grad")
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, where):
        out = x.contiguous().clone()
        comm.all_reduce(out, TP, name=f"all_reduce {where}")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _all_gather_seq(comm, x: torch.Tensor, name: str) -> torch.Tensor:
    """x[B, S/n, D] on each rank -> [B, S, D], the ranks' chunks in group-rank order along S."""
    n = comm.size(TP)
    b, chunk, d = x.shape
    out = torch.empty(n, b, chunk, d, dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.contiguous(), TP, name=name)
    return out.permute(1, 0, 2, 3).reshape(b, n * chunk, d)


def _reduce_scatter_seq(comm, x: torch.Tensor, name: str) -> torch.Tensor:
    """x[B, S, D] partial sums on each rank -> this rank's chunk [B, S/n, D] of their sum."""
    n = comm.size(TP)
    b, s, d = x.shape
    chunks = x.reshape(b, n, s // n, d).permute(1, 0, 2, 3).contiguous()  # chunk k is contiguous
    out = torch.empty(b, s // n, d, dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, chunks, TP, name=name)
    return out


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, where):
        ctx.comm, ctx.where = comm, where
        return _all_gather_seq(comm, x, f"all_gather {where}")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(ctx.comm, grad, f"reduce_scatter {ctx.where} grad"), None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, where):
        ctx.comm, ctx.where = comm, where
        return _reduce_scatter_seq(comm, x, f"reduce_scatter {where}")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(ctx.comm, grad, f"all_gather {ctx.where} grad"), None, None


class _SumOverReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, comm, slot, slots, where):
        ctx.comm, ctx.slot, ctx.slots, ctx.where = comm, slot, slots, where
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        # Every rank writes its copy's gradient into its head's slot; one all-reduce over tp sums the
        # copies of each head (a sub-group per head would move less, but needs groups the mesh lacks).
        slots = torch.zeros(ctx.slots, *grad.shape, dtype=grad.dtype, device=grad.device)
        slots[ctx.slot] = grad
        ctx.comm.all_reduce(slots, TP, name=f"all_reduce {ctx.where} replica grad")
        return slots[ctx.slot], None, None, None, None


def copy_to_tp(x, comm, where: str):
    """f: identity forward, all-reduce of the gradient over tp backward."""
    return _CopyToTP.apply(x, comm, where)


def reduce_from_tp(x, comm, where: str):
    """g: all-reduce of the partial sums over tp forward, identity backward."""
    return _ReduceFromTP.apply(x, comm, where)


def gather_from_sp(x, comm, where: str):
    """x[B, S/tp, D] -> x[B, S, D]: all-gather forward, reduce-scatter backward."""
    return _GatherFromSP.apply(x, comm, where)


def scatter_to_sp(x, comm, where: str):
    """partial x[B, S, D] -> summed x[B, S/tp, D]: reduce-scatter forward, all-gather backward."""
    return _ScatterToSP.apply(x, comm, where)


def sum_over_replicas(w, comm, slot: int, slots: int, where: str):
    """Identity forward; backward sums the gradients of the tp ranks that hold the same `slot`."""
    return _SumOverReplicas.apply(w, comm, slot, slots, where)
