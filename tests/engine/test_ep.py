"""Expert parallel against the single-process reference over 3 optimizer steps (loss, gradients, params,
AdamW state; tolerances and reasons in engine/verify.py: the all-to-all only moves rows, so the
differences are the usual fp32 reduction-order ones), with exact routing ties, with dropped tokens, on a
dp x ep mesh, and the all-to-alls in the trace."""

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.config import ModelConfig, ParallelConfig, RunConfig
from engine.model import capacity_keep, expert_capacity, route
from engine.run import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(world, mesh=(), experts=8, capacity_factor=None, steps=3, micro_batches=1):
    model = ModelConfig(mlp="moe", experts=experts, top_k=2, capacity_factor=capacity_factor)
    return RunConfig(model=model, parallel=ParallelConfig("ep", mesh=mesh), world=world, steps=steps,
                     micro_batches=micro_batches, timeout_s=240)


def test_route_breaks_exact_ties_towards_the_lower_expert():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 2.0]])
    weights, chosen = route(logits, 2)
    assert chosen.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(weights, torch.full((2, 2), 0.5))


def test_capacity_keeps_first_choices_before_second_choices():
    # Four tokens, expert 0 chosen first by tokens 0-2 and second by token 3; capacity 2 per expert.
    chosen = torch.tensor([[[0, 1], [0, 2], [0, 1], [1, 0]]])
    keep = capacity_keep(chosen, experts=4, capacity=2)
    assert keep.tolist() == [[[True, True], [True, True], [False, False], [True, False]]]
    assert expert_capacity(1.0, tokens=32, top_k=2, experts=8) == 8
    assert expert_capacity(0.5, tokens=32, top_k=2, experts=8) == 4


CASES = {  # name -> (world, mesh, capacity_factor, micro_batches)
    "ep=2": (2, (), None, 1),
    "ep=4": (4, (), None, 1),
    "dp=2,ep=2": (4, (("dp", 2), ("ep", 2)), None, 1),
    "ep=2 dropping": (2, (), 0.5, 1),
    "ep=2 accumulation": (2, (), None, 2),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_reference(pools, case):
    world, mesh, capacity_factor, micro_batches = CASES[case]
    summary, _ = run(_cfg(world, mesh, capacity_factor=capacity_factor, micro_batches=micro_batches),
                     traced=False, check=True, pool=pools(world))
    assert summary.check["passed"], summary.check["failures"]
    load = summary.stats["expert_load"]["layers"]["L0"]
    sequences, tokens = summary.config["micro_batch_size"] * micro_batches * world, 32
    assert sum(load["tokens_per_expert"]) == 3 * sequences * tokens * 2  # 3 steps, top-2
    if capacity_factor is None:
        assert sum(load["dropped_per_expert"]) == 0
    else:  # each expert keeps at most its capacity per sequence
        cap = expert_capacity(capacity_factor, tokens, 2, 8)
        assert all(p <= 3 * sequences * cap for p in load["processed_per_expert"])
        assert load["dropped_fraction"] > 0
    assert load["expert_max_over_mean"] >= 1.0


def tied_router_run(ctx, cfg):
    """Pool task: the whole run (strategy and reference) with every router weight zero, so all logits tie
    exactly in step 1 and the tie-break alone decides the routing."""
    from engine import parallelize, reference, train
    from engine.model import build_model

    def tied(m, seed):
        model = build_model(m, seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("router.weight"):
                    p.zero_()
        return model

    parallelize.build_model, reference.build_model = tied, tied
    try:
        return train.run_rank(ctx, cfg, traced=False, check=True)
    finally:
        parallelize.build_model, reference.build_model = build_model, build_model


@pytest.mark.multiprocess
def test_exact_ties_route_like_the_reference(pools):
    # Step 1: every token picks experts 0 and 1 (lower index wins), each keeps ceil(1.0*32*2/8) = 8 per
    # sequence, the other 24 tokens of each sequence get no MoE output. A different tie-break than the
    # reference's would fail the comparison at step 1.
    cfg = _cfg(2, capacity_factor=1.0, steps=1)
    results = pools(2).run("tests.engine.test_ep:tied_router_run", {"cfg": cfg}, timeout_s=240)
    check = results[0]["check"]
    assert check["passed"], check["failures"]
    load = results[0]["stats"]["expert_load"]["layers"]["L0"]
    sequences = 2 * cfg.micro_batch_size
    assert load["tokens_per_expert"] == [sequences * 32] * 2 + [0] * 6
    assert load["processed_per_expert"] == [sequences * 8] * 2 + [0] * 6
    assert load["processed_per_ep_rank"] == [2 * sequences * 8, 0]  # experts 0-3 live on ep rank 0


@pytest.mark.multiprocess
def test_trace_shows_the_all_to_alls(pools):
    summary, timeline = run(_cfg(4, steps=1), traced=True, pool=pools(4))
    comm = [s for s in timeline.spans if s.lane == "comm"]
    names = {s.name for s in comm}
    for layer in ("L0", "L1"):
        assert {f"all_to_all counts {layer}", f"all_to_all dispatch {layer}", f"all_to_all combine {layer}",
                f"all_to_all dispatch {layer} bwd", f"all_to_all combine {layer} bwd"} <= names
    assert all(s.group == "ep" for s in comm if s.name.startswith("all_to_all"))
    # dense gradients over the data axes (ep here); the experts' skip ep, so they are not all-reduced
    buckets = [s for s in comm if s.name.startswith("all_reduce bucket")]
    assert buckets and {s.group for s in buckets} == {"ep"}
    for r in range(4):
        def sent(name, r=r):
            return sum(s.bytes for s in comm if s.rank == r and s.name == name)
        # Gradients retrace the rows: dispatch's backward moves what combine's forward moved, and back.
        assert sent("all_to_all dispatch L0") == sent("all_to_all combine L0 bwd")
        assert sent("all_to_all combine L0") == sent("all_to_all dispatch L0 bwd")
    # Every rank's rows (64 tokens x top-2 x hidden 64 x 4 bytes) leave it except those for its own
    # experts: with near-uniform routing at initialisation about (ep-1)/ep of them.
    full_bytes = 2 * 32 * 2 * 64 * 4
    dispatched = sum(s.bytes for s in comm if s.name == "all_to_all dispatch L0") / 4
    assert 0.5 * full_bytes < dispatched < full_bytes


@pytest.mark.parametrize("args, says", [
    (["--experts", "6", "--world", "4"], "experts=6 is not divisible by ep=4"),
    (["--mlp", "dense"], "use --mlp moe"),
    (["--experts", "8", "--top-k", "9"], "top_k=9 must be between 1 and experts=8"),
    (["--capacity-factor", "0"], "capacity_factor=0.0 must be a positive number"),
    (["--mesh", "ep=2,tp=2", "--world", "4", "--sequence-parallel", "--capacity-factor", "1"],
     "drop --capacity-factor or --sequence-parallel"),
])
def test_bad_expert_parallel_input_exits_2(args, says):
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--strategy", "ep", *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_an_ep_axis_runs_expert_parallel_without_naming_the_strategy():
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--mesh", "dp=2,ep=2", "--world", "4", "--check",
                          "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["strategy"] == "ep" and reply["check"]["passed"]


def test_a_named_strategy_that_contradicts_the_mesh_is_refused():
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--strategy", "tp", "--mesh", "dp=2,ep=2",
                          "--mlp", "moe", "--world", "4"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "--strategy tp needs a tp axis" in out.stderr, out.stderr


def test_the_calibrations_expert_parallel_layer_is_the_engines_dispatch_on_every_row():
    # engine/calibrate times the MoE layer through engine/ep.py's own dispatch, its all-to-alls a local copy
    # (_LoopbackComm): with one ep rank that is the reference layer, up to fp32 reduction order (the dispatch
    # sums each token's expert outputs in another order)
    from engine.calibrate import _expert_parallel_moe
    from engine.model import MoE

    torch.manual_seed(0)
    m = ModelConfig(mlp="moe", experts=4, top_k=2)
    x = torch.randn(2, m.seq_len, m.hidden)
    whole = _expert_parallel_moe(m, 1)
    reference = MoE(m)
    reference.load_state_dict(whole.state_dict())
    torch.testing.assert_close(whole(x), reference(x), rtol=1e-5, atol=1e-6)
    # over 2 ep ranks it holds its 2 experts, and they take as many rows as the rank routes (balanced: every
    # peer sends what this rank sends), each token's top_k copies
    half, rows = _expert_parallel_moe(m, 2), []
    held = [e for e in half.experts if e.w1.weight.numel()]
    assert len(held) == 2
    for e in held:
        e.register_forward_hook(lambda _mod, inp, _out: rows.append(inp[0].shape[0]))
    half(x)
    assert sum(rows) == x.shape[0] * x.shape[1] * m.top_k
