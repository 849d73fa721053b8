"""Single-kernel costs against the op-level benchmarks they come from (hardware/chips.toml sources)."""

import math

import pytest

from hardware.chips import get_chip
from hardware.kernels import (
    best_flash_kernel,
    flash_attention_s,
    matmul_rate,
    matmul_s,
    matmul_shape_factor,
    norm_s,
    pointwise_s,
)

H100, A100, B200 = get_chip("h100"), get_chip("a100-80gb"), get_chip("b200")


def test_large_gemms_reach_the_sustained_matmul_rate():
    # the shape curve is normalised at 8192^3, where the large shapes of the MSMF / MAMF tables sit
    # [MLE] MSMF with the node's 8 GPUs all busy, 698.6 (H200) and 1426.4 (B200) TFLOP/s at their K = 20480
    # shapes, taken to 8192^3 by the shape curve
    assert H100.matmul_efficiency * 989 == pytest.approx(698.6 / 1.0187, rel=0.002)
    assert B200.matmul_efficiency * 2250 == pytest.approx(1426.4 / 1.0225, rel=0.002)
    # the curve is capped at 8192^3, so the measured shape itself gets the 8192^3 rate, within 2.5 % of its MSMF
    for chip, m, n, k, msmf in ((H100, 8192, 8448, 20480, 698.6), (B200, 9472, 8192, 20480, 1426.4)):
        assert matmul_rate(chip, "bf16", m, n, k) / 1e12 == pytest.approx(msmf, rel=0.025)
    for chip in (H100, A100, B200):
        assert matmul_shape_factor(chip, 8192, 8192, 8192) == pytest.approx(1.0)
        assert matmul_rate(chip, "bf16", 8192, 8192, 8192) == pytest.approx(
            chip.bf16_flops_per_s * chip.matmul_efficiency)


# OpenXLA default_matmul_perf_table, sm_90 (H100), bf16, measured kernel time (TFLOP/s)
XLA_SM90 = [(2048, 2048, 2048, 641), (4096, 4096, 4096, 780), (2048, 4096, 4096, 752), (4096, 4096, 2048, 736),
            (4096, 2048, 2048, 728)]


def test_h100_shape_curve_follows_the_measured_gemm_table():
    # the table times short runs (burst clocks) and the planner's level is the sustained rate, so compare the
    # shape of the curve: each shape's model / table ratio within 5 % of their geometric mean
    ratios = [matmul_rate(H100, "bf16", m, n, k) / 1e12 / tflops for m, n, k, tflops in XLA_SM90]
    level = math.prod(ratios) ** (1 / len(ratios))
    assert level == pytest.approx(686 / 805, rel=0.05)  # sustained over the table's best burst
    for r in ratios:
        assert r == pytest.approx(level, rel=0.05)


def test_small_and_skinny_gemms_are_slower():
    big = matmul_rate(H100, "bf16", 8192, 8192, 8192)
    assert matmul_rate(H100, "bf16", 8192, 8192, 256) < 0.6 * big  # short K
    assert matmul_rate(H100, "bf16", 512, 512, 8192) < 0.6 * big  # small output


def test_memory_bound_gemm_takes_the_roofline_memory_time():
    # a matrix-vector product reads the whole weight once: 2 bytes x K x N at the achievable HBM rate
    t = matmul_s(H100, "bf16", 1, 8192, 8192)
    assert t == pytest.approx(2 * (8192 + 8192 * 8192 + 8192) / H100.hbm_bw(achievable=True))


def test_fp8_gemms_run_at_the_fp8_rate_and_a100_has_none():
    assert matmul_rate(H100, "fp8", 8192, 8192, 8192) == pytest.approx(1979e12 * H100.fp8_matmul_efficiency)
    with pytest.raises(ValueError, match="fp8"):
        matmul_rate(A100, "fp8", 8192, 8192, 8192)


@pytest.mark.parametrize("chip, published", [
    # FlashAttention-2 forward + backward, causal, head dim 128 at 2k, 4k, 8k, 16k tokens (Dao 2023 figures)
    (A100, (155, 173, 182, 189)),
    (H100, (265, 294, 308, 328)),
])
def test_flash_attention_2_curve_reproduces_the_paper(chip, published):
    for s, tflops in zip((2048, 4096, 8192, 16384), published, strict=True):
        fwd_flops = 1e15
        fwd_s, bwd_s = flash_attention_s(chip, fwd_flops, s, "flash")
        assert bwd_s == pytest.approx(2.5 * fwd_s)  # five matmuls to two
        assert 3.5 * fwd_flops / (fwd_s + bwd_s) / 1e12 == pytest.approx(tflops, rel=0.04)


def test_the_newer_kernels_reproduce_their_published_rates_in_their_own_flop_convention():
    def tflops_at_8k(chip, backward_ratio):
        """Forward + backward FLOP/s at 8k keys, the backward counted as `backward_ratio` x the forward."""
        fwd_s, bwd_s = flash_attention_s(chip, 1e15, 8192, "flash3")
        return (1 + backward_ratio) * 1e15 / (fwd_s + bwd_s) / 1e12

    # FlashAttention-3 paper, cuDNN on H100, causal head dim 128 at 8k: forward 529, backward ~456 TFLOP/s,
    # the backward counted as 2.5x the forward, as the FlashAttention benchmarks count it: 475 together
    assert tflops_at_8k(H100, 2.5) == pytest.approx(3.5 / (1 / 529 + 2.5 / 456), rel=0.02)
    # [MLE]'s in-step FA4 on B200: 834 TFLOP/s at 8k, counting the causal backward as 2x the forward (6 s^2 d h L)
    assert tflops_at_8k(B200, 2.0) == pytest.approx(834, rel=0.02)


def test_the_newer_kernels_exist_only_where_published():
    assert best_flash_kernel(H100) == "flash3" and best_flash_kernel(B200) == "flash3"
    assert best_flash_kernel(A100) == "flash" and best_flash_kernel(get_chip("tpu-v5p")) == "flash"
    fa2, _ = flash_attention_s(H100, 1e15, 8192, "flash")
    fa3, _ = flash_attention_s(H100, 1e15, 8192, "flash3")
    assert fa3 < fa2
    with pytest.raises(ValueError, match="FlashAttention-3"):
        flash_attention_s(A100, 1e15, 8192, "flash3")


def _combined_tflops(fwd_causal, bwd_unmasked, fwd_unmasked):
    """Forward + backward TFLOP/s of a causal kernel from the FlashAttention-3 paper's figures: the causal
    backward is the unmasked one times the forward's causal / unmasked ratio (chips.toml, h100)."""
    bwd_causal = bwd_unmasked * fwd_causal / fwd_unmasked
    return 3.5 / (1 / fwd_causal + 2.5 / bwd_causal)


@pytest.mark.parametrize("kernel, head_dim_64, head_dim_128", [
    # FlashAttention-3 paper, H100 SXM5 BF16 at 8k: (forward causal, backward unmasked, forward unmasked)
    ("flash", (295, 287, 322), (333, 318, 370)),  # FlashAttention-2
    ("flash3", (379, 432, 412), (529, 518, 600)),  # cuDNN, the kernel flash3_efficiency is read from
    ("flash3", (460, 472, 496), (602, 559, 646)),  # FlashAttention-3
])
def test_head_dim_64_runs_at_the_measured_share_of_head_dim_128(kernel, head_dim_64, head_dim_128):
    def seconds(head_dim):
        return sum(flash_attention_s(H100, 1e15, 8192, kernel, head_dim))

    measured = _combined_tflops(*head_dim_64) / _combined_tflops(*head_dim_128)
    assert seconds(128) / seconds(64) == pytest.approx(measured, rel=0.01)
    # between the two measured head dims the rate moves linearly; at or above 128 it is the measured one
    assert seconds(96) == pytest.approx(seconds(128) / ((1 + seconds(128) / seconds(64)) / 2))
    assert seconds(256) == seconds(128) == sum(flash_attention_s(H100, 1e15, 8192, kernel))
    # Triton's kernel is FlashAttention-2's time scaled, so it takes FlashAttention-2's ratio
    tri = sum(flash_attention_s(A100, 1e15, 8192, "flash-triton", 64)) / sum(
        flash_attention_s(A100, 1e15, 8192, "flash-triton"))
    assert tri == pytest.approx(1 / 0.91)


def test_head_dim_is_not_applied_where_it_was_not_measured():
    for chip, kernel in ((get_chip("tpu-v5p"), "flash"), (get_chip("mi300x"), "flash"), (B200, "flash3")):
        # splash attention, AMD's kernels and FA4 have no measurement by head dim
        assert flash_attention_s(chip, 1e15, 8192, kernel, 64) == flash_attention_s(chip, 1e15, 8192, kernel)
    # FlashAttention-2 runs the same Ampere kernels on A100 as on H100, where it was measured
    assert sum(flash_attention_s(A100, 1e15, 8192, "flash")) / sum(flash_attention_s(A100, 1e15, 8192, "flash", 64)) \
        == pytest.approx(0.91)


def test_triton_flash_attention_is_the_fa2_papers_ratio_to_fa2():
    # Dao 2023 sec. 4.1: FlashAttention-2 is 1.3-1.5x faster than FlashAttention in Triton forward, ~2x backward
    fa2_f, fa2_b = flash_attention_s(A100, 1e15, 2048, "flash")
    tri_f, tri_b = flash_attention_s(A100, 1e15, 2048, "flash-triton")
    assert 1.3 <= tri_f / fa2_f <= 1.5
    assert tri_b / fa2_b == pytest.approx(2.0)


def test_memory_bound_kernels():
    assert pointwise_s(H100, 1e9) == pytest.approx(1e9 / (3.35e12 * H100.hbm_efficiency))
    assert norm_s(H100, 1e9) == pytest.approx(1e9 / (3.35e12 * 0.58))
    assert norm_s(H100, 1e9, backward=True) > 2 * norm_s(H100, 1e9)  # stock norm backward kernels
