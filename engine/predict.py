"""Every live run beside its own prediction: this machine's calibration, measured once and cached, and the
planner's prediction of a run from it.

    cal, messages = ensure_calibration([2, 4], progress=lambda fraction, text: ...)
    prediction = predicted(cfg)       # {"step_time_s": ..., "breakdown_s": {...}, ...} or the reason why not

Torch-free in the calling process, like `engine.run`: the measurements run on the worker pools
(`engine.calibrate`), the fits and the cache file are `hardware.this_machine`, the prediction is
`planner.live`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace
from importlib import metadata

CALIBRATION_TIMEOUT_S = 180.0


def torch_version() -> str:
    """The installed torch's version, read from its package metadata (importing torch takes seconds)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def cached_calibration():
    """This machine's calibration if the cache holds a sound one, else None (nothing is measured)."""
    from hardware import this_machine as tm

    return tm.load(tm.machine_key(torch_version()))[0]


def group_sizes(cfg) -> list[int]:
    """The sizes of the process groups the run `cfg` communicates over: each mesh axis of degree > 1, and the
    multi-axis groups of its gradient sync and statistics (engine.parallelize.group_spans, the groups the run
    makes)."""
    from engine.parallelize import group_spans

    mesh = cfg.mesh
    spans = [(a,) for a in mesh.names] + group_spans(cfg, mesh)
    return sorted({n for n in (math.prod(mesh.degree(a) for a in span) for span in spans) if n > 1})


# Calibrations this process measured and could not save (a cache folder it cannot write: a server run as a user
# without a writable home): kept here for the process's later runs, by machine key. Without it every press on
# such a server had measured the machine again, about 25 s each, and said nothing.
_KEPT: dict = {}


def ensure_calibration(worlds, progress=None, remeasure: bool = False, collective_timeout_s: float = 30.0,
                       stop=None, group_sizes=()):
    """This machine's calibration with communication measured at every world in `worlds`: from the
    cache when it is there and sound, else measured now (about 25 s for 2 ranks, 45 s more for 4, on 2 cores) and saved.
    At each world it measures groups of 2 and of the whole world (`tm.default_group_sizes`) and every size
    in `group_sizes` that divides it (a run's groups: `group_sizes(cfg)`); a cached world lacking one of
    those is measured for it alone, the rest of the file kept.

    Returns (calibration, messages): the messages say what was measured and why (missing, stale,
    corrupt, asked for), for the page or the command line to show. Raises `launch.WorkerError` when a
    measuring rank fails or times out, and `launch.RunStopped` once the `stop` event is set (between its
    measurements and inside one: a live panel's Stop, which had waited the calibration's half minute out).
    """
    from hardware import this_machine as tm

    report = progress or (lambda fraction, message: None)
    key = tm.machine_key(torch_version())
    cal, why = (None, "measuring again, as asked") if remeasure else tm.load(key)
    if cal is None and not remeasure and key in _KEPT:
        cal, why = _KEPT[key], (f"{tm.NOT_KEPT_WORDS} {tm.cache_path(key).parent}: this process keeps the one it "
                                "measured, until it ends (set SHARDLAB_CACHE_DIR to a writable folder)")
    messages = [why] if why else []
    worlds = sorted({int(w) for w in worlds if int(w) > 1})
    sizes_asked = {int(n) for n in group_sizes}
    wanted = {w: sorted(set(tm.default_group_sizes(w)) | {n for n in sizes_asked if 1 < n <= w and w % n == 0})
              for w in worlds}
    todo = worlds if cal is None else [w for w in worlds if w not in cal.worlds]
    # worlds measured before, without some group size a run there needs: those sizes' communication alone
    more = {} if cal is None else {w: [n for n in wanted[w] if n not in cal.measured_sizes(w)]
                                   for w in worlds if w in cal.worlds}
    more = {w: sizes for w, sizes in more.items() if sizes}
    if cal is not None and not todo and not more:
        return cal, messages

    measure = _measurer(collective_timeout_s, stop)
    steps, done = (0 if cal is not None else 1) + len(todo) + len(more), 0
    if cal is None:
        report(0.0, "timing the engine's modules on one rank")
        reference_block_s(measure)  # the first on a fresh pool can overlap its start-up (2.70 against 1.93 ms)
        solo = measure(1, "compute_task", {"reps": 15})[0]
        fits, units, probe = tm.fit_compute(solo)
        # the speed the fits are at: the reference Block timed between the modules' groups
        cal = tm.Calibration(key=key, created_s=time.time(), cpus=tm.cpu_count(), torch=torch_version(),
                             compute=fits, engine_units=units, probe=probe,
                             reference_s=tm.anchor_reference_s(solo), adamw_state=tm.fit_adamw_state(solo))
        cal.compute_share[1] = 1.0
        messages.append("timed the engine's modules, its driver and this machine's roofline on one rank")
        done += 1
    for w in todo:
        report(done / steps, f"measuring gloo and shared cores with {w} ranks")
        if w > cal.cpus:
            # the Block on one rank per core right before and after all the ranks time it together (tm.fit_share)
            per_core = {"reps": 15, "shapes": "sharing", "active": cal.cpus}
            cores = measure(w, "compute_task", per_core)
            shared = measure(w, "compute_task", {"reps": 15, "shapes": "sharing"})
            cores += measure(w, "compute_task", per_core)
        sizes = wanted[w]
        # a pipeline's posting, timed before and after the collectives: one short run can fall in a slow spell
        # (two calibrations, each timing it once, read 0.47 and 0.79 ms at world 4)
        posting = {schedule: measure(w, "pipeline_posting", {"schedule": schedule})
                   for schedule in tm.POSTING_SCHEDULES}
        comm = measure(w, "comm_task", {"group_sizes": sizes})
        resume = measure(w, "resume_task", {})
        for schedule, first in posting.items():
            again = measure(w, "pipeline_posting", {"schedule": schedule})
            posting[schedule] = [a + b for a, b in zip(first, again, strict=True)]
        # no more ranks than cores: each computes on a core of its own, as the speed check times them
        cal.compute_share[w] = tm.fit_share(shared, [rows[0] for rows in cores if rows]) if w > cal.cpus else 1.0
        cal.comm.update(tm.fit_comm(w, comm))
        for schedule, per_rank in posting.items():
            cal.comm.update(tm.fit_posting(w, per_rank, schedule))
        cal.resume_s[w] = tm.fit_resume(resume)
        cal.worlds = sorted(set(cal.worlds) | {w})
        cal.group_sizes[w] = sizes
        messages.append(f"measured gloo's collectives and core sharing with {w} ranks")
        done += 1
    for w, sizes in more.items():
        groups = ", ".join(map(str, sizes))
        report(done / steps, f"measuring gloo on groups of {groups} with {w} ranks")
        measured = cal.measured_sizes(w)  # what the file holds (before this: as its keys name it)
        cal.comm.update(tm.fit_comm(w, measure(w, "comm_task", {"group_sizes": sizes})))
        cal.group_sizes[w] = sorted(set(measured) | set(sizes))
        messages.append(f"measured gloo's collectives on groups of {groups} with {w} ranks (the calibration had "
                        f"groups of {', '.join(map(str, measured))} only)")
        done += 1
    try:
        tm.save(cal)
        _KEPT.pop(key, None)
    except OSError as e:  # a read-only or missing cache folder: the calibration still serves this process
        _KEPT[key] = cal
        messages.append(f"{tm.NOT_KEPT_WORDS} {tm.cache_path(cal.key).parent} ({e.strerror}): this process keeps "
                        "it until it ends, a new one measures again (set SHARDLAB_CACHE_DIR to a writable folder)")
    report(1.0, "calibrated")
    return cal, messages


def _calibration_ended(progress) -> None:
    """Tell the listener the calibration is over, though it failed (a success reports "calibrated"): the
    classroom queue does not charge a calibration's time to a press's limit (server/queue._Clock), and a
    failed one had stayed "calibrating" until the run's first step."""
    if progress is not None:
        progress(1.0, "could not calibrate this machine: the run goes on without a prediction")


def _cache_file(cal) -> str:
    from hardware import this_machine as tm

    return str(tm.cache_path(cal.key))


def reference_blocks_s(measure, world: int = 1) -> list[float]:
    """The default Block's forward + backward, the median pass (`Calibration.reference_s`;
    `engine.calibrate.reference_task`), through `measure(world, task, args)`: on a `world`-rank pool (about
    0.5 s on 2 cores), on one rank per core at once, in rank order: every rank where there are no more
    ranks than cores, else the first as many as there are cores."""
    return [rows[0]["block_s"] for rows in measure(world, "reference_task", {}) if rows]


def reference_block_s(measure, world: int = 1) -> float:
    """`reference_blocks_s`'s slowest: the slowest rank sets the pace of a step whose ranks wait for one
    another."""
    return max(reference_blocks_s(measure, world))


def at_speed_now(cal, world: int = 1, collective_timeout_s: float = 30.0, stop=None):
    """(`cal` at the speed this machine runs now, the factor): its reference Block timed again, on the pool
    of a `world`-rank run (the one the run will use: no other pool is started; `Calibration.at_speed`), on
    one rank per core at once (`reference_blocks_s`), against the calibration's one rank alone.

    With no more ranks than cores, each rank keeps its core: the factor is the slowest rank's time (how
    much slower the run's slowest core is than the one the modules were timed on), and
    `Calibration.rank_pace` each rank's time over that slowest one's (a 2-rank pipeline's stage on the
    faster core does its passes sooner). With more, the ranks take turns on every core: the factor is the
    cores' mean, the speed `Calibration.share` slows down (a check on rank 0 alone read whichever core it
    landed on: 1.35-2.53 ms over 24 timings in four minutes here, two ranks' mean 1.41-2.21 over as many).

    Always, even right after calibrating: the reference is timed with the modules, about a minute before the
    first run, and this machine's speed moves that much within a minute (one benchmark's 4-rank runs, a
    minute or two after calibrating, timed it at 0.61-1.32x; its 2-rank runs, which a 60 s grace had spared
    the check, were all predicted too fast)."""
    if cal.reference_s <= 0:
        return cal, 1.0
    times = reference_blocks_s(_measurer(collective_timeout_s, stop), world)
    if len(times) < world:  # more ranks than cores
        return cal.at_speed(statistics.fmean(times))
    slowest = max(times)
    now, factor = cal.at_speed(slowest)
    # and each rank at its own speed: this machine's cores do not run at one (`Calibration.rank_pace`)
    return (replace(now, rank_pace=tuple(t / slowest for t in times)) if len(times) > 1 else now), factor


def _measurer(collective_timeout_s: float, stop=None):
    """measure(world, task, args): run an `engine.calibrate` task on the worker pool of `world` CPU ranks,
    returning each rank's result; setting `stop` ends it (`launch.RunStopped`)."""
    from engine import launch

    def measure(world: int, task: str, args: dict) -> list:  # Pool.run checks `stop` before it starts anything
        return launch.get_pool(world, "cpu", collective_timeout_s).run(f"engine.calibrate:{task}", args,
                                                                        timeout_s=CALIBRATION_TIMEOUT_S, stop=stop)

    return measure


def predicted(cfg, progress=None, stop=None) -> dict:
    """The planner's prediction of the run `cfg` on this machine, as the JSON object the run's summary
    carries under "predicted": step_time_s, breakdown_s and the calibration messages, or step_time_s
    None and `why` when there is no prediction (a CUDA run; the calibration could not be measured)."""
    from engine.launch import RunStopped, WorkerError
    from hardware.this_machine import CalibrationError
    from planner.live import predict

    if cfg.device != "cpu":
        return {"step_time_s": None, "breakdown_s": {},
                "why": "the live prediction is calibrated for CPU runs over gloo; this run is on CUDA"}
    if cfg.dtype != "float32":
        return {"step_time_s": None, "breakdown_s": {},
                "why": "this machine's calibration times the engine's modules in fp32; a bf16 run's kernels "
                       "are other ones, so it is not predicted"}
    try:
        cal, messages = ensure_calibration([cfg.world], progress, collective_timeout_s=cfg.collective_timeout_s,
                                           stop=stop, group_sizes=group_sizes(cfg))
        now, speed = at_speed_now(cal, cfg.world, cfg.collective_timeout_s, stop)
    except RunStopped:
        raise  # the run's Stop: the run does not start
    except WorkerError as e:
        _calibration_ended(progress)
        return {"step_time_s": None, "breakdown_s": {}, "why": f"this machine could not be calibrated: {e}"}
    except Exception as e:  # a fit that failed on odd measurements: the run still runs, unpredicted
        _calibration_ended(progress)
        return {"step_time_s": None, "breakdown_s": {},
                "why": f"this machine could not be calibrated ({type(e).__name__}: {e})"}
    try:
        out = predict(cfg, now).as_dict()
    except CalibrationError as e:
        return {"step_time_s": None, "breakdown_s": {}, "why": str(e), "calibration": messages}
    except Exception as e:  # the planner failed on this calibration: say so, the run still runs
        return {"step_time_s": None, "breakdown_s": {}, "calibration": messages,
                "why": f"the planner could not predict this run from this machine's calibration "
                       f"({type(e).__name__}: {e}); measure it again (bench --remeasure, or delete "
                       f"{_cache_file(cal)})"}
    out["calibration"] = messages
    # the machine's speed now against the calibration's: the compute fits were scaled by it
    out["speed_factor"] = speed
    # a shared machine drifts: the pages say how old the calibration was when it predicted this run
    out["calibrated_at_s"], out["predicted_at_s"] = cal.created_s, time.time()
    return out
