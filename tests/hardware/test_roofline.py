"""Roofline: ridge points and matmul verdicts against the scaling book's worked examples."""

import pytest

from hardware.chips import get_chip
from hardware.roofline import matmul_cost, ridge_point, roofline_curve


def test_sb_h100_ridge_295():
    # [SB] Part 12: H100 9.89e14 / 3.35e12 = 295 FLOPs per byte.
    assert ridge_point(get_chip("h100")) == pytest.approx(295.2, abs=0.1)


def test_sb_b200_ridge_281_and_fp8_doubles_it():
    # [SB] Part 12, Quiz 1 Q3: B200 2250e12 / 8e12 = 281; fp8 doubles it to 562; H100 fp8 590.
    assert ridge_point(get_chip("b200")) == pytest.approx(281.25)
    assert ridge_point(get_chip("b200"), "fp8") == pytest.approx(562.5)
    assert ridge_point(get_chip("h100"), "fp8") == pytest.approx(590, rel=2e-3)


def test_sb_b200_matmul_times():
    # [SB] Part 12, Quiz 1 Q4: fp16[64, 4096] . fp16[4096, 8192] on a B200 is bandwidth-bound:
    # 2*(64*4096 + 4096*8192 + 64*8192) = 69e6 B / 8e12 = 8.6 us.
    small = matmul_cost(64, 4096, 8192, "fp16", get_chip("b200"))
    assert small.bound == "memory" and small.time_s == pytest.approx(8.6e-6, rel=0.01)
    # B=512 is compute-bound: 2*512*4096*8192 / 2.25e15 = 15.3 us ([SB] rounds the peak to 2.3e15: 15 us).
    big = matmul_cost(512, 4096, 8192, "fp16", get_chip("b200"))
    assert big.bound == "compute" and big.time_s == pytest.approx(15.27e-6, rel=0.01)


def test_sb_v5e_ridge_240_and_the_b128_matmul_is_memory_bound():
    # [SB] Part 1: v5e 1.97e14 / 8.2e11 = 240.2. Our table keeps Google's 8.19e11: 240.5.
    v5e = get_chip("tpu-v5e")
    assert ridge_point(v5e) == pytest.approx(240.2, rel=2e-3)
    # bf16 In[128, 4096] . W[4096, 4096]: 2*128*4096*4096 = 4.295e9 FLOPs over
    # 2*(128*4096 + 4096*4096 + 128*4096) = 35,651,584 B -> intensity 120.5 < 240: HBM-bound.
    cost = matmul_cost(128, 4096, 4096, "bf16", v5e)
    assert cost.flops == 2 * 128 * 4096 * 4096
    assert cost.bytes == 35_651_584
    assert cost.intensity == pytest.approx(120.47, abs=0.01)
    assert cost.bound == "memory"
    assert cost.time_s == cost.memory_s == pytest.approx(35_651_584 / 8.19e11)
    assert cost.achieved_flops_per_s == pytest.approx(cost.intensity * 8.19e11)


def test_large_batch_turns_compute_bound():
    # [SB] Part 1: for B << D = F the intensity ~ B, so past B ~ 240 the v5e is compute-bound.
    # B=512: 512*4096*4096 / (512*4096 + 4096*4096 + 512*4096) = 409.6 > 240.
    cost = matmul_cost(512, 4096, 4096, "bf16", get_chip("tpu-v5e"))
    assert cost.intensity == pytest.approx(409.6)
    assert cost.bound == "compute" and cost.time_s == cost.compute_s
    assert cost.achieved_flops_per_s == pytest.approx(1.97e14)


def test_fp8_halves_the_bytes_and_doubles_the_peak():
    h100 = get_chip("h100")
    bf16 = matmul_cost(4096, 8192, 8192, "bf16", h100)
    fp8 = matmul_cost(4096, 8192, 8192, "fp8", h100)
    assert fp8.bytes == bf16.bytes / 2 and fp8.intensity == pytest.approx(2 * bf16.intensity)
    assert fp8.compute_s == pytest.approx(bf16.compute_s * 989 / 1979)
    assert ridge_point(h100, "fp8") == pytest.approx(1979e12 / 3.35e12)


def test_achievable_uses_the_efficiencies():
    h100 = get_chip("h100")
    spec = matmul_cost(8192, 8192, 8192, "bf16", h100)
    real = matmul_cost(8192, 8192, 8192, "bf16", h100, achievable=True)
    assert real.compute_s == pytest.approx(spec.compute_s / h100.matmul_efficiency)
    assert real.ridge == pytest.approx(ridge_point(h100, achievable=True))


def test_roofline_curve():
    # peak 100, bandwidth 10: I=1 -> 10, I=10 -> 100 (the ridge), I=100 -> capped at 100.
    assert roofline_curve(100.0, 10.0, [1, 10, 100]) == [10.0, 100.0, 100.0]
    with pytest.raises(ValueError, match="positive"):
        roofline_curve(0, 10, [1])


@pytest.mark.parametrize("bad", [0, -1, 1.5, "128", True, None, float("nan"), float("inf")])
def test_bad_sizes_are_clear(bad):
    with pytest.raises(ValueError, match="matmul size B must be a whole number > 0"):
        matmul_cost(bad, 4096, 4096, "bf16", get_chip("h100"))


def test_bad_dtypes_are_clear():
    with pytest.raises(ValueError, match="unknown dtype"):
        matmul_cost(1, 1, 1, "int3", get_chip("h100"))
    with pytest.raises(ValueError, match="no fp8 tensor cores; choose bf16"):
        matmul_cost(1, 1, 1, "fp8", get_chip("a100-80gb"))
