"""Timeline charts: any `core.timeline.Timeline` (measured or predicted) as an animated Gantt chart.

One row per rank and lane (compute, comm, idle), one colour per kind of work. The animation sweeps a
cursor through the step and reveals each span as it happens, so overlap of communication with compute
(or its absence) is seen rather than read.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import plotly.graph_objects as go

from core.timeline import LANES, Span, Timeline, kind_label, span_kind
from ui.tables import step_unit

# The app's one palette of work: compute in blues and teals (forward, its recomputation a lighter blue,
# backward), the optimizer green, each collective its own warm colour, idle grey. Every chart of a step
# colours by it.
KIND_COLORS = {
    "forward": "#4C78A8",
    "recompute": "#9ECAE9",
    "backward": "#72B7B2",
    "optimizer": "#54A24B",
    "all_gather": "#F58518",
    "reduce_scatter": "#E45756",
    "all_reduce": "#B279A2",
    "all_to_all": "#FF9DA6",
    "send/recv": "#9D755D",
    "other comm": "#EECA3B",
    "other compute": "#BAB0AC",
    "idle": "#DDDDDD",
}
# Zero-bubble pipelines split the backward in two: shades of the backward's colour.
BACKWARD_INPUT_COLOR = "#A5D3CE"
BACKWARD_WEIGHT_COLOR = "#3F8D86"
# A row whose few spans are all narrower than this share of the time axis (under 2 px in a lesson's 466 px
# chart: the optimizer step of a 50 s step on a real cluster, 0.05 % of it) also draws each as a tick mark
# (`_ticked`): as bars alone the row read empty. A row of many such spans draws a strip of them already.
THIN_SHARE = 1 / 250
TICKED_ROW_SPANS = 8
# What a timeline chart marks that is no kind of work, in one neutral grey: "none predicted" on a row shared with
# another chart, the other chart's step end (ui.live)
NOTE_COLOR = "#888888"


def row_label(rank: int, lane: str) -> str:
    return f"rank {rank} · {lane}"


def densest_row(timeline: Timeline, by_kind: bool = True) -> int:
    """The most spans any one row of `timeline_figure` draws (a rank's kind of work, or its lane)."""
    rows = Counter((s.rank, span_kind(s) if by_kind else s.lane) for s in timeline.spans)
    return max(rows.values(), default=0)


def _rows(timeline: Timeline, by_kind: bool = False) -> list[str]:
    if by_kind:
        used = {(s.rank, span_kind(s)) for s in timeline.spans}
        return [row_label(r, kind_label(kind)) for r in timeline.ranks for kind in KIND_COLORS if (r, kind) in used]
    used = {(s.rank, s.lane) for s in timeline.spans}
    return [row_label(r, lane) for r in timeline.ranks for lane in LANES if (r, lane) in used]


def legend_marker(name: str, color: str, size: int = 12, opacity: float = 1.0, **trace) -> go.Scatter:
    """A legend entry with nothing drawn: a kind of work a chart has none of, or a shaded region."""
    return go.Scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                      marker={"symbol": "square", "size": size, "color": color, "opacity": opacity}, **trace)


def shared_rows(*timelines: Timeline) -> list[str]:
    """The rows of several timelines together (rank by rank, lane by lane), for figures drawn to be compared:
    a lane only one of them uses (the engine's idle waits) gets its row in both, so their rows line up."""
    return _rows(Timeline([s for t in timelines for s in t.spans]))


def shared_kinds(*timelines: Timeline) -> list[str]:
    """The kinds of work of several timelines together, in the palette's order, for figures drawn to be
    compared: both legends list the same entries, so they are as wide and the plots' time axes line up to the
    pixel (a kind in one legend only had shifted the other chart's 10 ms by 8 px)."""
    used = {span_kind(s) for t in timelines for s in t.spans}
    return [k for k in KIND_COLORS if k in used]


def timeline_figure(timeline: Timeline, title: str = "", frames: int = 30, animate: bool = True,
                    x_max_ms: float | None = None, rows_by_kind: bool = False,
                    rows: list[str] | None = None, kinds: list[str] | None = None) -> go.Figure:
    """Gantt chart of `timeline` from its first span, in milliseconds (over 10 s in the unit a step time of its
    length is read in, ui.tables.step_unit: seconds, minutes from 2 min, hours from 2 h); with
    `animate`, play/pause buttons and a slider sweep a cursor through it, revealing spans as they start.
    `x_max_ms` fixes the time axis (two timelines drawn to compare share one); the cursor sweeps it all.
    `rows_by_kind`: one row per rank and kind of work (forward, backward, each collective) instead of one per
    rank and lane, for a long step whose thousands of spans would merge into one strip. `rows`: the rows to
    draw (`shared_rows`), else the timeline's own; `kinds`: the kinds in the legend (`shared_kinds`), else the
    timeline's own."""
    tl = timeline.normalized()
    t_end_ms = max(tl.end_s * 1e3, x_max_ms or 0.0)
    # the axis's unit: ms, then the unit the step's own time is said in (minutes and hours for the steps of huge
    # models on few chips): it had switched to minutes at 10 min, where the step's metric had at 2 min
    if t_end_ms > 10_000:
        seconds_per_unit, unit = step_unit(t_end_ms / 1e3)
        scale = 1 / seconds_per_unit
    else:
        scale, unit = 1e3, "ms"
    t_end = t_end_ms * scale / 1e3
    by_kind: dict[str, list[Span]] = defaultdict(list)
    for s in tl.spans:
        by_kind[span_kind(s)].append(s)
    drawn = [k for k in KIND_COLORS if by_kind.get(k)]
    # every kind named, in this order (legendrank): another chart drawn to compare lists the same; never a span
    # left out of it
    legend = drawn if kinds is None else [*kinds, *(k for k in drawn if k not in kinds)]
    rows = rows if rows is not None else _rows(tl, rows_by_kind)

    def row(s: Span) -> str:
        return row_label(s.rank, kind_label(span_kind(s)) if rows_by_kind else s.lane)

    # arrays, not lists: Plotly checks a list element by element (3 s for a 58k-span pipeline step)
    start_of = {k: np.array([s.start_s for s in by_kind[k]]) * scale for k in drawn}
    end_of = {k: np.array([s.end_s for s in by_kind[k]]) * scale for k in drawn}

    def bars(kind: str, t: float | None) -> dict:
        starts, ends = start_of[kind], end_of[kind]
        if t is not None:
            ends = np.maximum(starts, np.minimum(ends, t))
        return {"x": np.maximum(ends - starts, 0.0), "base": starts}

    ticked = _ticked([s for k in drawn for s in by_kind[k]], row, t_end * THIN_SHARE / scale)

    def ticks(kind: str, t: float | None) -> dict:  # shown once the cursor reaches them
        spans = [s for s in ticked if span_kind(s) == kind and (t is None or s.start_s * scale <= t)]
        return {"x": [(s.start_s + s.end_s) / 2 * scale for s in spans], "y": [row(s) for s in spans],
                "customdata": [hover(s) for s in spans]}

    def cursor(t: float) -> dict:
        return {"x": [t, t], "y": [rows[0], rows[-1]] if rows else []}

    def hover(s: Span) -> str:
        parts = [s.name, f"from {s.start_s * scale:.3f} {unit}, lasting {s.duration_s * scale:.3f} {unit}"]
        if s.bytes:
            parts.append(f"{s.bytes:,} bytes" + (f" over {s.group}" if s.group else ""))
        elif s.group:
            parts.append(f"group {s.group}")
        parts.append(f"step {s.step}" + ("" if s.micro_batch is None else f", micro-batch {s.micro_batch}"))
        return "<br>".join(parts)

    from ui.charts import title_extra_px  # here: ui.charts imports this module's colours

    animated = animate and bool(rows) and frames > 1
    fig = go.Figure()
    for kind in drawn:
        spans = by_kind[kind]
        full = bars(kind, None)
        # a white edge separates neighbouring bars that are wide enough to show it; on a thin one it is all
        # that shows, and a row of them reads paler than its colour
        edges = [0.5 if len(spans) <= 300 and s.duration_s * scale >= t_end / 150 else 0 for s in spans]
        fig.add_trace(go.Bar(
            orientation="h", y=np.array([row(s) for s in spans], dtype=object), name=kind_label(kind),
            marker={"color": KIND_COLORS[kind], "line": {"width": np.array(edges), "color": "white"}},
            customdata=np.array([hover(s) for s in spans], dtype=object),
            hovertemplate="%{customdata}<extra></extra>", legendrank=legend.index(kind),
            **full,
        ))
    if animated:  # the cursor the animation sweeps, drawn once it moves: at rest, at the step's end, it had read
        # as the legend's border and hidden the step's last bar
        fig.add_trace(go.Scatter(mode="lines", line={"color": "black", "width": 2}, name="now", showlegend=False,
                                 hoverinfo="skip", x=[], y=[]))
    tick_kinds = [k for k in drawn if any(span_kind(s) == k for s in ticked)]
    for kind in tick_kinds:  # over the cursor: a step's last span (its optimizer) lies under the cursor's end
        fig.add_trace(go.Scatter(
            mode="markers", name=f"{kind_label(kind)}, too short for a bar", showlegend=False,
            hovertemplate="%{customdata}<extra></extra>",
            marker={"symbol": "line-ns", "size": 22, "line": {"width": 4, "color": KIND_COLORS[kind]}},
            **ticks(kind, None)))
    for kind in (k for k in legend if k not in drawn):  # named only: Plotly lists no empty bar trace
        fig.add_trace(legend_marker(kind_label(kind), KIND_COLORS[kind], legendrank=legend.index(kind)))
    # a row drawn to line up with another chart's (`shared_rows`) that this timeline has nothing in says so: a
    # prediction's empty "idle" rows beside the engine's measured waits had read as something missing
    filled = {row(s) for s in tl.spans}
    for empty in (r for r in rows if r not in filled):
        fig.add_annotation(x=0, y=empty, text=f"none {tl.source}", xanchor="left", showarrow=False,
                           font={"size": 11, "color": NOTE_COLOR})
    fig.update_layout(
        title=title, barmode="overlay", height=max(260, 42 * len(rows) + 140), bargap=0.25,
        # a line's height more for each line of a title after its first: the live panel's three-line one had
        # touched the first lane
        margin={"l": 10, "r": 10, "t": 50 + title_extra_px(title) if title else 20, "b": 10},
        legend={"orientation": "v", "x": 1.01, "y": 1, "title": {"text": "work"}},
        xaxis={"title": f"time ({unit})", "range": [0, t_end * 1.02 or 1.0]},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(rows))},
    )
    if animated:
        times = [t_end * i / (frames - 1) for i in range(frames)]
        fig.frames = [go.Frame(name=f"{t:.3f}", data=[go.Bar(**bars(k, t)) for k in drawn] + [go.Scatter(**cursor(t))]
                               + [go.Scatter(**ticks(k, t)) for k in tick_kinds],
                               traces=list(range(len(drawn) + 1 + len(tick_kinds)))) for t in times]
        add_time_animation(fig, times, [f"{t:.3f}" for t in times], unit, frame_ms=80)
    return fig


def _ticked(spans: list[Span], row, thin_s: float) -> list[Span]:
    """The spans of the rows (`row(span)`) that hold at most TICKED_ROW_SPANS spans, each shorter than
    `thin_s`: the rows that would read empty as bars alone."""
    by_row: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_row[row(s)].append(s)
    return [s for of_row in by_row.values()
            if len(of_row) <= TICKED_ROW_SPANS and all(s.duration_s < thin_s for s in of_row) for s in of_row]


def add_time_animation(fig: go.Figure, times: list[float], frame_names: list[str], unit: str,
                       frame_ms: int) -> None:
    """Play/pause buttons and a time slider under `fig`, whose frames are named `frame_names` (one per
    entry of `times`). Below the plot, not above it: there they would cover the title on short charts. The
    slider runs under the buttons, the whole width, its reading at its right end: beside the buttons (from
    22 % of the width) it ran under them in a half-page chart or a window 800-1,024 px wide, and its reading
    lay on the x axis's title. Its ticks carry no numbers (the x axis above reads the time; one per frame, they
    had crowded in uneven steps, "0.0, 1.7, 3.4 ... 32.2"): the reading alone says where it is."""
    fig.update_layout(
        updatemenus=[{
            "type": "buttons", "direction": "left", "x": 0.0, "y": 0, "xanchor": "left", "yanchor": "top",
            "pad": {"t": 60},
            "buttons": [
                {"label": "▶ Play", "method": "animate",
                 "args": [None, {"frame": {"duration": frame_ms, "redraw": True}, "fromcurrent": True,
                                 "transition": {"duration": 0}}]},
                {"label": "❚❚ Pause", "method": "animate",
                 "args": [[None], {"frame": {"duration": 0, "redraw": False}, "mode": "immediate"}]},
            ],
        }],
        sliders=[{
            "active": len(times) - 1, "x": 0.0, "len": 1.0, "y": 0, "yanchor": "top", "pad": {"t": 105},
            "currentvalue": {"prefix": "t = ", "suffix": f" {unit}", "xanchor": "right",
                             "font": {"size": 14, "color": "#31333F"}},  # Streamlit's text colour
            "font": {"color": "rgba(0, 0, 0, 0)"},  # the ticks' labels, not the reading's
            "steps": [{"label": f"{t:.1f}", "method": "animate",
                       "args": [[name], {"mode": "immediate", "frame": {"duration": 0, "redraw": True}}]}
                      for t, name in zip(times, frame_names, strict=True)],
        }],
    )
    fig.update_layout(height=fig.layout.height + 140, margin={"b": 150})


def step_timeline(timeline: Timeline, step: int) -> Timeline:
    """The spans of one step only (one step is the picture worth animating)."""
    return Timeline([s for s in timeline.spans if s.step == step], source=timeline.source, meta=timeline.meta)


def lane_summary(timeline: Timeline) -> list[dict]:
    """Per rank: busy ms per lane, comm bytes and how much of the comm time ran while the same rank
    computed (Timeline.overlap: each side an interval union)."""
    rows = []
    for rank in timeline.ranks:
        comm_s, hidden_s = timeline.overlap(rank)
        rows.append({
            "rank": rank,
            "compute ms": round(timeline.busy_seconds(rank, "compute") * 1e3, 3),
            "comm ms": round(comm_s * 1e3, 3),
            "comm under compute %": round(100 * hidden_s / comm_s, 1) if comm_s else None,
            "comm bytes": timeline.comm_bytes(rank),
        })
    return rows
