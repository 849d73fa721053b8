"""Exercises: each answer equals the owning module's number, worked out by hand here, for several settings;
on the pages they follow the sliders and the sidebar."""

import math

import pytest

from hardware.chips import CHIPS
from planner.costs import cluster_chip
from planner.models import MODEL_PRESETS
from tests.ui.apptest_util import open_app
from ui import exercises as ex

H100, V5P = CHIPS["h100"], CHIPS["tpu-v5p"]
LLAMA_8B, LLAMA_70B, V3 = MODEL_PRESETS["Llama 3 8B"], MODEL_PRESETS["Llama 3 70B"], MODEL_PRESETS["DeepSeek-V3"]


def test_ridge_point_is_peak_over_bandwidth():
    assert ex.ridge_point(H100).answer == pytest.approx(989e12 / 3.35e12)  # ~295 ([SB] Part 12)
    assert ex.ridge_point(V5P).answer == pytest.approx(4.59e14 / 2.765e12, rel=0.01)


@pytest.mark.parametrize("chip, dp, stride, answer", [
    (cluster_chip(V5P, 64, None), 4, 1, 2550),  # one wrapped axis of a 4 x 4 x 4 slice ([SB])
    (cluster_chip(V5P, 4096, None), 4, 1, 5100),  # 4 of a 16-chip axis: a line, one link at its ends
    (H100, 8, 1, 2198), (H100, 32, 1, 2473)])
def test_fsdp_batch_is_c_over_w(chip, dp, stride, answer):
    assert ex.fsdp_batch(LLAMA_8B, chip, dp, stride).answer == pytest.approx(answer, abs=1)


@pytest.mark.parametrize("dp, stage", [(1, "none: even ZeRO-3 does not fit; raise dp"),
                                       (8, "none: even ZeRO-3 does not fit; raise dp"), (64, 3)])
def test_smallest_zero_stage_that_fits(dp, stage):
    # Llama 3 70B, ~70.6e9 parameters, 16 bytes each = 1.13 TB, on 80 GB: ZeRO-3 at dp 8 holds 141 GB: no; at
    # dp 64, ZeRO-2 keeps 2 + 14/64 bytes (157 GB): no, ZeRO-3 16/64 bytes (17.6 GB): yes
    from planner.flops import total_params
    from planner.memory import zero_bytes_per_param

    psi = total_params(LLAMA_70B)
    got = ex.smallest_fitting_zero_stage(psi, LLAMA_70B.name, H100, dp).answer
    want = next((s for s in range(4) if sum(zero_bytes_per_param(s, dp)) * psi <= H100.hbm_bytes),
                "none: even ZeRO-3 does not fit; raise dp")
    assert got == want == stage


def test_largest_compute_bound_tp():
    # 1.5 F / (C / W) for SwiGLU's three matrices: Llama 3 70B on v5p 1.5 x 28,672 / 2,550 = 16.9 -> 16; Llama 3 8B
    # on H100 1.5 x 14,336 / 2,198 = 9.8 -> 9; F / (C / W) for two ([SB]'s): GPT-3 2.7B on v5p 10,240 / 2,550 -> 4
    assert ex.largest_compute_bound_tp(LLAMA_70B, V5P, 4096).answer == 16
    # the rule allows 9.8 on H100; 9 fits no 8-GPU node and divides no 32 heads: 8
    assert ex.largest_compute_bound_tp(LLAMA_8B, H100, 4096).answer == 8
    assert ex.largest_compute_bound_tp(MODEL_PRESETS["GPT-3 2.7B"], V5P, 4096).answer == 4
    # on a TPU each degree gets its own group's links on the job's slice: on 4 x 4 x 4, Y = 32 spans two wrapped
    # axes and half the third (C / W 1,152: 1.5 x 28,672 / 1,152 = 37.3); on 16 x 16 x 16 a group of 4 is a
    # line along part of an axis (5,100: 10,240 / 5,100 = 2.0)
    assert ex.largest_compute_bound_tp(LLAMA_70B, V5P, 4096, job_chips=64).answer == 32
    assert ex.largest_compute_bound_tp(MODEL_PRESETS["GPT-3 2.7B"], V5P, 4096, job_chips=4096).answer == 2


@pytest.mark.parametrize("p, m", [(2, 10), (4, 30), (8, 70)])
def test_bubble_micro_batches(p, m):
    assert ex.bubble_micro_batches(p).answer == m  # (p - 1) / m <= 0.1


def test_ep_expert_width():
    assert ex.ep_expert_width(V3, H100, 8).answer == pytest.approx(2 / 3 * 7 / 8 * 989e12 / 450e9)
    # across 8-GPU nodes 56 of every 64 rows leave through the NIC: W = (63/64) / (56/64) x 50e9 (planner.bounds)
    assert ex.ep_expert_width(V3, H100, 64).answer == pytest.approx(2 / 3 * 63 / 64 * 989e12 / (63 / 56 * 50e9))


@pytest.mark.parametrize("page, params, says", [
    ("app_pages/pipeline.py", {"stages": "6"}, "**m = 50**"),
    ("app_pages/data_parallel.py", {"chip": "tpu-v5p", "dp": "4"}, "**2,550 tokens per chip**"),
    ("app_pages/tensor_parallel.py", {"chip": "tpu-v5p", "model": "Llama 3 70B"}, "Answer: **16**"),
    ("app_pages/hardware.py", {"chip": "h100"}, "**295 FLOPs per byte**"),
])
def test_the_pages_answers_follow_their_settings(page, params, says):
    at = open_app(page, **params)
    assert not at.exception
    answers = " ".join(m.value for e in at.expander if e.label == "Show the worked answer" for m in e.markdown)
    assert says in answers, answers


def test_compute_bound_tokens_reaches_the_ridge_point():
    e = ex.compute_bound_tokens(H100, 4096, 4096)
    b, d, f = e.answer, 4096, 4096
    ridge = 989e12 / 3.35e12
    # the first whole token count at or past the ridge (the nearest had been answered: 188 for 188.16 on A100)
    assert b * d * f / (b * d + d * f + b * f) >= ridge > (b - 1) * d * f / ((b - 1) * d + d * f + (b - 1) * f)
    a100 = ex.compute_bound_tokens(CHIPS["a100-80gb"], 1024, 4096)
    assert a100.answer == 189 and "so **189 tokens**" in a100.worked[-1]
    assert isinstance(ex.compute_bound_tokens(H100, 256, 256).answer, str)  # 256-wide weights never get there


@pytest.mark.parametrize("dtype, achievable", [("fp8", False), ("fp8", True), ("bf16", True)])
def test_the_hardware_exercises_follow_the_pages_number_format_and_numbers(dtype, achievable):
    """They had stayed bf16 and spec after the page switched to fp8 or achievable numbers."""
    from hardware.roofline import matmul_cost

    ridge = ex.ridge_point(H100, dtype, achievable)
    assert ridge.answer == pytest.approx(matmul_cost(1, 1, 1, dtype, H100, achievable).ridge)
    e = ex.compute_bound_tokens(H100, 8192, 8192, dtype, achievable)
    below, above = (matmul_cost(b, 8192, 8192, dtype, H100, achievable) for b in (int(e.answer) - 1, int(e.answer)))
    assert below.bound == "memory" and above.bound == "compute"  # the page's own matmul turns at the answer
    assert dtype in e.question and ("achievable" if achievable else "spec") in e.question


def test_ring_bytes_and_the_latency_crossover():
    assert ex.ring_bytes("all-reduce", 4, 1000).answer == 1500
    assert ex.ring_bytes("all-gather", 4, 1000).answer == 750
    from hardware.collectives import group_topology
    from ui.collectives import crossover_bytes

    topo = group_topology(H100, 8, 1)
    assert ex.latency_crossover(topo, crossover_bytes(topo.all_gather_s)).answer == crossover_bytes(topo.all_gather_s)
    # a ring all-to-all forwards the piece for the chip d steps on d times: (N - 1) / 2 of b, growing with N (the
    # page had answered an all-gather's (N - 1) / N: 28 MiB for 112 on 8 chips)
    assert ex.ring_bytes("all-to-all", 8, 32 * 2**20).answer == 112 * 2**20
    # with achievable links the pipeline's fill counts with the latency: the question says it, V* = N (α + fill /
    # (N - 1)) W (21.5 MiB on 8 H100, where N α W without the fill is 4.2 MiB)
    real = group_topology(H100, 8, 1, achievable=True)
    crossover = crossover_bytes(real.all_gather_s)
    link = real.link
    assert crossover == pytest.approx(8 * (link.latency_s + real.fill_s / 7) * link.bytes_per_s)
    assert "43 µs fill per collective" in ex.latency_crossover(real, crossover).question


def test_the_other_answers():
    assert ex.gpipe_bubble(4, 8).answer == pytest.approx(3 / 11)
    assert ex.a2a_leaving_share(8, 4096, 2, 4096).answer == pytest.approx(7 / 8)
    assert ex.ring_kv_held({"ring_kv_held_bytes": 2.0, "allgather_kv_held_bytes": 8.0}).answer == 4.0
    # Llama 3 405B: 16 bytes x 405.9e9 = 6.49 TB over 85.5 GB (80 GiB) -> 76 H100s
    from planner.flops import total_params

    psi = total_params(MODEL_PRESETS["Llama 3 405B"])
    assert ex.training_state_chips(psi, "Llama 3 405B", H100).answer == math.ceil(16 * psi / 85.5e9) == 76
    assert ex.tp_bytes_per_layer(8, 1, 8192, 4096, 12345.0).answer == 12345.0  # the page's own row


@pytest.mark.parametrize("page", ["app_pages/collectives.py", "app_pages/planner.py", "app_pages/context_parallel.py",
                                  "app_pages/expert_parallel.py", "app_pages/tensor_parallel.py"])
def test_every_lesson_has_exercises(page):
    at = open_app(page, tp_degree="4") if "tensor" in page else open_app(page)
    assert not at.exception
    assert sum(e.label == "Show the worked answer" for e in at.expander) >= 1


def test_a_small_array_is_quoted_in_its_own_unit():
    """A 128 B array had been asked about as "the 0 MiB array", its answer "0.0 MiB"."""
    from ui.exercises import ring_bytes

    ex = ring_bytes("all-gather", 4, 128)
    assert "the 128 B array" in ex.question and "**96 B**" in " ".join(ex.worked)
