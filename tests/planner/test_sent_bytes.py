"""Bytes one chip sends per step over each mesh axis (planner.simulate.sent_bytes_per_step), against
hand-worked ring counts: an all-reduce sends 2 (n-1)/n of its array, a gather or scatter (n-1)/n."""

import pytest

from planner.api import estimate
from planner.case import Cluster, Parallel
from planner.flops import total_params
from planner.models import MODEL_PRESETS
from planner.presets import make_case
from planner.simulate import sent_bytes_per_step

LLAMA = MODEL_PRESETS["Llama 3 8B"]
ACT = 8192 * 4096 * 2  # one sequence's activation [S, D] in bf16


def _sent(n: int, batch: int, **layout) -> tuple[dict, object]:
    degrees = {k: layout.pop(k, 1) for k in ("dp", "tp", "pp", "cp", "ep")}
    schedule = {k: layout.pop(k) for k in ("pp_schedule", "virtual_stages") if k in layout}
    case = make_case(LLAMA, Cluster("h100", n), global_batch=batch, parallel=Parallel(**degrees, **schedule),
                     micro_batch=1,
                     recompute="none", **layout)
    res = estimate(case).result
    return sent_bytes_per_step(res), res


def test_data_parallel_sends_the_gradients_once_per_step():
    sent, res = _sent(8, 64, dp=8, zero_stage=0)
    assert res.micro_batches == 8
    assert sent == {"dp": pytest.approx(2 * 7 / 8 * total_params(LLAMA) * 4)}  # fp32 gradients, Megatron's


def test_zero_1_reduce_scatters_the_gradients_and_gathers_the_bf16_weights():
    sent, _ = _sent(8, 64, dp=8, zero_stage=1)
    assert sent["dp"] == pytest.approx(7 / 8 * total_params(LLAMA) * (4 + 2))


def test_tensor_parallel_sends_four_activations_per_layer_and_micro_batch():
    sent, res = _sent(8, 8, dp=4, tp=2, zero_stage=0, sequence_parallel=False)
    # 2 all-reduces forward and 2 backward per layer, each 2 (t-1)/t = 1 activation at t = 2; the
    # vocabulary-parallel embedding's forward all-reduce, the head's input-gradient all-reduce and the fp32
    # cross-entropy's three all-reduces of 4 bytes a token (costs.vocab_parallel_comms)
    per_micro_batch = 4 * ACT * LLAMA.layers + 2 * ACT + 3 * 4 * 8192
    assert sent["tp"] == pytest.approx(per_micro_batch * res.micro_batches)


def test_a_pipeline_stage_sends_its_slice_of_each_activation():
    sent, res = _sent(16, 16, dp=4, tp=2, pp=2, zero_stage=1, pp_schedule="1f1b", virtual_stages=1)
    # stage 0: one forward send per micro-batch (its backward receives), 1/tp of the activation
    assert sent["pp"] == pytest.approx(res.micro_batches * ACT / 2)


def test_routed_experts_tp_collectives_carry_every_tokens_top_k_copies():
    """Megatron-Core's token dispatcher all-gathers the dispatched copies (T * top_k rows) over TP before the
    experts and reduce-scatters them after; the shared experts' collectives carry the layer's T rows."""
    from hardware.chips import get_chip
    from planner.case import Layout
    from planner.costs import layer_cost

    lay = Layout(dp=1, tp=2, pp=1, ep=8, micro_batch=1, sequence_parallel=True, etp=2)  # experts split by tp
    for name in ("Mixtral 8x7B", "DeepSeek-V3"):
        m = MODEL_PRESETS[name]
        lc = layer_cost(m, lay, get_chip("h100"), "bf16", True, 8)
        by_name = {c.name: c.nbytes for c in lc.fwd_comms if c.group == "tp"}
        act = m.seq_len * m.hidden * 2
        assert by_name["tp all-gather (experts fc1)"] == pytest.approx(m.top_k * act)
        assert by_name["tp reduce-scatter (experts fc2)"] == pytest.approx(m.top_k * act)
        assert by_name.get("tp all-gather (fc1)") == (pytest.approx(act) if m.shared_experts else None)


def test_under_fp8_the_sequence_parallel_all_gathers_move_one_byte_an_element():
    """Transformer Engine all-gathers the norm's output already cast to fp8 (and re-gathers that copy in backward),
    and the row layer's output gradient cast to e5m2; the reduce-scatters sum in bf16, and the MoE dispatcher's
    token all-gather moves bf16 tokens (planner.costs.FP8_GATHER_SHARE)."""
    from hardware.chips import get_chip
    from planner.case import Layout
    from planner.costs import layer_cost

    lay = Layout(dp=1, tp=8, pp=1, micro_batch=1, sequence_parallel=True)
    act = LLAMA.seq_len * LLAMA.hidden * 2
    for dtype, share in (("bf16", 1.0), ("fp8", 0.5)):
        lc = layer_cost(LLAMA, lay, get_chip("h100"), dtype, False, 8)
        comms = lc.fwd_comms + lc.bwd_comms
        gathers = [c for c in comms if c.kind == "all_gather" and c.group == "tp"]
        scatters = [c for c in comms if c.kind == "reduce_scatter" and c.group == "tp"]
        assert len(gathers) == 6 and len(scatters) == 4  # qkv and fc1 in, o and fc2 grads; their re-gathers
        assert all(c.nbytes == pytest.approx(share * act) for c in gathers)
        assert all(c.nbytes == pytest.approx(act) for c in scatters)
    mixtral = MODEL_PRESETS["Mixtral 8x7B"]
    moe = layer_cost(mixtral, Layout(dp=1, tp=2, pp=1, ep=8, micro_batch=1, sequence_parallel=True, etp=2),
                     get_chip("h100"), "fp8", True, 8)
    dispatched = {c.name: c.nbytes for c in moe.fwd_comms if c.group == "tp"}
    tokens = mixtral.top_k * mixtral.seq_len * mixtral.hidden * 2
    assert dispatched["tp all-gather (experts fc1)"] == pytest.approx(tokens)
