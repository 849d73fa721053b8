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
