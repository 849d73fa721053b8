"""The timeline chart: spans land on the right rows with the right times; frames reveal them in order."""

import pytest

from core.timeline import Span, Timeline
from ui.timeline import lane_summary, span_kind, timeline_figure


def _tl():
    return Timeline([
        Span(0, "compute", "fwd L0", 1.000, 1.004, step=0),
        Span(0, "compute", "bwd L0", 1.004, 1.010, step=0),
        Span(0, "comm", "all_reduce", 1.006, 1.012, bytes=1000, group="dp", is_async=True),
        Span(0, "compute", "optimizer", 1.012, 1.014),
        Span(1, "compute", "fwd L0", 1.001, 1.005),
        Span(1, "idle", "bubble", 1.005, 1.008),
        Span(1, "comm", "send act", 1.008, 1.009, bytes=64, group="pp"),
    ])


@pytest.mark.parametrize(("lane", "name", "kind"), [
    ("compute", "fwd L3", "forward"), ("compute", "bwd embed", "backward"), ("compute", "optimizer", "optimizer"),
    ("comm", "all_gather", "all_gather"), ("comm", "reduce-scatter grads", "reduce_scatter"),
    ("comm", "all_to_all dispatch", "all_to_all"), ("comm", "recv grad", "send/recv"), ("idle", "bubble", "idle"),
    ("compute", "recompute s0 L2", "recompute"),
])
def test_span_kind(lane, name, kind):
    assert span_kind(Span(0, lane, name, 0, 1)) == kind


def test_bars_start_and_last_in_milliseconds_from_the_first_span():
    fig = timeline_figure(_tl(), animate=False)
    by_name = {t.name: t for t in fig.data}
    fwd = by_name["forward"]
    assert list(fwd.base) == pytest.approx([0.0, 1.0])
    assert list(fwd.x) == pytest.approx([4.0, 4.0])
    assert list(fwd.y) == ["rank 0 · compute", "rank 1 · compute"]
    assert list(by_name["all-reduce"].y) == ["rank 0 · comm"]  # a collective named as prose writes it
    # rows: rank 0 compute+comm, rank 1 compute+comm+idle (top to bottom = reversed category array)
    assert list(fig.layout.yaxis.categoryarray)[::-1] == [
        "rank 0 · compute", "rank 0 · comm", "rank 1 · compute", "rank 1 · comm", "rank 1 · idle"]
    assert not fig.frames


def test_frames_reveal_spans_as_the_cursor_passes():
    fig = timeline_figure(_tl(), frames=8)
    assert len(fig.frames) == 8
    kinds = [t.name for t in fig.data if t.name != "now"]
    first, last = fig.frames[0], fig.frames[-1]
    assert all(sum(trace.x) == 0 for trace in first.data[:-1])  # t = 0: nothing has run yet
    for i, kind in enumerate(kinds):  # last frame = the full chart
        assert list(last.data[i].x) == pytest.approx(list(next(t for t in fig.data if t.name == kind).x))
    assert last.data[-1].x[0] == pytest.approx(14.0)  # cursor at the end, 14 ms
    widths = [sum(sum(trace.x) for trace in frame.data[:-1]) for frame in fig.frames]
    assert widths == sorted(widths)


def test_a_row_of_spans_too_short_for_a_bar_draws_them_as_ticks():
    # a real cluster's step: 60 micro-batches' forwards fill a row, the optimizer's 20 ms of a 50 s step do not
    spans = [Span(0, "compute", f"fwd mb{i}", i * 0.8, i * 0.8 + 0.01, step=0) for i in range(60)]
    spans.append(Span(0, "compute", "optimizer", 49.98, 50.0, step=0))
    fig = timeline_figure(Timeline(spans), frames=4, rows_by_kind=True)
    ticks = [t for t in fig.data if t.name.endswith("too short for a bar")]
    assert [t.name for t in ticks] == ["optimizer, too short for a bar"]
    assert list(ticks[0].x) == pytest.approx([49.99]) and list(ticks[0].y) == ["rank 0 · optimizer"]
    assert "optimizer" in ticks[0].customdata[0]
    at = list(fig.data).index(ticks[0])
    shown = [len(frame.data[at].x) for frame in fig.frames]  # revealed once the cursor reaches it, as the bars
    assert shown == [0, 0, 0, 1]
    assert not any(t.name.endswith("too short for a bar") for t in timeline_figure(_tl()).data)


def test_lane_summary_measures_overlap_of_comm_with_compute():
    rows = {r["rank"]: r for r in lane_summary(_tl())}
    assert rows[0]["comm ms"] == pytest.approx(6.0)
    # all_reduce 1.006-1.012 overlaps bwd (1.006-1.010) and optimizer (1.012-1.012: none): 4 of 6 ms
    assert rows[0]["comm under compute %"] == pytest.approx(66.7)
    assert rows[0]["comm bytes"] == 1000
    assert rows[1]["comm under compute %"] == 0.0


def test_the_per_rank_table_leaves_the_warm_up_out():
    tl = Timeline([Span(0, "compute", "fwd L0", 0.0, 0.600, step=0), Span(1, "comm", "recv act", 0.0, 0.600, step=0),
                   Span(0, "compute", "fwd L0", 1.0, 1.010, step=1),
                   Span(1, "compute", "fwd L1", 1.010, 1.020, step=1)])
    rows = {r["rank"]: r for r in lane_summary(tl.after_warm_up())}
    assert rows[0]["compute ms"] == pytest.approx(10.0) and rows[1]["comm ms"] == 0.0
    assert _tl().after_warm_up().spans == _tl().spans  # a run of one step: its warm-up is all there is


def test_a_kind_named_for_the_legend_only_is_listed():
    # Plotly lists no empty bar trace: the shared legend had still been one entry short on the chart without
    # that kind, and the two charts' time axes 24 px apart
    from core.timeline import Span, Timeline
    from ui.timeline import timeline_figure

    tl = Timeline([Span(0, "compute", "forward", 0.0, 1e-3)])
    fig = timeline_figure(tl, kinds=["forward", "all_reduce"])
    named = sorted((t.legendrank, t.name) for t in fig.data if t.showlegend is not False)
    assert [name for _, name in named] == ["forward", "all-reduce"]
    assert fig.data[-1].x == (None,) and fig.data[-1].marker.color  # a legend entry, no bar


@pytest.mark.parametrize(("seconds", "unit"), [(5.0, "ms"), (60.0, "s"), (500.0, "min"), (9000.0, "h")])
def test_a_long_steps_axis_is_in_the_unit_its_step_time_reads(seconds, unit):
    """A 500 s step had read "8.33 min" in its metric (ui.tables.format_step) and "time (s)" on its axis (minutes
    from 10 min only)."""
    from ui.tables import format_step

    fig = timeline_figure(Timeline([Span(0, "compute", "fwd L0", 0.0, seconds)]), animate=False)
    assert fig.layout.xaxis.title.text == f"time ({unit})"
    assert unit == "ms" or format_step(seconds).endswith(f" {unit}")
    assert fig.layout.xaxis.range[1] == pytest.approx(1.02 * seconds * {"ms": 1e3, "s": 1, "min": 1 / 60,
                                                                         "h": 1 / 3600}[unit])


def test_the_time_slider_runs_under_the_play_buttons():
    # beside the buttons (from 22 % of the width) the slider ran under them in a half-page chart or a window
    # 800-1,024 px wide, and its reading lay on the x axis's title
    import plotly.graph_objects as go

    from ui.timeline import add_time_animation

    fig = go.Figure(layout={"height": 300})
    add_time_animation(fig, [0.0, 1.0], ["0", "1"], "s", frame_ms=80)
    slider, buttons = fig.layout.sliders[0], fig.layout.updatemenus[0]
    assert slider.x == 0 and slider.len == 1 and slider.pad.t > buttons.pad.t + 30  # a row of its own
    assert slider.currentvalue.xanchor == "right"  # its reading clear of the buttons, at the right end
    assert fig.layout.margin.b > slider.pad.t
