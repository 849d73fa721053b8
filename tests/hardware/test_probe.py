"""The live probe: positive numbers within a small budget, and a Chip the roofline can plot."""

import pytest

from hardware.probe import ProbeResult, as_chip, measure_this_machine
from hardware.roofline import ridge_point


def test_probe_measures_positive_numbers_and_reports_progress():
    calls = []
    result = measure_this_machine(budget_s=0.2, progress=lambda f, msg: calls.append((f, msg)))
    assert result.matmul_flops_per_s > 0 and result.bf16_matmul_flops_per_s > 0
    assert result.memory_bytes_per_s > 0 and result.threads >= 1 and result.dtype == "fp32"
    assert result.details and all(isinstance(line, str) for line in result.details)
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and all(0 <= f <= 1 for f in fractions)

    chip = as_chip(result)
    assert chip.kind == "cpu" and chip.name == "This machine (CPU)"
    # Each dtype carries what was measured in that dtype.
    assert chip.peak_flops_per_s("fp32") == result.matmul_flops_per_s
    assert chip.peak_flops_per_s("bf16") == result.bf16_matmul_flops_per_s
    assert ridge_point(chip, "fp32") == pytest.approx(result.ridge_point("fp32"))
    assert all(chip.sources[name] for name in chip.sources)
    assert chip.dtypes == ("bf16", "fp32")
    with pytest.raises(ValueError, match="no fp8"):
        chip.peak_flops_per_s("fp8")


def test_probe_rejects_a_zero_budget():
    with pytest.raises(ValueError, match="budget_s"):
        measure_this_machine(budget_s=0)


def test_as_chip_refuses_to_stand_fp32_in_for_bf16():
    result = ProbeResult(matmul_flops_per_s=1e11, memory_bytes_per_s=2e10, threads=2)
    with pytest.raises(ValueError, match="no bf16 matmul rate"):
        as_chip(result)
    assert result.peak_flops_per_s("fp32") == 1e11 and result.hbm_bw() == 2e10
    with pytest.raises(ValueError, match="not bf16"):
        result.peak_flops_per_s("bf16")
