"""Meshes composed from plans (engine/parallelize.py): tensor, context and expert parallel and the
pipeline cut together with every ZeRO stage over the data axes, each against the single-process reference
over 3 steps (tolerances and their reasons: engine/verify.py), named by `--mesh` alone."""

import pytest

from engine.config import ModelConfig, ParallelConfig, RunConfig, parse_mesh, strategy_for, validate
from engine.run import run
from tests.engine.states import assert_equal_states, states

pytestmark = pytest.mark.multiprocess


def _cfg(mesh: str, zero_stage=None, mlp="dense", micro_batches=1, steps=3, **parallel) -> RunConfig:
    axes = parse_mesh(mesh)
    world = 1
    for _, d in axes:
        world *= d
    layers = 2 * dict(axes).get("pp", 1)
    return validate(RunConfig(model=ModelConfig(mlp=mlp, layers=layers),
                              parallel=ParallelConfig(strategy_for(axes), mesh=axes, zero_stage=zero_stage,
                                                      **parallel),
                              world=world, steps=steps, micro_batches=micro_batches))


FOUR = {  # name -> config kwargs; every one is a combination the engine refused before plans composed
    "cp=2,tp=2": dict(mesh="cp=2,tp=2"),
    "cp=2,tp=2 sp": dict(mesh="cp=2,tp=2", sequence_parallel=True),
    "ep=2,tp=2": dict(mesh="ep=2,tp=2", mlp="moe"),
    "ep=2,tp=2 sp": dict(mesh="ep=2,tp=2", mlp="moe", sequence_parallel=True),
    "fsdp=2,ep=2": dict(mesh="fsdp=2,ep=2", mlp="moe"),
    "dp=2,fsdp=2 (HSDP)": dict(mesh="dp=2,fsdp=2"),
    "dp=2,fsdp=2 (HSDP) accumulation": dict(mesh="dp=2,fsdp=2", micro_batches=2),
    "fsdp=2,cp=2": dict(mesh="fsdp=2,cp=2"),
    "dp=2,cp=2 zero 1": dict(mesh="dp=2,cp=2", zero_stage=1),
    "dp=2,ep=2 zero 2": dict(mesh="dp=2,ep=2", zero_stage=2, mlp="moe"),
    "dp=2,tp=2 zero 1": dict(mesh="dp=2,tp=2", zero_stage=1),
    "dp=2,tp=2 zero 2": dict(mesh="dp=2,tp=2", zero_stage=2),
    "dp=2,tp=2 zero 3": dict(mesh="dp=2,tp=2", zero_stage=3),
    "pp=2,cp=2 zero 3": dict(mesh="pp=2,cp=2", zero_stage=3, micro_batches=2),
}

EIGHT = {
    "pp=2,cp=2,tp=2": dict(mesh="pp=2,cp=2,tp=2", micro_batches=2),
    "pp=2,dp=2,ep=2": dict(mesh="pp=2,dp=2,ep=2", mlp="moe", micro_batches=2),
    "dp=2,cp=2,ep=2 zero 3": dict(mesh="dp=2,cp=2,ep=2", mlp="moe", zero_stage=3),
    "dp=2,fsdp=2,tp=2 sp": dict(mesh="dp=2,fsdp=2,tp=2", sequence_parallel=True),
    "pp=2,fsdp=2,tp=2 zb-h1": dict(mesh="pp=2,fsdp=2,tp=2", schedule="zb-h1", micro_batches=2),
}


@pytest.mark.parametrize("case", list(FOUR))
def test_four_rank_meshes_match_the_reference(pools, case):
    cfg = _cfg(**FOUR[case])
    summary, _ = run(cfg, traced=False, check=True, pool=pools(4))
    assert summary.check["passed"], summary.check["failures"]


@pytest.mark.parametrize("case", list(EIGHT))
def test_eight_rank_meshes_match_the_reference(pools, case):
    cfg = _cfg(**EIGHT[case])
    summary, _ = run(cfg, traced=False, check=True, pool=pools(8))
    assert summary.check["passed"], summary.check["failures"]


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "dp=2,fsdp=2", "dp=2,cp=2"])
def test_zero_stages_stay_exactly_equal_on_composed_meshes(pools, mesh):
    # Stages 1, 2 and 3 reduce-scatter the same flat buffers over the same shard axis, then all-reduce the
    # shards over the same replica axes, in the same order: bit-identical fp32 results (atol = rtol = 0).
    pool = pools(4)
    z1 = states(pool, _cfg(mesh, zero_stage=1))
    assert_equal_states(z1, states(pool, _cfg(mesh, zero_stage=2)), f"{mesh}: zero 2 vs zero 1")
    assert_equal_states(z1, states(pool, _cfg(mesh, zero_stage=3)), f"{mesh}: zero 3 vs zero 1")


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_zb_h1_on_flat_buffers_equals_1f1b_exactly(pools, zero_stage):
    # ZB-H1's BW adds each module's weight gradient into the flat buffer where a fused backward's autograd
    # puts it, micro-batch after micro-batch, and tells the sharder: the same bits as 1F1B (atol = rtol = 0).
    pool = pools(4)
    one_f = states(pool, _cfg("pp=2,dp=2", zero_stage=zero_stage, micro_batches=4))
    zb = states(pool, _cfg("pp=2,dp=2", zero_stage=zero_stage, micro_batches=4, schedule="zb-h1"))
    assert_equal_states(one_f, zb, f"zb-h1 vs 1f1b at zero stage {zero_stage}")


def test_hsdp_shards_over_fsdp_and_all_reduces_over_dp(pools):
    summary, timeline = run(_cfg("dp=2,fsdp=2", steps=1), traced=True, pool=pools(4))
    comm = [s for s in timeline.spans if s.lane == "comm"]
    assert {s.group for s in comm if s.name.startswith(("all_gather", "reduce_scatter"))} == {"fsdp"}
    assert {s.group for s in comm if s.name == "all_reduce grad shards"} == {"dp"}
    # Each rank holds half of every unit (sharded over fsdp=2), whatever dp is.
    full = _cfg("fsdp=2", steps=1)
    alone, _ = run(full, traced=False, pool=pools(2))
    assert summary.memory_bytes[0]["params"] == alone.memory_bytes[0]["params"]


def test_the_mesh_alone_names_the_strategies(pools):
    # the command line's --mesh alone: no --strategy, the run's configuration and its summary's mesh from it
    # (on the folder's warm pool: as its own `python -m engine` it had cost 10 s, most of it starting Python
    # and four ranks; the Lab's test runs a command line with its --mesh and compares the reply's mesh)
    from engine.cli import config_from_args, run_parser

    cfg = config_from_args(run_parser("x").parse_args(["--mesh", "cp=2,tp=2", "--world", "4", "--check"]))
    summary, _ = run(cfg, traced=False, check=True, pool=pools(4))
    assert summary.check["passed"], summary.check["failures"]
    assert summary.mesh == {"cp": 2, "tp": 2} and summary.strategy == strategy_for((("cp", 2), ("tp", 2)))
