"""Every live run beside its prediction: the calibration is measured when its file is missing or
corrupt (with a message, never a traceback), and a run's JSON carries the prediction."""

import json
import os
import subprocess
import sys
import time

import pytest

from engine.cli import config_from_args, run_parser
from engine.predict import ensure_calibration, predicted, torch_version
from hardware import this_machine as tm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def calibrated(measured_calibration):
    """The session's real calibration of world 2, measured from a corrupt file (tests/conftest.py), in its
    cache folder for this module's tests (the session's folder keeps its recorded calibration for the others)."""
    cal, messages, steps, folder = measured_calibration
    session_dir = os.environ["SHARDLAB_CACHE_DIR"]
    os.environ["SHARDLAB_CACHE_DIR"] = str(folder)
    try:
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
    assert cal.reference_s > 0  # the speed the fits are at: the reference Block timed between their groups
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
                                   "--strategy tp --sequence-parallel --world 2", "--strategy fsdp --world 2",
                                   "--strategy dp --world 2", "--mesh dp=2,fsdp=2 --world 4"])
def test_the_predicted_communication_is_the_engines_op_for_op(flags, recorded_calibration):
    # the side-by-side view pairs the two timelines' spans: each rank's collectives in the prediction carry
    # the engine's names and the bytes it records sending (the recorded calibration: no timing is compared),
    # and its compute the engine's names (the gradients' division, "finish grads", had been predicted but not
    # recorded: the page said "other compute took 0.0x its predicted time")
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
        if "tp" not in flags:  # tp's prediction splits a layer where its collectives fall ("fwd L0 attn", "... mlp")
            assert ({s.name for s in pred.timeline.for_rank(rank) if s.lane == "compute"}
                    == {s.name for s in timeline.for_rank(rank) if s.lane == "compute" and s.step == last}), rank


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


def test_a_calibration_that_cannot_be_saved_is_kept_by_the_process(tmp_path, monkeypatch, recorded_calibration):
    """A cache folder the server cannot write had cost every press a new measurement (~25 s) and said nothing:
    the process keeps what it measured, and each prediction says why (the live panel warns with it)."""
    import dataclasses

    import engine.predict as ep
    from ui.live import LiveRun, not_kept_warning

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("SHARDLAB_CACHE_DIR", str(blocked / "cache"))  # under a file: no one can make it
    monkeypatch.setattr(ep, "_KEPT", {})
    key = tm.machine_key(torch_version())
    # a calibration lacking world 4's groups of 2, so that one measurement (faked here) is due
    cal = dataclasses.replace(recorded_calibration, key=key, created_s=time.time(), cpus=tm.cpu_count(),
                              group_sizes={**recorded_calibration.group_sizes, 4: [4]})
    monkeypatch.setattr(tm, "load", lambda key: (cal, ""))
    monkeypatch.setattr(tm, "fit_comm", lambda world, rows: {})
    measured = []
    monkeypatch.setattr(ep, "_measurer", lambda *a: lambda world, task, args: measured.append(task) or [])
    kept, messages = ep.ensure_calibration([4])
    assert measured == ["comm_task"] and kept.group_sizes[4] == [2, 4]
    assert messages[-1].startswith(tm.NOT_KEPT_WORDS) and "SHARDLAB_CACHE_DIR" in messages[-1]
    # the next prediction of this process: nothing in the cache, nothing measured, the same calibration
    monkeypatch.setattr(tm, "load", lambda key: (None, "no calibration of this machine yet"))
    again, messages = ep.ensure_calibration([4])
    assert again is kept and measured == ["comm_task"] and len(messages) == 1
    summary = type("Summary", (), {"predicted": {"calibration": messages}})()
    assert not_kept_warning(LiveRun(label="x", cfg=None, summary=summary, timeline=None)) == messages[0]


# -- a calibration the planner cannot use, the group sizes a run needs -------------------------------------

def _cfg(*flags: str):
    return config_from_args(run_parser("x").parse_args(list(flags)))


@pytest.mark.parametrize("flags, sizes", [
    ("--strategy dp --world 2", [2]),
    ("--mesh dp=2,tp=4 --world 8", [2, 4]),  # tp's groups of 4 at world 8: neither 2 nor 8
    ("--mesh pp=2,dp=3 --world 6", [2, 3]),
    ("--mesh dp=2,cp=2,tp=2 --world 8", [2, 4]),  # the gradients' dp + cp groups of 4
    ("--mesh fsdp=2,dp=3 --world 6", [2, 3, 6]),  # HSDP: the shards, their replicas, and all data axes
])
def test_group_sizes_are_every_group_the_engine_makes(flags, sizes):
    from engine.predict import group_sizes

    assert group_sizes(_cfg(*flags.split())) == sizes


def test_the_prediction_asks_for_the_runs_group_sizes(monkeypatch):
    import engine.predict as ep

    asked = []

    def ensure(worlds, progress=None, **kw):
        asked.append((worlds, kw.get("group_sizes")))
        raise RuntimeError("stop here")

    monkeypatch.setattr(ep, "ensure_calibration", ensure)
    pred = predicted(_cfg("--mesh", "dp=2,tp=4", "--world", "8"))
    assert asked == [([8], [2, 4])] and pred["step_time_s"] is None and "stop here" in pred["why"]


def test_a_prediction_that_fails_is_a_reason_not_a_traceback(monkeypatch):
    # a calibration that passed every check of the file, and a planner that still fails on it: the run runs,
    # without a prediction, and says why (engine.run calls this before the run; `--json` must print its object)
    import engine.predict as ep
    import planner.live
    from tests.hardware.test_this_machine import _cal

    cal = _cal(created_s=1e9)
    monkeypatch.setattr(ep, "ensure_calibration", lambda *a, **kw: (cal, ["a message"]))
    monkeypatch.setattr(ep, "at_speed_now", lambda cal, *a, **kw: (cal, 1.0))

    def predict(cfg, cal):
        return {}[0]

    monkeypatch.setattr(planner.live, "predict", predict)
    pred = predicted(_cfg("--strategy", "dp", "--world", "2"))
    assert pred["step_time_s"] is None and pred["breakdown_s"] == {} and "KeyError" in pred["why"]
    assert pred["calibration"] == ["a message"]
    json.dumps(pred)


def test_anchors_stamp_each_group_with_the_reference_timed_around_it():
    from engine.calibrate import _Anchors

    out = [{"op": "before"}]
    anchors = _Anchors(out)
    out += [{"op": "linear"}, {"op": "linear"}]
    anchors.mark()
    first = anchors.last
    out.append({"op": "zb_split"})  # a ratio of its own timings: left unstamped
    anchors.skip()
    out.append({"op": "head"})
    anchors.mark()
    assert "anchor_s" not in out[0] and "anchor_s" not in out[3]
    assert out[1]["anchor_s"] == out[2]["anchor_s"] > 0
    assert out[4]["anchor_s"] == pytest.approx((first + anchors.last) / 2)


def _fake_measure(calls):
    """engine.calibrate's tasks as `measure(world, task, args)` answers them, without a process: each
    comm_task row every (kind, mode) of tm.comm_modes on the groups asked for."""
    def measure(world, task, args):
        calls.append((world, task, dict(args)))
        if task == "reference_task":
            return [[{"block_s": 1.5e-3}]]
        if task == "compute_task":
            return [[{"fwd_s": 1e-3, "bwd_s": 2e-3}] if rank < args.get("active", world) else []
                    for rank in range(world)]
        if task == "pipeline_posting":
            return [[2e-4] for _ in range(world)]
        if task == "resume_task":
            return [[{"after_comm_s": 4e-4, "after_compute_s": 3e-4}] for _ in range(world)]
        assert task == "comm_task"
        rows = [{"kind": kind, "n": n, "world": world, "bytes": b, "mode": mode, "seconds": 1e-3 + 1e-9 * b,
                 "cpu_s": 5e-4, "gap_s": 3e-4} for n in args["group_sizes"] for kind, mode in tm.comm_modes(world, n)
                for b in (1024, 131072)]
        return [rows]
    return measure


def test_a_cached_world_missing_a_group_size_is_measured_for_it_alone(tmp_path, monkeypatch):
    import engine.predict as ep
    from tests.hardware.test_this_machine import _cal, _fill

    monkeypatch.setenv("SHARDLAB_CACHE_DIR", str(tmp_path))
    key = tm.machine_key(torch_version())
    cal = _cal(key=key, created_s=time.time())
    cal.worlds, cal.group_sizes = [2, 6], {2: [2], 6: [2, 6]}
    _fill(cal)
    tm.save(cal)
    calls = []
    monkeypatch.setattr(ep, "_measurer", lambda *a, **kw: _fake_measure(calls))
    got, messages = ensure_calibration([6], group_sizes=[2, 3])  # a pp=2,dp=3 run: groups of 3
    assert calls == [(6, "comm_task", {"group_sizes": [3]})]  # nothing else measured again
    assert messages == ["measured gloo's collectives on groups of 3 with 6 ranks (the calibration had groups of "
                        "2, 6 only)"]
    assert got.measured_sizes(6) == [2, 3, 6] and got.compute == cal.compute and got.created_s == cal.created_s
    assert got.comm_fit(6, "all_gather", 3).alpha_s == pytest.approx(1e-3)
    assert all(got.comm[k] == f for k, f in cal.comm.items())  # what was there is kept
    loaded, why = tm.load(key)
    assert why == "" and loaded == got
    calls.clear()
    assert ensure_calibration([6], group_sizes=[3]) == (got, []) and calls == []  # now from the cache
    # a world measured for the first time: its default groups and the run's
    got, messages = ensure_calibration([8], group_sizes=[2, 4])
    assert [c for c in calls if c[1] == "comm_task"] == [(8, "comm_task", {"group_sizes": [2, 4, 8]})]
    assert got.measured_sizes(8) == [2, 4, 8] and tm.load(key) == (got, "")


@pytest.mark.multiprocess
def test_speed_check_times_every_core_and_takes_the_slowest(pools):
    from engine.predict import reference_block_s

    rows = pools(2).run("engine.calibrate:reference_task", {"reps": 3}, timeout_s=120)
    timed = [r for r in rows if r]
    # one rank per core at once: each on a core of its own, as in the run (more ranks than cores: the first
    # as many as there are cores, as core sharing is measured against)
    assert len(timed) == (2 if tm.cpu_count() >= 2 else 1) and all(r[0]["block_s"] > 0 for r in timed)
    # the slowest rank's time: it paces a step whose ranks wait for one another
    assert reference_block_s(lambda world, task, args: [[{"block_s": 2e-3}], [{"block_s": 3e-3}], []], 3) == 3e-3


def test_the_speed_check_gives_each_rank_its_pace(monkeypatch):
    import engine.predict as ep
    from tests.hardware.test_this_machine import _cal

    times = [[{"block_s": 2e-3}], [{"block_s": 3e-3}]]
    monkeypatch.setattr(ep, "_measurer", lambda *a, **kw: lambda world, task, args: times[:world])
    cal = _cal(reference_s=1.5e-3)
    now, factor = ep.at_speed_now(cal, 2)
    assert factor == pytest.approx(2.0) and now.rank_pace == pytest.approx((2 / 3, 1.0))  # the slowest's
    alone, factor = ep.at_speed_now(cal, 1)  # one rank timed: one speed
    assert factor == pytest.approx(2e-3 / 1.5e-3) and alone.rank_pace == ()
    # more ranks than cores: one rank per core timed, the ranks taking turns on every core: the cores' mean
    shared, factor = ep.at_speed_now(cal, 3)
    assert factor == pytest.approx(2.5e-3 / 1.5e-3) and shared.rank_pace == ()


def test_core_sharing_is_measured_against_one_rank_per_core(tmp_path, monkeypatch):
    import engine.predict as ep
    from tests.hardware.test_this_machine import _cal

    monkeypatch.setenv("SHARDLAB_CACHE_DIR", str(tmp_path))
    key = tm.machine_key(torch_version())
    tm.save(_cal(key=key, created_s=time.time()))  # 2 cores, world 2 measured
    calls = []
    monkeypatch.setattr(ep, "_measurer", lambda *a, **kw: _fake_measure(calls))
    cal, _ = ensure_calibration([4])
    sharing = [(world, args) for world, task, args in calls if task == "compute_task"]
    # 2 ranks of the 4-rank pool (one per core) right before and after all 4 at once
    assert sharing == [(4, {"reps": 15, "shapes": "sharing", "active": 2}), (4, {"reps": 15, "shapes": "sharing"}),
                       (4, {"reps": 15, "shapes": "sharing", "active": 2})]
    assert cal.compute_share[4] == 1.0  # the fake times every rank alike
    assert cal.share(2) == 1.0  # no more ranks than cores: nothing shared, whatever an older file held


@pytest.mark.multiprocess
def test_comm_task_times_exactly_comm_modes(pools):
    # the one list of what the measurement times (tm.comm_modes), against the measurement itself: a file
    # lacking any of it is measured again (tm.load), so the two must agree (few rounds, one size: no timing)
    rows = pools(2).run("engine.calibrate:comm_task", {"group_sizes": [2], "sizes": (1024,), "rounds": 2,
                                                       "async_rounds": 1}, timeout_s=120)
    assert set(tm.fit_comm(2, rows)) == {tm.comm_key(2, kind, 2, mode) for kind, mode in tm.comm_modes(2, 2)}


def test_back_to_back_timings_follow_an_operation_of_the_same_size():
    # a naive sync's all-reduces follow one another parameter by parameter; taking turns with 512 KB, a 1 KB
    # all-reduce had been timed right after the larger one, whose ranks finish apart
    from engine.calibrate import back_to_back

    order = []
    calls = {(kind, nbytes): (lambda kind=kind, nbytes=nbytes: order.append((kind, nbytes)))
             for kind in ("all_reduce", "all_gather") for nbytes in (1024, 131072, 524288)}
    barrier = type("Dist", (), {"barrier": staticmethod(lambda: None)})
    sums = back_to_back(calls, 20, barrier)
    assert set(sums) == set(calls) and all(s[2] == 20 for s in sums.values())
    # warm-ups included, the size changes twice over the whole measurement: every call but each size's first
    # comes right after one of its own size
    sizes = [nbytes for _, nbytes in order]
    assert sum(a != b for a, b in zip(sizes, sizes[1:], strict=False)) == 2


def test_the_posting_pipelines_are_valid_runs_at_any_world():
    # a calibration at any world the Lab allows times posting in each of POSTING_SCHEDULES: interleaved needs
    # its micro-batches a multiple of pp and a layer per chunk
    from engine.calibrate import posting_run
    from engine.config import validate
    from hardware.this_machine import POSTING_SCHEDULES

    for world in (2, 3, 4, 6, 8):
        for schedule in POSTING_SCHEDULES:
            cfg = posting_run(world, schedule)
            validate(cfg)
            assert cfg.parallel.degree("pp", world) == world and cfg.parallel.schedule == schedule
    assert [posting_run(w, "interleaved-1f1b").micro_batches for w in (2, 3, 4, 8)] == [4, 6, 4, 8]
