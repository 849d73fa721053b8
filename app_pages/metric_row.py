"""A row of a page's headline numbers (st.metric), the one way every page lays them out."""

from contextlib import contextmanager

import streamlit as st


@contextmanager
def metric_row():
    """Metrics side by side while they fit and the rest on a row below, each as wide as its label and value
    (`metric`): columns of equal width had cut them ("75.7 µs" to "75.7...", "Predicted step tim...", "77.1 GB"
    to "77.1 ...") in a window 800-1,024 px wide."""
    with st.container(horizontal=True, horizontal_alignment="distribute"):
        yield


def metric(label: str, value, **kwargs) -> None:
    """One metric of a `metric_row`, as wide as its content."""
    st.metric(label, value, width="content", **kwargs)


def peak_words(result) -> str:
    """Which peak a planner StepResult's MFU is taken against (StepResult.mfu: the chip's peak in the run's number
    format), for a metric's help: an fp8 run's MFU against bf16's peak would read twice as high."""
    chip, dtype = result.chip, result.case.training.dtype
    return (f"each chip's peak {dtype} FLOP/s ({chip.peak_flops_per_s(dtype) / 1e12:,.0f} TFLOP/s on "
            f"{chip.name}, the run's number format)")


def memory_metric(total_bytes: float, fits: bool) -> None:
    """The memory a chip needs, and whether it fits, as a `metric` of a `metric_row`: no arrow, since "fits" is no
    rise, and an arrow up beside "does not fit" read as more room (the planner's and the meshes' pages)."""
    metric("Memory per chip", f"{total_bytes / 1e9:,.1f} GB", delta="fits" if fits else "does not fit",
           delta_color="normal" if fits else "inverse", delta_arrow="off")
