"""Measure this machine's roofline: matmul FLOP/s and memory bytes/s, in a few seconds.

torch is imported inside the functions so that ``import hardware`` stays light for the planner.
The numbers are best-of-several timings, i.e. what this machine reaches, not a datasheet peak.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hardware.chips import Chip

Progress = Callable[[float, str], None]

# fp32 sizes to try; the largest is 4 MiB per operand, so the probe stays cheap on small machines.
_MATMUL_SIZES = (256, 512, 1024)
_BF16_SIZE = 256
# Elements in the copy probe: 2^24 fp32 = 64 MiB per tensor, 128 MiB touched per copy: more than most
# CPUs' last-level cache, so the copy runs at DRAM speed.
_COPY_NUMEL = 1 << 24


@dataclass(frozen=True)
class ProbeResult:
    matmul_flops_per_s: float  # fp32 matmul, best of the sizes tried
    memory_bytes_per_s: float  # large tensor copy, read + write bytes counted
    threads: int
    dtype: str = "fp32"  # dtype of matmul_flops_per_s
    bf16_matmul_flops_per_s: float | None = None  # bf16 matmul, when measured
    memory_total_bytes: float | None = None
    details: list[str] = field(default_factory=list)

    def peak_flops_per_s(self, dtype: str = "fp32") -> float:
        """Measured matmul FLOP/s for fp32 or bf16; the roofline plots this machine with it."""
        if dtype == "fp32":
            return self.matmul_flops_per_s
        if dtype == "bf16" and self.bf16_matmul_flops_per_s is not None:
            return self.bf16_matmul_flops_per_s
        raise ValueError(f"the probe measured {self.dtype}" + (" and bf16" if self.bf16_matmul_flops_per_s
                                                                else "") + f", not {dtype}")

    def hbm_bw(self) -> float:
        """Measured memory bytes/s (the CPU's stand-in for HBM bandwidth)."""
        return self.memory_bytes_per_s

    def ridge_point(self, dtype: str = "fp32") -> float:
        return self.peak_flops_per_s(dtype) / self.memory_bytes_per_s


def _best_seconds(fn, until: float) -> float:
    """Fastest wall time of ``fn`` over calls until the ``until`` perf_counter deadline.

    One untimed warm-up call first (lazy initialisation, thread pool start), then at least one timed call
    even when the deadline has passed, so a tiny budget still yields a number.
    """
    fn()
    best = float("inf")
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 >= until:
            return best


def measure_this_machine(budget_s: float = 3.0, progress: Progress | None = None) -> ProbeResult:
    """Time fp32 and bf16 matmuls and a large copy on the CPU in about ``budget_s`` seconds.

    The budget covers the measuring; importing torch (1-2 s the first time in a process) comes on top.
    Each phase keeps the fastest of its runs: on a busy machine that is the closest to what it can do.
    """
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0 seconds, got {budget_s!r}")
    report = progress or (lambda fraction, message: None)
    report(0.0, "importing torch")
    import torch

    start = time.perf_counter()
    details: list[str] = []
    threads = torch.get_num_threads()
    # Deadlines as fractions of the budget: half for the fp32 sizes, then bf16, then the copy.
    phases = len(_MATMUL_SIZES) + 2
    deadlines = [start + budget_s * f for f in (1 / 6, 2 / 6, 3 / 6, 0.65, 1.0)]

    best_fp32 = 0.0
    for i, size in enumerate(_MATMUL_SIZES):
        report(i / phases, f"fp32 matmul {size}x{size}x{size}")
        a = torch.randn(size, size)
        b = torch.randn(size, size)
        seconds = _best_seconds(lambda a=a, b=b: torch.mm(a, b), deadlines[i])
        rate = 2.0 * size**3 / seconds  # 2*M*N*K FLOPs per matmul
        details.append(f"fp32 matmul {size}^3: {rate / 1e9:.1f} GFLOP/s (fastest run {seconds * 1e3:.2f} ms)")
        best_fp32 = max(best_fp32, rate)

    report(len(_MATMUL_SIZES) / phases, f"bf16 matmul {_BF16_SIZE}^3")
    a16 = torch.randn(_BF16_SIZE, _BF16_SIZE).to(torch.bfloat16)
    b16 = torch.randn(_BF16_SIZE, _BF16_SIZE).to(torch.bfloat16)
    seconds = _best_seconds(lambda: torch.mm(a16, b16), deadlines[-2])
    bf16_rate = 2.0 * _BF16_SIZE**3 / seconds
    details.append(f"bf16 matmul {_BF16_SIZE}^3: {bf16_rate / 1e9:.1f} GFLOP/s "
                   f"(fastest run {seconds * 1e3:.2f} ms)")

    report((len(_MATMUL_SIZES) + 1) / phases, "memory copy")
    src = torch.ones(_COPY_NUMEL)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), deadlines[-1])
    copied = 2.0 * src.numel() * src.element_size()  # one read of src + one write of dst
    memory_rate = copied / seconds
    details.append(f"copy of {src.numel() * src.element_size() / 2**20:.0f} MiB: "
                   f"{memory_rate / 1e9:.1f} GB/s (read + write)")
    details.append(f"torch threads: {threads}; measured for {time.perf_counter() - start:.2f} s")
    report(1.0, "done")
    return ProbeResult(
        matmul_flops_per_s=best_fp32,
        memory_bytes_per_s=memory_rate,
        threads=threads,
        dtype="fp32",
        bf16_matmul_flops_per_s=bf16_rate,
        memory_total_bytes=_total_memory_bytes(),
        details=details,
    )


def _total_memory_bytes() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def as_chip(result: ProbeResult) -> Chip:
    """This machine as a Chip (kind "cpu"), so tables, rooflines and the planner can include it.

    bf16 and fp32 matmul rates are each what was measured in that dtype. The engine's ranks on this
    machine talk through memory (gloo), so the links are modelled as half the copy bandwidth per
    direction (a copy counts each byte twice) - an upper bound for gloo, which adds TCP overhead.
    """
    if result.bf16_matmul_flops_per_s is None:
        raise ValueError("this probe result has no bf16 matmul rate; run measure_this_machine() to get one")
    memory_total = result.memory_total_bytes or _total_memory_bytes()
    if memory_total is None:
        raise ValueError("cannot tell this machine's RAM size; set ProbeResult.memory_total_bytes")
    measured = "measured on this machine by hardware/probe.py"
    link_bw = result.memory_bytes_per_s / 2
    cpus = os.cpu_count() or 1
    sources = {
        "bf16_flops_per_s": f"bf16 matmul {_BF16_SIZE}^3, {measured}",
        "fp32_flops_per_s": f"fp32 matmul, best of {_MATMUL_SIZES}, {measured}",
        "fp8_flops_per_s": "not measured: torch has no CPU fp8 matmul",
        "hbm_bytes": "total RAM from os.sysconf",
        "hbm_bytes_per_s": f"tensor copy, read + write bytes, {measured}",
        "scaleup_bytes_per_s": "half the measured copy bandwidth: ranks on one machine exchange "
                               "through memory",
        "scaleout_bytes_per_s": "as scale-up: a single machine has no network between its ranks",
        "scaleup_domain": "os.cpu_count(): the engine's ranks all run on this machine",
        "scaleup_latency_s": "estimate: gloo over TCP loopback, ~20 us per message",
        "scaleout_latency_s": "estimate: as scale-up",
        "matmul_efficiency": "1.0: the measured rate is already what this machine achieves",
        "hbm_efficiency": "1.0: the measured rate is already what this machine achieves",
        "link_efficiency": "1.0: modelled from a measurement",
        "scaleout_efficiency": "1.0: modelled from a measurement",
        "matmul_half_area": "not measured by this probe: 1 (no shape effect)",
        "matmul_half_k": "not measured by this probe: 1 (no shape effect)",
        "fp8_matmul_efficiency": "not measured: torch has no CPU fp8 matmul",
        "attention_efficiency": "not measured by this probe: as the matmul rate",
        "flash3_efficiency": "none: a CPU runs the flash kernel only",
        "attention_head_dim_64": "none: the live engine's attention is timed by the calibration, not by head dim",
        "flash3_head_dim_64": "none: no newer kernel",
        "norm_efficiency": "1.0: the measured copy rate",
        "norm_bwd_efficiency": "1.0: the measured copy rate",
        "scaleup_fill_s": "0: latency only",
        "scaleout_fill_s": "0: latency only",
        "ici_axes": "not a TPU",
        "torus_shape": "not a TPU",
        "torus_wrap_multiple": "not a TPU",
        "tp_comm_overlap": "false: the live engine's tensor-parallel collectives block their rank",
    }
    return Chip(
        key="this-machine",
        name="This machine (CPU)",
        vendor="local",
        kind="cpu",
        bf16_flops_per_s=result.bf16_matmul_flops_per_s,
        fp8_flops_per_s=None,
        hbm_bytes=memory_total,
        hbm_bytes_per_s=result.memory_bytes_per_s,
        scaleup_bytes_per_s=link_bw,
        ici_axes=0,
        scaleout_bytes_per_s=link_bw,
        scaleup_domain=cpus,
        torus_shape=None,
        torus_wrap_multiple=0,
        scaleup_latency_s=20e-6,
        scaleout_latency_s=20e-6,
        matmul_efficiency=1.0,
        hbm_efficiency=1.0,
        link_efficiency=1.0,
        matmul_half_area=1.0,
        matmul_half_k=1.0,
        fp8_matmul_efficiency=None,
        attention_efficiency=1.0,
        flash3_efficiency=None,
        attention_head_dim_64=None,
        flash3_head_dim_64=None,
        norm_efficiency=1.0,
        norm_bwd_efficiency=1.0,
        scaleup_fill_s=0.0,
        scaleout_fill_s=0.0,
        scaleout_efficiency=1.0,
        scaleup_topology="switch",
        tp_comm_overlap=False,
        sources=sources,
        fp32_flops_per_s=result.matmul_flops_per_s,
    )
