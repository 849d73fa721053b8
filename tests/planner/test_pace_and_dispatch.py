"""Cluster effects, each from op-level evidence or a stated mechanism: a synchronous step goes at its slowest
GPU's pace; a deduplicated expert dispatch (DeepEP) crosses the network once per destination node; hidden
communication slows a GPU's compute (NCCL's kernels take SMs) but not a TPU's (DMA engines)."""

import json
from dataclasses import replace

import pytest

from hardware import kernels
from hardware.chips import ChipTableError, get_chip
from hardware.collectives import deduplicated_all_to_all_s, group_topology
from planner.__main__ import main
from planner.api import estimate
from planner.costs import OVERLAP_SLOWDOWN, cluster_chip, expert_nodes_per_token, overlap_slowdown, slowest_chip_pace
from planner.models import MODEL_PRESETS, SpecError


def test_one_chip_keeps_its_table_rates_a_node_and_a_cluster_wait_for_their_slowest_gpu():
    h100 = get_chip("h100")
    assert slowest_chip_pace(h100, 1, 8) == 1.0
    assert slowest_chip_pace(h100, 8, 8) == pytest.approx(1 - 0.045 / 2)  # [MLE]: 4.5 % spread in an H200 node
    assert slowest_chip_pace(h100, 64, 8) == pytest.approx(1 - 0.08 / 2)  # Sinha et al.: 8 % across clusters
    assert slowest_chip_pace(get_chip("tpu-v5p"), 256, 4) == 1.0  # no TPU measurement: not applied
    assert cluster_chip(h100, 64, 8).pace == pytest.approx(0.96)


def test_every_kernel_runs_at_the_chips_pace():
    h100 = get_chip("h100")
    slow = replace(h100, pace=0.8)
    assert kernels.matmul_s(slow, "bf16", 8192, 8192, 8192) == pytest.approx(
        kernels.matmul_s(h100, "bf16", 8192, 8192, 8192) / 0.8)
    assert kernels.flash_attention_s(slow, 1e12, 8192, "flash3")[1] == pytest.approx(
        kernels.flash_attention_s(h100, 1e12, 8192, "flash3")[1] / 0.8)
    assert kernels.pointwise_s(slow, 1e9) == pytest.approx(kernels.pointwise_s(h100, 1e9) / 0.8)
    assert kernels.norm_s(slow, 1e9, backward=True) == pytest.approx(kernels.norm_s(h100, 1e9, backward=True) / 0.8)
    with pytest.raises(ChipTableError, match="pace"):
        replace(h100, pace=1.5)


def test_mfu_is_still_against_the_datasheet_peak():
    case = {"model": {"layers": 8, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256,
                      "seq_len": 4096},
            "training": {"global_batch": 64, "micro_batch": 1, "recompute": "none", "zero_stage": 1},
            "parallel": {"dp": 64, "tp": 1, "pp": 1, "cp": 1},
            "cluster": {"chip": "h100", "num_chips": 64, "chips_per_node": 8}}
    est = estimate(case)
    assert est.mfu == pytest.approx(est.result.model_flops / (est.step_time_s * 64 * 989e12))


def test_expected_nodes_per_token_by_hand():
    ds = MODEL_PRESETS["DeepSeek-V3"]
    # 8 nodes of 8 ranks, 4 experts a rank: a group of 32 experts is one node, 4 groups -> C = 4 nodes;
    # 8 draws over 4 nodes hit 4 (1 - (3/4)^8) = 3.5995 of them
    assert expert_nodes_per_token(ds, 64, 8) == pytest.approx(4 * (1 - 0.75 ** 8))
    # 4 ranks a node (tp = 2 beside ep): a group spans 2 nodes, 4 groups -> C = 8 of the 16 nodes
    assert expert_nodes_per_token(ds, 64, 4) == pytest.approx(8 * (1 - (7 / 8) ** 8))
    # 2 nodes of 8 ranks hold 4 groups each: 4 groups of 8 miss a node with probability C(4,4)/C(8,4) = 1/70,
    # so C = 2 (1 - 1/70) nodes, and 8 draws hit C (1 - (1 - 1/C)^8) of them
    c = 2 * (1 - 1 / 70)
    assert expert_nodes_per_token(ds, 16, 8) == pytest.approx(c * (1 - (1 - 1 / c) ** 8))
    free = replace(ds, expert_groups=0, expert_groups_per_token=0)
    assert expert_nodes_per_token(free, 64, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8))
    assert expert_nodes_per_token(free, 8, 8) == pytest.approx(1.0)  # one node


def test_deduplicated_dispatch_sends_fewer_bytes_over_the_network_and_is_plain_inside_a_node():
    h100 = get_chip("h100")
    across = group_topology(h100, 64, 1, achievable=True)
    copies = 256e6
    plain = across.all_to_all_s(copies)
    dedup = deduplicated_all_to_all_s(across, copies, copies / 8 * 3.6)
    assert dedup < 0.6 * plain  # 3.6 node copies instead of 8 expert copies cross the network
    inside = group_topology(h100, 8, 1, achievable=True)
    assert deduplicated_all_to_all_s(inside, copies, copies / 4) == inside.all_to_all_s(copies)


def _moe_case(chip="h100", **training):
    m = MODEL_PRESETS["DeepSeek-V3"]
    model = {k: getattr(m, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "mlp",
                                        "experts", "top_k", "head_dim", "shared_experts", "dense_layers",
                                        "dense_ffn", "q_lora_rank", "kv_lora_rank", "rope_head_dim",
                                        "expert_groups", "expert_groups_per_token")}
    return {"name": "ds", "model": model,
            "training": {"global_batch": 512, "micro_batch": 1, "recompute": "full", "zero_stage": 1,
                         "dtype": "bf16", **training},
            "parallel": {"dp": 64, "tp": 1, "pp": 16, "cp": 1, "ep": 64, "pp_schedule": "1f1b"},
            "cluster": {"chip": chip, "num_chips": 1024, "chips_per_node": 8}}


def test_deepep_shortens_the_expert_all_to_all():
    plain = estimate(_moe_case(ep_dispatch="all_to_all"))
    deepep = estimate(_moe_case(ep_dispatch="deepep"))
    assert deepep.breakdown["ep_comm"] < 0.6 * plain.breakdown["ep_comm"]
    assert deepep.breakdown["compute"] == pytest.approx(plain.breakdown["compute"], rel=0.05)


@pytest.mark.parametrize("chip, dispatch", [("h100", "deepep"), ("b200", "deepep"), ("gb200-nvl72", "deepep"),
                                            ("a100-80gb", "all_to_all"), ("mi300x", "all_to_all")])
def test_a_null_dispatch_is_what_the_chips_moe_recipes_run(chip, dispatch):
    # chips.toml deepep_dispatch: Megatron-Bridge's MoE recipes run DeepEP / HybridEP on Hopper and Blackwell;
    # DeepEP needs SM90 (its README), so A100 and AMD keep the NCCL / RCCL all-to-all
    null = estimate(_moe_case(chip))
    assert null.chosen["training"]["ep_dispatch"] == dispatch
    assert null.step_time_s == estimate(_moe_case(chip, ep_dispatch=dispatch)).step_time_s


def test_the_explanation_names_the_dispatch_and_the_links_the_all_to_alls_take():
    def ep_sentence(chip):
        return next(w for w in estimate(_moe_case(chip)).explanation if w.startswith("EP="))

    assert "over the network (DeepEP" in ep_sentence("h100")  # 64 ranks over 8 nodes
    assert "over the network cost" in ep_sentence("a100-80gb")  # the NCCL all-to-all


def test_the_links_named_are_the_group_s_own():
    from types import SimpleNamespace

    from planner.costs import cluster_chip
    from planner.explain import _link

    v5e = cluster_chip(get_chip("tpu-v5e"), 512, 4)  # two 256-chip slices
    tpu = SimpleNamespace(chip=v5e, extra={"chips_per_node": 4})
    assert _link(tpu, 8, 1) == "ICI"
    assert _link(tpu, 8, 64) == "the data-center network"  # 8 ranks 64 apart span 512 chips
    gpu = SimpleNamespace(chip=get_chip("h100"), extra={"chips_per_node": 8})
    assert (_link(gpu, 8, 1), _link(gpu, 16, 1)) == ("NVLink", "the network")


def test_bad_dispatch_and_routing_groups_name_their_field(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_moe_case(ep_dispatch="nvshmem")))
    assert main(["estimate", str(path)]) == 2
    assert "training.ep_dispatch" in capsys.readouterr().err
    with pytest.raises(SpecError, match="model.expert_groups"):
        replace(MODEL_PRESETS["DeepSeek-V3"], expert_groups=7)
    with pytest.raises(SpecError, match="model.expert_groups_per_token"):
        replace(MODEL_PRESETS["DeepSeek-V3"], expert_groups_per_token=9)


def _dense_compute_s(chip, node, zero_stage):
    case = {"model": {"layers": 8, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 32000,
                      "seq_len": 4096},
            "training": {"global_batch": 16, "micro_batch": 1, "recompute": "none", "zero_stage": zero_stage},
            "parallel": {"dp": 16, "tp": 1, "pp": 1, "cp": 1},
            "cluster": {"chip": chip, "num_chips": 16, "chips_per_node": node}}
    return estimate(case).breakdown["compute"]


def test_hidden_communication_slows_gpu_compute_only():
    assert overlap_slowdown(get_chip("h100")) == OVERLAP_SLOWDOWN == 0.189
    assert overlap_slowdown(get_chip("tpu-v5p")) == 0.0
    # ZeRO-3's per-layer gathers hide under the layers: the GPU's compute grows by what hides, the TPU's not
    assert _dense_compute_s("h100", 8, 3) > 1.01 * _dense_compute_s("h100", 8, 1)
    assert _dense_compute_s("tpu-v5p", 4, 3) == pytest.approx(_dense_compute_s("tpu-v5p", 4, 1), rel=1e-9)


def _zero1_dp_seconds(chip, node, **training):
    """(exposed data-parallel seconds, gather, reduce-scatter, forward, backward) of a ZeRO-1 case."""
    from planner import costs

    case = {"model": {"layers": 4, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000,
                      "seq_len": 2048},
            "training": {"global_batch": 64, "micro_batch": 1, "recompute": "none", "zero_stage": 1,
                         "grad_reduce_in_fp32": False, **training},
            "parallel": {"dp": 64, "tp": 1, "pp": 1, "cp": 1},
            "cluster": {"chip": chip, "num_chips": 64, "chips_per_node": node}}
    res = estimate(case).result
    st, lay = res.stages[0], res.layout
    topo = costs.topology(res.chip, 64, 1, node)
    chunk = st.chunks[0]
    return (st.dp_exposed_s, costs.comm_s(topo, "all_gather", st.params * 2),
            costs.comm_s(topo, "reduce_scatter", st.params * lay.grad_bytes), chunk.fwd_s, chunk.bwd_s, st.params)


@pytest.mark.parametrize("chip,node", [("h100", 8), ("tpu-v5p", 4)])
def test_the_hidden_weight_gather_slows_compute_like_the_hidden_gradient_sync(chip, node):
    # ZeRO-1 gathers the updated weights under the next forward (param_gather_overlap) and reduce-scatters the
    # gradients under the backward: what hides of either costs overlap_slowdown of compute, what does not shows:
    # the edge bucket of each, the word embedding's rows and one layer's share of the rest (the first bucket
    # the next forward needs, the last one the backward fills)
    both = _zero1_dp_seconds(chip, node, grad_reduce_overlap=True, param_gather_overlap=True)
    exposed, gather, sync, fwd, bwd, params = both
    assert 0 < gather < fwd and 0 < sync < bwd * 3 / 4  # each hides but for the edge bucket's
    rows = 32000 * 4096
    edge = (rows + (params - rows) / 4) / params
    slow = overlap_slowdown(get_chip(chip))
    shown = edge * (sync + gather)
    assert exposed == pytest.approx(shown + slow * (gather + sync - shown), rel=1e-9)
    neither = _zero1_dp_seconds(chip, node, grad_reduce_overlap=False, param_gather_overlap=False)[0]
    assert neither == pytest.approx(gather + sync, rel=1e-9)
