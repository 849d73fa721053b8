"""The bound meter: one layer's math against the communication it has to hide (planner.bounds), as two
bars in the app's palette, with the verdict and the rule in words. No Streamlit here."""

from __future__ import annotations

import plotly.graph_objects as go

from planner.bounds import Bound
from ui.charts import BREAKDOWN_STYLE
from ui.tables import three_figures

# The math in the compute colour; the communication in its collective's colour as the planner's breakdown and
# the step timelines draw it (ui.charts.BREAKDOWN_STYLE): a gradient all-reduce in the all-reduce's colour, the
# same on the meter as on the live timeline beside it. (One colour for every meter had drawn data parallel's
# all-reduce yellow and the live run's purple on one page.)
MATH_COLOR = BREAKDOWN_STYLE["compute"][1]
COMM_COLOR = {strategy: BREAKDOWN_STYLE[key][1]
              for strategy, key in {"dp": "dp_comm", "fsdp": "zero3_comm", "tp": "tp_comm", "ep": "ep_comm"}.items()}
WHAT = {"dp": ("backward math", "gradient all-reduce"), "fsdp": ("forward math", "weight all-gather"),
        "tp": ("MLP math per pass", "activation all-gather + reduce-scatter"),
        "ep": ("expert math (forward)", "dispatch + combine all-to-all")}
# what each bound's two times are counted over (planner.bounds): a layer, or TP's one MLP in one pass
PER = {"dp": "layer", "fsdp": "layer", "tp": "MLP pass", "ep": "layer"}


def bound_figure(bound: Bound, what: str) -> go.Figure:
    """Titled "<what>: compute-bound" (or communication-bound), each bar in its work's colour (COMM_COLOR)."""
    math_label, comm_label = WHAT[bound.strategy]
    longest = max(bound.math_s, bound.comm_s)
    scale, unit = (1e3, "ms") if longest >= 1e-3 else (1e6, "µs")
    fig = go.Figure()
    bars = ((math_label, bound.math_s, MATH_COLOR), (comm_label, bound.comm_s, COMM_COLOR[bound.strategy]))
    for label, seconds, color in bars:
        # three figures, as the lessons' tables say the same times ("365 µs" had read "364.79 µs" on the meter)
        fig.add_trace(go.Bar(y=[label], x=[seconds * scale], orientation="h", marker_color=color,
                             text=[three_figures(seconds * scale, unit)], textposition="outside", cliponaxis=False,
                             showlegend=False))
    # The verdict and the axis title's basis each on a line of their own: on one line both ran past the chart's
    # edges where a meter has half the page (data parallel's two) or a window is narrow.
    fig.update_layout(title=f"{what}:<br>{'compute' if bound.compute_bound else 'communication'}-bound",
                      height=210, margin={"l": 10, "r": 60, "t": 60, "b": 50},
                      xaxis={"title": f"{unit} per {PER[bound.strategy]}<br>(peak FLOP/s, link bandwidth)",
                             "range": [0, 1.25 * longest * scale]},
                      yaxis={"autorange": "reversed"})
    return fig


def verdict_text(bound: Bound) -> str:
    ratio = bound.math_s / bound.comm_s if bound.comm_s else float("inf")
    return (f"**{bound.verdict.split(':')[0].capitalize()}**: the math takes {ratio:,.2f}x the communication "
            f"per {PER[bound.strategy]}. {bound.rule}.")
