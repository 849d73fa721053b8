"""Table builders: pure functions, data in, rows out (st.dataframe takes a list of dicts)."""

from __future__ import annotations

from collections.abc import Iterable


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
