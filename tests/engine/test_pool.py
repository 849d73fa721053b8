"""The worker pool: reuse, a raising rank, a hanging rank, no orphans, usable afterwards."""

import os
import subprocess
import sys
import time

import pytest

from engine import launch
from engine.launch import Pool, RankFailed, RunTimedOut

pytestmark = pytest.mark.multiprocess
TASKS = "tests.engine.pool_tasks"


def _gone(pid: int) -> bool:
    """True when no process with this pid exists, or only a zombie we are not its parent of."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _all_gone(pids, within_s=5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_warm_pool_is_reused(pools):
    pool = pools(2)
    first = pool.run(f"{TASKS}:whoami")
    starts = pool.starts
    for _ in range(3):
        again = pool.run(f"{TASKS}:whoami")
        assert [r["pid"] for r in again] == [r["pid"] for r in first]
    assert pool.starts == starts  # no new processes for later runs
    assert pool.run(f"{TASKS}:all_reduce_ranks") == [1.0, 1.0]  # the process group is still up


def test_tasks_run_with_the_garbage_collector_paused(pools):
    """A full collection in the middle of a step took 58-80 ms here (engine.worker.collector_paused)."""
    pool = pools(2)
    for state in pool.run(f"{TASKS}:collector_state"):
        assert state["enabled"] is False
        assert state["frozen"] > 1000  # torch's objects, left out of the collections the steps make


def test_ranks_keep_the_memory_torch_frees(pools):
    """A freed tensor of a few MiB went back to the system and the next one was faulted in again, page by
    page: 300-1,140 faults and up to 2x the time of a 256 x 256 ring-attention block here, from one batch of
    calls to the next (glibc's thresholds move as it goes: a plain process read 0, 7,456 and 12,576 faults
    over ten blocks). engine.worker.keep_freed_memory sets them once: none."""
    for rank in pools(2).run(f"{TASKS}:page_faults_of_ring_blocks"):
        assert rank == {"kept": True, "faults": 0}


def test_the_collector_comes_back_after_a_paused_block_even_one_that_raises():
    import gc

    from engine.worker import collector_paused

    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(ValueError):
        with collector_paused():
            assert not gc.isenabled() and gc.get_freeze_count() > 0
            with collector_paused():  # re-entrant: the inner block leaves the outer one's pause alone
                pass
            assert not gc.isenabled()
            raise ValueError
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.fixture
def fault_pool():
    pool = Pool(2, collective_timeout_s=20)  # its own pool: the shared ones stay warm
    yield pool
    pool.shutdown()


@pytest.mark.parametrize("task, says", [("raise_on", "injected failure on rank 1"),
                                        ("exit_on", "worker exited with code 3")])
def test_failing_rank_is_reported_and_pool_recovers(fault_pool, task, says):
    fault_pool.start()
    pids = fault_pool.pids
    with pytest.raises(RankFailed) as err:
        fault_pool.run(f"{TASKS}:{task}", {"rank": 1}, timeout_s=30)
    assert err.value.rank == 1 and says in err.value.detail
    assert _all_gone(pids), "workers of the failed run are still alive"
    assert fault_pool.run(f"{TASKS}:all_reduce_ranks") == [1.0, 1.0]  # restarted, usable
    assert set(fault_pool.pids).isdisjoint(pids)


def test_hanging_rank_times_out_with_its_location(fault_pool):
    fault_pool.start()
    pids = fault_pool.pids
    with pytest.raises(RunTimedOut) as err:
        fault_pool.run(f"{TASKS}:hang_on", {"rank": 1}, timeout_s=2)
    where = err.value.where
    assert "pool_tasks.py" in where[1] and "hang_on" in where[1]  # the rank that hangs, and where
    assert "waiting in a collective" in where[0]  # the rank stuck waiting for it
    assert _all_gone(pids), "workers of the hung run are still alive"
    assert fault_pool.run(f"{TASKS}:all_reduce_ranks") == [1.0, 1.0]


def test_a_rank_that_hangs_past_the_collective_timeout_is_the_one_reported():
    # the collective timeout fires before the run's: rank 0's gloo timeout had been the only failure reported,
    # naming rank 0 and never rank 1 (a reviewer's case)
    pool = Pool(2, collective_timeout_s=2)
    try:
        pool.start()
        pids = pool.pids
        with pytest.raises(RankFailed) as err:
            pool.run(f"{TASKS}:hang_on", {"rank": 1}, timeout_s=60)
        assert err.value.rank == 1
        assert "did not reach a collective" in err.value.detail and "hang_on" in err.value.detail
        assert "rank 0, waiting for it" in err.value.detail
        assert _all_gone(pids), "workers of the hung run are still alive"
    finally:
        pool.shutdown()


def test_workers_exit_when_their_parent_dies(tmp_path):
    # A server killed with SIGKILL runs no cleanup; its workers must notice and exit on their own.
    script = ("import sys; from engine.launch import Pool; p = Pool(2); p.start(); "
              "print(*p.pids, flush=True); sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=launch.REPO_ROOT)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and not any(_gone(p) for p in pids)
    parent.kill()
    parent.wait()
    assert _all_gone(pids, within_s=10), "workers outlived their parent"


def test_registry_keeps_a_bounded_number_of_pools():
    made = [launch.get_pool(w, collective_timeout_s=7.5) for w in (1, 2, 3)]  # not started: no processes
    assert launch.get_pool(3, collective_timeout_s=7.5) is made[2]
    assert made[0] not in launch._registry.values() and len(launch._registry) <= launch.MAX_POOLS
    launch.shutdown_all()


def test_log_folders_left_by_a_killed_owner_are_removed_and_live_ones_kept(tmp_path):
    """A pool's log folder is named by its owner's pid; SIGKILL leaves it behind, and the next pool to start
    removes it. A live owner's folder, another process's files and the older unnamed folders are left."""
    from engine.launch import LOGDIR_PREFIX, _pid_namespace, remove_orphaned_logdirs

    ns = _pid_namespace()
    if ns is None:
        pytest.skip("no /proc/self/ns/pid: pids cannot be judged here")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{LOGDIR_PREFIX}ns{ns}-{int(gone.stdout)}-abc"
    alive = tmp_path / f"{LOGDIR_PREFIX}ns{ns}-{os.getppid()}-def"
    unnamed = tmp_path / f"{LOGDIR_PREFIX}xyz"
    elsewhere = tmp_path / f"{LOGDIR_PREFIX}ns{ns + 1}-{int(gone.stdout)}-ghi"  # another container's pid
    for folder in (dead, alive, unnamed, elsewhere):
        folder.mkdir()
        (folder / "rank0.log").write_text("log")
    assert remove_orphaned_logdirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and unnamed.exists() and elsewhere.exists()


def test_a_worker_killed_by_a_signal_is_said_so():
    import signal

    from engine.launch import exit_report, exit_words

    assert exit_words(3) == "exited with code 3"
    assert exit_words(-signal.SIGKILL).startswith("was killed by SIGKILL (on Linux, usually the kernel's out-of-memory")
    assert exit_words(-signal.SIGSEGV) == "was killed by SIGSEGV"
    # a page's summary quotes the detail's last line: the signal for a kill, the error for an exit with a code
    assert exit_report(-signal.SIGKILL, "a warning\n").splitlines()[-1].startswith("worker was killed by SIGKILL")
    assert exit_report(1, "ValueError: bad").splitlines()[-1] == "ValueError: bad"


@pytest.mark.multiprocess
def test_a_stop_ends_the_wait_for_a_pool_another_run_holds(pools):
    """A sweep queued behind another job's run on the same pool had waited for its lock whatever Stop said."""
    import threading

    from engine.launch import RunStopped

    pool = pools(2)
    stop = threading.Event()
    stop.set()
    with pool._lock:  # another run holds the pool
        with pytest.raises(RunStopped):
            pool.run("tests.engine.pool_tasks:whoami", stop=stop)
    assert [r["rank"] for r in pool.run("tests.engine.pool_tasks:whoami")] == [0, 1]
