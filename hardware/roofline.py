"""Roofline: a kernel takes max(FLOPs / peak FLOP/s, bytes / memory bandwidth).

Arithmetic intensity I = FLOPs / bytes moved. Below the ridge point I* = peak / bandwidth the memory
system cannot feed the matrix units and the kernel is memory-bound; above it, compute-bound
(Williams, Waterman, Patterson, "Roofline", CACM 2009; [SB] Part 1 "Rooflines").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from hardware.chips import DTYPE_BYTES, Chip


def ridge_point(chip: Chip, dtype: str = "bf16", achievable: bool = False) -> float:
    """FLOPs per byte at which ``chip`` turns from memory-bound to compute-bound."""
    # I* = C / W_hbm ([SB] Part 1: H100 9.9e14 / 3.35e12 ~ 295; TPU v5e 1.97e14 / 8.2e11 ~ 240).
    return chip.peak_flops_per_s(dtype, achievable) / chip.hbm_bw(achievable)


@dataclass(frozen=True)
class MatmulCost:
    flops: float
    bytes: float
    intensity: float  # FLOPs per byte
    ridge: float  # FLOPs per byte
    compute_s: float
    memory_s: float
    time_s: float
    bound: str  # "compute" | "memory"
    achieved_flops_per_s: float


def _check_size(name: str, value) -> int:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value <= 0 or value != int(value)):
        raise ValueError(f"matmul size {name} must be a whole number > 0, got {value!r}")
    return int(value)


def matmul_cost(B, D, F, dtype: str, chip: Chip, achievable: bool = False) -> MatmulCost:
    """Cost of ``In[B, D] . W[D, F] -> Out[B, F]`` with all three arrays in ``dtype`` read/written once."""
    b, d, f = _check_size("B", B), _check_size("D", D), _check_size("F", F)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    # 2BDF FLOPs (one multiply + one add per term); bytes = dtype * (BD + DF + BF) ([SB] Part 1).
    flops = 2.0 * b * d * f
    nbytes = float(DTYPE_BYTES[dtype] * (b * d + d * f + b * f))
    peak = chip.peak_flops_per_s(dtype, achievable)
    bw = chip.hbm_bw(achievable)
    compute_s = flops / peak
    memory_s = nbytes / bw
    time_s = max(compute_s, memory_s)
    return MatmulCost(
        flops=flops,
        bytes=nbytes,
        intensity=flops / nbytes,
        ridge=peak / bw,
        compute_s=compute_s,
        memory_s=memory_s,
        time_s=time_s,
        bound="compute" if compute_s >= memory_s else "memory",
        achieved_flops_per_s=flops / time_s,
    )


def roofline_curve(peak_flops_per_s: float, bw_bytes_per_s: float,
                   intensities: Iterable[float]) -> list[float]:
    """Attainable FLOP/s at each intensity: min(peak, I * bandwidth)."""
    if not peak_flops_per_s > 0 or not bw_bytes_per_s > 0:
        raise ValueError("a roofline needs a positive peak FLOP/s and a positive bandwidth")
    return [min(peak_flops_per_s, float(i) * bw_bytes_per_s) for i in intensities]
