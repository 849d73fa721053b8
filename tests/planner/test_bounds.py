"""The bound meter's rules against the scaling book's worked numbers ([SB] Part 5 and Part 12)."""

import math

import pytest

from hardware.chips import CHIPS
from planner.bounds import (
    cross_pod_bound,
    data_parallel_bound,
    fsdp_tp_tradeoff,
    group_bandwidth,
    tensor_parallel_bound,
)
from planner.costs import cluster_chip
from planner.models import MODEL_PRESETS, ModelSpec

LLAMA_8B, LLAMA_70B = MODEL_PRESETS["Llama 3 8B"], MODEL_PRESETS["Llama 3 70B"]


def v5p_slice(chips: int):
    """TPU v5p as a job of `chips` wires it: its slice's torus (4 x 4 x 4 for 64, wrapped)."""
    return cluster_chip(CHIPS["tpu-v5p"], chips, None)


@pytest.mark.parametrize("chip, dp, stride, threshold", [
    (v5p_slice(64), 4, 1, 2550),  # [SB]: 4.59e14 / 1.8e11 = 2550 over one wrapped ICI axis
    (v5p_slice(64), 64, 1, 850),  # [SB]: FSDP over all three axes, "850"
    (v5p_slice(4096), 4096, 1, 850),  # the same on 16 x 16 x 16
    (CHIPS["h100"], 8, 1, 2200),  # inside a node: 989e12 / 450e9 ~ 2200
    (CHIPS["h100"], 16, 1, 2475),  # across nodes: 989e12 / 400e9 (node egress) ~ 2475
], ids=["v5p-axis", "v5p-3-axes", "v5p-4096", "h100-node", "h100-2-nodes"])
@pytest.mark.parametrize("fsdp", [False, True])
def test_data_parallel_and_fsdp_turn_compute_bound_at_c_over_w(chip, dp, stride, threshold, fsdp):
    low = data_parallel_bound(LLAMA_8B, chip, 0.98 * threshold, dp, stride, fsdp=fsdp)
    high = data_parallel_bound(LLAMA_8B, chip, 1.02 * threshold, dp, stride, fsdp=fsdp)
    assert low.intensity == pytest.approx(threshold, rel=0.005)
    assert not low.compute_bound and high.compute_bound
    assert f"= {low.intensity:,.0f};" in low.rule


def test_a_group_spread_over_nodes_or_on_a_mesh_gets_only_its_own_links():
    h100, mi300x = CHIPS["h100"], CHIPS["mi300x"]
    # dp = 8 under tp = 8: one member per node, its own 50 GB/s NIC (the meter had given it the node's 400:
    # C / W 2,472, compute-bound at 4,096 tokens; it is 19,780, communication-bound)
    spread = data_parallel_bound(LLAMA_8B, h100, 4096, 8, stride=8)
    assert spread.intensity == pytest.approx(989e12 / 50e9, rel=0.01) and not spread.compute_bound
    # dp = 16 under tp = 2: four members per node share four NICs
    assert data_parallel_bound(LLAMA_8B, h100, 4096, 16, stride=2).intensity == pytest.approx(989e12 / 200e9,
                                                                                              rel=0.01)
    # a pair of MI300X shares one of the seven Infinity Fabric links, as hardware.collectives prices it
    pair = data_parallel_bound(LLAMA_8B, mi300x, 4096, 2)
    assert pair.intensity == pytest.approx(mi300x.peak_flops_per_s("bf16") / (mi300x.scaleup_bytes_per_s / 7))
    assert "1 of its 7 links" in pair.link


def test_tensor_parallel_limit_is_f_over_c_over_w():
    # [SB]: "Y < M_Y * F / 2550 ~ M_Y * 11" for F = 28,672 (Llama 3 70B) on TPU v5p, M_Y the axes the TP group
    # spans: the rule of an MLP of two matrices, as [SB] derives it. On a 4 x 4 x 4 slice a group of 4 spans one
    # wrapped axis, 16 two, 64 all three
    from dataclasses import replace

    v5p = v5p_slice(64)
    two = replace(LLAMA_70B, mlp="gelu")
    assert "28,672 / 2,550 = 11.2" in tensor_parallel_bound(two, v5p, 4096, 4).rule
    assert "28,672 / 1,275 = 22.5" in tensor_parallel_bound(two, v5p, 4096, 16).rule
    assert tensor_parallel_bound(two, v5p, 4096, 16).compute_bound
    assert "28,672 / 850 = 33.7" in tensor_parallel_bound(two, v5p, 4096, 64).rule
    assert not tensor_parallel_bound(two, v5p, 4096, 64).compute_bound
    # Llama's SwiGLU MLP has a third matrix on the same gathered input: 1.5x the math, the same bytes
    swiglu = tensor_parallel_bound(LLAMA_70B, v5p, 4096, 4)
    assert "1.5 x 28,672 / 2,550 = 16.9" in swiglu.rule and swiglu.compute_bound
    assert not tensor_parallel_bound(LLAMA_70B, v5p, 4096, 64).compute_bound  # 1.5 x 33.7 = 50.6
    assert swiglu.math_s == pytest.approx(1.5 * tensor_parallel_bound(two, v5p, 4096, 4).math_s)


def test_a_tpu_group_gets_the_links_of_the_axes_it_spans_on_its_slice():
    # the collective model's links (hardware.collectives.group_topology), the meter's W: a line along part of an
    # axis has one link at its ends (4 of a 16-chip axis: 5,100, where the meter had said 2,550), a group across
    # two slices all-gathers over ICI inside each (the DCN carries 1/512 of it), a group of one chip per slice
    # the DCN alone (4.59e14 / 6.25e9 = 73,440)
    v5p = CHIPS["tpu-v5p"]
    line = data_parallel_bound(LLAMA_8B, cluster_chip(v5p, 4096, None), 4096, 4)
    assert line.intensity == pytest.approx(5100) and "no wraparound" in line.link
    two_slices = cluster_chip(v5p, 1024, None, slices=2)
    across = data_parallel_bound(LLAMA_8B, two_slices, 4096, 1024)
    assert across.intensity == pytest.approx(850, rel=0.01) and "2 slices" in across.link
    dcn = data_parallel_bound(LLAMA_8B, two_slices, 4096, 2, stride=512)
    assert dcn.intensity == pytest.approx(73440) and "DCN" in dcn.link


def test_tensor_parallel_does_not_depend_on_the_batch():
    h100 = CHIPS["h100"]
    verdicts = {tensor_parallel_bound(LLAMA_8B, h100, tokens, 8).compute_bound for tokens in (512, 4096, 65536)}
    assert len(verdicts) == 1


def test_expert_parallel_inside_a_node_and_across_nodes():
    # hand-worked, H100: C / W = 989e12 / 450e9 = 2,198 inside a node; SwiGLU experts (n = 3): F > (2/3)(ep-1)/ep
    # C/W = 1,282 at ep = 8 (7/8). Across 8-GPU nodes an all-to-all's rows for the node's own members stay on
    # NVLink: at ep = 64, 56 of every 64 rows leave through each GPU's 50 GB/s NIC, so a chip moves its (63/64)
    # of the rows at W = (63/64) / (56/64) x 50e9 = 56.25e9 (C / W 17,582: F > 11,538); at ep = 16 half leave,
    # W = 93.75e9 (C / W 10,549: F > 6,593). Every leaving row at the NIC had said 12,981 and 12,362
    from planner.bounds import expert_parallel_bound

    v3, h100 = MODEL_PRESETS["DeepSeek-V3"], CHIPS["h100"]
    inside, across = expert_parallel_bound(v3, h100, 4096, 8), expert_parallel_bound(v3, h100, 4096, 64)
    assert "= 1,282; here F = 2,048" in inside.rule and inside.compute_bound
    assert "= 11,538; here F = 2,048" in across.rule and not across.compute_bound
    assert "each GPU's own NIC; 56 of every 64 rows leave the node" in across.link
    assert "= 6,593; here F = 2,048" in expert_parallel_bound(v3, h100, 4096, 16).rule
    # one GPU per node: every row leaves, through its own NIC (C / W = 989e12 / 50e9 = 19,780)
    spread = expert_parallel_bound(v3, h100, 4096, 8, stride=8)
    assert spread.intensity == pytest.approx(19780, rel=0.01) and "every row leaves the node" in spread.link


def _book_model(ffn: int, mlp: str = "gelu") -> ModelSpec:
    return ModelSpec("[SB] example", 1, 8192, 64, 8, ffn, 32000, 4096, mlp=mlp)  # [SB]'s MLP: two matrices


def test_mixed_fsdp_and_tp_floor_is_the_books_2_alpha_squared_over_f():
    # [SB] Part 5: "BS per device > 2 * 2550^2 / F", "432" for F = 30,000 (LLaMA-3 70B), "around 396" for
    # F = 32,768 (the 4x4x4 example, B = 48,000 on 64 chips)
    alpha = 4.59e14 / 1.8e11
    for ffn, book in ((30000, 432), (32768, 396)):
        t = fsdp_tp_tradeoff(_book_model(ffn), v5p_slice(64), 48000, 64)
        assert t.min_tokens_per_chip == pytest.approx(2 * alpha ** 2 / ffn)
        assert t.min_tokens_per_chip == pytest.approx(book, rel=0.01)


def test_a_swiglu_mlp_gathers_half_more_weights_for_half_more_math():
    # its gate's matrix adds D F weights and 2 B D F FLOPs, no activations (the gate reads the gathered input):
    # X_opt = sqrt((2 / n) B N / F) falls by sqrt(2/3), the floor (8 / n) alpha^2 / F by 2/3
    # (inside one H100 node every split gets the same NVLink: the closed form's X_opt moves with n alone; on a
    # TPU slice the best split, and so its axes, can change with n)
    two, three = (fsdp_tp_tradeoff(_book_model(32768, mlp), CHIPS["h100"], 48000, 8) for mlp in ("gelu", "swiglu"))
    assert three.matrices == 3 and two.matrices == 2
    assert three.x_opt == pytest.approx(two.x_opt * math.sqrt(2 / 3))
    assert three.min_tokens_per_chip == pytest.approx(two.min_tokens_per_chip * 2 / 3)
    for a, b in zip(two.rows, three.rows, strict=True):
        assert b.fsdp_s == pytest.approx(1.5 * a.fsdp_s) and b.math_s == pytest.approx(1.5 * a.math_s)
        assert b.tp_s == a.tp_s


def test_the_tradeoff_is_least_near_x_opt():
    t = fsdp_tp_tradeoff(_book_model(32768), v5p_slice(64), 48000, 64)
    # X_opt = sqrt(2 B N / F) with one bandwidth on both axes: sqrt(2 x 48,000 x 64 / 32,768) = 13.7
    assert t.x_opt == pytest.approx(13.69, abs=0.01)
    assert t.best.fsdp == 16 and t.best.tp == 4  # the divisor of 64 nearest the optimum in cost
    assert [r.fsdp * r.tp for r in t.rows] == [64] * len(t.rows)
    # each split with its own groups' links: more FSDP (larger X, smaller Y) gathers more weights over more axes
    for r in t.rows:
        w_x, w_y = group_bandwidth(v5p_slice(64), r.fsdp, r.tp)[0], group_bandwidth(v5p_slice(64), r.tp, 1)[0]
        assert r.fsdp_s == (pytest.approx(2 * 2 * 8192 * 32768 / (r.tp * w_x)) if r.fsdp > 1 else 0.0)
        assert r.tp_s == (pytest.approx(4 * 48000 * 8192 / (r.fsdp * w_y)) if r.tp > 1 else 0.0)
    assert all(a.tp_s > b.tp_s for a, b in zip(t.rows[1:], t.rows[2:], strict=False))
    assert len({r.math_s for r in t.rows}) == 1


def test_data_parallel_between_pods_needs_c_over_w_dcn_tokens_per_pod():
    # [SB] Part 5: "per pod batch size > C / W_DCN ... = 76,000" (its rounding of 4.59e14 / 6.25e9 = 73,440)
    b = cross_pod_bound(_book_model(30000), CHIPS["tpu-v5p"], 3.5e6)
    assert b.intensity == pytest.approx(73440) and b.compute_bound
    assert not cross_pod_bound(_book_model(30000), CHIPS["tpu-v5p"], 50000).compute_bound


def test_across_gpu_nodes_the_tradeoff_takes_its_floor_from_the_splits():
    # with the links changing with the split (a node's NICs shared by its members of the group), [SB]'s closed
    # form had drawn X_opt = 437 where the total still fell, and a floor of 272 tokens where pure FSDP over
    # 400 GB/s needs C / W = 2,472
    from planner.bounds import divisors

    t = fsdp_tp_tradeoff(MODEL_PRESETS["Llama 3 405B"], CHIPS["h100"], 1024 * 8192, 1024)
    assert t.x_opt is None and t.best.fsdp == 1024
    assert 2_000 < t.min_tokens_per_chip < 2_472  # the best split's own threshold, a little under pure FSDP's
    at_floor = t.min_tokens_per_chip * 1024 / (1024 * 8192)  # rows scale with the batch: math and TP linearly
    # at the floor one split's communication just equals its math, and none is below it
    slack = [r.math_s * at_floor - (r.fsdp_s + r.tp_s * at_floor) for r in t.rows]
    assert max(slack) == pytest.approx(0, abs=1e-12)
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and len(divisors(2**32)) == 33  # in sqrt(n) steps
