"""The run queue with a stand-in runner: order, fairness, caps, the cache, the wait estimate, faults."""

import re
import threading
from dataclasses import replace

import pytest

from engine.config import ModelConfig, RunConfig
from server.queue import CANCELLED, DONE, FAILED, REPLACED, WAITING, Refused, RunQueue, Task
from server.settings import Settings, SettingsError


class Gate:
    """A runner that blocks each run until the test lets it go, and records what ran."""

    def __init__(self):
        self.ran: list = []
        self.release = threading.Semaphore(0)
        self.started = threading.Semaphore(0)

    def __call__(self, cfg, on_step, progress, stop):
        self.ran.append(cfg.seed)
        self.started.release()
        assert self.release.acquire(timeout=10), "the test never released the run"
        if cfg.seed == 666:
            raise RuntimeError("rank 1 failed: injected")
        for s in range(cfg.steps):
            on_step(s + 1, 1.0)
        return {"seed": cfg.seed}, None


def cfg(seed=0, **kw):
    return RunConfig(seed=seed, **kw)


def queue(runner, **kw):
    return RunQueue(Settings(**{"max_concurrent": 1, **kw}), runner=runner)


def test_runs_in_order_one_at_a_time_and_reports_place_and_wait():
    gate = Gate()
    q = queue(gate)
    a = q.submit("s1", [("a", cfg(1))])
    assert gate.started.acquire(timeout=5)
    b, c = q.submit("s2", [("b", cfg(2))]), q.submit("s3", [("c", cfg(3))])
    assert q.position(b) == (1, 2) and q.position(c) == (2, 2)
    assert "you are next" in q.status(b) and "position 2 of 2" in q.status(c)
    assert q.estimated_wait_s(c) > q.estimated_wait_s(b) > 0
    for _ in range(3):
        gate.release.release()
    for job in (a, b, c):
        assert job.wait(10) and job.state == DONE and job.fraction == 1.0
    assert gate.ran == [1, 2, 3]
    assert a.results == [({"seed": 1}, None)]


def test_a_second_press_replaces_the_waiting_run_and_keeps_its_place():
    gate = Gate()
    q = queue(gate)
    q.submit("busy", [("x", cfg(9))])
    assert gate.started.acquire(timeout=5)
    first = q.submit("me", [("a", cfg(1))])
    other = q.submit("you", [("b", cfg(2))])
    second = q.submit("me", [("a", cfg(5))])
    assert first.wait(0) and first.state == REPLACED
    assert "replaced" in second.notice and q.position(second) == (1, 2) and q.position(other) == (2, 2)
    for _ in range(3):
        gate.release.release()
    assert other.wait(10) and second.state == DONE
    assert gate.ran == [9, 5, 2]


def test_a_press_while_the_sessions_run_executes_waits_behind_it():
    gate = Gate()
    q = queue(gate)
    running = q.submit("me", [("a", cfg(1))])
    assert gate.started.acquire(timeout=5)
    queued = q.submit("me", [("a", cfg(2))])
    assert queued.state == WAITING and "still running" in queued.notice
    gate.release.release()
    gate.release.release()
    assert queued.wait(10) and running.state == queued.state == DONE


def test_identical_runs_are_answered_from_the_cache_and_marked():
    gate = Gate()
    q = queue(gate)
    first = q.submit("s1", [("a", cfg(1))])
    assert gate.started.acquire(timeout=5)
    twin = q.submit("s2", [("a", cfg(1))])  # identical to the running one: waits for it, then the cache
    gate.release.release()
    assert first.wait(10) and twin.wait(10)
    assert not first.cached and twin.cached and twin.results is first.results and twin.cached_from
    later = q.submit("s3", [("a", cfg(1))])
    assert later.wait(0) and later.cached
    assert gate.ran == [1] and q.snapshot()["cached"] == 2


def test_the_cache_can_be_turned_off():
    gate = Gate()
    q = queue(gate, result_cache=0)
    a = q.submit("s1", [("a", cfg(1))])
    gate.release.release()
    assert a.wait(10)
    b = q.submit("s2", [("a", cfg(1))])
    gate.release.release()
    assert b.wait(10) and not b.cached and gate.ran == [1, 1]


@pytest.mark.parametrize("change, says", [
    (dict(world=9), "9 processes is more than this server allows (8)"),
    (dict(steps=21), "21 steps is more than this server allows (20)"),
    (dict(model=ModelConfig(layers=4, hidden=512, heads=8, kv_heads=8, ffn=2048, vocab=32000)),
     "parameters, more than this server allows"),
])
def test_caps_refuse_before_anything_runs(change, says):
    gate = Gate()
    q = queue(gate)
    with pytest.raises(Refused, match=re.escape(says)):
        q.submit("s", [("big", replace(cfg(), **change))])
    assert gate.ran == [] and q.snapshot()["waiting"] == 0


def test_a_run_this_machine_cannot_hold_is_refused_before_it_queues(monkeypatch):
    """A teacher may raise max_params past what the server's memory holds: such a run is refused with the
    engine's own message (engine.config.check_fits_machine) instead of failing in its ranks."""
    from engine import config

    monkeypatch.setattr(config, "machine_memory_bytes", lambda: 2**20)  # a 1 MiB machine
    gate = Gate()
    q = queue(gate)
    with pytest.raises(Refused, match=re.escape("this machine has 0.0 GiB")):
        q.submit("s", [("small", cfg())])
    assert gate.ran == [] and q.snapshot()["waiting"] == 0


@pytest.mark.parametrize("limit", [5, 300])
def test_the_wall_clock_cap_is_each_runs_timeout(limit):
    """Above RunConfig's own 60 s too: the server's 120 s default had been capped at 60."""
    gate = Gate()
    q = queue(gate, max_run_s=limit)
    job = q.submit("s", [("a", cfg(1, timeout_s=60))])
    gate.release.release()
    assert job.wait(10) and job.runs[0][1].timeout_s == limit


def test_a_closed_tabs_waiting_run_leaves_the_line(monkeypatch):
    """It had kept its place, its share of max_queue and its part of everyone's expected wait until its turn."""
    from server import queue as queue_module

    monkeypatch.setattr(queue_module, "CLOSED_TAB_S", 0.0)  # gone for good at once
    gate = Gate()
    q = queue(gate, max_queue=3)
    q.submit("s0", [("a", cfg(0))])
    assert gate.started.acquire(timeout=5)
    gone = [q.submit(f"gone{i}", [("a", cfg(10 + i))], alive=lambda: False) for i in range(3)]
    live = q.submit("live", [("a", cfg(20))])  # the queue is not full: the closed tabs' runs hold no place
    assert q.position(live) == (1, 1) and all(j.state == CANCELLED for j in gone)
    gate.release.release()
    gate.release.release()
    assert live.wait(10) and live.state == DONE and gate.ran == [0, 20]


def test_with_the_cache_off_identical_runs_each_count_in_the_wait():
    gate = Gate()
    q = queue(gate, result_cache=0)
    first = q.submit("s0", [("a", cfg(1))])
    assert gate.started.acquire(timeout=5)
    q._durations[first.key] = 5.0
    jobs = [q.submit(f"s{i}", [("a", cfg(1))]) for i in range(1, 5)]
    # each identical run runs again (no cache answers it): the last waits for the running one and three more
    assert q.estimated_wait_s(jobs[-1]) >= 15.0
    for _ in range(5):
        gate.release.release()
    assert all(j.wait(10) for j in jobs)


def test_one_session_runs_one_job_at_a_time_even_with_a_free_slot():
    """Its second press had started at once beside the first (on the second slot), taking every slot, while its
    notice said it would start after it."""
    gate = Gate()
    q = queue(gate, max_concurrent=2)
    first = q.submit("me", [("a", cfg(1, world=2))])
    assert gate.started.acquire(timeout=5)
    second = q.submit("me", [("b", cfg(2, world=4))])
    other = q.submit("you", [("c", cfg(3, world=4))])
    assert gate.started.acquire(timeout=5)  # the other session's run takes the free slot
    assert gate.ran == [1, 3] and second.state == WAITING and "starts after it" in second.notice
    for _ in range(3):
        gate.release.release()
    assert first.wait(10) and second.wait(10) and other.wait(10) and gate.ran == [1, 3, 2]


def test_a_full_queue_refuses_with_a_message():
    gate = Gate()
    q = queue(gate, max_queue=2)
    q.submit("s0", [("a", cfg(0))])
    assert gate.started.acquire(timeout=5)
    q.submit("s1", [("a", cfg(1))])
    q.submit("s2", [("a", cfg(2))])
    with pytest.raises(Refused, match="queue is full"):
        q.submit("s3", [("a", cfg(3))])
    for _ in range(3):
        gate.release.release()


def test_a_failed_run_fails_its_job_only():
    gate = Gate()
    q = queue(gate)
    bad = q.submit("s1", [("a", cfg(666))])
    good = q.submit("s2", [("a", cfg(2))])
    gate.release.release()
    gate.release.release()
    assert bad.wait(10) and good.wait(10)
    assert bad.state == FAILED and "injected" in str(bad.error) and good.state == DONE
    assert q.snapshot()[FAILED] == 1


def test_a_press_that_fails_in_a_later_run_keeps_the_runs_before_it():
    # a press of two configurations stopped in its second run had lost its first run's results
    gate = Gate()
    q = queue(gate)
    job = q.submit("s1", [("a", cfg(1)), ("b", cfg(666))])
    gate.release.release()
    gate.release.release()
    assert job.wait(10) and job.state == FAILED and "injected" in str(job.error)
    assert job.results == [({"seed": 1}, None)]


def test_cancel_takes_a_waiting_job_out_and_shutdown_cancels_the_rest():
    gate = Gate()
    q = queue(gate)
    q.submit("s0", [("a", cfg(0))])
    assert gate.started.acquire(timeout=5)
    gone, left = q.submit("s1", [("a", cfg(1))]), q.submit("s2", [("a", cfg(2))])
    q.cancel(gone)
    assert gone.state == CANCELLED and q.position(left) == (1, 1)
    q.shutdown()
    assert left.wait(0) and left.state == CANCELLED and "stopped" in str(left.error)
    with pytest.raises(Refused, match="stopping"):
        q.submit("s3", [("a", cfg(3))])
    gate.release.release()


def test_concurrent_slots_run_side_by_side():
    gate = Gate()
    q = queue(gate, max_concurrent=2)
    # different worlds: different worker pools (one job at a time on a pool)
    a, b = q.submit("s1", [("a", cfg(1, world=2))]), q.submit("s2", [("b", cfg(2, world=4))])
    assert gate.started.acquire(timeout=5) and gate.started.acquire(timeout=5)
    assert q.snapshot()["running"] == 2
    gate.release.release()
    gate.release.release()
    assert a.wait(10) and b.wait(10)


def test_settings_from_the_environment():
    s = Settings.from_env({"SHARDLAB_MAX_CONCURRENT": "3", "SHARDLAB_MAX_RUN_S": "30.5", "SHARDLAB_RESULT_CACHE": "0"})
    assert (s.max_concurrent, s.max_run_s, s.result_cache, s.max_world) == (3, 30.5, 0, 8)
    assert Settings.from_env({}).max_concurrent == Settings.default_concurrency() >= 1
    assert Settings.default_concurrency(2) == 1 and Settings.default_concurrency(16) == 4
    with pytest.raises(SettingsError, match="SHARDLAB_MAX_WORLD='lots' must be a whole number, e.g. 8"):
        Settings.from_env({"SHARDLAB_MAX_WORLD": "lots"})
    with pytest.raises(SettingsError, match="SHARDLAB_MAX_CONCURRENT='0' must be at least 1"):
        Settings.from_env({"SHARDLAB_MAX_CONCURRENT": "0"})
    # a typo's size: 100,000 slots had started 22,000 threads before the machine refused more
    with pytest.raises(SettingsError, match="SHARDLAB_MAX_CONCURRENT='100000' must be at most 64"):
        Settings.from_env({"SHARDLAB_MAX_CONCURRENT": "100000"})
    with pytest.raises(SettingsError, match="SHARDLAB_MAX_RUN_S='inf' must be at most 86,400"):
        Settings.from_env({"SHARDLAB_MAX_RUN_S": "inf"})
    assert {r["environment variable"] for r in s.rows()} >= {"SHARDLAB_MAX_CONCURRENT", "SHARDLAB_MAX_RUN_S"}


def test_a_task_is_stopped_at_the_servers_time_limit_and_by_stop():
    """Tasks (the calibration, a sweep) had run past SHARDLAB_MAX_RUN_S, and Stop did nothing to them."""
    from server.queue import STOPPED, Task

    def work(progress, stop):
        assert stop.wait(30), "never stopped"
        raise RuntimeError("ended by its stop event")

    q = queue(Gate(), max_run_s=1)
    over = q.submit("s", [("sweep", Task("a", 2, work))])
    assert over.wait(30) and over.state == FAILED and isinstance(over.error, TimeoutError)
    assert "this server's limit of 1 s (SHARDLAB_MAX_RUN_S, for one press)" in str(over.error)
    q = queue(Gate(), max_run_s=600)
    asked = q.submit("s", [("sweep", Task("b", 2, work))])
    while asked.state == WAITING:
        asked.wait(0.05)
    q.stop(asked)
    assert asked.wait(30) and asked.state == STOPPED


def test_a_page_that_comes_back_within_the_grace_keeps_its_place():
    """A browser reconnecting after a network blip is not a closed tab: its run keeps its place in line."""
    gate = Gate()
    q = queue(gate)
    q.submit("s0", [("a", cfg(0))])
    assert gate.started.acquire(timeout=5)
    there = [False]
    blip = q.submit("blip", [("a", cfg(1))], alive=lambda: there[0])
    assert q.position(blip) == (1, 1) and blip.gone_since is not None  # gone a moment: still in line
    there[0] = True
    assert q.position(blip) == (1, 1) and blip.gone_since is None
    gate.release.release()
    gate.release.release()
    assert blip.wait(10) and blip.state == DONE


def test_jobs_on_one_worker_pool_take_turns_and_the_wait_says_so():
    """Two jobs of one world had taken a slot each and then waited on the pool's lock, the second's time limit
    spent waiting; and a session's second press had been told 'you are next, about 1 s' behind its own 100 s
    run."""
    gate = Gate()
    q = queue(gate, max_concurrent=2)
    first = q.submit("me", [("a", cfg(1, world=2))])
    assert gate.started.acquire(timeout=5)
    q._durations[first.key] = 100.0
    mine = q.submit("me", [("b", cfg(2, world=4))])  # another pool, but my session's run is going
    same_pool = q.submit("you", [("c", cfg(3, world=2))])
    assert q.estimated_wait_s(mine) > 90 and q.estimated_wait_s(same_pool) > 90
    assert not gate.started.acquire(timeout=0.5) and gate.ran == [1]  # a free slot, and neither may start
    for _ in range(3):
        gate.release.release()
    assert all(j.wait(10) for j in (first, mine, same_pool))


@pytest.mark.parametrize("raw, value", [("5,000,000", 5_000_000), ("5_000_000", 5_000_000), ("5e6", 5_000_000),
                                        (" 4000000 ", 4_000_000)])
def test_a_whole_number_is_read_as_people_write_it(raw, value):
    """The docs' own table writes the default 5,000,000: that, 5e6 and 10.0 had been "not a number"."""
    assert Settings.from_env({"SHARDLAB_MAX_PARAMS": raw}).max_params == value
    assert Settings.from_env({"SHARDLAB_MAX_STEPS": "10.0"}).max_steps == 10
    assert Settings.from_env({"SHARDLAB_MAX_RUN_S": "1,000.5"}).max_run_s == 1000.5


@pytest.mark.parametrize("env, says", [
    ({"SHARDLAB_MAX_STEPS": "10.5"}, "SHARDLAB_MAX_STEPS='10.5' must be a whole number, e.g. 20"),
    ({"SHARDLAB_MAX_PARAMS": "5,00,000"}, "SHARDLAB_MAX_PARAMS='5,00,000' must be a whole number, e.g. 5000000"),
    ({"SHARDLAB_MAX_RUN_S": "nan"}, "SHARDLAB_MAX_RUN_S='nan' must be a number of seconds, e.g. 120"),
    ({"SHARDLAB_MAX_WORLD": "-3"}, "SHARDLAB_MAX_WORLD='-3' must be at least 2"),
    # 1 had passed, then refused every lesson's run at its first press
    ({"SHARDLAB_MAX_WORLD": "1"}, "SHARDLAB_MAX_WORLD='1' must be at least 2: every live lesson runs 2 processes"),
    # past the engine's own 64 processes, and a queue no class fills: typos, as 100,000 slots had been
    ({"SHARDLAB_MAX_WORLD": "100000"}, "SHARDLAB_MAX_WORLD='100000' must be at most 64: the engine starts"),
    ({"SHARDLAB_MAX_QUEUE": "9" * 20}, f"SHARDLAB_MAX_QUEUE='{'9' * 20}' must be at most 10,000"),
    ({"SHARDLAB_MAX_STEPS": "1e30"}, "SHARDLAB_MAX_STEPS='1e30' must be at most 100,000"),
    ({"SHARDLAB_RESULT_CACHE": "9" * 23}, f"SHARDLAB_RESULT_CACHE='{'9' * 23}' must be at most 10,000: each answer"),
    ({"SHARDLAB_MAX_PARAMS": "1e12"}, "SHARDLAB_MAX_PARAMS='1e12' must be at most 10,000,000,000"),
])
def test_a_setting_it_cannot_use_says_what_to_set(env, says):
    with pytest.raises(SettingsError) as e:
        Settings.from_env(env)
    assert str(e.value).startswith(says)


def test_a_very_long_value_is_cut_in_the_message():
    """A 5,000-digit value had been echoed whole."""
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"SHARDLAB_MAX_STEPS": "9" * 5000})
    said = str(e.value)
    assert len(said) < 400 and "(5,000 characters)" in said and "must be at most 100,000" in said


def test_the_default_concurrency_counts_the_cores_this_process_may_use(monkeypatch):
    """os.cpu_count() is the host's cores; a container's CPU set is sched_getaffinity's (hardware.this_machine)."""
    import os

    from hardware import this_machine

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
    assert this_machine.cpu_count() == 8
    assert Settings.default_concurrency() == 2 and Settings.from_env({}).max_concurrent == 2


def test_the_settings_check_exits_with_the_message(monkeypatch, capsys):
    """What ./run.sh runs before it starts the server (`python -m server.settings`)."""
    from server import settings

    monkeypatch.setenv("SHARDLAB_MAX_STEPS", "abc")
    assert settings.main() == 2
    assert "SHARDLAB_MAX_STEPS='abc' must be a whole number, e.g. 20" in capsys.readouterr().err
    monkeypatch.setenv("SHARDLAB_MAX_STEPS", "40")
    assert settings.main() == 0


class Stoppable:
    """A runner that stands in for engine.run: each run records the timeout it was given, then waits for the
    job's stop event for `wait_s` (None: it returns at once), as the prediction and a calibration do (no
    timeout of the run's own covers them: engine/run.py), and raises what the engine raises when stopped."""

    def __init__(self, wait_s=None):
        self.timeouts: list[float] = []
        self.wait_s = wait_s

    def __call__(self, cfg, on_step, progress, stop):
        self.timeouts.append(cfg.timeout_s)
        if self.wait_s is None:
            return {"seed": cfg.seed}, None
        assert stop.wait(self.wait_s), "never stopped"
        raise RuntimeError("stopped (RunStopped)")


def test_one_press_of_several_runs_has_one_deadline():
    """A press of k configurations had held its slot k times SHARDLAB_MAX_RUN_S, plus each run's prediction: the
    limit is the job's, so the first run's prediction is stopped at it and the others never start."""
    runner = Stoppable(wait_s=30)
    q = queue(runner, max_run_s=1)
    job = q.submit("s", [("a", cfg(1)), ("b", cfg(2)), ("c", cfg(3))])
    assert job.wait(30) and job.state == FAILED and job.timed_out
    assert len(runner.timeouts) == 1  # the other two never started
    said = str(job.error)
    assert isinstance(job.error, TimeoutError)
    assert said.startswith("its 3 runs, together, ran past this server's limit of 1 s (SHARDLAB_MAX_RUN_S, for one "
                           "press)")


def test_each_run_gets_what_is_left_of_the_limit():
    runner = Stoppable()
    q = queue(runner, max_run_s=600)
    job = q.submit("s", [("a", cfg(1)), ("b", cfg(2))])
    assert job.wait(10) and job.state == DONE
    first, second = runner.timeouts
    assert first <= 600 and second < first
    assert all(c.timeout_s == 600 for _, c in job.runs)  # the job's own configurations (its key, the commands)


def test_the_machines_first_calibration_is_not_charged_to_the_limit():
    """A calibration is kept only once finished: a limit that stopped it would stop every press after it too, and
    the machine would never be calibrated. Its time is not counted; the run's after it is."""
    stopped = []

    def runner(c, on_step, progress, stop):
        progress(0.0, "measuring gloo and shared cores with 2 ranks")
        stopped.append(stop.wait(1.5))  # longer than the limit
        progress(1.0, "calibrated")
        return {"seed": c.seed}, None

    q = queue(runner, max_run_s=1)
    job = q.submit("s", [("a", cfg(1))])
    assert job.wait(30) and job.state == DONE and not job.timed_out and stopped == [False]
    # the same wait outside a calibration is charged, and stopped at the limit
    q = queue(Stoppable(wait_s=30), max_run_s=1)
    job = q.submit("s", [("a", cfg(1))])
    assert job.wait(30) and job.state == FAILED and job.timed_out


def test_a_calibration_that_fails_stops_being_uncharged():
    """engine.predict reports a failed calibration as ended (a success says "calibrated"): the time after it, up to
    the run's first step, had gone uncharged, and a press could run past its limit."""
    from engine.predict import _calibration_ended

    def runner(c, on_step, progress, stop):
        progress(0.0, "measuring gloo and shared cores with 2 ranks")
        _calibration_ended(progress)  # the measurement failed: predicted() gives a reason, the run goes on
        stop.wait(30)
        raise RuntimeError("stopped (RunStopped)")

    q = queue(runner, max_run_s=1)
    job = q.submit("s", [("a", cfg(1))])
    assert job.wait(30) and job.state == FAILED and job.timed_out


def test_the_hardware_pages_calibration_task_is_not_charged_either():
    # docs/classroom.md: the machine's first calibration is not counted, from a training run or from "Measure this
    # machine"; any other task's time is
    def calibrate(progress, stop):
        progress(0.0, "timing the engine's modules on one rank")
        heard = stop.wait(1.5)
        progress(1.0, "calibrated")
        return heard

    q = queue(Stoppable(), max_run_s=1)
    job = q.submit("s", [("cal", Task("calibration:2", 2, calibrate, calibrates=True))])
    assert job.wait(30) and job.state == DONE and job.results == [False]
    job = q.submit("s", [("sweep", Task("sweep:2", 2, calibrate))])
    assert job.wait(30) and job.timed_out


def test_a_runs_own_timeout_at_the_deadline_names_the_servers_limit():
    """engine.launch's "did not finish within 0.8 s" had said nothing of the server's limit that set it."""
    from app_pages.engine_errors import engine_error_message

    class OwnTimeout(Exception):  # as engine.launch.RunTimedOut: the run's timeout, before the stop is heard
        pass

    def runner(c, on_step, progress, stop):
        threading.Event().wait(c.timeout_s)  # deaf to the stop: a rank that does not hear it
        raise OwnTimeout(f"run timed out after {c.timeout_s:g} s")

    q = queue(runner, max_run_s=1)
    job = q.submit("s", [("a", cfg(1))])
    assert job.wait(30) and job.state == FAILED
    message, _ = engine_error_message(job.error, what="run", hint="try fewer processes")
    assert message == ("The run was stopped: it ran past this server's limit of 1 s (SHARDLAB_MAX_RUN_S, for one "
                       "press); try fewer processes.")


def test_a_waiting_run_taken_by_a_slot_meanwhile_never_reads_position_0():
    """status() had read the state without the lock: the slot took the job before position() took the lock,
    and a waiting student saw "position 0 of 0"."""
    gate = Gate()
    q = queue(gate)
    q.submit("busy", [("x", cfg(9))])
    assert gate.started.acquire(timeout=5)
    job = q.submit("me", [("a", cfg(1))])
    real = q.position

    def position_after_the_slot_moves(j):
        gate.release.release()  # the running job ends: the slot may take `job` now, unless status holds the lock
        gate.started.acquire(timeout=2)
        return real(j)

    q.position = position_after_the_slot_moves
    said = q.status(job)
    assert "position 0" not in said
    q.position = real
    gate.release.release()
    assert job.wait(10) and job.state == DONE
