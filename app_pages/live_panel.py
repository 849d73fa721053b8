"""The one live panel every lesson uses: run on this machine through the server's queue (its place in
line, then progress and a Stop button), the verdict against the
single-process reference with its tolerances, the measured step beside the planner's prediction of it,
the trace download and the command line that reproduces the run. Figures and words are built in
`ui/live.py`; this module only places them.

    if st.button("Run on this machine"):
        run_live("live_dp", [("ZeRO-3", cfg)], hint="try fewer processes")
    for run in show_live("live_dp"):
        ...  # the page's own views of run.summary / run.timeline
"""

from __future__ import annotations

import time

import streamlit as st

from app_pages.engine_errors import engine_error_message
from app_pages.metric_row import metric, metric_row
from app_pages.text_table import text_table
from core.timeline import strict_json
from ui.live import (
    LiveRun,
    busy_warning,
    calibration_age,
    differences,
    not_kept_warning,
    prediction_error,
    prediction_notes,
    side_by_side,
    speed_note,
    spread_sentence,
    tolerance_rows,
    verdict,
)
from ui.tables import NO_VALUE, count, shell_lines
from ui.timeline import lane_summary


def show_engine_failure(exc: BaseException, hint: str, what: str = "run") -> None:
    """One sentence, and the workers' words folded away."""
    from engine.launch import RunStopped

    message, details = engine_error_message(exc, what=what, hint=hint)
    if isinstance(exc, RunStopped):  # asked for: a notice, as a stop before the start is, not an error
        st.warning(message, icon=":material/stop_circle:")
    else:
        st.error(message, icon=":material/error:")
    if details:
        with st.expander("What the workers said"):
            st.code(details, language=None)


def _session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no-session"


def _alive(session_id: str):
    """() -> bool: is this browser session still connected? (its waiting run is skipped once it is not)"""
    def alive() -> bool:
        from streamlit import runtime

        return not runtime.exists() or runtime.get_instance().is_active_session(session_id)

    return alive


def _yield_check():
    """Streamlit's own check for a rerun or stop of this script (a widget moved, Stop pressed, the tab
    closed), so that waiting needs no message to the browser; a no-op where this Streamlit lacks it."""
    try:
        from streamlit.runtime.scriptrunner_utils.script_run_context import get_run_yield_check
    except ImportError:
        return lambda: None
    return get_run_yield_check() or (lambda: None)


def run_live(key: str, runs: list[tuple[str, object]], hint: str) -> list[LiveRun] | None:
    """Run each (label, RunConfig) through this server's run queue (server/queue.py), checked against the
    reference and predicted by the planner (the first run calibrates this machine: engine/predict.py). While it
    waits the bar says its place in line and the expected wait; while it runs, the steps done and the
    loss, beside a Stop button. Moving a widget meanwhile does not lose the run: `show_live(key)` picks it
    up again. The results are kept in st.session_state[key]; a failure is shown and clears them."""
    from engine.config import ConfigError, validate
    from server.queue import Refused

    pending = st.session_state.get(_pending_key(key))
    if pending is not None:  # one run of a panel at a time: the first is collected, never dropped
        st.warning("Your previous run is still going: it finishes first (or press Stop), then press Run again for "
                   "this one." if not pending[0].wait(0) else "Your previous run has just finished: it is shown "
                   "below. Press Run again for this one.", icon=":material/hourglass_top:")
        return _follow(key)
    runs = _within_step_cap(runs)
    try:
        for label, cfg in runs:
            try:
                validate(cfg)
            except ConfigError as e:
                raise Refused(f"{label}: {e}") from None
    except Refused as e:
        st.session_state.pop(key, None)
        st.error(f"This run cannot start: {e}.", icon=":material/block:")
        return None
    if not _submit(key, runs, hint, "run"):
        st.session_state.pop(key, None)
        return None
    return _follow(key)


def _server_settings():
    """This server's settings (server.settings.Settings), or None where they are malformed: said by the queue
    when a run is submitted, and in "About this server"."""
    from server.queue import get_queue
    from server.settings import SettingsError

    try:
        return get_queue().settings
    except SettingsError:
        return None


def server_max_world(most: int) -> int:
    """The processes one run may start on this server (SHARDLAB_MAX_WORLD), at most `most`: for a page that sizes
    its run itself."""
    settings = _server_settings()
    return most if settings is None else min(most, settings.max_world)


def _within_step_cap(runs: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The runs with at most this server's steps (SHARDLAB_MAX_STEPS), said when it shortens them: a page whose
    steps are fixed had been refused with advice it has no control for."""
    from dataclasses import replace

    settings = _server_settings()
    if settings is None:
        return runs
    cap = settings.max_steps
    if all(cfg.steps <= cap for _, cfg in runs):
        return runs
    st.info(f"This server runs at most {count(cap, 'optimizer step')} a run (SHARDLAB_MAX_STEPS): these run "
            f"{cap}.", icon=":material/info:")
    return [(label, replace(cfg, steps=min(cfg.steps, cap))) for label, cfg in runs]


def run_task(label: str, task, hint: str, what: str = "run"):
    """Other work on the worker processes (server.queue.Task: the calibration, a sweep), queued like a run.
    The page calls it on every run of its script: with the `task` its button just made (else None), which is
    queued unless one of `label` is still going; and whichever is pending is followed, so that moving a widget
    while it waits or runs does not lose it (the rerun picks it up again). Its result once it finishes, else
    None (nothing pending, or a failure, which has been shown). Shows "About this server" above it, as a live
    run's panel does (the Hardware and Collectives pages had not said what the queue and its limits were)."""
    about_server()
    key = f"task_{label}"
    pending = st.session_state.get(_pending_key(key))
    if task is not None and pending is not None and not pending[0].wait(0):
        st.warning(f"Your previous {what} is still going: it is shown when it finishes.",
                   icon=":material/hourglass_top:")
    elif task is not None and not _submit(key, [(label, task)], hint, what):
        return None
    if _pending_key(key) not in st.session_state:
        return None
    job = _follow(key)
    return job.results[0] if job is not None else None


def _pending_key(key: str) -> str:
    return f"{key}__pending"


def _asked_key(key: str) -> str:
    """Where a press that ended early keeps the labels of every run it asked for."""
    return f"{key}__asked"


def _submit(key: str, runs, hint: str, what: str) -> bool:
    from server.queue import Refused, get_queue
    from server.settings import SettingsError

    try:
        sid = _session_id()
        job = get_queue().submit(sid, runs, alive=_alive(sid))
    except (Refused, SettingsError) as e:
        st.error(f"This {what} cannot start: {e}.", icon=":material/block:")
        return False
    st.session_state[_pending_key(key)] = (job, hint, what)
    return True


def _follow(key: str):
    """Show the pending job of `key` until it ends: its place in line, then its progress and a Stop
    button. A finished run becomes LiveRuns in st.session_state[key] (returned); a task's job is
    returned as it is; None once a failure or a stop has been shown."""
    from server.queue import DONE, STOPPED, Task, get_queue

    job, hint, what = st.session_state[_pending_key(key)]
    is_task = isinstance(job.runs[0][1], Task)
    queue = get_queue()
    stop_key = f"{key}__stop"
    if st.session_state.get(stop_key):
        queue.stop(job)
    if not job.wait(0):
        notice_slot = st.empty()  # gone once the job ends, as the bar and the button are
        if job.notice:
            notice_slot.info(job.notice, icon=":material/schedule:")
        stop_slot = st.empty()
        stop_slot.button(f"Stop this {what}", key=stop_key, icon=":material/stop_circle:",
                         help=f"End the {what} now: its worker processes are stopped, the next run starts fresh ones")
        bar = st.progress(0.0, text="Starting ...")
        check, shown = _yield_check(), None
        while not job.wait(0.25):
            check()  # a rerun (a widget, Stop) or a closed tab ends this loop; the job goes on
            now = (round(min(1.0, job.fraction), 2), queue.status(job))
            if now != shown:  # a class of waiting pages: send only what changed
                bar.progress(now[0], text=now[1])
                shown = now
        bar.empty()
        stop_slot.empty()
        notice_slot.empty()
    del st.session_state[_pending_key(key)]
    finished = [] if is_task else [LiveRun(label, cfg, summary, timeline, cached_from=job.cached_from)
                                   for (label, cfg), (summary, timeline) in zip(job.runs, job.results or [])]
    if job.state == DONE:
        if is_task:
            return job
        st.session_state[key] = finished
        st.session_state.pop(_asked_key(key), None)
        return finished
    # the runs of this press that finished before a failure or a stop are kept and shown (`show_live`), with
    # the labels of all it asked for; none: the page's older runs go, as they answer another press
    if finished:
        st.session_state[key] = finished
        st.session_state[_asked_key(key)] = [label for label, _ in job.runs]
    else:
        st.session_state.pop(key, None)
        st.session_state.pop(_asked_key(key), None)
    if job.state == STOPPED and job.error is None:
        st.warning("Stopped before it started.", icon=":material/stop_circle:")
    elif job.error is not None:
        show_engine_failure(job.error, hint=hint, what=what)
    else:
        st.warning(f"This {what} was {job.state} before it started.", icon=":material/block:")
    return None


def about_server() -> None:
    """The "About this server" expander: the queue's settings and what it is doing now."""
    from server.queue import get_queue
    from server.settings import SettingsError

    with st.expander("About this server"):
        try:
            queue = get_queue()
        except SettingsError as e:
            st.error(f"This server is misconfigured: {e}.")
            return
        now = queue.snapshot()
        st.caption(f"Live runs from every browser session share one queue: {now['running']} running, "
                   f"{now['waiting']} waiting; {now['done']:,} finished so far ({now['cached']:,} answered from "
                   "the cache of identical runs). The teacher sets these with environment variables "
                   "(docs/classroom.md).")
        text_table(queue.settings.rows())


def show_live(key: str) -> list[LiveRun]:
    """Everything the panel shows of the runs kept under `key` (none yet: nothing); returns them so the
    page can add its own views."""
    about_server()
    if _pending_key(key) in st.session_state:  # a run still going after a rerun: follow it again
        _follow(key)
    runs: list[LiveRun] = st.session_state.get(key) or []
    if not runs:
        return []
    asked = st.session_state.get(_asked_key(key)) or []
    if len(asked) > len(runs):
        missing = ", ".join(asked[len(runs):])
        st.info(f"{count(len(runs), 'run')} of the {len(asked)} this press asked for finished before it ended; "
                f"not finished: {missing}. They are shown below; press the button again for all of them.",
                icon=":material/info:")
    for run in runs:
        ok, text = verdict(run)
        (st.success if ok else st.error)(text)
    if runs[0].cached_from is not None:
        at = time.strftime("%H:%M:%S", time.localtime(runs[0].cached_from))
        st.caption(f"Answered from this server's cache: an identical run finished at {at}, so these are its "
                   "results and timings (the check was made then, against the same reference).")
    with st.expander("Tolerances and why"):
        for run in runs:
            if len(runs) > 1:
                st.markdown(f"**{run.label}**")
            st.dataframe(tolerance_rows(run.summary.check), hide_index=True, width="stretch")
    if len(runs) == 1:
        _show_run(key, runs[0])
    else:
        for tab, run in zip(st.tabs([r.label for r in runs]), runs, strict=True):
            with tab:
                _show_run(key, run)
    return runs


def _show_run(key: str, run: LiveRun) -> None:
    from engine.cli import command_line

    slug = f"{key}_{run.label}"
    s, pred = run.summary, run.prediction or {}
    error = prediction_error(run)
    with metric_row():
        metric("Measured step time", f"{s.step_time_s * 1e3:,.1f} ms",
               help="mean over the steps after the first (warm-up), slowest rank")
        if error is None:
            metric("Predicted step time", "n/a")
        else:
            metric("Predicted step time", f"{pred['step_time_s'] * 1e3:,.1f} ms",
                   help="planner/live.py on this machine's calibration, before the run")
            metric("Prediction error", f"{error:+.0%}", help="(predicted - measured) / measured")
    if not_kept := not_kept_warning(run):
        st.warning(not_kept[0].upper() + not_kept[1:] + ".")
    if error is None:
        st.caption(f"No prediction: {pred.get('why', 'the run carries none')}.")
    else:
        if warning := busy_warning(run):
            st.warning(warning[0].upper() + warning[1:])
        for note in prediction_notes(run):
            st.caption(note)
        if s.steps == 1:
            st.caption("A run of one step measures its warm-up too (first calls allocate memory and fill "
                       "caches); the prediction is of a warm step. Run 2 or more steps to compare them.")
        elif (spread := spread_sentence(run)) is not None:
            st.caption(f"{spread} The measured step time is their mean: on a few shared cores one run's "
                       "steps spread widely, and so does one prediction error.")
    pred_fig, meas_fig, step = side_by_side(run)
    if pred_fig is not None:
        st.plotly_chart(pred_fig, key=f"{slug}_predicted")
        st.plotly_chart(meas_fig, key=f"{slug}_measured")
        diffs = differences(run)
        # compare() averages the steps after the warm-up: said so, under a chart of one of them
        steps = max(1, len(run.summary.step_times_s) - 1)
        over = ("the run's step" if len(run.summary.step_times_s) == 1 else "the step after the warm-up" if steps == 1
                else f"the {steps} steps after the warm-up")
        st.markdown(f"**Where they differ most** (per rank per step, averaged over {over}, not only the step "
                    "drawn):\n" + "\n".join(f"- {d}" for d in diffs)
                    if diffs else f"Every kind of work took within 10 % of its predicted time, averaged over {over}.")
        age = calibration_age(run)
        st.caption("The two timelines share one time axis and one set of colours, and each marks where the "
                   "other's step ends (dashed); press Play under each to watch its step. The prediction is made "
                   "from this machine's calibration alone (each module, gloo operation and core-sharing measured "
                   "once, cached), never from this run, and assumes nothing else keeps the cores busy (this "
                   "server and your browser may). "
                   "Processes sharing a few cores stall now and then, which a single step shows and a "
                   "prediction of the typical step does not."
                   + (f" The calibration was {age} old when it predicted this run; a shared machine's speed "
                      "drifts (other programs, other users), so if every kind of work took longer or shorter "
                      "than predicted, measure it again on the Hardware lesson." if age else "")
                   + (f" Checked before the run: {note}." if (note := speed_note(run)) else ""))
    else:
        st.plotly_chart(meas_fig, key=f"{slug}_measured")
    steps = run.cfg.steps
    # the steps the step time is the mean of: with the warm-up in, a pipeline's first stage had read 644 ms of
    # compute against its second stage's 83 (step 0's first calls), where the timeline showed them alike
    warm_up = "the warm-up, where the first calls run and the optimizer's state is allocated"
    over = (f"its one step ({warm_up})" if steps == 1 else
            f"step 1, the one the step time is measured on (step 0, {warm_up}, left out)" if steps == 2 else
            f"steps 1-{steps - 1}, the ones the step time is the mean of (step 0, {warm_up}, left out)")
    st.markdown(f"Each rank over {over}, and the bytes it sent.")
    # 1,824,000 bytes; times to the hundredth of a ms in every row ("45.31" had stood over "34.905")
    text_table([{"rank": row["rank"], "compute ms": f"{row['compute ms']:.2f}", "comm ms": f"{row['comm ms']:.2f}",
                 "comm under compute": NO_VALUE if row["comm under compute %"] is None
                 else f"{row['comm under compute %']:.0f} %", "comm bytes": f"{row['comm bytes']:,}"}
                for row in lane_summary(run.timeline.after_warm_up())])
    st.markdown("Run it again from a terminal:")
    st.code(shell_lines(command_line(run.cfg)), language="bash", wrap_lines=True)
    st.download_button("Download the trace (open it in ui.perfetto.dev or chrome://tracing)",
                       strict_json(run.timeline.to_chrome_trace()), key=f"{slug}_trace",
                       file_name=f"shardlab-{run.label.lower().replace(' ', '-').replace('+', '')}-trace.json",
                       mime="application/json")
