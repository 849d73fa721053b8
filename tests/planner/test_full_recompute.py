"""Full recomputation: what runs again before a layer's backward, on a GPU (the whole forward, PyTorch's
checkpoint) and on a TPU (JAX / XLA drop what the backward does not read: planner.costs.full_recompute)."""

from dataclasses import replace

import pytest

from hardware import kernels
from hardware.chips import get_chip
from planner.case import Layout
from planner.costs import layer_cost
from planner.models import MODEL_PRESETS

LLAMA = MODEL_PRESETS["Llama 3 8B"]  # d 4096, 32 query heads of 128, 8 KV heads, SwiGLU 14336
TP = 4
TOKENS = 8192  # one sequence of the preset


def _cost(chip, recompute, m=LLAMA, kind=False, **lay):
    lay = Layout(dp=lay.pop("dp", 1), tp=TP, pp=1, sequence_parallel=True, attention="flash", recompute=recompute,
                 **lay)
    return layer_cost(m, lay, chip, "bf16", kind, 4 if chip.kind == "tpu" else 8)


@pytest.mark.parametrize("chip_name", ["tpu-v5p", "tpu-v6e"])
def test_on_a_tpu_a_sequential_layer_skips_only_the_down_projection(chip_name):
    # the MLP's norm reads x + o, so attention's output projection runs again; the down projection's output
    # only joins the residual, so neither it nor the reduce-scatter of its partial sums does
    chip = get_chip(chip_name)
    full, none = _cost(chip, "full"), _cost(chip, "none")
    # XLA's collective matmul runs it as TP GEMMs of TOKENS / TP rows (planner.costs._chunked_gemm_times)
    down = TP * kernels.matmul_s(chip, "bf16", TOKENS / TP, 14336 / TP, 4096)
    assert full.recompute_s == pytest.approx(none.fwd_compute_s - down, rel=1e-12)
    assert [c.name for c in full.recompute_comms] == ["tp all-gather (qkv)", "tp all-gather (fc1)",
                                                      "tp reduce-scatter (o)"]
    assert full.full_recompute_flops == pytest.approx(full.fwd_flops - 2 * TOKENS * 14336 * 4096 / TP, rel=1e-12)


def test_on_a_tpu_a_parallel_block_skips_both_projections_that_feed_the_residual():
    # PaLM's y = x + attn(ln(x)) + mlp(ln(x)): o and down only feed the sum
    chip = get_chip("tpu-v5p")
    m = replace(LLAMA, parallel_block=True)
    full, none = _cost(chip, "full", m), _cost(chip, "none", m)
    o = TP * kernels.matmul_s(chip, "bf16", TOKENS / TP, 32 * 128 / TP, 4096)
    down = TP * kernels.matmul_s(chip, "bf16", TOKENS / TP, 14336 / TP, 4096)
    assert full.recompute_s == pytest.approx(none.fwd_compute_s - o - down, rel=1e-12)
    assert [c.name for c in full.recompute_comms] == ["tp all-gather (qkv)", "tp all-gather (fc1)"]
    skipped = 2 * TOKENS * (32 * 128 * 4096 + 14336 * 4096) / TP
    assert full.full_recompute_flops == pytest.approx(full.fwd_flops - skipped, rel=1e-12)


def test_on_a_tpu_a_moe_layer_runs_its_routed_experts_again():
    # the combine weighs the routed experts' outputs by the router's probabilities, whose gradient reads them:
    # only the shared expert's down projection is left out
    chip = get_chip("tpu-v5p")
    ds = MODEL_PRESETS["DeepSeek-V3"]
    full = _cost(chip, "full", ds, True, dp=8, ep=8, etp=TP)  # the experts split by tp too
    shared_down = 2 * ds.seq_len * ds.shared_experts * ds.ffn * ds.hidden / TP  # one sequence of 4,096 tokens
    assert full.fwd_flops - full.full_recompute_flops == pytest.approx(shared_down, rel=1e-12)
    assert "tp reduce-scatter (experts fc2)" in [c.name for c in full.recompute_comms]


def test_on_a_gpu_the_recomputation_runs_the_whole_forward_again():
    chip = get_chip("h100")
    full, none = _cost(chip, "full"), _cost(chip, "none")
    assert full.recompute_s == none.fwd_compute_s
    assert full.recompute_comms == full.fwd_comms
    assert full.full_recompute_flops == full.fwd_flops


def test_a_gpu_recomputation_leaves_out_the_zero3_gather_and_what_its_hidden_part_slows():
    # the backward's gather serves the recomputation: the forward's gather is not repeated, nor the compute the
    # hidden part of it slowed (planner.costs.overlap_slowdown), nor FSDP's copy out of it; the TP collectives
    # and theirs are
    from planner.costs import fsdp_copy_bytes, overlap_slowdown

    chip = get_chip("h100")
    full = _cost(chip, "full", dp=8, zero_stage=3)
    gather = [c for c in full.fwd_comms if c.group == "dp"]
    assert gather and gather[0].hidden_s > 0
    lay = Layout(dp=8, tp=TP, pp=1, zero_stage=3)  # FSDP2 (the GPU default) copies the gathered bf16 weights out
    copies = kernels.pointwise_s(chip, fsdp_copy_bytes(lay)[0] * gather[0].nbytes / 2)
    assert lay.fsdp_impl == "fsdp2" and copies > 0
    assert full.recompute_s == pytest.approx(
        full.fwd_compute_s - copies - overlap_slowdown(chip) * gather[0].hidden_s, rel=1e-12)
    assert gather[0] not in full.recompute_comms


@pytest.mark.parametrize("mode", ["none", "selective", "dots"])
def test_only_a_full_recomputation_repeats_collectives(mode):
    # selective, op lists and dots rerun what lies between the collectives, never a collective itself
    cost = _cost(get_chip("h100"), mode)
    assert cost.fwd_comms and cost.recompute_comms == ()
