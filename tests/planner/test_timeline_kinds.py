"""The predicted timeline draws each kind of work in the row and colour the step's breakdown gives it."""

import pytest

from core.timeline import span_kind
from planner import estimate, make_case
from planner.case import Cluster, Parallel
from planner.timeline import predicted_timeline
from ui.charts import BREAKDOWN_STYLE
from ui.timeline import KIND_COLORS


def _kinds(case, **kw) -> dict[str, float]:
    est = estimate(case)
    out: dict[str, float] = {}
    for s in predicted_timeline(est.result, **kw).spans:
        out[span_kind(s)] = out.get(span_kind(s), 0.0) + s.duration_s
    return out


def test_expert_dispatch_is_an_all_to_all_and_the_context_ring_a_send_at_every_zoom():
    """Layer by layer, "ep dispatch + combine" had been drawn as "other comm" (the breakdown: all-to-all)."""
    moe = make_case("Mixtral 8x7B", Cluster("h100", 64), global_batch=512,
                    parallel=Parallel(dp=64, tp=1, pp=1, cp=1, ep=8))  # ep among the dp ranks (Megatron-LM's)
    for kw in ({"max_layer_passes": 10**6}, {"max_layer_passes": 1}):  # by layer, then by pass
        kinds = _kinds(moe, **kw)
        assert kinds.get("all_to_all", 0) > 0 and "other comm" not in kinds, kw
    ring = make_case("Llama 3 70B", Cluster("h100", 64), global_batch=64,
                     parallel=Parallel(dp=2, tp=8, pp=1, cp=4, ep=1))
    kinds = _kinds(ring, max_layer_passes=10**6)
    assert kinds.get("send/recv", 0) > 0 and "other comm" not in kinds
    assert BREAKDOWN_STYLE["cp_comm"][1] == KIND_COLORS["send/recv"]
    assert BREAKDOWN_STYLE["ep_comm"][1] == KIND_COLORS["all_to_all"]


def test_recomputation_has_its_own_spans_when_passes_are_drawn_whole():
    case = make_case("Llama 3 8B", Cluster("h100", 8), global_batch=64,
                     parallel=Parallel(dp=8, tp=1, pp=1, cp=1, ep=1), recompute="full")
    est = estimate(case)
    assert est.result.breakdown["recompute"] > 0
    by_pass = _kinds(case, max_layer_passes=1)
    assert by_pass["recompute"] == pytest.approx(_kinds(case, max_layer_passes=10**6)["recompute"], rel=0.05)
