"""The Pipeline parallel lesson: the grid, table and real-chip builders by hand, the page through AppTest,
one live pipeline run."""

import pytest
from streamlit.testing.v1 import AppTest

from core.schedules import BACKWARD, FORWARD, OpTimes, make_schedule, simulate
from core.timeline import Span, Timeline
from hardware.chips import CHIPS
from hardware.collectives import group_topology
from planner.models import MODEL_PRESETS
from tests.ui.apptest_util import open_app
from ui.live import LIVE_STEPS
from ui.pipeline import (
    KIND_LABELS,
    LABEL_CHAR_PX,
    NARROW_PLOT_PX,
    SCHEDULE_LABELS,
    bubble_in_words,
    comparison,
    comparison_table,
    grid_cells,
    held_micro_batches,
    in_flight_figure,
    measured_op_times,
    op_times,
    real_chip_view,
    schedule_figure,
    simulate_schedule,
)
from ui.timeline import step_timeline

PAGE = "app_pages/pipeline.py"
EQUAL = op_times(2.0)  # t_B = 2 t_F, so t_BI = t_BW = t_F for ZB-H1: the papers' equal-times case


def _page(**params) -> AppTest:
    return open_app(PAGE, **params)


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


# What fits an 800-px window with the sidebar open: a third of the page's column is some 123 px, about 20
# characters of a metric's label ("Bubble fraction (formula)", 25, read "Bubble fraction (form..."); a chart
# title's line in the 468-px plot, about 55 characters at Plotly's title size.
METRIC_LABEL_CHARS = 20
HALF_PLOT_TITLE_CHARS = 55  # a half-width plot: fewer than ui.charts.TITLE_LINE_CHARS (a full-width one)


def _holds(node, key: str) -> bool:
    return getattr(node, "key", None) == key or any(_holds(c, key) for c in getattr(node, "children", {}).values())


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_grid_cells_are_the_schedules_compute_actions_at_simulated_times(name, v):
    sim = simulate(make_schedule(name, 4, 8, v), EQUAL)
    cells = grid_cells(sim)
    want = [(r, a.kind, a.micro_batch, a.stage, start, end)
            for r, (actions, intervals) in enumerate(zip(sim.schedule.actions, sim.intervals_s, strict=True))
            for a, (start, end) in zip(actions, intervals, strict=True) if a.is_compute]
    assert [(c.rank, c.kind, c.micro_batch, c.stage, c.start, c.end) for c in cells] == want


def test_figure_draws_every_cell_labelled_and_fills_each_row_with_work_or_bubble():
    sim = simulate(make_schedule("1f1b", 4, 8), EQUAL)
    fig = schedule_figure(sim, animate=False)
    by_name = {trace.name: trace for trace in fig.data if trace.type == "bar"}
    forward, backward = by_name[KIND_LABELS["F"]], by_name[KIND_LABELS["B"]]
    bubble = by_name[KIND_LABELS["bubble"]]
    assert len(forward.x) == len(backward.x) == 4 * 8
    assert sorted(forward.text[:4]) == ["0", "1", "2", "3"]  # rank 0's warm-up forwards: micro-batches 0..3
    for rank in range(4):
        row = f"rank {rank}"
        filled = sum(w for trace in (forward, backward, bubble) for y, w in zip(trace.y, trace.x) if y == row)
        assert filled == pytest.approx(sim.makespan_s)  # every instant of the step is work or bubble


def test_interleaved_cells_name_the_chunk_and_the_animation_reveals_work():
    sim = simulate(make_schedule("interleaved-1f1b", 2, 4, 2), EQUAL)
    labels = {c.label(2) for c in grid_cells(sim)}
    assert {"0A", "0B", "0a", "0b"} <= labels  # forward upper case, backward lower case
    fig = schedule_figure(sim, frames=5)
    assert len(fig.frames) == 5
    assert sum(fig.frames[0].data[0].x) == 0  # t = 0: nothing has run yet
    assert sum(fig.frames[-1].data[0].x) == pytest.approx(sum(fig.data[0].x))


def test_interleaved_labels_are_drawn_whole_in_a_narrow_window():
    # Plotly keeps 3 px a side of a bar free for its label: in a 1,024-px window an interleaved forward (t_F / 2,
    # some 9 px) hid its "0A". A label that fits its cell in an 800-px window is drawn as it is.
    sim = simulate(make_schedule("interleaved-1f1b", 4, 8, 2), EQUAL)
    fig = schedule_figure(sim, animate=False)
    forward = [t for t in fig.data if t.legendgroup == FORWARD]
    assert [t.constraintext for t in forward] == ["none"]
    assert len(forward[0].text) == 4 * 8 * 2 and "3<br>B" in forward[0].text  # the chunk under the micro-batch
    x_max = fig.layout.xaxis.range[1]
    for trace in fig.data:
        if trace.type == "bar" and trace.constraintext == "none":
            for text, width in zip(trace.text, trace.x, strict=True):
                assert width / x_max * NARROW_PLOT_PX >= LABEL_CHAR_PX * max(map(len, text.split("<br>")))


def test_labels_too_wide_for_a_narrow_window_are_plotlys_to_fit_and_each_kind_is_named_once():
    sim = simulate(make_schedule("gpipe", 8, 16), EQUAL)  # a forward is t_F of a 69 t_F step: under 6 px
    fig = schedule_figure(sim, frames=3)
    bars = [t for t in fig.data if t.type == "bar"]
    fitted = {t.legendgroup: t for t in bars if t.constraintext == "both"}
    assert len(fitted[FORWARD].text) == 8 * 16
    assert sorted(set(fitted[BACKWARD].text)) == [str(mb) for mb in range(10, 16)]  # two digits, twice as wide
    assert [t.name for t in bars if t.showlegend] == [KIND_LABELS[k] for k in (FORWARD, BACKWARD, "bubble")]
    assert all(len(frame.data) == len(fig.data) for frame in fig.frames)  # the animation moves every trace


def test_comparison_table_shows_the_formulas_and_simulates_bubbles():
    sims, rows = comparison(4, 8, 2, EQUAL)
    by_name = {row["schedule"]: row for row in rows}
    # Narayanan et al. 2021: (p-1)/m = 3/8, interleaved (p-1)/(v m) = 3/16; Qi et al. 2023: a third of 1F1B
    assert by_name["GPipe"]["formula bubble"] == pytest.approx(0.375)
    assert by_name["1F1B"]["formula bubble"] == pytest.approx(0.375)
    assert by_name["Interleaved 1F1B"]["formula bubble"] == pytest.approx(0.1875)
    assert by_name["ZB-H1"]["formula bubble"] == pytest.approx(0.125)
    for name, sim in sims.items():
        row = by_name[SCHEDULE_LABELS[name]]
        v = 2 if name == "interleaved-1f1b" else 1
        again = simulate(make_schedule(name, 4, 8, v), EQUAL)
        assert row["simulated bubble"] == sim.bubble_fraction == again.bubble_fraction
        assert row["formula bubble"] == pytest.approx(row["simulated bubble"]), name
    assert (by_name["GPipe"]["held, rank 0"], by_name["1F1B"]["held, rank 0"]) == (8, 4)


def test_comparison_keeps_the_reason_a_schedule_cannot_run():
    sims, rows = comparison(4, 6, 2, EQUAL)
    interleaved = next(r for r in rows if r["schedule"] == "Interleaved 1F1B")
    assert "multiple of num_ranks (4)" in interleaved["note"] and "use 4 or 8" in interleaved["note"]
    assert interleaved["simulated bubble"] is None
    assert set(sims) == {"gpipe", "1f1b", "zb-h1"}


def test_comparison_table_shows_a_dash_where_a_schedule_cannot_run_and_its_notes_in_full():
    _, rows = comparison(8, 1, 2, op_times(2.0, 0.5))
    table, notes = comparison_table(rows)
    interleaved = next(r for r in table if r["schedule"] == "Interleaved 1F1B")
    assert [interleaved[k] for k in ("formula bubble", "simulated bubble", "held, rank 0", "held, last rank")] \
        == ["—"] * 4
    assert "note" not in interleaved  # a grid cell cut the sentence off: the notes go under the table
    assert next(r for r in table if r["schedule"] == "GPipe")["formula bubble"] == "7.000"
    assert notes == ["GPipe, 1F1B, ZB-H1: the formula leaves communication out.",
                     "Interleaved 1F1B: cannot run here: interleaved-1f1b needs num_micro_batches to be a "
                     "multiple of num_ranks (8), got 1: use 8 micro-batches."]


def test_bubble_in_words_is_a_ratio_to_the_compute_time_not_a_share_of_the_step():
    # (p-1)/m = 31: the bubble lasts 31 compute times; the step is 32 of them, 31/32 idle
    words = bubble_in_words(32, 1)
    assert "**31×** the compute time" in words and "**96.9%** of the step" in words
    assert "**0.375×**" in bubble_in_words(4, 8) and "**27.3%**" in bubble_in_words(4, 8)  # 3/11


def test_activations_held_1f1b_against_gpipe():
    held = {name: held_micro_batches(simulate_schedule(name, 4, 8, 2, EQUAL))
            for name in ("gpipe", "1f1b", "interleaved-1f1b")}
    assert held["gpipe"] == [8, 8, 8, 8]
    assert held["1f1b"] == [4, 3, 2, 1]
    assert held["interleaved-1f1b"] == [5.5, 4.5, 3.5, 2.5]  # (micro-batch, chunk) pairs / v
    fig = in_flight_figure({n: simulate_schedule(n, 4, 8, 2, EQUAL) for n in held}, "1f1b")
    # the bars faded, not their numbers, in a colour the legend's swatch shows faded too
    assert [t.marker.color.startswith("rgba(") and t.marker.color.endswith(", 0.35)") for t in fig.data] == [
        True, False, True] and fig.data[1].marker.color == "#4C78A8"
    assert all(t.marker.opacity is None and t.opacity is None for t in fig.data)
    assert list(fig.data[1].y) == [4, 3, 2, 1]
    # in one line the title ran past the plot's right edge in a 1,024-px window
    assert max(len(line) for line in fig.layout.title.text.split("<br>")) <= HALF_PLOT_TITLE_CHARS


def test_real_chip_view_follows_the_planner():
    spec, chip = MODEL_PRESETS["Llama 3 70B"], CHIPS["h100"]
    view = real_chip_view(spec, chip, pp=4, micro_batches=16, tp=8, stride=8)
    assert view.layers_per_stage == (20, 20, 20, 20)
    # 1F1B's first stage holds p = 4 micro-batches, GPipe's all 16
    assert view.activation_bytes_gpipe == pytest.approx(4 * view.activation_bytes_1f1b)
    assert view.p2p_bytes == spec.seq_len * spec.hidden * 2 / 8
    assert view.p2p_s == group_topology(chip, 4, stride=8, achievable=True).p2p_s(view.p2p_bytes)
    assert 0 < view.p2p_s < view.stage_forward_s
    with pytest.raises(ValueError, match="choose pp <= 80"):
        real_chip_view(spec, chip, pp=128, micro_batches=16)


def test_measured_op_times_and_one_step():
    spans = [Span(0, "compute", "F s0", 0.0, 0.001, step=1, micro_batch=0),
             Span(0, "compute", "B s0", 0.002, 0.004, step=1, micro_batch=0),
             Span(0, "comm", "send act s0", 0.001, 0.0015, step=1, micro_batch=0),
             Span(0, "compute", "F s0", 0.0, 0.005, step=0, micro_batch=0)]
    timeline = Timeline(spans)
    assert measured_op_times(timeline, 1, 1) == OpTimes(0.001, 0.001, 0.001)
    assert measured_op_times(timeline, 1, 2).forward_s == pytest.approx(0.002)  # a chunk is 1/v of the layers
    assert [s.step for s in step_timeline(timeline, 1).spans] == [1, 1, 1]
    with pytest.raises(ValueError, match="no pipeline forward and backward"):
        measured_op_times(timeline, 0, 1)


def test_page_opens_with_the_schedule_and_its_bubble():
    at = _page()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Pipeline parallel"
    # default: 1F1B, p = 4, m = 8 -> (p-1)/m = 0.375
    assert _metric(at, "Simulated bubble") == _metric(at, "Formula bubble") == "0.375"
    assert len(at.get("plotly_chart")) == 2  # the grid and the activations held; no live run yet
    assert not at.error


def test_changing_schedule_stages_and_micro_batches_redraws():
    at = _page()
    before = at.get("plotly_chart")[0].proto.spec
    at.slider(key="stages").set_value(2).run()
    assert _metric(at, "Simulated bubble") == "0.125"  # (2-1)/8
    at.selectbox(key="schedule").set_value("zb-h1").run()
    at.slider(key="micro_batches").set_value(4).run()
    assert _metric(at, "Simulated bubble") == "0.083"  # (2-1)/(3*4)
    assert at.get("plotly_chart")[0].proto.spec != before


def test_invalid_interleaved_micro_batches_say_what_to_change():
    at = _page(stages="4", micro_batches="6")
    at.selectbox(key="schedule").set_value("interleaved-1f1b").run()
    assert not at.exception
    assert "multiple of num_ranks (4), got 6: use 4 or 8 micro-batches" in at.error[0].value
    assert len(at.get("plotly_chart")) == 1  # the grid is gone, the other schedules' memory stays


def test_page_words_the_real_chip_bubble_and_leaves_no_none_in_the_table():
    at = _page(schedule="Interleaved 1F1B", stages="8", micro_batches="1")
    at.select_slider(key="real_pp").set_value(32)
    at.select_slider(key="real_m").set_value(1).run()
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(md.value for md in at.markdown)
    assert "**31×** the compute time here, so **96.9%** of the step is bubble" in text
    assert "31.00" not in text
    table = at.table[0].value  # app_pages.text_table: a static table
    assert "note" not in table.columns and not table.isna().any().any()
    numbers = ["formula bubble", "simulated bubble", "held, rank 0", "held, last rank"]
    assert (table[table["schedule"] == "Interleaved 1F1B"].iloc[0][numbers] == "—").all()
    assert list(table.columns) == ["schedule", *numbers, "formula"]  # the numbers in view first (800 px)
    assert any("Interleaved 1F1B: cannot run here" in c.value and "use 8 micro-batches" in c.value
               for c in at.caption)


def test_the_labels_fit_an_800_px_window():
    at = _page(schedule="Interleaved 1F1B")
    assert not at.exception, [e.value for e in at.exception]
    # "Activations on stage 0, GPipe" was cut in a 1,024-px window; the stage is said in the help
    assert [m.label for m in at.metric if len(m.label) > METRIC_LABEL_CHARS] == []
    assert all(m.help.startswith("On stage 0") for m in at.metric if m.label.startswith("Activations"))
    # a schedule's box half a row wide: a quarter of it cut "Interleaved 1F1B" to "Interleaved 1I"
    for key in ("schedule", "live_schedule"):
        assert next(col.weight for col in at.columns if _holds(col, key)) >= 0.5


def test_link_opens_the_chosen_schedule():
    at = _page(schedule="ZB-H1", stages="2", micro_batches="4")  # a bound selectbox carries its label
    assert _metric(at, "Simulated bubble") == "0.083"


@pytest.mark.multiprocess
def test_live_pipeline_run_matches_the_reference_and_draws_the_timeline():
    at = _page()
    at.select_slider(key="live_world").set_value(2)
    at.selectbox(key="live_schedule").set_value("gpipe")
    at.select_slider(key="live_m").set_value(2)
    at.button[0].click().run(timeout=120)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert "matches the single-process reference" in at.success[0].value
    assert _metric(at, "Bubble, formula") == "0.500"  # (2-1)/2
    measured = next(m for m in at.metric if m.label == "Bubble, measured")
    # any step after the warm-up: the lessons run ui.live.LIVE_STEPS
    assert measured.help in {f"On step {k}, the one the measured timeline draws" for k in range(1, LIVE_STEPS)}
    assert float(measured.value) > 0
    assert [m.label for m in at.metric if len(m.label) > METRIC_LABEL_CHARS] == []
    assert len(at.get("plotly_chart")) == 4  # grid, activations held, predicted and measured step
    assert at.get("download_button")
    # the per-rank table over the steps the step time is the mean of, the warm-up left out
    assert any(m.value.startswith("Each rank over steps 1-") and "left out" in m.value for m in at.markdown)
    held = next(t.value for t in at.table if "micro-batches held, schedule" in t.value.columns)
    assert all("." not in v for v in held["micro-batches held, schedule"])  # GPipe holds whole micro-batches



def test_the_transfer_time_adds_up_from_its_parts():
    spec, chip = MODEL_PRESETS["Llama 3 70B"], CHIPS["h100"]
    view = real_chip_view(spec, chip, pp=4, micro_batches=16, stride=8)  # stages a node apart: the network
    # over the network: alpha and the fill as the chip table states them, the bytes at the achievable NIC rate
    assert view.fill_s == chip.scaleout_fill_s
    assert view.latency_s - view.fill_s == pytest.approx(chip.scaleout_latency_s)
    assert view.bandwidth_s == pytest.approx(view.p2p_bytes / chip.scaleout_bw(True), rel=1e-9)


def test_the_zb_h1_caption_counts_in_words():
    """It had printed a Python list: "the inputs of up to [1, 2, 3, 4] deferred BW"."""
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/pipeline.py")
    caption = next(c.value for c in at.caption if c.value.startswith("ZB-H1 also keeps"))
    assert "[" not in caption and " deferred BW on ranks 0 to " in caption
