"""`Estimate.chosen` (planner.api.chosen_fields) lists what the planner picked for the null fields that act on the
layout it picked: a pipeline schedule at pp 1, sequence parallelism at tp 1 or a ZeRO stage over one data-parallel
rank had been listed though nothing runs them."""

from planner import assumptions, estimate, make_case
from planner.case import Cluster, Parallel


def _chosen(n: int, **degrees) -> dict:
    est = estimate(make_case("Llama 3 8B", Cluster("h100", n), global_batch=64, parallel=Parallel(**degrees)))
    return {k: v for block in est.chosen.values() for k, v in block.items()}


def test_fields_that_do_nothing_for_the_layout_are_left_out():
    flat = _chosen(8, dp=8, tp=1, pp=1, cp=1, ep=1)
    assert not {"pp_schedule", "virtual_stages", "sequence_parallel"} & set(flat)
    assert "zero_stage" in flat  # eight data-parallel ranks shard
    one = _chosen(1, dp=1, tp=1, pp=1, cp=1, ep=1)
    assert not {"zero_stage", "grad_reduce_overlap", "param_gather_overlap"} & set(one)
    # the gradients' dtype is kept on one rank too: it sets their bytes in memory
    assert "grad_reduce_in_fp32" in one


def test_they_are_listed_where_the_layout_runs_them():
    piped = _chosen(16, dp=4, tp=2, pp=2, cp=1, ep=1)
    assert {"pp_schedule", "virtual_stages", "sequence_parallel", "zero_stage"} <= set(piped)


def test_assumptions_hold_the_layout_without_them():
    """`assumptions` writes `chosen` back into the case: a field left out is picked the same way again."""
    case = make_case("Llama 3 8B", Cluster("h100", 1), global_batch=8, parallel=Parallel(dp=1, tp=1, pp=1, cp=1, ep=1))
    est = estimate(case)
    found = assumptions(case, est)
    assert found and all(a.base_step_time_s == est.step_time_s for a in found)
    same = [a for a in found if a.field == "training.grad_reduce_in_fp32"]
    assert same and same[0].step_time_s == est.step_time_s  # one rank: no gradient to reduce, the same step
