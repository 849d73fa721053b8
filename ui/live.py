"""What the one live panel (app_pages/live_panel.py) shows of a finished run, built without Streamlit:
the verdict against the single-process reference, the measured step beside its prediction on one time
axis, the error and what differs most, and the command line that reproduces the run."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import plotly.graph_objects as go

from core.timeline import Timeline
from hardware.this_machine import NOT_KEPT_WORDS, busy_words, speed_words
from planner.live import compare, step_spread_words
from ui.timeline import NOTE_COLOR, shared_kinds, shared_rows, step_timeline, timeline_figure


@dataclass
class LiveRun:
    label: str
    cfg: object  # engine.config.RunConfig
    summary: object  # engine.run.RunSummary (read by attribute; ui does not import the engine)
    timeline: Timeline
    cached_from: float | None = None  # answered from the server's cache: when the original run finished

    @property
    def prediction(self) -> dict | None:
        return self.summary.predicted

    @cached_property
    def predicted_timeline(self) -> Timeline | None:
        p = self.prediction
        return Timeline.from_dict(p["timeline"]) if p and p.get("timeline") else None


def verdict(run: LiveRun) -> tuple[bool, str]:
    s, check = run.summary, run.summary.check
    cfg = run.cfg
    what = f"{run.label} on {cfg.world} process{'es' if cfg.world > 1 else ''}"
    if cfg.micro_batches > 1:
        what += f", {cfg.micro_batches} micro-batches,"
    if check is None:
        return True, f"{what} ran {s.steps} steps (not compared with the reference); loss {s.loss[-1]:.4f}."
    splits = "nothing, one process alone" if cfg.world == 1 else "nothing but pipeline stages"
    how = (f"bit for bit: this run splits {splits}, so it repeats the reference's arithmetic"
           if check.get("exact") else f"largest difference {check['max_abs_diff']:.2e}")
    return s.ok, (f"{what} {'matches' if s.ok else 'DOES NOT match'} the single-process reference over "
                     f"{s.steps} step{'s' if s.steps > 1 else ''} ({how}; loss {s.loss[-1]:.4f}).")


def tolerance_rows(check: dict | None) -> list[dict]:
    if not check:
        return []
    return [{"quantity": q, "largest difference": f"{check['by_quantity'].get(q, 0):.2e}", "rtol": t["rtol"],
             "atol": t["atol"], "why": t["why"]} for q, t in check.get("tolerances", {}).items()]


# The optimizer steps a lesson's live run takes unless the student picks others: the warm-up and four measured,
# whose mean is the step time judged beside the prediction. With the lessons' earlier 2 or 3 steps, the one or two
# measured steps ran 12-36 ms apart on a few shared cores, and a page read -60 % where the bench's 30 steps of the
# same run read within 20 %: the error was the steps' spread, not the prediction's. Each step adds some 20-170 ms.
LIVE_STEPS = 5
LIVE_STEP_CHOICES = [1, 2, 3, 5, 8]


def representative_step(summary) -> int:
    """The step after the first (the warm-up) whose time (slowest rank) is nearest the run's step time."""
    times = summary.step_times_s
    candidates = range(1, len(times)) if len(times) > 1 else range(1)
    return min(candidates, key=lambda i: (abs(times[i] - summary.step_time_s), i))


def measured_step_words(summary, step: int) -> tuple[str, str]:
    """(which step the measured chart draws, the run's mean beside its time where the two can differ), in
    words short enough for the chart's title lines. Of two steps after the warm-up both lie as far from their
    mean: "the one nearest the mean" had named one, 39 ms, under a headline of 60 ms and its error."""
    last = len(summary.step_times_s) - 1
    if last < 1:
        return "step 0, the run's only step (its warm-up)", ""
    if last == 1:
        return "step 1, the only one after the warm-up", ""
    mean = f" (mean {summary.step_time_s * 1e3:.1f} ms)"
    if last == 2:
        return f"step {step}, one of the two after the warm-up", mean
    return f"step {step}, nearest the mean of steps 1-{last}", mean


def prediction_error(run: LiveRun) -> float | None:
    p = run.prediction
    if not p or p.get("step_time_s") is None:
        return None
    return (p["step_time_s"] - run.summary.step_time_s) / run.summary.step_time_s


def spread_sentence(run: LiveRun) -> str | None:
    """'Its 7 steps after the warm-up took ... ms; the prediction ... lies ...' (planner.live.step_spread_words)
    as a sentence; None for a run of fewer than three steps."""
    words = step_spread_words(run.summary.step_times_s, (run.prediction or {}).get("step_time_s"))
    return f"{words[0].upper()}{words[1:]}." if words else None


def calibration_age(run: LiveRun) -> str | None:
    """'12 minutes' (or seconds, hours, days): how long before this run's prediction this machine was
    calibrated; None when the prediction does not say."""
    p = run.prediction or {}
    if p.get("calibrated_at_s") is None or p.get("predicted_at_s") is None:
        return None
    age = max(0.0, p["predicted_at_s"] - p["calibrated_at_s"])
    for unit, seconds in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if age >= seconds:
            n = int(age // seconds)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return "under a minute"


def speed_note(run: LiveRun) -> str | None:
    """What the prediction did about the machine's speed of the moment (engine/predict.at_speed_now), in
    words; None when it ran at the calibration's speed or did not check it (an older prediction)."""
    speed = (run.prediction or {}).get("speed_factor")
    return None if speed is None or speed == 1.0 else speed_words(speed)


def not_kept_warning(run: LiveRun) -> str | None:
    """The calibration's message when its cache folder could not be written (each new server process measures
    the machine again, about 25 s before its first prediction), for a warning above the comparison; else None."""
    messages = (run.prediction or {}).get("calibration") or []
    return next((m for m in messages if m.startswith(NOT_KEPT_WORDS)), None)


def busy_warning(run: LiveRun) -> str | None:
    """hardware.this_machine.busy_words for this run's speed check; None when it read the machine near its
    calibration's speed or did not check it (an older prediction)."""
    speed = (run.prediction or {}).get("speed_factor")
    return None if speed is None else busy_words(speed)


def prediction_notes(run: LiveRun) -> list[str]:
    """The prediction's own notes as the panel says them (planner.live: where it extrapolates the calibration)."""
    return [f"Note on the prediction: {note}." for note in (run.prediction or {}).get("notes", [])]


def differences(run: LiveRun, top: int = 3) -> list[str]:
    predicted = run.predicted_timeline
    if predicted is None:
        return []
    return [row["text"] for row in compare(predicted, run.timeline, top=top)]


def side_by_side(run: LiveRun) -> tuple[go.Figure | None, go.Figure, int]:
    """(predicted figure or None, measured figure of the representative step, that step), on one time
    axis, with the same rows and colours, each animated."""
    step = representative_step(run.summary)
    measured = step_timeline(run.timeline, step)
    predicted = run.predicted_timeline
    x_max = max(measured.duration_s, run.summary.step_times_s[step],
                run.prediction["step_time_s"] if predicted else 0.0) * 1e3
    # one set of rows for both: the engine's idle waits (a ring's "wait kv") had given the measured chart rows
    # the predicted one lacked, so its ranks sat lower
    rows = shared_rows(measured, predicted) if predicted else None
    kinds = shared_kinds(measured, predicted) if predicted else None
    which, mean = measured_step_words(run.summary, step)
    left_out = "" if len(run.summary.step_times_s) == 1 else "; step 0, the warm-up, is left out"
    # the step time on a line of its own: on one line the title ran past the plot's right edge in an 800-px window
    meas_fig = timeline_figure(measured, x_max_ms=x_max, rows=rows, kinds=kinds, title=f"Measured: {which},<br>"
                               f"{run.summary.step_times_s[step] * 1e3:.1f} ms on the slowest rank{mean}<br><sup>the "
                               f"ranks start each step together, after a barrier{left_out}</sup>")
    pred_fig = (timeline_figure(predicted, x_max_ms=x_max, rows=rows, kinds=kinds,
                                title=f"Predicted by the planner for this machine "
                                      f"({run.prediction['step_time_s'] * 1e3:.1f} ms)")
                if predicted else None)
    if pred_fig is not None:  # each chart marks where the other's step ends: a prediction 5x short had read as
        # a sliver at the left of an axis drawn for the run, with nothing to say what the rest was
        _mark_end(pred_fig, run.summary.step_times_s[step] * 1e3)
        _mark_end(meas_fig, run.prediction["step_time_s"] * 1e3)
    return pred_fig, meas_fig, step


def _mark_end(fig: go.Figure, end_ms: float) -> None:
    """A dashed line where the other chart's step ends, named in the legend (as a label over the plot it had
    lain on the measured chart's subtitle), in the same words on both: the two legends stay one width, so the
    time axes line up to the pixel."""
    line = {"color": NOTE_COLOR, "dash": "dash", "width": 1.5}
    fig.add_vline(x=end_ms, line=line)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line=line, name="other chart's end",
                             hoverinfo="skip"))
