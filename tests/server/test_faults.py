"""Faults through the server's queue, on real worker processes: a rank that raises, hangs or is killed
(kill -9) mid-run, and a pool that died between runs. Each is reported in plain words, its workers are
gone, and the next student's run still finishes with a verified result."""

import os
import signal
import time

import pytest

from app_pages.engine_errors import engine_error_message
from engine.config import RunConfig
from engine.launch import Pool, RunStopped
from engine.run import run
from server.queue import DONE, FAILED, STOPPED, RunQueue
from server.settings import Settings
from tests.engine.test_pool import _all_gone

pytestmark = pytest.mark.multiprocess
TASKS = "tests.engine.pool_tasks"
RAISE, HANG, KILL = 101, 102, 103  # seeds that ask the stand-in runner for a fault


@pytest.fixture
def served():
    """A queue whose runner runs on its own 2-rank pool; the seed of a run picks an injected fault."""
    pool = Pool(2, collective_timeout_s=10)
    seen_pids: list[int] = []

    def runner(cfg, on_step, progress, stop):
        if not pool.alive:
            pool.start()
        seen_pids.extend(pool.pids)
        if cfg.seed == RAISE:
            pool.run(f"{TASKS}:raise_on", {"rank": 1}, timeout_s=20)
        if cfg.seed == HANG:
            pool.run(f"{TASKS}:hang_on", {"rank": 1}, timeout_s=3)
        if cfg.seed == KILL:
            victim = pool.pids[1]

            def kill_after_first_step(steps_done, loss):
                if steps_done == 1:
                    os.kill(victim, signal.SIGKILL)
                on_step(steps_done, loss)

            return run(cfg, check=True, pool=pool, on_step=kill_after_first_step)
        return run(cfg, check=True, pool=pool, on_step=on_step, stop=stop)

    queue = RunQueue(Settings(max_concurrent=1), runner=runner)
    yield queue, pool, seen_pids
    queue.shutdown()
    pool.shutdown()


@pytest.mark.parametrize("seed, says", [
    (RAISE, "Rank 1 failed: ValueError: injected failure on rank 1"),
    (HANG, "did not finish within 3 s (ranks 0, 1 were still running)"),
    (KILL, "Rank 1 failed: worker was killed by SIGKILL (on Linux, usually the kernel's out-of-memory killer"),
])
def test_a_fault_fails_one_run_and_the_next_one_finishes(served, seed, says):
    queue, pool, seen_pids = served
    faulty = queue.submit("student-a", [("faulty", RunConfig(world=2, steps=20 if seed == KILL else 2, seed=seed))])
    other = queue.submit("student-b", [("dp", RunConfig(world=2, steps=2))])
    assert faulty.wait(60) and other.wait(60)
    assert faulty.state == FAILED
    message, _details = engine_error_message(faulty.error, what="run", hint="try again")
    assert says in message
    assert other.state == DONE and other.results[0][0].check["passed"]
    first_pool = seen_pids[:2]
    assert _all_gone(first_pool), "the failed run's workers are still alive"


def test_a_pool_that_died_between_runs_is_rebuilt(served):
    queue, pool, _ = served
    first = queue.submit("a", [("dp", RunConfig(world=2, steps=1))])
    assert first.wait(60) and first.state == DONE
    pids = pool.pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    # at once: a worker killed a moment ago may still look alive; the pool's ping finds it out
    again = queue.submit("b", [("dp", RunConfig(world=2, steps=2))])
    assert again.wait(60) and again.state == DONE and again.results[0][0].check["passed"]
    assert set(pool.pids).isdisjoint(pids)


def test_stop_mid_run_ends_it_and_leaves_no_process(served):
    queue, pool, seen_pids = served
    job = queue.submit("a", [("dp", RunConfig(world=2, steps=20, micro_batches=4))])
    deadline = time.monotonic() + 60
    while job.steps_done < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.steps_done >= 1, "the run never reported a step"
    queue.stop(job)
    assert job.wait(30) and job.state == STOPPED
    assert isinstance(job.error, RunStopped) and 1 <= job.error.steps_done < 20
    message, _ = engine_error_message(job.error, what="run", hint="")
    assert message.startswith("Stopped, as asked, after")
    assert _all_gone(seen_pids[:2]), "the stopped run's workers are still alive"
    after = queue.submit("b", [("dp", RunConfig(world=2, steps=2))])
    assert after.wait(60) and after.state == DONE
