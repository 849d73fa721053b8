"""The planner's prediction of live runs (planner/live.py), on a calibration measured on a 2-core machine
(tests/planner/data): every strategy and mesh the engine runs gets a prediction in the engine's span
format, consistent with the calibration's own measurement of the engine; and the comparison with a
measured timeline names what differs most."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.timeline import Span, Timeline
from engine.cli import config_from_args, run_parser
from hardware.this_machine import Calibration
from planner.live import WAITING, compare, per_step_by_kind, predict

CAL = Calibration.from_dict(json.loads((Path(__file__).parent / "data" / "calibration-2core.json").read_text()))


def _cfg(flags: str):
    return config_from_args(run_parser("test").parse_args(flags.split()))


RUNS = [
    "--strategy dp --world 2", "--strategy dp --world 2 --dp-comm naive", "--strategy dp --world 2 --micro-batches 2",
    "--strategy dp --zero-stage 1 --world 2", "--strategy dp --zero-stage 2 --world 4",
    "--strategy fsdp --world 2", "--strategy fsdp --world 4 --no-prefetch",
    "--strategy tp --world 2", "--strategy tp --sequence-parallel --world 4",
    "--strategy tp --mesh dp=2,tp=2 --world 4",
    "--strategy pp --schedule 1f1b --micro-batches 4 --world 2", "--strategy pp --mesh pp=2,dp=2 --world 4",
    "--strategy pp --schedule interleaved-1f1b --virtual-stages 2 --micro-batches 4 --world 2",
    "--strategy pp --schedule zb-h1 --micro-batches 4 --world 2", "--strategy pp --mesh tp=2,pp=2 --world 4",
    "--strategy cp --world 2", "--strategy cp --cp-variant allgather --world 2",
    "--strategy cp --mesh dp=2,cp=2 --world 4",
    "--strategy ep --world 2", "--strategy ep --mesh dp=2,ep=2 --world 4",
]


@pytest.mark.parametrize("flags", RUNS)
def test_every_live_run_has_a_prediction(flags):
    cfg = _cfg(flags)
    pred = predict(cfg, CAL)
    assert pred.step_time_s > 0
    assert sum(pred.breakdown_s.values()) == pytest.approx(pred.step_time_s)
    assert pred.timeline.ranks == list(range(cfg.world)) and pred.timeline.source == "predicted"
    names = {s.name for s in pred.timeline.spans if s.lane == "compute"}
    assert "optimizer step" in names
    d = pred.as_dict()
    assert json.loads(json.dumps(d))["step_time_s"] == pytest.approx(pred.step_time_s)


def test_idle_spans_as_the_engine_draws_them():
    # the engine marks a pipeline's bubbles (core/timeline.py) and leaves other waits as gaps
    assert not any(s.lane == "idle" for s in predict(_cfg("--strategy fsdp --world 2"), CAL).timeline.spans)
    pp = predict(_cfg("--strategy pp --schedule 1f1b --micro-batches 4 --world 2"), CAL).timeline
    assert {s.name for s in pp.spans if s.lane == "idle"} == {"bubble"}


def test_one_rank_agrees_with_the_calibrations_own_engine_step():
    # the calibration times the engine's data-parallel step at world 1; the prediction, built from the
    # modules' fits and the driver's overhead per unit, should land near it (not fitted to it: the
    # modules are timed separately, at other shapes)
    pred = predict(_cfg("--world 1"), CAL)
    assert pred.step_time_s == pytest.approx(CAL.engine_units["step"], rel=0.15)


def test_dp_spans_are_named_as_the_engine_names_them():
    pred = predict(_cfg("--strategy dp --world 2"), CAL)
    compute = {s.name for s in pred.timeline.spans if s.lane == "compute"}
    assert {"fwd embed", "fwd L0", "fwd L1", "fwd head", "bwd head", "bwd L0", "optimizer step"} <= compute
    comm = [s for s in pred.timeline.spans if s.lane == "comm"]
    assert comm and all(s.group == "dp" and s.is_async and "all_reduce" in s.name for s in comm)


def test_the_costs_follow_the_strategy():
    # bucketed all-reduces hide under backward; the naive sync after backward does not
    bucketed = predict(_cfg("--strategy dp --world 2"), CAL)
    naive = predict(_cfg("--strategy dp --world 2 --dp-comm naive"), CAL)
    assert naive.step_time_s > bucketed.step_time_s
    # tensor parallel waits for its all-reduces: its breakdown has tp communication
    assert predict(_cfg("--strategy tp --world 2"), CAL).breakdown_s.get("tp_comm", 0) > 0


def _tl(spans, source="measured"):
    return Timeline(spans, source=source)


def test_per_step_counts_nested_spans_once_and_measures_waiting():
    spans = []
    for step in (0, 1, 2):
        t = 10.0 * step
        spans += [Span(0, "compute", "fwd L0", t, t + 4.0, step=step),
                  Span(0, "compute", "attn L0 ring 0", t + 1.0, t + 2.0, step=step),  # nested in fwd L0
                  Span(0, "comm", "all_reduce grads", t + 4.0, t + 5.0, group="dp", step=step),
                  Span(0, "comm", "all_gather L0", t + 4.0, t + 9.0, group="dp", is_async=True, step=step),
                  Span(0, "compute", "optimizer step", t + 6.0, t + 7.0, step=step)]
    kinds = per_step_by_kind(_tl(spans))  # step 0 (warm-up) left out
    assert kinds["forward compute"] == pytest.approx(3.0)
    assert kinds["other compute"] == pytest.approx(1.0)
    assert kinds["gloo all_reduce (dp)"] == pytest.approx(1.0)
    assert kinds["optimizer compute"] == pytest.approx(1.0)
    assert kinds[WAITING] == pytest.approx(9.0 - 6.0)  # the window is 9 s, blocking spans cover 6 s
    assert not any("all_gather" in k for k in kinds)  # asynchronous: runs beside the step


def test_compare_names_the_span_that_differs_most():
    pred = _tl([Span(0, "compute", "fwd L0", 0.0, 1e-3), Span(0, "comm", "all_reduce", 1e-3, 2e-3, group="dp")],
               source="predicted")
    meas = _tl([Span(0, "compute", "fwd L0", 0.0, 1.05e-3, step=s) for s in (0, 1)]
               + [Span(0, "comm", "all_reduce", 1.05e-3, 3.15e-3, group="dp", step=s) for s in (0, 1)])
    rows = compare(pred, meas)
    assert [r["what"] for r in rows] == ["gloo all_reduce (dp)"]  # forward differs by only 5 %
    assert rows[0]["ratio"] == pytest.approx(2.1)
    assert rows[0]["text"].startswith("gloo all_reduce (dp) took 2.1x its predicted time")


def test_the_planner_never_imports_the_engine_package():
    # the torch-free core (mesh, timeline, schedules) is below both; the planner reads a RunConfig by attribute
    code = ("import sys, planner.api, planner.live, planner.layout_search, planner.timeline, planner.simulate; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'engine'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def test_the_planner_side_never_imports_torch():
    code = ("import sys, planner.live, planner.eventsim, hardware.this_machine, engine.predict, engine.run; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"
