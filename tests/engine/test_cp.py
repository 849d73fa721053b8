"""Context parallel: the ring-attention arithmetic alone (no processes), then both variants against the
single-process reference over 3 optimizer steps at world 2 and 4 and on a dp x cp mesh, and the ring's
point-to-point traffic in the trace.

Tolerance (engine/verify.py): the reference runs one fused causal softmax per sequence; ring attention
computes it in blocks merged by the log-sum-exp rule, in another order, and sums the weight gradients over
cp ranks. Those are fp32 reordering errors (measured: loss 5e-7, grads 1e-6, params 1e-5 after 3 AdamW
steps, well inside verify's rtol 1e-4 and params atol 0.1 lr per step)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig, ParallelConfig, RunConfig
from engine.model import unit_forward_flops
from engine.ring_attention import (
    block_backward,
    block_forward,
    block_plan,
    expand_kv,
    merge,
    reduce_kv,
    zigzag_positions,
)
from engine.run import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _qkv(seed=0, b=2, h=4, kv=2, t=16, d=8):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, d, generator=gen), torch.randn(b, kv, t, d, generator=gen),
            torch.randn(b, kv, t, d, generator=gen))


def test_lse_merge_of_blocks_equals_full_softmax_attention():
    q, k, v = _qkv()
    k, v = expand_kv(k, 4), expand_kv(v, 4)
    scale = q.shape[-1] ** -0.5
    expect = F.scaled_dot_product_attention(q, k, v)
    # Three uneven key blocks, merged in a scrambled order: the rule does not care about either.
    blocks = [slice(9, 16), slice(0, 4), slice(4, 9)]
    out, lse = block_forward(q, k[:, :, blocks[0]], v[:, :, blocks[0]], None, scale)
    for cols in blocks[1:]:
        out, lse = merge(out, lse, *block_forward(q, k[:, :, cols], v[:, :, cols], None, scale))
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)  # fp32, another summation order
    expect_lse = torch.logsumexp(q @ k.transpose(-1, -2) * scale, -1)
    torch.testing.assert_close(lse, expect_lse, rtol=1e-6, atol=1e-6)


def test_block_backward_summed_over_blocks_equals_autograd():
    q, k, v = _qkv(1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale, t = q.shape[-1] ** -0.5, q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, expand_kv(k, 4), expand_kv(v, 4), is_causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    with torch.no_grad():
        ke, ve = expand_kv(k, 4), expand_kv(v, 4)
        _, lse = block_forward(q, ke, ve, causal, scale)
        delta = (dout * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for cols in (slice(0, 8), slice(8, 16)):  # the final lse makes the blocks' gradients simply add
            dq_b, dk_b, dv_b = block_backward(q, ke[:, :, cols], ve[:, :, cols], causal[:, cols], scale, lse,
                                              dout, delta)
            dq += dq_b
            dk[:, :, cols] += reduce_kv(dk_b, 2)
            dv[:, :, cols] += reduce_kv(dv_b, 2)
    for mine, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_plan_covers_the_causal_mask_with_equal_work(cp):
    seq_len, c = 8 * cp, 4
    pos = [zigzag_positions(seq_len, cp, r) for r in range(cp)]
    assert sorted(torch.cat(pos).tolist()) == list(range(seq_len))
    work = []
    for r in range(cp):
        pairs = 0
        for src in range(cp):
            need = pos[r][:, None] >= pos[src][None, :]
            rows, cols, causal = block_plan(r, src, c)
            planned = torch.zeros_like(need)
            planned[rows, cols] = need[rows, cols] if causal else True
            # Nothing needed is skipped and nothing masked is computed.
            assert torch.equal(planned, need), (r, src)
            pairs += int(planned.sum())
        work.append(pairs)
    assert len(set(work)) == 1  # the point of the zig-zag split: every rank attends to as many pairs


def _cfg(world, variant="ring", mesh=(), steps=3, micro_batches=1):
    return RunConfig(model=ModelConfig(), parallel=ParallelConfig("cp", mesh=mesh, cp_variant=variant),
                     world=world, steps=steps, micro_batches=micro_batches, timeout_s=240)


CASES = {  # name -> (world, variant, mesh, micro_batches)
    "ring cp=2": (2, "ring", (), 1),
    "ring cp=4": (4, "ring", (), 1),
    "allgather cp=2": (2, "allgather", (), 1),
    "allgather cp=4": (4, "allgather", (), 1),
    "ring dp=2,cp=2": (4, "ring", (("dp", 2), ("cp", 2)), 1),
    "ring cp=2 accumulation": (2, "ring", (), 2),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_matches_reference(pools, case):
    world, variant, mesh, micro_batches = CASES[case]
    summary, _ = run(_cfg(world, variant, mesh, micro_batches=micro_batches), traced=False, check=True,
                     pool=pools(world))
    assert summary.check["passed"], summary.check["failures"]


def _kv_bytes(cp, m=ModelConfig(), batch=2):
    return 2 * batch * m.kv_heads * (m.seq_len // cp) * m.head_dim * 4  # K and V of one rank, fp32


@pytest.mark.multiprocess
def test_ring_trace_overlaps_transfers_with_attention(pools):
    cp = 4
    _, timeline = run(_cfg(cp, steps=1), traced=True, pool=pools(cp))
    for r in range(cp):
        spans = timeline.for_rank(r)
        p2p = [s for s in spans if s.name.startswith(("send ", "recv "))]
        assert p2p and all(s.group == "cp" and s.is_async for s in p2p)
        for layer in ("L0", "L1"):
            sent = sum(s.bytes for s in p2p if s.name.startswith("send") and s.name.endswith(layer))
            assert sent == (3 * cp - 2) * _kv_bytes(cp)  # (cp-1) K/V fwd, (cp-1) K/V + cp dK/dV bwd
            # Each K/V transfer is issued before the block's attention and completes after it.
            for s in range(cp - 1):
                attn = next(x for x in spans if x.name == f"attn {layer} ring {s}")
                assert any(x.name == f"recv kv {layer}" and x.start_s <= attn.start_s
                           and x.end_s >= attn.end_s for x in p2p), (r, layer, s)
    # Over the cp ranks: all the per-token work once, and (cp+1)/(2cp) of the full score matrix (the zig-zag
    # plan skips the masked blocks).
    m = ModelConfig()
    whole, scores = unit_forward_flops(m, 1, 2), 4 * 2 * m.seq_len**2 * m.heads * m.head_dim
    fwd = sum(s.flops for s in timeline.spans if s.name == "fwd L0")
    assert fwd == pytest.approx(whole - scores + scores * (cp + 1) / (2 * cp))


@pytest.mark.multiprocess
def test_ring_trace_says_where_the_layer_waited_and_posted(pools):
    # A layer's span encloses its ring: the blocks (compute), the posting of each shift (a blocking comm
    # span) and the waits for the shifts (idle spans), so what is left of the layer is its own compute.
    from planner.live import WAITING, per_step_by_kind

    cp = 2
    _, timeline = run(_cfg(cp, steps=2), traced=True, pool=pools(cp))
    for r in range(cp):
        spans = timeline.for_rank(r)
        layers = [s for s in spans if s.lane == "compute" and s.name in ("fwd L0", "fwd L1", "bwd L0", "bwd L1")]
        posts = [s for s in spans if s.name.startswith("post ")]
        waits = [s for s in spans if s.lane == "idle"]
        # per layer and step: forward 1 K/V shift; backward 1 K/V and cp dK/dV shifts
        assert len(posts) == 2 * 2 * ((cp - 1) + (cp - 1) + cp)
        assert all(s.group == "cp" and not s.is_async and s.lane == "comm" for s in posts)
        assert {s.name.split()[1] for s in waits} == {"kv", "dkv"}
        for s in posts + waits:
            assert any(x.start_s <= s.start_s and s.end_s <= x.end_s and x.name.endswith(s.name.split()[-1])
                       for x in layers), s
    kinds = per_step_by_kind(timeline)  # step 1 (step 0 is the warm-up)
    step = [s for s in timeline.spans if s.step == 1]
    waited = sum(s.duration_s for s in step if s.lane == "idle") / cp
    posted = sum(s.duration_s for s in step if s.name.startswith("post ")) / cp
    assert kinds["gloo other comm (cp)"] == pytest.approx(posted)
    assert kinds[WAITING] >= waited * (1 - 1e-9)
    # backward compute: the backward spans less the ring blocks, posts and waits inside them
    inside = [x for x in step if x.name.startswith(("attn bwd", "post ")) or x.lane == "idle"]
    bwd = [s for s in step if s.lane == "compute" and s.name.startswith("bwd ")]
    own = sum(s.duration_s - sum(x.duration_s for x in inside if x.rank == s.rank and s.start_s <= x.start_s
                                 and x.end_s <= s.end_s) for s in bwd) / cp
    assert kinds["backward compute"] == pytest.approx(own)


@pytest.mark.multiprocess
def test_allgather_trace_moves_the_formula_bytes(pools):
    cp = 4
    _, timeline = run(_cfg(cp, "allgather", steps=1), traced=True, pool=pools(cp))
    comm = [s for s in timeline.spans if s.lane == "comm" and s.rank == 0]
    for layer in ("L0", "L1"):
        gathered = [s for s in comm if s.name == f"all_gather kv {layer}"]
        scattered = [s for s in comm if s.name == f"reduce_scatter dkv {layer}"]
        assert len(gathered) == len(scattered) == 1 and gathered[0].group == scattered[0].group == "cp"
        assert gathered[0].bytes == scattered[0].bytes == (cp - 1) * _kv_bytes(cp)
    fwd = sum(s.flops for s in timeline.spans if s.name == "fwd L0")
    assert fwd == pytest.approx(unit_forward_flops(ModelConfig(), 1, 2))  # queries against every key


@pytest.mark.parametrize("args, says", [
    (["--world", "4", "--seq-len", "30"], "seq_len=30 is not divisible by 2 × cp = 8 (cp=4)"),
    (["--mesh", "cp=2,tp=4", "--world", "8", "--seq-len", "20", "--sequence-parallel"],
     "seq_len=20 is not divisible by tp*cp=8"),
    (["--mlp", "moe", "--capacity-factor", "1"], "drop --capacity-factor"),
    (["--mesh", "dp=2,cp=3", "--world", "4"], "has 6 ranks but world=4"),
])
def test_bad_context_parallel_input_exits_2(args, says):
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--strategy", "cp", *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
