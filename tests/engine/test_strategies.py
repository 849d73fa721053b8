"""Every strategy against the single-process reference over 3 optimizer steps, at world 2 and 4:
loss, gradients, parameters and AdamW state (tolerances and their reasons: engine/verify.py).
Then exact equalities between strategies whose reductions happen in the same order, memory against
the ZeRO formulas, and the measured timeline."""

import math

import pytest

from engine.config import ModelConfig, ParallelConfig, RunConfig
from engine.model import build_model
from engine.run import assemble, run
from tests.engine.states import assert_equal_states, states

pytestmark = pytest.mark.multiprocess

CASES = {  # name -> (ParallelConfig, micro_batches, mlp)
    "dp naive": (ParallelConfig("dp", zero_stage=0, dp_comm="naive"), 1, "dense"),
    "dp bucketed": (ParallelConfig("dp", zero_stage=0, dp_comm="bucketed"), 1, "dense"),
    "dp accumulation": (ParallelConfig("dp", zero_stage=0), 2, "dense"),
    "zero 1": (ParallelConfig("dp", zero_stage=1), 1, "dense"),
    "zero 2": (ParallelConfig("dp", zero_stage=2), 1, "dense"),
    "zero 2 accumulation": (ParallelConfig("dp", zero_stage=2), 2, "dense"),
    "fsdp": (ParallelConfig("fsdp", zero_stage=3), 1, "dense"),
    "fsdp accumulation": (ParallelConfig("fsdp", zero_stage=3), 2, "dense"),
    "fsdp moe": (ParallelConfig("fsdp", zero_stage=3), 1, "moe"),
}


def _cfg(world, case, steps=3):
    parallel, mb, mlp = CASES[case]
    return RunConfig(model=ModelConfig(mlp=mlp), parallel=parallel, world=world, steps=steps,
                     micro_batches=mb)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_matches_reference(pools, world, case):
    summary, _ = run(_cfg(world, case), traced=False, check=True, pool=pools(world))
    assert summary.check["passed"], summary.check["failures"]
    assert summary.ok


@pytest.mark.parametrize("world", [2, 4])
def test_zero_stages_are_exactly_equal(pools, world):
    # Stages 1, 2 and 3 reduce-scatter the same flat per-unit buffers in the same order and update shards
    # with the same elementwise AdamW: fp32 results must be bit-identical (atol = rtol = 0).
    pool = pools(world)
    z1 = states(pool, _cfg(world, "zero 1"))
    assert_equal_states(z1, states(pool, _cfg(world, "zero 2")), "zero 2 vs zero 1")
    assert_equal_states(z1, states(pool, _cfg(world, "fsdp")), "zero 3 vs zero 1")


def test_zero_equals_plain_dp_exactly_at_world_2(pools):
    # With two ranks every reduction is a single addition a + b, which is commutative in IEEE fp32, so
    # per-parameter all-reduce (dp) and per-unit reduce-scatter (ZeRO) give identical bits. At world 4
    # gloo's ring adds the four terms in an order that depends on the buffer layout: not exact there.
    pool = pools(2)
    dp = states(pool, _cfg(2, "dp naive"))
    assert_equal_states(dp, states(pool, _cfg(2, "dp bucketed")), "dp bucketed vs naive")
    assert_equal_states(dp, states(pool, _cfg(2, "zero 2")), "zero 2 vs dp")
    assert_equal_states(dp, states(pool, _cfg(2, "fsdp")), "zero 3 vs dp")


def _padded_numel(world):
    model = build_model(ModelConfig(), 0)
    return sum(math.ceil(sum(p.numel() for p in u.parameters()) / world) * world for u in model.units)


@pytest.mark.parametrize("world", [2, 4])
def test_memory_follows_the_zero_formulas(pools, world):
    # Rajbhandari et al. 2020, eq. 1 in fp32 with AdamW: params 4 Psi, grads 4 Psi, moments 8 Psi; a
    # sharded quantity is divided by dp. Psi counts the flat buffers' padding (at most dp-1 per unit).
    psi = sum(p.numel() for p in build_model(ModelConfig(), 0).parameters())
    padded = _padded_numel(world)
    expect = {  # stage -> (params, grads, optimizer) bytes per rank
        0: (4 * psi, 4 * psi, 8 * psi),
        1: (4 * padded, 4 * padded + 4 * padded // world, 8 * padded // world),
        2: (4 * padded, 4 * padded // world, 8 * padded // world),
        3: (4 * padded // world, 4 * padded // world, 8 * padded // world),
    }
    for stage, (params, grads, optimizer) in expect.items():
        parallel = ParallelConfig("fsdp" if stage == 3 else "dp", zero_stage=stage)
        summary, _ = run(RunConfig(parallel=parallel, world=world, steps=1), traced=False, pool=pools(world))
        for mem in summary.memory_bytes:
            assert (mem["params"], mem["grads"], mem["optimizer"]) == (params, grads, optimizer), stage
            assert mem["activations_peak"] > 0
    # stage 1 keeps the whole local gradient (4 Psi) and the reduce-scattered shard it updates with


def test_timeline_and_chrome_trace(pools, tmp_path):
    cfg = _cfg(4, "fsdp", steps=2)
    summary, timeline = run(cfg, traced=True, pool=pools(4))
    assert timeline.ranks == [0, 1, 2, 3]
    names = {s.name for s in timeline.spans}
    assert {"fwd embed", "fwd L0", "bwd L1", "bwd embed", "optimizer step", "all_gather L0",
            "reduce_scatter head"} <= names
    fwd = _first(timeline.for_rank(0), "fwd L0")
    assert _first(timeline.for_rank(0), "bwd L0").flops == 2 * fwd.flops > 0  # backward = 2x forward
    comm = [s for s in timeline.spans if s.lane == "comm"]
    assert all(s.group == "dp" and s.bytes > 0 for s in comm)
    assert any(s.is_async for s in comm)  # prefetch and reduce-scatter are issued without blocking
    assert summary.comm_bytes == [timeline.comm_bytes(r) for r in range(4)]
    # Per step, ring bytes (n-1)/n of: every unit gathered for forward, all but the head (kept after
    # forward) gathered again for backward, every unit's gradient reduce-scattered.
    head = math.ceil(sum(p.numel() for p in build_model(ModelConfig(), 0).units[-1].parameters()) / 4) * 4
    per_step = 3 / 4 * 4 * (3 * _padded_numel(4) - head)
    assert summary.comm_bytes[0] == pytest.approx(2 * per_step, rel=1e-3)

    path = tmp_path / "t.json"
    timeline.write_chrome_trace(str(path))
    import json

    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1, 2, 3}
    for e in complete:
        assert {"name", "cat", "ph", "pid", "tid", "ts", "dur"} <= e.keys() and e["dur"] >= 0 and e["ts"] >= 0
        assert e["tid"] == (0 if e["cat"] == "compute" else 1)  # compute and comm on separate tracks
    assert {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"} == \
        {f"rank {r}" for r in range(4)}


def test_assemble_takes_the_slowest_rank_per_step():
    cfg = RunConfig(world=2, steps=3)
    results = [{"rank": r, "losses": [1.0, 2.0, 3.0], "step_times_s": [0.5, 0.1 * (r + 1), 0.2],
                "memory_bytes": {}, "comm_bytes": 0, "spans": [], "check": None} for r in (1, 0)]
    summary, _ = assemble(cfg, results)
    assert summary.step_times_s == [0.5, 0.2, 0.2] and summary.step_time_s == 0.2


def _first(spans, name):
    return min((s for s in spans if s.name == name), key=lambda s: s.start_s)


def test_communication_is_issued_during_backward(pools):
    # Overlap is an ordering fact, not a timing one: the async op is issued before backward has finished.
    _, tl = run(_cfg(2, "dp bucketed", steps=1), pool=pools(2))
    spans = tl.for_rank(0)
    assert _first(spans, "all_reduce bucket 0").start_s < _first(spans, "bwd embed").end_s
    _, tl = run(_cfg(2, "fsdp", steps=1), pool=pools(2))
    spans = tl.for_rank(0)
    # prefetch: L0's gather for backward is issued before L1's backward computes
    gathers_l0 = sorted((s for s in spans if s.name == "all_gather L0"), key=lambda s: s.start_s)
    assert len(gathers_l0) == 2 and gathers_l0[1].start_s < _first(spans, "bwd L1").end_s
    assert _first(spans, "reduce_scatter head").start_s < _first(spans, "bwd embed").start_s
