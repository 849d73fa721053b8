"""Full recomputation: what runs again before a layer's backward, on a GPU (the whole forward, PyTorch's
checkpoint) and on a TPU (JAX / XLA drop what the backward does not use: planner.costs.full_recompute)."""

import pytest

from hardware import kernels
from hardware.chips import get_chip
from planner.case import Layout
from planner.costs import layer_cost
from planner.models import MODEL_PRESETS

LLAMA = MODEL_PRESETS["Llama 3 8B"]  # d 4096, 32 query heads of 128, 8 KV heads, SwiGLU 14336
TP = 4
TOKENS = 8192  # one sequence of the preset


def _cost(chip, recompute):
    lay = Layout(dp=1, tp=TP, pp=1, sequence_parallel=True, attention="flash", recompute=recompute)
    return layer_cost(LLAMA, lay, chip, "bf16", False, 4 if chip.kind == "tpu" else 8)


@pytest.mark.parametrize("chip_name", ["tpu-v5p", "tpu-v6e"])
def test_on_a_tpu_the_recomputation_skips_the_gemms_and_reductions_that_feed_the_residual(chip_name):
    chip = get_chip(chip_name)
    full, none = _cost(chip, "full"), _cost(chip, "none")
    o = kernels.matmul_s(chip, "bf16", TOKENS, 32 * 128 / TP, 4096)  # attention's output projection
    down = kernels.matmul_s(chip, "bf16", TOKENS, 14336 / TP, 4096)  # the MLP's down projection
    assert full.recompute_s == pytest.approx(none.fwd_compute_s - o - down, rel=1e-12)
    # and their FLOPs, which the timeline's recompute spans carry: 2 T (4096 x 4096 + 14336 x 4096) / t
    skipped = 2 * TOKENS * (32 * 128 * 4096 + 14336 * 4096) / TP
    assert full.full_recompute_flops == pytest.approx(full.fwd_flops - skipped, rel=1e-12)
    # the sequence all-gathers before qkv and fc1 run again; the reduce-scatters after o and fc2 do not
    assert [c.name for c in full.recompute_comms] == ["tp all-gather (qkv)", "tp all-gather (fc1)"]
    assert {c.name for c in full.fwd_comms} == {"tp all-gather (qkv)", "tp all-gather (fc1)",
                                                "tp reduce-scatter (o)", "tp reduce-scatter (fc2)"}


def test_on_a_gpu_the_recomputation_runs_the_whole_forward_again():
    chip = get_chip("h100")
    full, none = _cost(chip, "full"), _cost(chip, "none")
    assert full.recompute_s == none.fwd_compute_s
    assert full.recompute_comms == full.fwd_comms
    assert full.full_recompute_flops == full.fwd_flops
