"""Every live run beside its prediction: the calibration is measured when its file is missing or
corrupt (with a message, never a traceback), and a run's JSON carries the prediction."""

import json
import os
import subprocess
import sys

import pytest

from engine.cli import config_from_args, run_parser
from engine.predict import ensure_calibration, predicted, torch_version
from hardware import this_machine as tm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """Calibrate world 2 for real, starting from a corrupt file, in a cache folder of this module's own (the
    session's folder keeps its recorded calibration for every other test: tests/conftest.py)."""
    session_dir = os.environ["SHARDLAB_CACHE_DIR"]
    os.environ["SHARDLAB_CACHE_DIR"] = str(tmp_path_factory.mktemp("calibration"))
    try:
        path = tm.cache_path(tm.machine_key(torch_version()))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"format": 2, "key": ')  # half a file, as a crash mid-write would leave (save() cannot)
        steps = []
        cal, messages = ensure_calibration([2], progress=lambda fraction, text: steps.append((fraction, text)))
        yield cal, messages, steps
    finally:
        os.environ["SHARDLAB_CACHE_DIR"] = session_dir


@pytest.mark.multiprocess
def test_corrupt_calibration_is_measured_again_with_a_message(calibrated):
    cal, messages, steps = calibrated
    assert "unreadable" in messages[0] and "measuring again" in messages[0]
    assert cal.worlds == [2] and cal.cpus == tm.cpu_count()
    assert set(tm.COMPUTE_FITS) <= set(cal.compute)
    # ZB-H1's split backward, timed beside the fused one: the two halves do the fused pass's work between them
    zb = cal.compute["zb_split"]
    assert zb.fwd(1.0) > 0 and zb.bwd(1.0) > 0 and zb.fwd(1.0) + zb.bwd(1.0) > 0.9
    # and its forward, which records for the split: a hook on each parameter module, never faster by much
    assert cal.compute["zb_record"].fwd(1.0) > 0.8
    assert cal.comm[tm.comm_key(2, "all_reduce", 2, "sync")].alpha_s > 0
    # blocking operations timed after three gaps of compute, and what compute loses after communicating
    gaps = [cal.comm[tm.comm_key(2, "all_to_all", 2, mode)].gap_s for mode in ("sync_short", "sync", "sync_long")]
    assert 0 < gaps[0] < gaps[1] < gaps[2]
    assert set(cal.resume_s) == {2}
    # a receive posted after its send (a pipeline's RECV): gloo moves the message only then
    assert cal.comm[tm.comm_key(2, "send_recv", 2, tm.late_mode(1))].seconds(1024) > 0
    # and one sent to a receive already waiting, timed one way with the sender's clock in the message
    assert cal.comm[tm.comm_key(2, "send_recv", 2, tm.early_mode(1))].seconds(1024) > 0
    # and a late receive with its sender blocked in its wait
    assert cal.idle_late_fit(2, 2).seconds(1024) > 0
    # and how long posting a pipeline message holds its sender, timed in the engine's own 1F1B pipeline
    assert cal.send_post_fit(2).seconds(16384) > 0
    assert [f for f, _ in steps] == sorted(f for f, _ in steps) and steps[-1] == (1.0, "calibrated")
    again, messages = ensure_calibration([2])  # now from the cache
    assert messages == [] and again == cal


@pytest.mark.multiprocess
def test_run_json_carries_the_prediction(calibrated):
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--strategy", "dp", "--world", "2", "--steps", "2",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    pred = reply["predicted"]
    assert pred["step_time_s"] > 0 and reply["step_time_s"] > 0
    assert sum(pred["breakdown_s"].values()) == pytest.approx(pred["step_time_s"])
    assert pred["calibration"] == []  # this module's calibration was reused


@pytest.mark.multiprocess
def test_predict_flag_prints_the_prediction(calibrated):
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--strategy", "fsdp", "--world", "2", "--steps", "3",
                          "--predict"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "predicted step time (planner, this machine's calibration):" in out.stdout
    # where the prediction falls among the measured steps (planner.live.step_spread_words)
    assert "measured: its 2 steps after the warm-up took " in out.stdout and "the prediction, " in out.stdout


@pytest.mark.multiprocess
def test_mamba_and_hybrid_runs_are_predicted(calibrated):
    # from this module's calibration, which times the Mamba-2 mixer: no measuring again, no refusal
    for flags in (["--arch", "mamba2", "--strategy", "tp"], ["--arch", "hybrid", "--strategy", "cp"]):
        pred = predicted(config_from_args(run_parser("x").parse_args([*flags, "--world", "2"])))
        assert pred["step_time_s"] > 0 and pred["calibration"] == [], pred.get("why")


def test_no_prediction_for_cuda_says_why():
    cfg = config_from_args(run_parser("x").parse_args(["--device", "cuda"]))
    pred = predicted(cfg)
    assert pred["step_time_s"] is None and "CUDA" in pred["why"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", ["--mesh pp=2,dp=2 --schedule zb-h1 --micro-batches 4 --world 4",
                                   "--strategy tp --sequence-parallel --world 2", "--strategy fsdp --world 2"])
def test_the_predicted_communication_is_the_engines_op_for_op(flags, recorded_calibration):
    # the side-by-side view pairs the two timelines' spans: each rank's collectives in the prediction carry
    # the engine's names and the bytes it records sending (the recorded calibration: no timing is compared)
    import collections

    from engine.run import run
    from planner.live import predict

    cfg = config_from_args(run_parser("x").parse_args(flags.split() + ["--steps", "2"]))
    pred = predict(cfg, recorded_calibration)
    _, timeline = run(cfg)
    last = max(s.step for s in timeline.spans)
    for rank in range(cfg.world):
        measured = collections.Counter((s.name, s.bytes) for s in timeline.for_rank(rank)
                                       if s.lane == "comm" and s.step == last)
        assert collections.Counter((s.name, s.bytes) for s in pred.timeline.for_rank(rank)
                                   if s.lane == "comm") == measured, rank


@pytest.mark.multiprocess
def test_the_speed_check_times_the_reference_on_the_runs_own_pool():
    # every prediction times the calibration's reference Block again first (engine/predict.at_speed_now),
    # on the pool the run will use: a server keeps two pools warm, and a one-rank pool for the check would
    # push out a run's pool each time
    from engine import launch

    launch.shutdown_all()
    pred = predicted(config_from_args(run_parser("x").parse_args(["--strategy", "dp", "--world", "2"])))
    assert pred["step_time_s"] > 0 and pred["speed_factor"] > 0
    assert set(launch._registry) == {("cpu", 2)}


def test_a_pipeline_message_is_its_median_plus_the_modes_mean_stall():
    # engine/calibrate._typical_messages: a scheduler tick's stall in one 1 KB late receive is the mode's,
    # spread over all its samples (both sizes), and another mode's messages keep their own
    from engine.calibrate import _typical_messages

    samples = {("late1", 1024): [(1e-4, 5e-5), (1e-4, 5e-5), (4.1e-3, 1e-4)],
               ("late1", 131072): [(2e-4, 1e-4)] * 3,
               ("early1", 1024): [(1e-4, 0.0)] * 3}
    out = _typical_messages(samples)
    stall = 4e-3 / 6
    assert out[("late1", 1024)] == [pytest.approx(1e-4 + stall), 5e-5, 1]
    assert out[("late1", 131072)][0] == pytest.approx(2e-4 + stall)
    assert out[("early1", 1024)][0] == pytest.approx(1e-4)


@pytest.mark.multiprocess
def test_stop_ends_a_first_time_calibration_and_keeps_nothing(tmp_path, monkeypatch):
    """A live panel's Stop during the run's first calibration had waited its half minute out."""
    import threading

    from engine.launch import RunStopped
    from engine.run import run

    monkeypatch.setenv("SHARDLAB_CACHE_DIR", str(tmp_path))
    stop = threading.Event()
    heard = []

    def progress(fraction, message):  # Stop pressed as the calibration says what it starts with
        heard.append(message)
        stop.set()

    cfg = config_from_args(run_parser("x").parse_args(["--strategy", "dp", "--world", "2", "--steps", "2"]))
    with pytest.raises(RunStopped):
        run(cfg, predict=True, progress=progress, stop=stop)
    assert heard == ["timing the engine's modules on one rank"]  # no later measurement started
    assert not tm.cache_path(tm.machine_key(torch_version())).exists()
