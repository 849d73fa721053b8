"""The one live panel's pieces (ui/live.py): the measured step beside its prediction on one axis, the
error and what differs most, the verdict, on hand-made runs."""

import pytest

from core.timeline import Span, Timeline
from engine.config import RunConfig
from engine.run import RunSummary
from ui.live import (
    LiveRun,
    busy_warning,
    calibration_age,
    differences,
    prediction_error,
    prediction_notes,
    representative_step,
    side_by_side,
    speed_note,
    spread_sentence,
    tolerance_rows,
    verdict,
)


def _run(pred_ms=8.0, step_times_ms=(30.0, 10.0, 12.0, 11.0), ok=True, mean_ms=11.5) -> LiveRun:
    measured = []
    for step, t in enumerate(step_times_ms):
        measured += [Span(r, "compute", "fwd L0", 100 * step, 100 * step + t / 2e3, step=step) for r in (0, 1)]
        measured += [Span(r, "comm", "all_reduce grads", 100 * step + t / 2e3, 100 * step + t / 1e3, group="dp",
                          step=step) for r in (0, 1)]
    predicted = Timeline([Span(r, "compute", "fwd L0", 0, pred_ms / 2e3) for r in (0, 1)]
                         + [Span(r, "comm", "all_reduce grads", pred_ms / 2e3, pred_ms / 1e3, group="dp")
                            for r in (0, 1)],
                         source="predicted")
    check = {"passed": ok, "max_abs_diff": 1e-6, "by_quantity": {"loss": 1e-7},
             "tolerances": {"loss": {"rtol": 1e-5, "atol": 1e-6, "why": "summation order"}}}
    summary = RunSummary(ok=ok, check=check, world=2, strategy="dp", zero_stage=0, mesh={"dp": 2},
                         steps=len(step_times_ms), micro_batches=1, device="cpu", loss=[5.5], step_time_s=mean_ms / 1e3,
                         step_times_s=[t / 1e3 for t in step_times_ms], memory_bytes=[], comm_bytes=[], stats={},
                         config={}, predicted={"step_time_s": pred_ms / 1e3, "breakdown_s": {},
                                               "timeline": predicted.to_dict()})
    return LiveRun("DP", RunConfig(world=2, steps=len(step_times_ms)), summary, Timeline(measured))


def test_the_error_is_against_the_runs_step_time():
    assert prediction_error(_run(pred_ms=9.2)) == pytest.approx(9.2 / 11.5 - 1)
    run = _run()
    run.summary.predicted = {"step_time_s": None, "why": "CUDA"}
    assert prediction_error(run) is None and differences(run) == []


def test_the_calibrations_age_is_read_at_the_prediction():
    run = _run()
    assert calibration_age(run) is None  # an older prediction does not say
    for seconds, words in ((42, "under a minute"), (60, "1 minute"), (15 * 60 + 5, "15 minutes"), (2 * 3600, "2 hours"),
                           (3 * 86400, "3 days")):
        run.summary.predicted.update(calibrated_at_s=1000.0, predicted_at_s=1000.0 + seconds)
        assert calibration_age(run) == words


def test_the_speed_check_is_said_when_it_scaled_the_prediction():
    run = _run()
    assert speed_note(run) is None  # an older prediction does not say
    run.summary.predicted["speed_factor"] = 1.0
    assert speed_note(run) is None  # at the calibration's speed: nothing to say
    run.summary.predicted["speed_factor"] = 1.25
    assert "1.25x slower" in speed_note(run) and "communication was not" in speed_note(run)


def test_a_machine_far_from_its_calibrations_speed_is_said_before_the_comparison():
    run = _run()
    assert busy_warning(run) is None  # an older prediction does not say
    for quiet in (1.0, 2.0, 0.5):  # read on a quiet machine (this_machine.BUSY_SPEED_FACTOR)
        run.summary.predicted["speed_factor"] = quiet
        assert busy_warning(run) is None
    run.summary.predicted["speed_factor"] = 5.9  # a browser drawing the page on the same 2 cores
    assert "5.9x slower" in busy_warning(run) and "run again when the machine is quiet" in busy_warning(run)
    run.summary.predicted["speed_factor"] = 0.25
    assert "calibration was made on a busy machine" in busy_warning(run) and "4.0x faster" in busy_warning(run)


def test_the_spread_of_the_steps_places_the_prediction_among_them():
    # steps after the warm-up (30 ms): 10, 12, 11 ms
    assert spread_sentence(_run(pred_ms=11.5)) == ("Its 3 steps after the warm-up took 10.0 to 12.0 ms; the "
                                                   "prediction, 11.5 ms, lies between them (2 of the 3 were faster).")
    assert spread_sentence(_run(pred_ms=8.0)).endswith("8.0 ms, lies below every one of them.")
    assert spread_sentence(_run(pred_ms=30.0)).endswith("30.0 ms, lies above every one of them.")
    run = _run()
    run.summary.predicted = {"step_time_s": None, "why": "CUDA"}
    assert spread_sentence(run) == "Its 3 steps after the warm-up took 10.0 to 12.0 ms."
    assert spread_sentence(_run(step_times_ms=(30.0, 10.0))) is None  # one step after the warm-up: no spread


def test_the_step_shown_is_the_one_nearest_the_step_time():
    assert representative_step(_run().summary) in (2, 3)  # 12 and 11 ms are both 0.5 ms from 11.5 ms


def test_side_by_side_shares_the_time_axis_and_the_rows():
    pred_fig, meas_fig, step = side_by_side(_run(pred_ms=20.0))
    assert pred_fig.layout.xaxis.range == meas_fig.layout.xaxis.range
    assert pred_fig.layout.xaxis.range[1] == pytest.approx(20.0 * 1.02)
    rows = {y for trace in pred_fig.data for y in (() if trace.y is None else trace.y)}
    assert rows == {y for trace in meas_fig.data for y in (() if trace.y is None else trace.y)}
    assert pred_fig.frames and meas_fig.frames  # both animated
    assert "Measured: step" in meas_fig.layout.title.text and "20.0 ms" in pred_fig.layout.title.text
    # each marks where the other's step ends (the measured one drawn: step 2, 12 ms)
    (pred_end,), (meas_end,) = pred_fig.layout.shapes, meas_fig.layout.shapes
    assert (pred_end.x0, meas_end.x0) == (pytest.approx(12.0), pytest.approx(20.0))
    assert pred_fig.data[-1].name == meas_fig.data[-1].name == "other chart's end"


def test_differences_name_the_slow_collective():
    texts = differences(_run(pred_ms=4.0))
    assert texts and texts[0].startswith("gloo all-reduce (dp) took")


def test_verdict_and_tolerances():
    ok, text = verdict(_run())
    assert ok and text.startswith("DP on 2 processes matches the single-process reference over 4 steps")
    bad, text = verdict(_run(ok=False))
    assert not bad and "DOES NOT match" in text
    assert tolerance_rows(_run().summary.check)[0]["why"] == "summation order"
    # an exact check says what the run split: pipeline stages, or nothing at all on one process (it had said
    # "nothing but pipeline stages" of a Lab run with every axis at 1)
    from dataclasses import replace

    exact = _run()
    exact.summary.check["exact"] = True
    assert "splits nothing but pipeline stages" in verdict(exact)[1]
    alone = replace(exact, cfg=RunConfig(world=1, steps=4))
    assert "on 1 process matches" in verdict(alone)[1] and "splits nothing, one process alone" in verdict(alone)[1]


def test_both_charts_draw_the_same_rows_when_only_the_measurement_waits():
    """The engine marks a ring's waits as idle spans the prediction has no row for: the measured chart had drawn
    extra rows, so its ranks sat lower than the predicted chart's."""
    from dataclasses import replace

    run = _run()
    waits = [Span(r, "idle", "wait kv", 100 * s + 1e-3, 100 * s + 2e-3, step=s) for s in range(4) for r in (0, 1)]
    run = replace(run, timeline=Timeline(run.timeline.spans + waits))
    pred_fig, meas_fig, _ = side_by_side(run)
    assert list(pred_fig.layout.yaxis.categoryarray) == list(meas_fig.layout.yaxis.categoryarray)
    assert any("idle" in row for row in pred_fig.layout.yaxis.categoryarray)
    # the prediction's idle rows, empty, say so; the measured chart fills every row
    assert [(a.y, a.text) for a in pred_fig.layout.annotations] == [("rank 0 · idle", "none predicted"),
                                                                     ("rank 1 · idle", "none predicted")]
    assert not meas_fig.layout.annotations
    # and the same legend: a kind in one chart only had made its legend wider, so the two plots' time axes
    # differed by 24 px over the same range
    legend = [t.name for t in pred_fig.data if t.showlegend is not False]
    assert legend == [t.name for t in meas_fig.data if t.showlegend is not False]


def test_the_measured_charts_title_fits_an_800_px_window():
    """On one line, "Measured: step 1, the one nearest the mean (25.1 ms on the slowest rank)" ran past the
    468-px plot's right edge; the step time has a line of its own. About 55 characters fit at Plotly's title
    size, some 90 in the smaller subtitle."""
    for step_times_ms in ((30.0, 10.0, 12.0, 11.0), (30.0, 40.0, 80.0), (30.0, 12.0), (30.0,)):
        title = side_by_side(_run(step_times_ms=step_times_ms))[1].layout.title.text
        lines = title.split("<br>")
        assert max(len(line) for line in lines if not line.startswith("<sup>")) <= 55, title
        assert max(len(line) for line in lines) <= 90 + len("<sup></sup>"), title


def test_the_measured_chart_says_which_step_it_draws_and_the_mean_it_is_judged_by():
    """Two steps after the warm-up lie as far from their mean: the title had called the one drawn (39 ms) "the
    one nearest the mean" under a headline of 60 ms."""
    two = side_by_side(_run(step_times_ms=(30.0, 40.0, 80.0), mean_ms=60.0))[1].layout.title.text
    assert "one of the two after the warm-up" in two and "(mean 60.0 ms)" in two and "nearest" not in two
    three = side_by_side(_run(step_times_ms=(30.0, 10.0, 12.0, 11.0), mean_ms=11.0))[1].layout.title.text
    assert "step 3, nearest the mean of steps 1-3" in three and "(mean 11.0 ms)" in three
    one = side_by_side(_run(step_times_ms=(30.0, 12.0), mean_ms=12.0))[1].layout.title.text
    assert "step 1, the only one after the warm-up" in one and "mean" not in one


def test_a_one_step_runs_chart_says_it_is_the_warm_up():
    _, meas_fig, step = side_by_side(_run(step_times_ms=(30.0,)))
    assert step == 0 and "the run's only step (its warm-up)" in meas_fig.layout.title.text
    assert "nearest the mean" not in meas_fig.layout.title.text and "is left out" not in meas_fig.layout.title.text


def test_a_run_compared_bit_for_bit_says_so():
    from ui.live import verdict

    run = _run()
    assert "largest difference 1.00e-06" in verdict(run)[1]
    run.summary.check["exact"] = True
    ok, words = verdict(run)
    assert ok and "bit for bit" in words and "largest difference" not in words


def test_the_predictions_notes_are_said_under_it():
    run = _run()
    assert prediction_notes(run) == []  # within what the calibration timed
    run.summary.predicted["notes"] = ["its attention runs over 512 tokens, longer than the 256 this machine's "
                                      "calibration timed: the prediction extrapolates there"]
    assert prediction_notes(run) == ["Note on the prediction: its attention runs over 512 tokens, longer than the "
                                     "256 this machine's calibration timed: the prediction extrapolates there."]
    run.summary.predicted = None
    assert prediction_notes(run) == []
