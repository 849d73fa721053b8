"""The one live panel every lesson uses: run on this machine with progress, the verdict against the
single-process reference with its tolerances, the measured step beside the planner's prediction of it,
the trace download and the command line that reproduces the run. Figures and words are built in
`ui/live.py`; this module only places them.

    if st.button("Run on this machine"):
        run_live("live_dp", [("ZeRO-3", cfg)], hint="try fewer processes")
    for run in show_live("live_dp"):
        ...  # the page's own views of run.summary / run.timeline
"""

from __future__ import annotations

import json

import streamlit as st

from ui.engine_errors import engine_error_message
from ui.live import LiveRun, differences, prediction_error, side_by_side, tolerance_rows, verdict
from ui.timeline import lane_summary


def show_engine_failure(exc: BaseException, hint: str, what: str = "run") -> None:
    """One sentence, and the workers' words folded away."""
    message, details = engine_error_message(exc, what=what, hint=hint)
    st.error(message, icon=":material/error:")
    if details:
        with st.expander("What the workers said"):
            st.code(details, language=None)


def run_live(key: str, runs: list[tuple[str, object]], hint: str) -> list[LiveRun] | None:
    """Run each (label, RunConfig) on this machine, checked against the reference and predicted by the
    planner (the first run of a session calibrates this machine: 7-25 s, shown as progress).
    The results are kept in st.session_state[key]; a failure is shown and clears them."""
    from engine.config import ConfigError
    from engine.run import run

    bar = st.progress(0.0, text="Starting ...")
    done: list[LiveRun] = []
    try:
        for i, (label, cfg) in enumerate(runs):
            share = 1 / len(runs)

            def progress(fraction: float, message: str, i=i, share=share) -> None:
                bar.progress(min(1.0, (i + 0.5 * fraction) * share),
                             text=f"Calibrating this machine for the prediction (once): {message} ...")

            bar.progress(i * share, text=f"Running {label} on {cfg.world} process(es) "
                                         "(the first run starts them) ...")
            summary, timeline = run(cfg, check=True, predict=True, progress=progress)
            done.append(LiveRun(label, cfg, summary, timeline))
        st.session_state[key] = done
        return done
    except ConfigError as e:
        st.session_state.pop(key, None)
        st.error(f"This run cannot start: {e}.", icon=":material/block:")
    except Exception as e:  # noqa: BLE001 - any engine failure is reported, never a traceback
        st.session_state.pop(key, None)
        show_engine_failure(e, hint=hint)
    finally:
        bar.empty()
    return None


def show_live(key: str) -> list[LiveRun]:
    """Everything the panel shows of the runs kept under `key` (none yet: nothing); returns them so the
    page can add its own views."""
    runs: list[LiveRun] = st.session_state.get(key) or []
    if not runs:
        return []
    for run in runs:
        ok, text = verdict(run)
        (st.success if ok else st.error)(text)
    with st.expander("Tolerances and why"):
        for run in runs:
            if len(runs) > 1:
                st.markdown(f"**{run.label}**")
            st.dataframe(tolerance_rows(run.summary["check"]), hide_index=True, width="stretch")
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
    m1, m2, m3 = st.columns(3)
    m1.metric("Measured step time", f"{s['step_time_s'] * 1e3:,.1f} ms", help="mean over the steps after the first (warm-up), slowest rank")
    if error is None:
        m2.metric("Predicted step time", "n/a")
        st.caption(f"No prediction: {pred.get('why', 'the run carries none')}.")
    else:
        m2.metric("Predicted step time", f"{pred['step_time_s'] * 1e3:,.1f} ms",
                  help="planner/live.py on this machine's calibration, before the run")
        m3.metric("Prediction error", f"{error:+.0%}", help="(predicted - measured) / measured")
        if s["steps"] == 1:
            st.caption("A run of one step measures its warm-up too (first calls allocate memory and fill "
                       "caches); the prediction is of a warm step. Run 2 or more steps to compare them.")
    pred_fig, meas_fig, step = side_by_side(run)
    if pred_fig is not None:
        st.plotly_chart(pred_fig, key=f"{slug}_predicted")
        st.plotly_chart(meas_fig, key=f"{slug}_measured")
        diffs = differences(run)
        st.markdown("**Where they differ most** (per rank per step):\n" + "\n".join(f"- {d}" for d in diffs)
                    if diffs else "Every kind of work took within 10 % of its predicted time.")
        st.caption("The two timelines share one time axis and one set of colours; press Play under each to "
                   "watch its step. The prediction is made from this machine's calibration alone (each "
                   "module, gloo operation and core-sharing measured once, cached), never from this run, "
                   "and assumes nothing else keeps the cores busy (this server and your browser may). "
                   "Processes sharing a few cores stall now and then, which a single step shows and a "
                   "prediction of the typical step does not.")
    else:
        st.plotly_chart(meas_fig, key=f"{slug}_measured")
    st.dataframe(lane_summary(run.timeline), hide_index=True, width="stretch")
    st.markdown("Run it again from a terminal:")
    st.code(command_line(run.cfg), language="bash")
    st.download_button("Download the trace (open it in ui.perfetto.dev or chrome://tracing)",
                       json.dumps(run.timeline.to_chrome_trace()), key=f"{slug}_trace",
                       file_name=f"shardlab-{run.label.lower().replace(' ', '-').replace('+', '')}-trace.json",
                       mime="application/json")
