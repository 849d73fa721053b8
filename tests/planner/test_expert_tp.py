"""Expert tensor parallelism (parallel.etp, Megatron-Core's expert_tensor_parallel_size): the routed experts
either split by tp as the dense layers do (etp = tp), or fold the tp ranks into ep (etp = 1, the null default:
what Megatron-Bridge's MoE recipes set): each expert whole, the tokens of a rank's sequence shard dispatched
over ep, no TP collective around the experts, ep carved from tp x cp x dp."""

from dataclasses import replace

import pytest

from hardware import kernels
from hardware.chips import get_chip
from planner.api import estimate
from planner.case import Layout
from planner.costs import layer_cost
from planner.models import MODEL_PRESETS, SpecError

MIXTRAL = MODEL_PRESETS["Mixtral 8x7B"]  # 8 experts of SwiGLU 14336, top-2, d 4096, 4096 tokens a sequence
H100 = get_chip("h100")


def _layer(etp, tp=2, ep=4):
    lay = Layout(dp=8, tp=tp, pp=1, ep=ep, micro_batch=1, sequence_parallel=True, etp=etp)
    return lay, layer_cost(MIXTRAL, lay, H100, "bf16", True, 8)


def test_folded_experts_run_whole_on_a_ranks_own_tokens_with_no_tp_collective():
    lay, folded = _layer(etp=1)
    _, split = _layer(etp=2)
    names = {c.name for c in folded.fwd_comms + folded.bwd_comms}
    assert not any("experts" in n for n in names)  # the token dispatcher's TP gather and reduce-scatter are gone
    assert any("experts" in c.name for c in split.fwd_comms + split.bwd_comms)
    # each of a rank's 2 local experts: its T / tp tokens' top-2 copies over 4 ep ranks, the whole 14336 wide;
    # split by tp, the pair's gathered T tokens' copies, half as wide: the same FLOPs in another shape
    T, d, f = MIXTRAL.seq_len, MIXTRAL.hidden, MIXTRAL.ffn

    def experts_s(rows, width):  # forward, input gradient and weight gradient of fc1 (gate and up) and fc2
        mm = kernels.matmul_s
        fc1 = mm(H100, "bf16", rows, d, 2 * width) + mm(H100, "bf16", rows, 2 * width, d) \
            + mm(H100, "bf16", d, rows, 2 * width)
        fc2 = mm(H100, "bf16", rows, width, d) + mm(H100, "bf16", rows, d, width) + mm(H100, "bf16", width, rows, d)
        return 2 * (fc1 + fc2)

    assert dict(folded.by_class)["gemm"] - dict(split.by_class)["gemm"] == pytest.approx(
        experts_s(T / 2 * 2 * 4 / 8, f) - experts_s(T * 2 * 4 / 8, f / 2), rel=1e-9)
    # the all-to-all carries the same bytes either way: each rank's T / tp tokens' copies
    for layer in (folded, split):
        (a2a,) = [c for c in layer.fwd_comms if c.group == "ep"]
        assert a2a.nbytes == pytest.approx(T / 2 * 2 * d * 2)


def test_folded_experts_spread_over_fewer_ranks_apart():
    # ep 4 over consecutive ranks (stride etp 1) stays in a node of 8; split by tp 2 it strides 2, still in one
    lay1, lay2 = Layout(dp=8, tp=2, pp=1, ep=4, etp=1), Layout(dp=8, tp=2, pp=1, ep=4, etp=2)
    assert (lay1.etp, lay2.etp) == (1, 2)
    # an expert's replicas: tp x cp x dp / (ep x etp) ranks, etp x ep apart
    assert (lay1.expert_dp, lay1.expert_dp_stride) == (4, 4)
    assert (lay2.expert_dp, lay2.expert_dp_stride) == (2, 8)
    assert Layout(dp=8, tp=1, pp=1, ep=4).expert_dp == 2  # without tp the two agree


def _moe_case(**parallel):
    m = MIXTRAL
    return {"name": "etp", "model": {k: getattr(m, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn",
                                                                  "vocab", "seq_len", "mlp", "experts", "top_k")},
            "training": {"global_batch": 64, "micro_batch": 1, "recompute": "full", "zero_stage": 1,
                         "sequence_parallel": True},
            "parallel": {"dp": 8, "tp": 2, "pp": 4, "cp": 1, **parallel},
            "cluster": {"chip": "h100", "num_chips": 64, "chips_per_node": 8}}


def test_a_null_etp_is_one_and_is_reported():
    est = estimate(_moe_case(ep=8))
    assert est.layout.etp == 1 and est.chosen["parallel"]["etp"] == 1
    assert "etp" not in estimate(_moe_case(ep=8, etp=2)).chosen.get("parallel", {})


def test_folded_experts_may_take_more_ep_ranks_than_dp():
    # 16 experts, ep 16 over tp 2 x dp 8: only with the tp ranks folded into ep
    def case(**parallel):
        out = _moe_case(**parallel)
        out["model"]["experts"] = 16
        return out

    assert estimate(case(ep=16, etp=1)).layout.ep == 16
    with pytest.raises(SpecError, match="parallel.ep"):
        estimate(case(ep=16, etp=2))
    from planner.case import parse_case
    from planner.layout_search import candidate_layouts

    assert {lay.ep for lay in candidate_layouts(parse_case(case(ep=None)), H100)} == {1, 2, 4, 8, 16}


@pytest.mark.parametrize("etp, match", [(4, "must be 1"), (3, "must be 1")])
def test_etp_is_one_or_tp(etp, match):
    with pytest.raises(SpecError, match="parallel.etp"):
        estimate(_moe_case(ep=8, etp=etp))


def test_etp_needs_an_moe_model():
    case = _moe_case(ep=1, etp=2)
    case["model"]["experts"] = case["model"]["top_k"] = 0
    with pytest.raises(SpecError, match="parallel.etp"):
        estimate(case)


def test_etp_tp_keeps_the_experts_split_whatever_tp_the_search_takes():
    est = estimate(_moe_case(ep=8, etp="tp"))
    assert est.layout.etp == est.layout.tp == 2 and not est.layout.experts_folded
    free = _moe_case(ep=None, etp="tp")
    free["parallel"].update(tp=None, dp=None)
    from planner.case import parse_case
    from planner.layout_search import candidate_layouts

    assert all(lay.etp == lay.tp for lay in candidate_layouts(parse_case(free), H100))


@pytest.mark.parametrize("parallel, training, field", [
    ({"tp": None, "dp": None, "ep": 8, "etp": 2}, {}, "parallel.etp"),  # etp > 1 needs the tp it equals
    ({"tp": 2, "dp": None, "pp": 8, "ep": 64}, {}, "parallel.ep: 64 must divide tp.cp.dp = 8"),  # dp 64 / 16 = 4
    ({"ep": 8}, {"sequence_parallel": False}, "training.sequence_parallel"),  # MoE under tp needs SP
])
def test_bad_expert_layouts_name_their_field(parallel, training, field):
    case = _moe_case(**parallel)
    case["model"]["experts"] = 64  # every ep here divides the experts
    case["training"].update(training)
    with pytest.raises(SpecError, match=field):
        estimate(case)


def test_a_null_tp_leaves_ep_to_the_search():
    # dp 4 x pp 2 on 64 chips with ep 8: tp 8 folded would hold it, so no error before the search tries it
    case = _moe_case(tp=None, dp=4, pp=2, ep=8)
    assert estimate(case).layout.ep == 8


def test_per_layer_zero3_gathers_experts_over_their_own_replicas_and_none_without():
    # ep 8 over dp 8 leaves an expert no replica: its weights are not sharded, so not gathered either
    lay = Layout(dp=8, tp=1, pp=1, ep=8, micro_batch=1, zero_stage=3)
    gather = [c for c in layer_cost(MIXTRAL, lay, H100, "bf16", True, 8).fwd_comms if c.group == "dp"][0]
    from planner.flops import layer_params_on_chip

    dense, experts = layer_params_on_chip(MIXTRAL, True, 1, 8, 1)
    assert experts > 0 and gather.nbytes == pytest.approx(2 * dense)
    lay4 = Layout(dp=8, tp=1, pp=1, ep=4, micro_batch=1, zero_stage=3)
    gather4 = [c for c in layer_cost(MIXTRAL, lay4, H100, "bf16", True, 8).fwd_comms if c.group == "dp"][0]
    assert gather4.nbytes == pytest.approx(2 * sum(layer_params_on_chip(MIXTRAL, True, 1, 4, 1)))


def test_the_sidebar_mesh_splits_experts_by_tp():
    from core.mesh import Mesh
    from planner.case import mesh_parallel

    mesh = Mesh((("dp", 2), ("ep", 4), ("tp", 2)))
    assert mesh_parallel(mesh, MIXTRAL).etp == "tp"
    assert mesh_parallel(mesh, MODEL_PRESETS["Llama 3 8B"]).etp is None


def test_an_overlapped_expert_all_to_all_hides_its_recomputed_twin_too():
    # a full recomputation repeats the forward's all-to-alls; under ep_comm_overlap the pass with no other
    # micro-batch beside it shows them (ChunkCost.showing_ep), and the step counts what that adds
    from planner.case import Cluster, Parallel
    from planner.presets import make_case

    case = make_case("DeepSeek-V3", Cluster("h100", 256, 8), zero_stage=3, recompute="full", micro_batch=1,
                     ep_comm_overlap=True, parallel=Parallel(dp=64, tp=1, pp=4, cp=1, ep=8, pp_schedule="1f1b"))
    est = estimate(case)
    chunk = est.result.stages[0].chunks[0]
    def hidden(comms):
        return sum(c.time_s - c.exposed_s for c in comms if c.group == "ep")

    rerun = sum(n * hidden(lc.recompute_comms) for lc, n in chunk.layer_costs)
    assert rerun > 0
    assert chunk.ep_hidden_s("bwd") == pytest.approx(sum(n * hidden(lc.bwd_comms) for lc, n in chunk.layer_costs)
                                                     + rerun)
    spans = est.timeline.spans
    assert all(s.end_s >= s.start_s for s in spans)
    assert max(s.end_s for s in spans) == pytest.approx(est.step_time_s, rel=1e-9)


def test_a_cp_group_is_tp_apart_with_experts_or_without():
    # Megatron-Core builds the dense layers' groups with ep = 1 (tp, cp, dp, pp): Mixtral at tp 1, cp 2, ep 8
    # keeps its K/V ring between neighbours on NVLink, not 8 ranks apart across the node
    from planner import costs

    lay = Layout(dp=16, tp=1, pp=1, cp=2, ep=8, micro_batch=1)
    assert lay.mesh.stride("cp") == 1 and costs.data_stride(lay) == 1
    ring = [c for c in layer_cost(MIXTRAL, lay, H100, "bf16", True, 8).fwd_comms if c.group == "cp"][0]
    step = costs.comm_s(costs.topology(H100, 2, 1, 8), "p2p", ring.nbytes)
    assert ring.time_s == pytest.approx(step) and not costs.crosses_network(2, 1, H100, 8)


def test_deepep_sends_a_token_once_to_each_rank_holding_any_of_its_experts():
    # inside a node: Mixtral's top-2 of 8 experts over 8 ranks reach 8 (1 - (7/8)^2) = 1.875 ranks a token, where
    # the plain all-to-all sends both copies
    from planner import costs

    lay = Layout(dp=8, tp=1, pp=1, ep=8, micro_batch=1)
    plain, deepep = ([c for c in layer_cost(MIXTRAL, replace(lay, ep_dispatch=d), H100, "bf16", True, 8).fwd_comms
                      if c.group == "ep"][0] for d in ("all_to_all", "deepep"))
    topo = costs.topology(H100, 8, 1, 8)
    assert plain.time_s == pytest.approx(2 * costs.comm_s(topo, "all_to_all", plain.nbytes))
    assert deepep.time_s == pytest.approx(2 * costs.comm_s(topo, "all_to_all", plain.nbytes / 2 * 1.875))


def test_the_search_never_offers_moe_under_tp_without_sequence_parallelism():
    from planner.case import parse_case
    from planner.layout_search import candidate_layouts

    case = _moe_case(tp=None, dp=None, ep=None)
    case["training"]["sequence_parallel"] = False
    assert all(lay.tp == 1 for lay in candidate_layouts(parse_case(case), H100))


def test_a_null_cp_may_still_give_a_folded_ep_its_ranks():
    # 16 experts, ep 16 on 64 chips at dp 4, tp 2, pp 4: tp x dp = 8 ranks, but cp 2 (null here) makes 16
    case = _moe_case(dp=4, tp=2, pp=4, cp=None, ep=16)
    case["model"]["experts"] = 16
    est = estimate(case)
    assert (est.layout.ep, est.layout.cp, est.layout.etp) == (16, 2, 1)


def test_folded_experts_permute_only_a_ranks_own_tokens():
    # Megatron-Core's permute (index_select) and unpermute (scatter-add) read and write each token's top-k
    # copies, 2 x (2 + 2) k h bytes per token each way: split by tp, over the pair's gathered T tokens; with
    # the tp ranks folded into ep, over the rank's own T / tp (no gather; planner.costs._elementwise)
    from planner.costs import _elementwise

    folded, split = (Layout(dp=8, tp=2, pp=1, ep=4, sequence_parallel=True, etp=e) for e in (1, 2))
    T, h, k = MIXTRAL.seq_len, MIXTRAL.hidden, MIXTRAL.top_k
    dense = _elementwise(MIXTRAL, replace(folded, etp=1), False, T)["point_fwd"]  # no experts: no permute
    moe_split = _elementwise(MIXTRAL, split, True, T)["point_fwd"]
    moe_folded = _elementwise(MIXTRAL, folded, True, T)["point_fwd"]
    # the NCCL all-to-all dispatcher with two local experts a rank (8 over ep = 4) permutes twice each way: by
    # destination rank, then by local expert (MoEAlltoAllTokenDispatcher's sort_chunks_by_idxs); DeepEP once
    assert moe_split - moe_folded == pytest.approx(2 * 8 * k * h * T * (1 - 1 / 2))
    assert moe_folded > dense
    deepep = {f: _elementwise(MIXTRAL, replace(lay, ep_dispatch="deepep"), True, T)["point_fwd"]
              for f, lay in (("split", split), ("folded", folded))}
    assert deepep["split"] - deepep["folded"] == pytest.approx(8 * k * h * T * (1 - 1 / 2))
    one_local = replace(folded, ep=8)  # one expert a rank: nothing to sort after the exchange
    assert (_elementwise(MIXTRAL, one_local, True, T)["point_fwd"]
            == pytest.approx(_elementwise(MIXTRAL, replace(one_local, ep_dispatch="deepep"), True, T)["point_fwd"]))


def test_experts_split_by_tp_take_their_ep_ranks_from_cp_and_dp():
    # Megatron-Core's expert ranks: world = etp x ep x expert dp x pp, so ep divides tp x cp x dp / etp: with
    # the experts split by tp (etp = tp) the dense layers' cp x dp ranks, 8 = 2 x 4 here
    from planner import make_case
    from planner.case import Cluster, Parallel

    def case(dp):
        return make_case("Mixtral 8x7B", Cluster("h100", 2 * dp, 8), global_batch=64,
                         parallel=Parallel(dp=dp, tp=1, pp=1, cp=2, ep=8))

    est = estimate(case(4))
    assert (est.layout.ep, est.layout.expert_dp) == (8, 1)
    with pytest.raises(SpecError, match="parallel.ep: 8 must divide cp\\*dp = 4"):
        estimate(case(2))


def test_a_layers_gradient_sync_is_summed_over_cp_and_dp():
    from planner.api import layer_comm_bytes

    llama = MODEL_PRESETS["Llama 3 8B"]
    assert "dp" in layer_comm_bytes(llama, False, cp=2)  # dp 1, cp 2: two ranks still sum the gradient
    four, two = layer_comm_bytes(llama, False, cp=2, dp=2)["dp"], layer_comm_bytes(llama, False, dp=2)["dp"]
    assert four["time_s"] > two["time_s"]


def test_an_overlapped_dispatch_or_combine_hides_only_under_the_compute_paired_with_it():
    # Megatron-Core's combined 1F1B (Megatron-LM PR 2719's table), hand-worked: 4 ms of all-to-all each way,
    # 2 ms of dispatch and 2 of combine; attention 0.5 ms forward, 1 ms backward; the MoE block 2 ms forward,
    # 4 ms input gradient, 2 ms weight gradient
    from planner.costs import MoeSides, paired_ep_exposed_s

    sides = MoeSides(attention_fwd_s=0.5e-3, moe_fwd_s=2e-3, attention_bwd_s=1e-3, moe_dgrad_s=4e-3,
                     moe_wgrad_s=2e-3)
    fwd, bwd = paired_ep_exposed_s(4e-3, 4e-3, sides)
    # phase 1: the backward's combine outlasts the attention forward by 1.5 ms; phase 2: both dispatches hide
    # (max(max(2, 4) + 2, max(6, 2) + 2) = 8 ms, the compute's own); phase 3: the forward's combine outlasts
    # the attention backward by 1 ms
    assert fwd == pytest.approx(1e-3) and bwd == pytest.approx(1.5e-3)
    # hidden under the whole other pass instead, the forward's 4 ms would show 1.5 (the forward computes 2.5)
    # and the backward's none (it computes 7): 1.5 ms in all, where the pairing leaves 2.5 in view
    # phase 2's cross-stream waits: a forward dispatch 0.1 ms longer than the MoE input gradient is absorbed
    # by the weight gradient before the MoE forward needs it, and the backward's dispatch fits beside both
    sides2 = MoeSides(attention_fwd_s=5e-3, moe_fwd_s=0.5e-3, attention_bwd_s=5e-3, moe_dgrad_s=1.5e-3,
                      moe_wgrad_s=0.5e-3)
    assert paired_ep_exposed_s(3.2e-3, 1e-3, sides2) == (0.0, 0.0)
    # ... and a backward dispatch that waits for the input gradient and then outlasts the rest shows
    fwd3, bwd3 = paired_ep_exposed_s(3.2e-3, 4e-3, sides2)  # max(1.6, 1.5) + 2 = 3.6 against 2.5 of compute
    assert fwd3 == 0.0 and bwd3 == pytest.approx(1.1e-3)


def test_the_layer_split_for_the_overlap_adds_up_to_its_compute():
    # moe_sides cuts a layer's compute into the MoE block (its GEMMs and pointwise bytes) and the rest, whole
    from planner.costs import MoeSides, moe_sides

    ew = {"moe_point_fwd": 0.0, "moe_point_bwd": 0.0}
    sides = moe_sides(H100, ew, ["experts fc1"], {"experts fc1": 1.0, "qkv": 2.0}, {"experts fc1": 3.0, "qkv": 4.0},
                      {"experts fc1": 5.0, "qkv": 6.0}, fwd_s=10.0, bwd_s=30.0)
    assert sides == MoeSides(attention_fwd_s=9.0, moe_fwd_s=1.0, attention_bwd_s=22.0, moe_dgrad_s=3.0,
                             moe_wgrad_s=5.0)
    # DeepSeek-V3 over EP 64 (8 nodes) on H100: the backward's combine outlasts the MLA forward beside it, so part
    # of the backward's all-to-all shows though the whole forward pass would have hidden it; the forward's hides
    lay = Layout(dp=64, tp=1, pp=1, ep=64, micro_batch=1, ep_comm_overlap=True)
    lc = layer_cost(MODEL_PRESETS["DeepSeek-V3"], lay, H100, "bf16", True, 8)
    fwd, bwd = ([c for c in comms if c.group == "ep"][0] for comms in (lc.fwd_comms, lc.bwd_comms))
    assert fwd.exposed_s == 0.0 and 0.0 < bwd.exposed_s < bwd.time_s
    assert bwd.time_s < lc.bwd_compute_s  # the whole backward pass would have hidden it
