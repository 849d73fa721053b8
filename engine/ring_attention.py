"""The arithmetic of ring attention, without processes: the load-balanced split of a sequence, attention
of queries against one block of keys that also returns the log-sum-exp, the merge of partial results, and
the hand-written backward of one block.

Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, section 3.1): attention over
keys split into blocks 1..n is recovered from each block's output O_i and log-sum-exp L_i = log sum_j
exp(s_j) of its scores:

    L = log(exp(L_1) + ... + exp(L_n))        O = sum_i exp(L_i - L) * O_i

so blocks can arrive one at a time, in any order (`merge`).

Zig-zag split (Llama 3, Dubey et al. 2024, section 3.3.2; Megatron-LM's context parallel): the sequence
is cut into 2*cp chunks and rank i holds chunks i and 2*cp-1-i, one early and one late, so under the
causal mask every rank does the same work:

    cp = 2, T = 8:   chunks  [0 1 | 2 3 | 4 5 | 6 7]
                     rank 0:  c0 c3  -> positions 0 1 6 7
                     rank 1:  c1 c2  -> positions 2 3 4 5

Against the K/V of another rank j, rank i's queries need (causal, by chunk):
    j < i: both query chunks see j's early chunk whole and none of j's late chunk  -> Q . K[:, :c]
    j > i: only the late query chunk sees anything, and it sees all of j's keys     -> Q[c:] . K
each half a block, unmasked; only the rank's own block (the diagonal) needs a mask.
"""

from __future__ import annotations

import torch

from core.mesh import cp_slice_owners


def _slice_positions(seq_len: int, cp: int, rank: int, zigzag: bool) -> torch.Tensor:
    """Absolute positions of the slices `rank` holds (core/mesh.cp_slice_owners), in sequence order."""
    owner = cp_slice_owners(cp, zigzag)
    c = seq_len // len(owner)
    return torch.cat([torch.arange(g * c, (g + 1) * c) for g, r in enumerate(owner) if r == rank])


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Absolute positions of the tokens rank `rank` holds: chunks rank and 2*cp-1-rank of 2*cp."""
    return _slice_positions(seq_len, cp, rank, zigzag=True)


def contiguous_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of rank `rank` when the sequence is cut into cp slices in order (Mamba-2 layers only)."""
    return _slice_positions(seq_len, cp, rank, zigzag=False)


def block_plan(rank: int, source: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal mask needed) of this rank's queries against `source`'s K/V."""
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv_heads, T, d] -> [B, heads, T, d]: each KV head serves heads/kv_heads query heads (GQA)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def reduce_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of `expand_kv`: a gradient over query heads summed back onto its KV head."""
    b, h, n, d = t.shape
    return t.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward(q, k, v, mask, scale):
    """q[B,h,M,d], k/v[B,h,N,d] (heads already expanded), mask[M,N] bool or None ->
    (out[B,h,M,d], lse[B,h,M]). Every row must see at least one key."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def merge(out, lse, out_b, lse_b):
    """Combine two partial attentions over disjoint key sets (the online-softmax rule above)."""
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None], new


def block_backward(q, k, v, mask, scale, lse, dout, delta):
    """Gradients of one block given the *final* lse and delta = rowsum(dout * out) (FlashAttention,
    Dao et al. 2022, Algorithm 2 / appendix B.2): P = exp(S - L), dV = P^T dO, dP = dO V^T,
    dS = P * (dP - delta), dQ = dS K * scale, dK = dS^T Q * scale."""
    p = torch.exp(_scores(q, k, mask, scale) - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk, dv
