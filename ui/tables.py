"""Table builders: pure functions, data in, rows out (st.dataframe takes a list of dicts)."""

from __future__ import annotations

from collections.abc import Iterable

CHIP_COLUMN_HELP = {
    "bf16 TFLOP/s": "Peak dense matrix-multiply rate in bf16 (C).",
    "fp8 TFLOP/s": "Peak dense rate in fp8; empty where the chip has no fp8 matrix units.",
    "HBM GB": ("High-bandwidth memory per chip: what weights, gradients, optimizer state and activations share. "
               "In 10^9 bytes, as software sees it: NVIDIA's '80GB' is 80 GiB, 85.5 GB."),
    "HBM TB/s": "Memory bandwidth (W_hbm): how fast the matrix units can be fed.",
    "Ridge (bf16 FLOP/B)": "C / W_hbm: the arithmetic intensity an operation needs to be compute-bound.",
    "Scale-up GB/s per direction": "NVLink per GPU, or ICI per link for TPUs (W_ici), one direction.",
    "Scale-out GB/s per chip": "InfiniBand / RoCE / data-centre network share of one chip, one direction.",
    "Scale-up domain": "How many chips the fast links join: an NVLink node, an NVL72 rack, a TPU torus slice.",
}


def chip_table_rows(chips: Iterable) -> list[dict]:
    """One row per chip, in the units people quote (TFLOP/s, GB, TB/s, GB/s)."""
    rows = []
    for c in chips:
        if c.kind == "tpu":
            scaleup = f"{c.scaleup_bytes_per_s / 1e9:,.0f} per link x {2 * c.ici_axes} links"
            domain = f"{'x'.join(map(str, c.torus_shape))} torus" if c.torus_shape else f"{c.scaleup_domain}"
        else:
            scaleup = f"{c.scaleup_bytes_per_s / 1e9:,.0f}"
            domain = f"{c.scaleup_domain} GPUs"
        rows.append({
            "Chip": c.name,
            "bf16 TFLOP/s": round(c.bf16_flops_per_s / 1e12),
            "fp8 TFLOP/s": round(c.fp8_flops_per_s / 1e12) if c.fp8_flops_per_s else None,
            "HBM GB": round(c.hbm_bytes / 1e9, 1),
            "HBM TB/s": round(c.hbm_bytes_per_s / 1e12, 2),
            "Ridge (bf16 FLOP/B)": round(c.bf16_flops_per_s / c.hbm_bytes_per_s),
            "Scale-up GB/s per direction": scaleup,
            "Scale-out GB/s per chip": round(c.scaleout_bytes_per_s / 1e9, 1),
            "Scale-up domain": domain,
        })
    return rows
