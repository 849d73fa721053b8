"""One run queue for the whole server: every live run of every browser session goes through it.

    queue = get_queue()
    job = queue.submit(session_id, [("ZeRO-3", cfg)])   # Refused: a cap says no, with what to change
    while not job.wait(0.25):
        queue.status(job)      # "position 3 of 7, about 12 s" while it waits; steps done while it runs
    job.results                # [(summary, timeline), ...]; with job.error, those of the runs before it

What it guarantees (settings in `server/settings.py`):

* at most `max_concurrent` runs execute at once, first come first served; a run identical to one that is
  executing waits for it and is then answered from the cache;
* caps per run (processes, steps, model size) are checked before anything starts;
* one wall-clock limit per job, `max_run_s`, over all its runs together (a page's press may carry several
  configurations), the prediction and a first calibration included: a slot is free again after at most this
  long. Each run is given what is left of it as its own timeout, and the job's stop event is set when it
  runs out;
* fairness: a session has at most one run waiting and one running. Pressing Run again while one waits
  replaces it (it keeps its place in line); pressing while one runs queues the new one behind it, and it
  starts only after it, even where another slot is free. Either way the job's `notice` says so;
* identical runs (same configurations, labels included) are answered from an in-memory cache of the last
  `result_cache` results, marked `cached` with the time the original finished;
* a waiting job whose page has gone (tab closed: `alive()` has said so for CLOSED_TAB_S) leaves the line (it
  holds no place, no share of `max_queue`); a running one finishes and fills the cache; `stop(job)` ends one
  on request (its workers are killed);
* one job at a time on a worker pool (engine.launch keeps one per world and device): two would take a slot
  each and run one after the other on the pool's lock;
* other work on the worker processes (the calibration, a collective sweep) queues the same way as a
  `Task`;
* a failed run (a rank that raised, hung, was killed) fails only its job: `engine.launch` has already torn
  its pool down, and the next run starts a fresh one.

The queue is torch-free; the runner it calls imports the engine. Tests pass their own runner.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace

from engine.config import ConfigError, check_fits_machine
from server.settings import Settings
from ui.tables import count

WAITING, RUNNING, DONE, FAILED = "waiting", "running", "done", "failed"
CANCELLED, REPLACED, STOPPED = "cancelled", "replaced", "stopped"
FINISHED = (DONE, FAILED, CANCELLED, REPLACED, STOPPED)
FIRST_GUESS_S = 10.0  # a run's duration before any has been measured (the first also calibrates: engine/predict.py)
# A waiting run's page gone this long leaves the line: a browser reconnects within seconds after a network blip
# (Streamlit takes the session out of its active ones meanwhile), a closed tab never does
CLOSED_TAB_S = 10.0


class Refused(ValueError):
    """The server will not queue this run; the message says what to change."""


@dataclass(frozen=True)
class Task:
    """Work on the worker processes other than a training run (the calibration, a collective sweep),
    queued like one: `fn(progress, stop)` with `progress(fraction, message)` returns the result; `stop` is a
    threading.Event set by the page's Stop or at the job's time limit (`max_run_s`), after which `fn`
    ends soon (engine.launch's pool runs take it and raise RunStopped)."""

    what: str  # identifies the work: identical `what` of a cacheable task is answered from the cache
    world: int
    fn: object = field(compare=False)
    cacheable: bool = False
    steps: int = 0
    # the machine's calibration (the hardware page's "Measure this machine"): not charged to the limit while it
    # measures, as a training run's first calibration is not (`_Clock`)
    calibrates: bool = False


@dataclass(eq=False)
class Job:
    id: int
    session: str
    runs: tuple  # ((label, RunConfig or Task), ...): one press of a Run button
    key: str  # identical runs have identical keys
    submitted_at: float
    state: str = WAITING
    notice: str | None = None  # what fairness did to this press, in words
    started_at: float | None = None
    finished_at: float | None = None
    run_index: int = 0  # which of `runs` is executing
    steps_done: int = 0  # of runs[run_index]
    loss: float | None = None
    calibrating: str | None = None  # the calibration's progress message, while it runs
    task_fraction: float = 0.0  # a Task's own progress
    # [(summary, timeline), ...]: every run's once DONE; the runs that finished before a failure or a stop
    results: list | None = None
    error: BaseException | None = None
    cached: bool = False
    cached_from: float | None = None  # when the run that is being reused finished (time.time())
    alive: object = None  # () -> bool: is the page that asked still there? (a closed tab's run is skipped)
    timed_out: bool = False  # stopped at the server's time limit (max_run_s, the whole job's)
    gone_since: float | None = None  # when `alive()` first said the page had gone (time.monotonic())
    stop_event: threading.Event = field(default_factory=threading.Event, repr=False)
    _event: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def steps_total(self) -> int:
        return sum(cfg.steps for _, cfg in self.runs)

    @property
    def fraction(self) -> float:
        """Share of the job's training steps finished."""
        if self.state == DONE:
            return 1.0
        if isinstance(self.runs[self.run_index][1], Task):
            return (self.run_index + self.task_fraction) / len(self.runs)
        before = sum(cfg.steps for _, cfg in self.runs[:self.run_index])
        return (before + self.steps_done) / max(1, self.steps_total)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the job has finished (done, failed, cancelled or replaced)."""
        return self._event.wait(timeout)


def run_key(runs) -> str:
    return json.dumps([[label, w.what if isinstance(w, Task) else asdict(w)] for label, w in runs],
                      sort_keys=True, default=str)


def cacheable(runs) -> bool:
    return all(w.cacheable for _, w in runs if isinstance(w, Task))


def engine_runner(cfg, on_step, progress, stop):
    """Run one configuration checked against the reference and beside its prediction (the live panel's
    run); setting `stop` ends it."""
    from engine.run import run

    return run(cfg, check=True, predict=True, progress=progress, on_step=on_step, stop=stop)


class RunQueue:
    def __init__(self, settings: Settings, runner=engine_runner):
        self.settings = settings
        self._runner = runner
        self._cond = threading.Condition()
        self._waiting: list[Job] = []
        self._running: list[Job] = []
        self._cache: OrderedDict[str, tuple[list, float]] = OrderedDict()
        self._durations: dict[str, float] = {}  # seconds the last real run of each key took
        self._recent: deque[float] = deque(maxlen=20)
        self._next_id = 0
        self._closed = False
        self.counts = {DONE: 0, FAILED: 0, CANCELLED: 0, REPLACED: 0, STOPPED: 0, "cached": 0}
        self._slots = [threading.Thread(target=self._slot, name=f"shardlab-run-slot-{i}", daemon=True)
                       for i in range(settings.max_concurrent)]
        for t in self._slots:
            t.start()

    # -- what a page calls ---------------------------------------------------------------------------------

    def check(self, runs) -> None:
        """Refused, with what to change, when a run breaks one of the server's caps."""
        s = self.settings
        if not runs:
            raise Refused("there is nothing to run")
        for label, cfg in runs:
            if isinstance(cfg, Task):
                if cfg.world > s.max_world:
                    raise Refused(f"{label}: {cfg.world} processes is more than this server allows "
                                  f"({s.max_world}); choose at most {s.max_world}")
                continue
            if cfg.world > s.max_world:
                raise Refused(f"{label}: {cfg.world} processes is more than this server allows ({s.max_world}); "
                              f"choose at most {s.max_world}")
            if cfg.steps > s.max_steps:
                raise Refused(f"{label}: {cfg.steps} steps is more than this server allows ({s.max_steps}); "
                              f"choose at most {s.max_steps}")
            if cfg.model.params > s.max_params:
                raise Refused(f"{label}: the model has {cfg.model.params:,} parameters, more than this server "
                              f"allows ({s.max_params:,}); make it smaller (fewer layers, a smaller hidden size "
                              "or vocabulary)")
            try:  # the live panel's runs are checked against the reference (engine_runner)
                check_fits_machine(cfg, check=True)
            except ConfigError as e:
                raise Refused(f"{label}: {e}") from None

    def as_run(self, cfg):
        """`cfg` as this server runs it: with the server's limit as its timeout (RunConfig.timeout_s, 60 s by
        default, had capped it below 120); a job of several runs gives each what is left of the limit
        (`_execute`). The Lab shows its commands so, to repeat the run exactly."""
        return replace(cfg, timeout_s=self.settings.max_run_s)

    def submit(self, session: str, runs, alive=None) -> Job:
        runs = tuple((label, w if isinstance(w, Task) else self.as_run(w)) for label, w in runs)
        self.check(runs)
        key = run_key(runs)
        with self._cond:
            if self._closed:
                raise Refused("the server is stopping; reload the page in a minute")
            self._drop_closed_tabs()
            self._next_id += 1
            job = Job(self._next_id, session, runs, key, time.monotonic(), alive=alive)
            hit = self._cache_get(key) if cacheable(runs) else None
            if hit is not None:
                self._finish_cached(job, *hit)
                return job
            mine = [j for j in self._waiting if j.session == session]
            if mine:
                old = mine[0]
                self._waiting[self._waiting.index(old)] = job
                old.notice = "replaced by a newer press of Run in the same session"
                self._end(old, REPLACED)
                job.notice = ("Your earlier run, which was still waiting, has been replaced by this one "
                              "(one waiting run per session); it keeps the earlier place in line.")
            else:
                if len(self._waiting) >= self.settings.max_queue:
                    raise Refused(f"the server's queue is full ({count(len(self._waiting), 'run')} waiting); "
                                  "try again in a minute")
                if any(j.session == session for j in self._running):
                    job.notice = "Your previous run is still running; this one starts after it."
                self._waiting.append(job)
            self._cond.notify_all()
            return job

    def cancel(self, job: Job) -> None:
        """Take a waiting job out of the line. A running job runs to the end."""
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self._end(job, CANCELLED)

    def stop(self, job: Job) -> None:
        """End a job on request: a waiting one leaves the line, a running one is stopped (its workers are
        killed; the next run starts fresh ones)."""
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self._end(job, STOPPED)
                return
        job.stop_event.set()

    def position(self, job: Job) -> tuple[int, int]:
        """(1-based place in line, runs waiting); (0, n) once it is running or finished."""
        with self._cond:
            self._drop_closed_tabs()
            n = len(self._waiting)
            return (self._waiting.index(job) + 1 if job in self._waiting else 0), n

    def estimated_wait_s(self, job: Job) -> float:
        """Seconds until `job` starts: the jobs ahead of it, and it, placed as `_next` starts them, each taking
        what its configuration took last time (a result the cache will answer takes nothing): on the first
        slot to free up, once its worker pools are free (one job at a time on a pool) and its session's
        earlier job has ended (one job at a time a session)."""
        with self._cond:
            self._drop_closed_tabs()
            now = time.monotonic()
            slots = [max(0.0, self._duration(j.key) - (now - j.started_at)) for j in self._running]
            slots += [0.0] * (self.settings.max_concurrent - len(slots))
            pools: dict[tuple, float] = {}
            sessions: dict[str, float] = {}
            for j, ends in zip(self._running, slots, strict=False):
                for pool in _pools(j):
                    pools[pool] = max(pools.get(pool, 0.0), ends)
                sessions[j.session] = max(sessions.get(j.session, 0.0), ends)
            # only the cache answers an identical run: with it off (or for work it does not keep) each runs
            answered = ({j.key for j in self._running} | set(self._cache)) if self.settings.result_cache else set()
            for ahead in self._waiting:
                ready = max([sessions.get(ahead.session, 0.0)] + [pools.get(p, 0.0) for p in _pools(ahead)])
                i = slots.index(min(slots))
                start = max(slots[i], ready)
                if ahead is job:
                    return start
                if ahead.key in answered and cacheable(ahead.runs):
                    continue
                if self.settings.result_cache and cacheable(ahead.runs):
                    answered.add(ahead.key)
                slots[i] = start + self._duration(ahead.key)
                for pool in _pools(ahead):
                    pools[pool] = slots[i]
                sessions[ahead.session] = slots[i]
            return 0.0

    def status(self, job: Job) -> str:
        """One line for the page's progress bar. Read under the lock: a state read before it, with the slot
        taking the job before `position` took it, had shown a waiting student "position 0 of 0"."""
        with self._cond:  # a Condition's lock is reentrant: position and estimated_wait_s take it again
            if job.state == WAITING:
                place, n = self.position(job)  # may take a closed tab's job out of the line: said below, as ended
            if job.state == WAITING:
                wait = self.estimated_wait_s(job)
                ahead = "you are next" if place == 1 else f"position {place} of {n}"
                k = self.settings.max_concurrent
                at_once = "one run at a time" if k == 1 else f"{k} runs at a time"
                return f"Waiting in this server's run queue: {ahead}, about {_rough_seconds(wait)} s ({at_once})"
        if job.state == RUNNING:
            label, cfg = job.runs[job.run_index]
            if isinstance(cfg, Task):
                return f"{label}: {job.calibrating or 'starting'}"
            if job.calibrating:
                return f"Calibrating this machine for the prediction (once): {job.calibrating}"
            loss = f", loss {job.loss:.4f}" if job.loss is not None else ""
            return (f"Running {label} on {cfg.world} process(es): step {job.steps_done} of {cfg.steps}{loss}")
        return job.state

    def snapshot(self) -> dict:
        with self._cond:
            return {"waiting": len(self._waiting), "running": len(self._running), **self.counts}

    def shutdown(self) -> None:
        """Refuse new runs and cancel the waiting ones (the pools are shut down by engine.launch at exit)."""
        with self._cond:
            self._closed = True
            for job in self._waiting:
                job.error = Refused("the server stopped before this run started")
                self._end(job, CANCELLED)
            self._waiting.clear()
            self._cond.notify_all()

    # -- the slots ---------------------------------------------------------------------------------------------

    def _duration(self, key: str) -> float:
        if key in self._durations:
            return self._durations[key]
        return sum(self._recent) / len(self._recent) if self._recent else FIRST_GUESS_S

    def _cache_get(self, key: str):
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        return None

    def _end(self, job: Job, state: str) -> None:
        """Every way a job ends (called with the lock held): its state, when, the count, its waiter woken."""
        job.state, job.finished_at = state, time.monotonic()
        self.counts[state] += 1
        job._event.set()

    def _finish_cached(self, job: Job, results: list, finished_at: float) -> None:
        job.results, job.cached, job.cached_from = results, True, finished_at
        job.started_at = time.monotonic()
        self.counts["cached"] += 1
        self._end(job, DONE)

    def _next(self) -> Job | None:
        """The first waiting job not identical to a running one (that one will answer it) whose session has no
        run executing (a session's second press queues behind its first, so one student cannot take every
        slot) and whose worker pools no running job holds (a run waits for the pool's lock: two jobs on one
        pool took a slot each and ran one after the other, the second's time limit spent waiting)."""
        busy = {j.key for j in self._running}
        sessions = {j.session for j in self._running}
        held = {pool for j in self._running for pool in _pools(j)}
        for job in self._waiting:
            if job.key not in busy and job.session not in sessions and not held & _pools(job):
                return job
        return None

    def _drop_closed_tabs(self) -> None:
        """Take the waiting jobs whose page has gone (a closed tab: `alive()` has said so for CLOSED_TAB_S) out of
        the line (called with the lock held), so they hold no place, no share of `max_queue` and no part of
        anyone's wait. A page that comes back within CLOSED_TAB_S (a browser reconnecting after a network blip)
        keeps its place."""
        now = time.monotonic()
        for job in [j for j in self._waiting if j.alive is not None]:
            if _still(job.alive):
                job.gone_since = None
                continue
            job.gone_since = job.gone_since or now
            if now - job.gone_since >= CLOSED_TAB_S:
                self._waiting.remove(job)
                self._end(job, CANCELLED)

    def _slot(self) -> None:
        while True:
            with self._cond:
                job = None
                while not self._closed:
                    self._drop_closed_tabs()  # a page gone CLOSED_TAB_S is skipped; one back sooner runs
                    job = self._next()
                    if job is not None:
                        break
                    self._cond.wait()
                if job is None:
                    return
                self._waiting.remove(job)
                hit = self._cache_get(job.key) if cacheable(job.runs) else None
                if hit is not None:
                    self._finish_cached(job, *hit)
                    self._cond.notify_all()
                    continue
                job.state, job.started_at = RUNNING, time.monotonic()
                self._running.append(job)
            state = self._execute(job)
            with self._cond:
                self._running.remove(job)
                if state == DONE:
                    took = time.monotonic() - job.started_at
                    self._durations[job.key] = took
                    self._recent.append(took)
                    if self.settings.result_cache and cacheable(job.runs):
                        self._cache[job.key] = (job.results, time.time())
                        while len(self._cache) > self.settings.result_cache:
                            self._cache.popitem(last=False)
                self._end(job, state)
                self._cond.notify_all()

    def _execute(self, job: Job) -> str:
        """Run the job's work under one limit, `max_run_s`, across all its runs (`_Clock`); the state it ends in
        (DONE, FAILED or STOPPED), its results or error set. The limit is the job's, not each run's: a press of k
        configurations had held its slot k times the limit, plus each run's prediction (made before a run's own
        timeout starts: engine/run.py). When it is used up the stop event is set, which ends the prediction and
        the run (RunStopped); each run's timeout is also what is left, should a rank not hear the stop."""
        limit = self.settings.max_run_s
        clock, finished = _Clock(job), threading.Event()

        def watch():
            while not finished.wait(WATCH_S):
                if clock.used() >= limit:
                    if not job.stop_event.is_set():  # a Stop pressed first is the reason it ends
                        job.timed_out = True
                        job.stop_event.set()
                    return

        threading.Thread(target=watch, daemon=True, name="shardlab-job-limit").start()
        results = []
        try:
            for i, (_label, cfg) in enumerate(job.runs):
                if job.timed_out:  # the limit ran out during the runs before: this one does not start
                    raise TimeoutError("no time left")
                job.run_index, job.steps_done, job.loss = i, 0, None

                def on_step(steps_done, loss):
                    job.steps_done, job.loss, job.calibrating = steps_done, loss, None

                def progress(fraction, message):
                    job.task_fraction, job.calibrating = fraction, message

                if isinstance(cfg, Task):
                    results.append(cfg.fn(progress, job.stop_event))
                else:
                    # what is left of the job's limit (at least a millisecond: validate wants a positive timeout;
                    # the stop event, set by then, ends the run at once)
                    left = max(1e-3, min(cfg.timeout_s, limit - clock.used()))
                    results.append(self._runner(replace(cfg, timeout_s=left), on_step, progress, job.stop_event))
                job.calibrating = None
            job.results = results
            return DONE
        except BaseException as e:  # noqa: BLE001 - reported to the job's page, never lost
            job.error = e
            job.results = results  # the runs that finished before it: the page shows them beside the failure
            # a run's own timeout is what was left of the limit: once it is used up, the server's limit is the
            # reason, whether or not the watch has seen it yet
            if job.timed_out or (not job.stop_event.is_set() and clock.used() >= limit - WATCH_S):
                job.timed_out = True
                what = "it" if len(job.runs) == 1 else f"its {len(job.runs)} runs, together,"
                job.error = TimeoutError(f"{what} ran past this server's limit of {limit:g} s (SHARDLAB_MAX_RUN_S, "
                                         "for one press)")
                return FAILED
            return STOPPED if job.stop_event.is_set() else FAILED
        finally:
            finished.set()


WATCH_S = 0.1  # how often a job's limit is looked at


class _Clock:
    """The seconds a job has used of its limit (`max_run_s`): all of its time but a first calibration of the
    machine's. That is measured once per machine and kept (tens of seconds: about 25 for 2 processes, 45 more for
    4, on 2 cores); it is kept only once finished, so a limit that stopped it would stop every press after it
    too, and the machine would never be calibrated. The page says while it calibrates."""

    def __init__(self, job: Job):
        self.job, self.last, self.spent = job, time.monotonic(), 0.0
        self.lock = threading.Lock()

    def calibrating(self) -> bool:
        job = self.job
        work = job.runs[job.run_index][1]
        if isinstance(work, Task):  # a task's progress is its own work, unless the task is the calibration
            return work.calibrates and job.task_fraction < 1.0
        return job.calibrating is not None and job.task_fraction < 1.0

    def used(self) -> float:
        with self.lock:
            now = time.monotonic()
            if not self.calibrating():
                self.spent += now - self.last
            self.last = now
            return self.spent


def _pools(job: Job) -> set[tuple]:
    """The worker pools a job's runs take (engine.launch keeps one per world and device): a Task's on the CPU."""
    return {(w.world, "cpu") if isinstance(w, Task) else (w.world, w.device) for _, w in job.runs}


def _still(alive) -> bool:
    try:
        return bool(alive())
    except Exception:  # noqa: BLE001 - a page that cannot say is treated as there
        return True


def _rough_seconds(s: float) -> int:
    """A wait as a person reads it: to the second below 10 s, to 5 s below a minute, then to 10 s."""
    step = 1 if s < 10 else 5 if s < 60 else 10
    return max(1, step * round(s / step))


_queue: RunQueue | None = None
_queue_lock = threading.Lock()


def get_queue() -> RunQueue:
    """The server's one queue, made on first use from the environment (SettingsError if malformed)."""
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = RunQueue(Settings.from_env())
            atexit.register(_queue.shutdown)
        return _queue
