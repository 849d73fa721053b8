"""A predicted comm span's bytes are what its rank sends (core.timeline.Span.bytes), as the live engine counts
them (hardware.collectives.ring_sent_bytes) and planner.simulate.sent_bytes_per_step sums them, at every zoom."""

import pytest

from hardware.collectives import ring_sent_bytes
from planner import estimate, make_case
from planner.case import Cluster, Parallel
from planner.simulate import sent_bytes_per_step
from planner.timeline import predicted_timeline

LAYERS = {"max_layer_passes": 10**6}  # layer by layer
PASSES = {"max_layer_passes": 1}  # each pass whole


def _sent(res, **kw) -> dict[str, int]:
    """Bytes the timeline's first rank sends over each group in the step."""
    out: dict[str, int] = {}
    timeline = predicted_timeline(res, **kw)
    assert timeline.meta["drawn"] == ("layers" if kw == LAYERS else "passes")
    for s in timeline.spans:
        if s.rank == 0 and s.lane == "comm" and s.bytes:
            out[s.group] = out.get(s.group, 0) + s.bytes
    return out


def test_layer_spans_carry_the_bytes_sent_not_the_array():
    """A tp all-gather's span had carried the whole gathered array (8/7 of what a rank sends at tp 8)."""
    case = make_case("Llama 3 8B", Cluster("h100", 8), global_batch=8, parallel=Parallel(dp=1, tp=8, pp=1, cp=1, ep=1))
    res = estimate(case).result
    lc = res.stages[0].chunks[0].layer_costs[0][0]
    qkv = next(c for c in lc.fwd_comms if c.name == "tp all-gather (qkv)")
    span = next(s for s in predicted_timeline(res, **LAYERS).spans if s.name == "tp all-gather (qkv)")
    assert span.bytes == int(ring_sent_bytes("all_gather", qkv.nbytes, 8)) == int(7 * qkv.nbytes / 8)


def test_a_ring_span_carries_all_its_steps_and_both_zooms_sum_to_the_steps_sent_bytes():
    """Llama 3 8B at dp 2 cp 4: each layer's K/V ring is 3 sends of its block in one span (count 3); the span had
    carried one, and the passes drawn whole three times the layers' sum."""
    case = make_case("Llama 3 8B", Cluster("h100", 8), global_batch=64,
                     parallel=Parallel(dp=2, tp=1, pp=1, cp=4, ep=1))
    res = estimate(case).result
    ring = next(c for c in res.stages[0].chunks[0].layer_costs[0][0].fwd_comms if c.group == "cp")
    assert ring.count == 3
    span = next(s for s in predicted_timeline(res, **LAYERS).spans if s.group == "cp")
    assert span.bytes == int(3 * ring.nbytes)
    step = sent_bytes_per_step(res)
    by_layer, by_pass = _sent(res, **LAYERS), _sent(res, **PASSES)
    assert by_layer["cp"] == pytest.approx(step["cp"], rel=1e-9)
    assert by_pass["cp"] == pytest.approx(step["cp"], rel=1e-9)


def test_tensor_parallel_bytes_agree_with_the_step_at_both_zooms():
    case = make_case("Llama 3 8B", Cluster("h100", 8), global_batch=8, parallel=Parallel(dp=2, tp=2, pp=1, cp=2, ep=1))
    res = estimate(case).result
    step = sent_bytes_per_step(res)
    for kw in (LAYERS, PASSES):
        sent = _sent(res, **kw)
        for group in ("tp", "cp"):
            assert sent[group] == pytest.approx(step[group], rel=1e-9), (kw, group)
