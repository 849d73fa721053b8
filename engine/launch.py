"""A pool of N worker processes, started once and reused for many runs.

Cold start (N processes each importing torch, then a gloo rendezvous) costs seconds; a warm run only
sends a task over an already open connection to ranks whose process group is already up.

Safety, in order of what goes wrong:
- every worker is `python -m engine.worker` (a module entry, never a re-run of the caller's
  `__main__`, which under Streamlit is a page script);
- all workers of a pool share one process group id, so one `killpg` ends them all; workers also exit
  by themselves when their parent dies;
- a rank that raises -> `RankFailed` with its rank and traceback; a run past its wall-clock limit ->
  `RunTimedOut` naming where each unfinished rank was (from a faulthandler stack dump); either way the
  pool is killed and the next run starts a fresh one;
- worker output goes to log files, never to the caller's stdout (the CLI prints JSON there).

`get_pool` keeps one pool per (world, device) in a module-level registry under a lock, for a Streamlit
server where many browser sessions share one process; `atexit` shuts them all down.
"""

from __future__ import annotations

import atexit
import os
import pickle
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Listener, wait

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



# The workers' log folder, named by the process that owns the pool (its pid namespace and pid): one that its owner
# left behind (killed with SIGKILL, which no cleanup survives) is removed when any later pool of the same
# namespace starts.
LOGDIR_PREFIX = "shardlab-pool-"
_OWNED = re.compile(re.escape(LOGDIR_PREFIX) + r"ns(\d+)-(\d+)-")


def _pid_namespace() -> int | None:
    """This process's pid namespace (the inode of /proc/self/ns/pid), or None where the OS does not say: a pid
    means something only inside its namespace, and containers may share one /tmp."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def logdir_prefix() -> str:
    """The log folder's name up to its random part: the owner's pid namespace and pid."""
    return f"{LOGDIR_PREFIX}ns{_pid_namespace() or 0}-{os.getpid()}-"


def exit_words(code: int | None) -> str:
    """How a worker process ended, in words: its exit code, or the signal that killed it (SIGKILL with no one
    sending it is, on Linux, the kernel's out-of-memory killer)."""
    if code is None:
        return "exited (its code unknown)"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    oom = (" (on Linux, usually the kernel's out-of-memory killer, unless someone sent it: then this run needs more "
           "memory than is free; make the model or the batch smaller)") if -code == signal.SIGKILL else ""
    return f"was killed by {name}{oom}"


def exit_report(code: int | None, log_tail: str, when: str = "") -> str:
    """A dead worker's detail: how it ended and what it last wrote. A page's one-line summary quotes the last
    line, so a signal (nothing the worker could write about) comes last, and an exit with a code (a Python error
    whose last line says what went wrong) comes first."""
    ended = f"worker {exit_words(code)}" + (f" {when}" if when else "")
    return f"{log_tail.rstrip()}\n{ended}".lstrip() if code is not None and code < 0 else f"{ended}\n{log_tail}"


def remove_orphaned_logdirs(root: str | None = None) -> list[str]:
    """Remove the pool log folders under `root` (the temporary folder) whose owning process is gone; the
    folders removed."""
    root = root or tempfile.gettempdir()
    removed = []
    namespace = _pid_namespace()
    try:
        names = os.listdir(root) if namespace is not None else []
    except OSError:
        return removed
    for name in names:
        owner = _OWNED.match(name)
        # only ours to judge: a folder of this pid namespace (another container's pids mean other processes)
        if owner is None or int(owner.group(1)) != namespace or int(owner.group(2)) == os.getpid():
            continue
        try:
            os.kill(int(owner.group(2)), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, OSError):
            continue  # another user's, or not a process id: not ours to judge
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed

class WorkerError(RuntimeError):
    """A run did not complete on every rank; the pool has been torn down."""


class RankFailed(WorkerError):
    def __init__(self, rank: int, detail: str):
        self.rank, self.detail = rank, detail
        super().__init__(f"rank {rank} failed:\n{detail}")


class RunStopped(WorkerError):
    def __init__(self, steps_done: int):
        self.steps_done = steps_done
        super().__init__(f"run stopped on request after {steps_done} step(s)")


class RunTimedOut(WorkerError):
    def __init__(self, timeout_s: float, where: dict[int, str]):
        self.timeout_s, self.where = timeout_s, where
        self.ranks = sorted(where)
        lines = "\n".join(f"  rank {r}: {w}" for r, w in sorted(where.items()))
        super().__init__(f"run timed out after {timeout_s:g} s; unfinished ranks:\n{lines}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pool:
    def __init__(self, world: int, device: str = "cpu", collective_timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0):
        self.world, self.device = world, device
        self.collective_timeout_s = collective_timeout_s
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.conns: list = []
        self.main_thread_ids: list[int] = []
        self.clock_offsets_s: list[float] = []
        self.logdir: str | None = None
        self.starts = 0  # how many times processes were started (tests check reuse)
        self.runs = 0
        self._task_id = 0
        self._lock = threading.Lock()

    # -- life cycle ---------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        """Start the workers; retried on a fresh port if the rendezvous port was taken meanwhile."""
        for attempt in range(3):
            try:
                self._start_once()
                return
            except RankFailed as e:
                if "address already in use" not in e.detail.lower() or attempt == 2:
                    raise

    def _start_once(self) -> None:
        self.shutdown()
        remove_orphaned_logdirs()
        self.logdir = tempfile.mkdtemp(prefix=logdir_prefix())
        key = secrets.token_bytes(16)
        # A backlog for every rank: with multiprocessing's default of 1, ranks that connect together beyond
        # the first have their SYNs dropped and retried after 1, 2, 4 ... s (Linux), which at 8 ranks on a
        # loaded machine ran past the start timeout ("workers did not connect within 120 s", seen twice).
        listener = Listener(("127.0.0.1", 0), backlog=max(8, self.world), authkey=key)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
        env.update({
            "SHARDLAB_POOL_ADDR": f"127.0.0.1:{listener.address[1]}", "SHARDLAB_POOL_KEY": key.hex(),
            "SHARDLAB_WORLD": str(self.world), "SHARDLAB_INIT": f"tcp://127.0.0.1:{free_port()}",
            "SHARDLAB_DEVICE": self.device, "SHARDLAB_PARENT_PID": str(os.getpid()),
            "SHARDLAB_COLLECTIVE_TIMEOUT_S": str(self.collective_timeout_s),
            "OMP_NUM_THREADS": "1",
        })
        accepted: list = []
        threading.Thread(target=_accept, args=(listener, self.world, accepted), daemon=True).start()
        self.starts += 1
        for rank in range(self.world):
            log = open(self._log_path(rank), "wb")
            pgid = {"process_group": 0} if rank == 0 else {"process_group": self.procs[0].pid}
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "engine.worker"], env={**env, "SHARDLAB_RANK": str(rank)},
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, **pgid))
            log.close()
        try:
            self._handshake(accepted)
        except BaseException:
            self.kill()
            raise
        finally:
            listener.close()

    def _handshake(self, accepted: list) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        by_rank: dict[int, object] = {}
        tids: dict[int, int] = {}
        while len(by_rank) < self.world:
            self._raise_if_exited("while starting")
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not connect within {self.start_timeout_s:g} s")
            while accepted:
                conn = accepted.pop()
                hello = _recv(conn)
                if hello is None:  # it went before saying who it is (e.g. a Python without torch): its exit says why
                    continue
                _, rank, _pid, tid = hello
                by_rank[rank], tids[rank] = conn, tid
            time.sleep(0.01)
        self.conns = [by_rank[r] for r in range(self.world)]
        self.main_thread_ids = [tids[r] for r in range(self.world)]
        for conn in self.conns:  # every rank has imported torch: join the process group together
            conn.send_bytes(pickle.dumps(("go",)))
        offsets: dict[int, float] = {}
        pending = set(range(self.world))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RunTimedOut(self.start_timeout_s, self._where(pending))
            for conn in wait([self.conns[r] for r in pending], timeout=min(remaining, 0.5)):
                rank = self.conns.index(conn)
                msg = _recv(conn)
                if msg is None or msg[0] == "error":
                    raise RankFailed(rank, msg[2] if msg else self._exit_detail(rank))
                offsets[rank] = msg[1]
                pending.discard(rank)
            self._raise_if_exited("while joining the process group", pending)
        self.clock_offsets_s = [offsets[r] for r in range(self.world)]

    def shutdown(self) -> None:
        """Ask workers to leave politely, then make sure none is left."""
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("exit",)))
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group and reap every worker: no orphans, no zombies."""
        if self.procs:
            try:
                os.killpg(self.procs[0].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self.logdir:  # error messages have already copied what they needed from the logs
            shutil.rmtree(self.logdir, ignore_errors=True)
            self.logdir = None

    # -- running tasks ------------------------------------------------------------------------------

    def run(self, target: str, kwargs: dict | list[dict] | None = None, timeout_s: float = 60.0,
            on_progress=None, stop=None) -> list:
        """Call `target(ctx, **kwargs)` on every rank (kwargs may differ per rank); results by rank.

        `on_progress(steps_done, loss)` hears each training step once every rank has finished it
        (`Context.step_done`), with the step's loss. Setting the `stop` event (a threading.Event) ends the
        run: the workers are killed (a rank may be inside a collective) and `RunStopped` is raised; the
        next run starts fresh ones, and a stop set while it waits for the pool (another run holds it) ends
        the wait."""
        while not self._lock.acquire(timeout=0.2):
            if stop is not None and stop.is_set():
                raise RunStopped(0)
        try:
            return self._run_locked(target, kwargs, timeout_s, on_progress, stop)
        finally:
            self._lock.release()

    def _run_locked(self, target, kwargs, timeout_s, on_progress, stop) -> list:
        """`run` with the pool's lock held."""
        if stop is not None and stop.is_set():
            raise RunStopped(0)
        if not self.alive or not self._answering():
            self.start()
        per_rank = kwargs if isinstance(kwargs, list) else [kwargs or {}] * self.world
        self._task_id += 1
        self.runs += 1
        log_sizes = [self._log_size(r) for r in range(self.world)]
        for rank, conn in enumerate(self.conns):
            conn.send_bytes(pickle.dumps(("task", self._task_id, target, per_rank[rank])))
        try:
            return self._collect(timeout_s, log_sizes, on_progress, stop)
        except BaseException:
            self.kill()
            raise

    def _answering(self, timeout_s: float = 2.0) -> bool:
        """Whether every worker answers a ping: a worker killed a moment ago can still look alive to
        poll() while its threads end, and a task sent to it would fail the run instead of restarting."""
        try:
            for conn in self.conns:
                conn.send_bytes(pickle.dumps(("ping",)))
        except OSError:
            return False
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.world))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for conn in wait([self.conns[r] for r in pending], timeout=remaining):
                msg = _recv(conn)
                if msg is None:
                    return False
                if msg[0] == "pong":
                    pending.discard(self.conns.index(conn))
        return True

    def _collect(self, timeout_s: float, log_sizes: list[int], on_progress=None, stop=None) -> list:
        deadline = time.monotonic() + timeout_s
        results: dict[int, object] = {}
        failures: dict[int, str] = {}
        steps_done = [0] * self.world
        step_losses: dict[int, list[float]] = {}
        while len(results) + len(failures) < self.world:
            if stop is not None and stop.is_set():
                raise RunStopped(min(steps_done))
            now = time.monotonic()
            if now >= deadline:
                pending = set(range(self.world)) - set(results) - set(failures)
                if failures:
                    break
                raise RunTimedOut(timeout_s, self._where(pending))
            pending_conns = [c for r, c in enumerate(self.conns) if r not in results and r not in failures]
            for conn in wait(pending_conns, timeout=min(0.2, deadline - now)):
                rank = self.conns.index(conn)
                msg = _recv(conn)
                if msg is None:
                    failures[rank] = self._exit_detail(rank, log_sizes[rank])
                elif msg[0] == "ok" and msg[1] == self._task_id:
                    results[rank] = msg[2]
                elif msg[0] == "progress" and msg[1] == self._task_id:
                    before = min(steps_done)
                    steps_done[rank] = msg[2]
                    if msg[3] is not None:
                        step_losses.setdefault(msg[2], []).append(msg[3])
                    if on_progress is not None and min(steps_done) > before:
                        # every rank has finished this step: its loss is the mean of the ranks that have
                        # one (data-parallel replicas; the last pipeline stages)
                        done = min(steps_done)
                        losses = step_losses.get(done)
                        _report(on_progress, done, sum(losses) / len(losses) if losses else None)
                elif msg[0] == "error":
                    failures[rank] = msg[2]
            if failures:
                # The first failure usually strands the others in a collective; give them a moment to
                # report their own errors, then stop waiting for them.
                deadline = min(deadline, time.monotonic() + 1.0)
        if failures:
            rank = _root_cause(failures)
            pending = sorted(set(range(self.world)) - set(results) - set(failures))
            if _secondary(failures[rank]) and pending:
                # every rank that failed was waiting in a collective for one still running: that one is stuck (a
                # hung rank had been reported as the failure of the rank its collective timed out on)
                where = self._where(pending)
                stuck = pending[0]
                waited = failures[rank].strip().splitlines()[-1]
                raise RankFailed(stuck, f"did not reach a collective that the other ranks waited in; it was "
                                        f"{where[stuck]}\n(rank {rank}, waiting for it: {waited})")
            raise RankFailed(rank, failures[rank])
        return [results[r] for r in range(self.world)]

    # -- diagnostics ----------------------------------------------------------------------------------

    def _log_path(self, rank: int) -> str:
        return os.path.join(self.logdir, f"rank{rank}.log")

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self._log_path(rank))
        except OSError:
            return 0

    def _log_tail(self, rank: int, since: int = 0, limit: int = 4000) -> str:
        try:
            with open(self._log_path(rank), "rb") as f:
                f.seek(since)
                return f.read().decode(errors="replace")[-limit:]
        except OSError:
            return ""

    def _exit_detail(self, rank: int, since: int = 0) -> str:
        code = self.procs[rank].wait(timeout=5) if self.procs else None
        return exit_report(code, self._log_tail(rank, since))

    def _raise_if_exited(self, when: str, ranks=None) -> None:
        for rank, p in enumerate(self.procs):
            if (ranks is None or rank in ranks) and p.poll() is not None:
                raise RankFailed(rank, exit_report(p.returncode, self._log_tail(rank), when))

    def _where(self, ranks) -> dict[int, str]:
        """Ask each unfinished rank for its Python stack (faulthandler on SIGUSR1) and name the frame."""
        sizes = {r: self._log_size(r) for r in ranks}
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except (ProcessLookupError, IndexError):
                pass
        time.sleep(0.3)
        where = {}
        for r in ranks:
            tid = self.main_thread_ids[r] if r < len(self.main_thread_ids) else None
            where[r] = _innermost_frame(self._log_tail(r, sizes[r], limit=20000), tid)
        return where


def _report(on_progress, steps_done: int, loss) -> None:
    """A progress listener's failure (a page whose session has gone) must not fail the run."""
    try:
        on_progress(steps_done, loss)
    except Exception:  # noqa: BLE001
        pass


def _accept(listener: Listener, n: int, out: list) -> None:
    for _ in range(n):
        try:
            out.append(listener.accept())
        except OSError:
            return


def _recv(conn):
    """A message from a worker (plain pickle, see worker._send), or None when it has gone."""
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _secondary(detail: str) -> bool:
    """Whether a rank's error is just a consequence of another rank dying or stalling (a broken connection or a
    collective timeout in gloo)."""
    return any(s in detail.lower() for s in ("connection closed by peer", "connection reset", "timed out", "timeout",
                                              "gloo"))


def _root_cause(failures: dict[int, str]) -> int:
    """The rank whose error is not `_secondary`, else the lowest."""
    return next((rank for rank in sorted(failures) if not _secondary(failures[rank])), min(failures))


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _innermost_frame(dump: str, thread_id: int | None) -> str:
    """The main thread's innermost frame outside torch, from a faulthandler dump."""
    block = dump
    if thread_id is not None:
        marker = f"0x{thread_id:016x}"
        at = dump.rfind(marker)
        if at >= 0:
            block = dump[at:].split("\n\n")[0]
    for m in _FRAME.finditer(block):
        path = m.group("file")
        if f"{os.sep}torch{os.sep}" in path:
            continue
        rel = os.path.relpath(path, REPO_ROOT) if path.startswith(REPO_ROOT) else path
        state = "waiting in a collective" if rel == os.path.join("engine", "comm.py") else "running"
        return f"{state} at {rel}:{m.group('line')} in {m.group('func')}"
    return "no stack dump (the process did not answer SIGUSR1)"


# Each worker holds an imported torch (a few hundred MB); a server keeps only the recently used pools.
MAX_POOLS = 2
_registry: OrderedDict[tuple[str, int], Pool] = OrderedDict()
_registry_lock = threading.Lock()


def get_pool(world: int, device: str = "cpu", collective_timeout_s: float = 30.0) -> Pool:
    """The shared warm pool for (device, world); created (not started) on first use. Pools beyond
    MAX_POOLS are shut down, least recently used first, after any run on them has finished."""
    with _registry_lock:
        key = (device, world)
        pool = _registry.get(key)
        if pool is None or pool.collective_timeout_s != collective_timeout_s:
            if pool is not None:
                _retire(_registry.pop(key))
            pool = _registry[key] = Pool(world, device, collective_timeout_s)
        _registry.move_to_end(key)
        while len(_registry) > MAX_POOLS:
            _retire(_registry.popitem(last=False)[1])
        return pool


def _retire(pool: Pool) -> None:
    with pool._lock:  # a run in progress on it finishes first
        pool.shutdown()


@atexit.register
def shutdown_all() -> None:
    with _registry_lock:
        for pool in _registry.values():
            pool.shutdown()
        _registry.clear()
