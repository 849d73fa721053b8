"""Chart builders: pure functions, data in, Plotly figure out. No Streamlit here."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import plotly.graph_objects as go

from hardware.roofline import roofline_curve
from ui.timeline import KIND_COLORS, legend_marker

# A chart title's line at most this many characters: a window 800 px wide holds about 65 of them across the page.
TITLE_LINE_CHARS = 60


TITLE_LINE_PX = 20  # one line of a chart title at Plotly's default title font


def wrap_title(text: str, chars: int = TITLE_LINE_CHARS) -> str:
    """`text` in lines of at most `chars` characters, joined by <br>: Plotly's titles and annotations do not
    wrap, and a long one ran past the chart's right edge in a narrow window."""
    return "<br>".join(textwrap.wrap(text, chars))


def title_extra_px(title: str, line_px: int = TITLE_LINE_PX) -> int:
    """The height a title's lines after its first take (lines split by <br>, `line_px` each): a chart adds it to
    its height and its top margin, so a title wrapped for a narrow window neither shrinks the plot nor lies on it."""
    return line_px * title.count("<br>")

# One colour per rank (a chip, a device of a group) on every chart that tells ranks apart: the collectives' ring,
# tensor, context and expert parallelism. Plotly's Dark24 without the eight colours on which black text reads
# under 4.5:1 (WCAG contrast: the ring writes its shards' names in black on them), and D3's cyan to make 16, the
# most ranks a lesson draws (ui.tensor_parallel.MAX_TP)
RANK_COLORS = ["#2E91E5", "#E15F99", "#1CA71C", "#FB0D0D", "#DA16FF", "#B68100", "#EB663B", "#00A08B", "#FB00D1",
               "#FC0080", "#B2828D", "#6C7C32", "#778AAE", "#A777F1", "#DA60CA", "#17BECF"]


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D",
           "#BAB0AC", "#EECA3B", "#1F77B4", "#2CA02C"]
# One colour per kind of memory, on every memory chart (the lessons' and the planner's); the optimizer's state
# in the optimizer's colour of the step's charts (ui/timeline.KIND_COLORS), the others in colours those leave free
MEMORY_COLORS = {"params": "#5E3C99", "grads": "#E7BA52", "optimizer": KIND_COLORS["optimizer"],
                 "activations": "#BAB0AC", "temporary": "#1F77B4", "gathered_params_peak": "#9E9AC8"}
# The planner's breakdown (planner.simulate.BREAKDOWN_KEYS): a label and the step charts' colour of its work
BREAKDOWN_STYLE = {
    "compute": ("compute", KIND_COLORS["forward"]),
    "recompute": ("recomputation", KIND_COLORS["recompute"]),
    "tp_comm": ("tensor-parallel collectives", KIND_COLORS["reduce_scatter"]),
    "cp_comm": ("context-parallel ring", KIND_COLORS["send/recv"]),  # sends round the ring, as the timeline draws
    "ep_comm": ("expert all-to-alls", KIND_COLORS["all_to_all"]),
    "zero3_comm": ("ZeRO-3 weight gathers", KIND_COLORS["all_gather"]),
    "pp_comm": ("pipeline sends", KIND_COLORS["send/recv"]),
    "bubble": ("pipeline bubble (idle)", "#AAAAAA"),
    "dp_comm": ("data-parallel gradient sync", KIND_COLORS["all_reduce"]),
    "optimizer": ("optimizer step", KIND_COLORS["optimizer"]),
}


@dataclass(frozen=True)
class RooflineSeries:
    """One chip's roofline: attainable FLOP/s = min(peak, intensity * bandwidth)."""
    label: str
    peak_flops_per_s: float
    bw_bytes_per_s: float
    highlight: bool = False
    color: str | None = None  # a colour of its own (the same chip the same colour whatever else is drawn)

    @property
    def ridge(self) -> float:
        return self.peak_flops_per_s / self.bw_bytes_per_s


@dataclass(frozen=True)
class OperatingPoint:
    label: str
    intensity: float  # FLOPs per byte
    flops_per_s: float  # attained


def log_ticks(values: list[float]) -> list[float]:
    """1-2-5 tick values covering `values` (all > 0), for a readable log axis."""
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    return [m * 10.0**e for e in range(lo, hi + 1) for m in (1, 2, 5)]


def log_axis(values: list[float], **axis) -> dict:
    """A log axis with its 1-2-5 ticks written out, its range snapped to the ticks just outside `values` (all
    > 0), so both ends carry a label: Plotly's own range had left the top third of a chart unlabelled (the
    expert-parallel cost chart's 20-40 ms)."""
    ticks = log_ticks(values)
    lo = max(t for t in ticks if t <= min(values))
    hi = min((t for t in ticks if t >= max(values) and t > lo), default=ticks[-1])
    shown = [t for t in ticks if lo <= t <= hi]
    if hi / lo > 1e4:  # over four decades, 1-2-5 crowds the axis: powers of ten only, the range snapped to them
        lo = 10.0 ** math.floor(math.log10(min(values)) + 1e-9)
        hi = 10.0 ** math.ceil(math.log10(max(values)) - 1e-9)
        shown = [10.0 ** e for e in range(round(math.log10(lo)), round(math.log10(hi)) + 1)]
    return {"type": "log", "tickvals": shown, "ticktext": [f"{t:,.0f}" if t >= 1 else f"{t:g}" for t in shown],
            "range": [math.log10(lo), math.log10(hi)], **axis}


def span_legend(text: str, color: str) -> go.Scatter:
    """A legend entry for a shaded region (`add_vrect`): the words in the legend, not over the lines."""
    return legend_marker(text, color, size=14, opacity=0.25)


def _log_grid(lo: float, hi: float, n: int = 200) -> list[float]:
    a, b = math.log10(lo), math.log10(hi)
    return [10 ** (a + (b - a) * i / (n - 1)) for i in range(n)]


def roofline_figure(series: list[RooflineSeries], points: list[OperatingPoint] = (),
                    title: str = "Roofline") -> go.Figure:
    """Log-log roofline of several chips with their ridge points and operating points marked."""
    ridges = [s.ridge for s in series] + [p.intensity for p in points]
    lo = min(0.1, min(ridges, default=1.0) / 100)
    hi = max(1e4, max(ridges, default=1.0) * 20)
    grid = _log_grid(lo, hi)
    fig = go.Figure()
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        y = [f / 1e12 for f in roofline_curve(s.peak_flops_per_s, s.bw_bytes_per_s, grid)]
        fig.add_trace(go.Scatter(
            x=grid, y=y, mode="lines", name=s.label,
            line={"color": color, "width": 4 if s.highlight else 2, "dash": "solid" if s.highlight else "dot"},
            hovertemplate=f"{s.label}<br>intensity %{{x:.3g}} FLOP/B<br>%{{y:.4g}} TFLOP/s<extra></extra>",
        ))
        fig.add_trace(go.Scatter(
            x=[s.ridge], y=[s.peak_flops_per_s / 1e12], mode="markers", showlegend=False,
            marker={"color": color, "size": 9, "symbol": "diamond"},
            hovertemplate=f"{s.label} ridge point: %{{x:.1f}} FLOP/B<extra></extra>",
        ))
    for p in points:
        fig.add_trace(go.Scatter(
            x=[p.intensity], y=[p.flops_per_s / 1e12], mode="markers+text", name=p.label,
            text=[p.label], textposition="top center",
            marker={"color": "black", "size": 16, "symbol": "star"},
            hovertemplate=f"{p.label}<br>%{{x:.3g}} FLOP/B<br>%{{y:.4g}} TFLOP/s<extra></extra>",
        ))
    # dtick=1 on a log axis: one labelled tick per decade, no cluttered minor labels
    # the legend under the chart and the axis title on two lines: in the hardware page's two thirds of the width, a
    # legend beside the chart squeezed the plot to a strip and pushed the axis title past both edges
    fig.update_xaxes(type="log", dtick=1, title="arithmetic intensity<br>(FLOPs per byte of HBM traffic)")
    fig.update_yaxes(type="log", dtick=1, title="attainable TFLOP/s")
    fig.update_layout(title=title, height=520, margin={"l": 10, "r": 10, "t": 50, "b": 10},
                      legend={"orientation": "h", "x": 0, "y": -0.3, "yanchor": "top"})
    return fig


BREAKDOWN_LABEL_CHARS = 22  # a line of a breakdown bar's label (`breakdown_figure`)


def breakdown_figure(breakdown: dict[str, float], step_s: float, title: str = "Where the step time goes",
                     zero_stage: int = 0) -> go.Figure:
    """Seconds per step by kind (the planner's breakdown), each bar in its work's colour and labelled with its
    share of the step beside it. Under ZeRO (`zero_stage` >= 1) the gradient sync is a reduce-scatter, drawn in
    its colour as the timeline draws it, not the all-reduce's."""
    parts = {k: v for k, v in breakdown.items() if v > 0}
    styles = dict(BREAKDOWN_STYLE)
    if zero_stage >= 1:
        styles["dp_comm"] = ("data-parallel sync (reduce-scatter, weight gather)", KIND_COLORS["reduce_scatter"])
    style = [styles.get(k, (k, PALETTE[0])) for k in parts]
    # labels of two lines at most ("data-parallel sync<br>(reduce-scatter, weight gather)"): on one they took half
    # of a narrow window's chart; a share under 0.05 % reads "< 0.1 %", not "0.0 %" beside a bar too thin to see
    labels = ["<br>".join(textwrap.wrap(label, BREAKDOWN_LABEL_CHARS)) for label, _ in style]
    fig = go.Figure(go.Bar(x=list(parts.values()), y=labels, orientation="h",
                           marker_color=[color for _, color in style], textposition="outside", cliponaxis=False,
                           text=[f"{100 * v / step_s:.1f} %" if v / step_s >= 5e-4 else "< 0.1 %"
                                 for v in parts.values()],
                           customdata=[label for label, _ in style],
                           hovertemplate="%{customdata}: %{x:.3g} s<extra></extra>"))
    fig.update_layout(height=max(260, 40 * len(parts) + 110), xaxis_title="seconds per step", title=title,
                      margin={"l": 10, "r": 40, "t": 50, "b": 10}, yaxis={"autorange": "reversed"},
                      xaxis={"range": [0, 1.2 * max(parts.values(), default=1.0)]})
    return fig


def memory_figure(mem: dict[str, float], hbm_bytes: float, title: str = "Memory per chip") -> go.Figure:
    """One chip's memory by kind (planner.memory's parts, in bytes), stacked against the HBM `hbm_bytes` it can
    use."""
    parts = [k for k in ("params", "grads", "optimizer", "activations", "temporary") if mem.get(k)]
    fig = go.Figure([go.Bar(x=[mem[k] / 1e9], y=["per chip"], name=k, orientation="h", marker_color=MEMORY_COLORS[k])
                     for k in parts])
    # the limit as a dashed line named in the legend: a label on the chart would sit on the bars
    usable = hbm_bytes / 1e9
    line = {"color": "black", "dash": "dash", "width": 2}
    fig.add_vline(x=usable, line=line)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=line, name=f"usable HBM ({usable:,.1f} GB)"))
    fig.update_layout(barmode="stack", height=280, xaxis_title="GB", title=title,
                      margin={"l": 10, "r": 10, "t": 50, "b": 10},
                      legend={"orientation": "h", "y": -0.55, "yanchor": "top"},  # below the axis title
                      xaxis={"range": [0, 1.08 * max(usable, sum(mem[k] for k in parts) / 1e9)]})
    return fig
