"""This machine as a chip: the calibration the planner predicts live runs with, fitted and cached.

`engine/calibrate.py` takes the measurements (it needs torch and the engine's worker pools); this module
is torch-free: it fits them, keeps them in a file under the user's cache folder keyed by the machine,
and says when that file is missing, stale or corrupt. A calibration holds

* compute: per module of the engine's model (engine/model.py, the Mamba-2 mixer of engine/mamba.py) and
  per piece of the engine's own machinery, seconds = fixed + per-unit-of-work * work, forward and
  backward (`Fit`), least squares over the shapes measured; the engine's own units at the default shape
  (`engine_units`);
* sharing: how much slower compute runs when W ranks run at once than with one rank on each core
  (`compute_share[W]`; 1 with no more ranks than cores);
* resuming: the seconds a compute segment adds when it starts right after the rank's own communication
  (`resume_s[W]`, engine/calibrate.resume_task);
* communication: per world W, operation, group size n and mode (blocking after three gaps of compute:
  `BLOCKING_MODES`; async bursts; contended, under compute; a ring shift's posting), gloo's seconds =
  alpha + beta * bytes and the process CPU it keeps busy (`CommFit`);
* the roofline: fp32 and bf16 matmul FLOP/s and copy bandwidth (the hardware lesson plots it).

Cache: `$SHARDLAB_CACHE_DIR`, else `$XDG_CACHE_HOME/shardlab`, else `~/.cache/shardlab`; one JSON file per
machine key (host, CPU model, cores, torch and Python versions). Writes are atomic (a temporary file a
killed write left is removed once STALE_TMP_S old). A file without one of `COMPUTE_FITS` (measured before
that module was), or without any operation engine/calibrate.comm_task times (`comm_modes`) on a group size
it measured (`Calibration.group_sizes`), is measured again, once: the new file has it. So is one holding
values no measurement makes (a negative time, no world 1, no cores: `_impossible`), or dated in the future.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, astuple, dataclass, field, replace
from pathlib import Path

from core.ssd import mamba_block_flops, state_correction_flops

# 9: a pipeline message's posting timed in the engine's interleaved pipeline too (POSTING_SCHEDULES); 8: the
# ranks' malloc keeps the memory torch frees (engine.worker.keep_freed_memory; before, a large attention
# block faulted its pages in again at every call, its time swinging 2x); 7: the Mamba-2 mixer timed as the
# engine initialises it (engine.calibrate._mamba_mixer; before, denormal floats had made its fit up to 4x
# slow), and what context parallel's state passing adds to it ("mamba_state"); 6: measured with Python's
# garbage collector paused in the ranks, as the runs now run (engine.worker.collector_paused); 5:
# compute_share measured against one rank per core, every core busy (4: against one rank alone, on either of
# this machine's unequal cores), and 1 with no more ranks than cores
FORMAT = 9
# The longest a "contended" measurement waits for an asynchronous operation under compute before it
# stops computing (engine/calibrate.py); an operation that took this long made no progress at all.
CONTENDED_CAP_S = 0.02
# Blocking operations are timed after three gaps of compute (engine/calibrate.SYNC_GAPS_S), shortest first
BLOCKING_MODES = ("sync_short", "sync", "sync_long")
# ... and back to back, each right after the one before it (no compute between: gloo's threads awake), as a
# naive data-parallel sync all-reduces one parameter after another
BACK_TO_BACK_MODE = "sync_b2b"
POST_MODE = "post"  # how long posting a point-to-point operation blocks the rank that posts it (CommFit)
# The engine's pipelines whose message postings the calibration times (engine/calibrate.pipeline_posting), each
# its own CommFit (`posting_mode`); the others post as the first does. On 2 ranks an interleaved pipeline's
# postings held their senders 0.41-0.52 ms on average against 1F1B's 0.22-0.25: its chunks send back to the
# previous rank while that rank sends on, and a posting that crosses the peer's own held it 2.5-4x longer
POSTING_SCHEDULES = ("1f1b", "interleaved-1f1b")
ALONE_MODE, PAIR_MODE = "alone", "pair"  # one asynchronous operation posted and waited; two posted at once
# torch's ProcessGroupGloo runs each group's queue on 2 worker threads (its default options: threads =
# 2 per device), so two operations of one group can be in flight at once. Measured here: back to back
# asynchronous all-reduces of 1 KiB on 2 ranks take 330 us alone, 433 us for two, 917 us for four. On busy
# cores the second thread buys less (`Calibration.pair_speedup`).
GLOO_THREADS = 2
# What engine/calibrate.comm_task times on each group size (`comm_modes` lists them, `load` checks them):
# every kind blocking ("sync"; send_recv on groups of an even size only)
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ring_shift", "send_recv")
ASYNC_KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # as bursts, alone and pairs, under compute
SYNC_GAP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")  # the live runs' blocking ones
# Modes comm_task times that a file may lack and still be used: planner/live reads a blocking operation
# right after another at the shortest gap's timing without it. (tests/planner/data/calibration-2core.json,
# the test suite's recorded machine, predates it; recorded again, this can be emptied.)
OPTIONAL_MODES = (BACK_TO_BACK_MODE,)
PAIR_SUMMARY_BYTES = 131072  # the size `summary_lines` quotes (one of engine/calibrate.COMM_SIZES)
STALE_AFTER_S = 30 * 24 * 3600  # a month: software updates and thermal changes drift the numbers
# A calibration dated later than now by more than this was made under another clock (or its file was
# edited): its age cannot be told, so it counts as stale
FUTURE_SKEW_S = 600.0
# A temporary file `save` left in the cache folder (a process killed while it wrote) this long unmodified
# belongs to no live writer (writing one takes milliseconds): `load` and `save` remove it
STALE_TMP_S = 600.0
TMP_PREFIX = "this-machine-"  # `save`'s temporary files: TMP_PREFIX + random + ".tmp" (older ShardLab: tmp*.tmp)
# The module fits every prediction may need (`fit_compute` makes them all); a cached calibration lacking
# one predates that module's measurement.
COMPUTE_FITS = ("linear", "rmsnorm", "attention", "swiglu", "embed", "head", "moe", "moe_ep", "mamba", "mamba_state",
                "ring_block", "ring_diag", "adamw", "tiny_op", "block_glue", "zb_split", "zb_record",
                "optimizer_driver")
# The largest shapes the calibration times the attention modules at (engine/calibrate.measure_compute): the
# prediction of a run beyond them extrapolates the fits, and says so (planner.live.extrapolation_notes)
ATTENTION_LONGEST = 256  # tokens of the longest attention timed
RING_LONGEST = 256  # rows and columns of the largest ring-attention block timed
# The AdamW kernel as the engine's optimizer step runs it: over every tensor a rank updates, one after another
# (engine/dp.py's parameters, engine/flat.py's shards), so the step's state (parameter, gradient and two moments,
# 16 bytes an element) passes through the caches once per step. The "adamw" fit, one tensor timed over and over,
# holds while that state stays in them; `Calibration.adamw_state` says how much slower each element goes as it
# outgrows them, from a step cycling through ADAMW_STATE_SIZES elements held in tensors of ADAMW_STATE_TENSOR.
# Measured here (2 cores, 2 MiB of L2 each): 1.37 ns an element over 64 Ki elements (1 MiB of state), 1.90 over
# 1 Mi (16 MiB), 2.93 over 4 Mi (64 MiB), 3.09 over 8 Mi; a width-256 model's step (2.1 M elements in 21 tensors)
# took 8.7-9.1 ms where the one-tensor fit said 3.1, and 10.5 ms in a 2-rank run.
ADAMW_STATE_TENSOR = 65536
# The engine's own step at world 1 is timed on two models (engine.calibrate.engine_units): the default, whose
# data stays in the caches from one layer to the next, and WIDE_UNITS (width 256, ffn 1,024: 3.75 MiB of weights
# a layer), whose layers each find the caches emptied by the layer before, and whose optimizer step follows a
# forward and backward that emptied them too. Its spans are kept under WIDE_PREFIX. Measured here: a width-256
# Block took 1.53 / 2.66 ms (forward / backward) timed over and over, 2.33 / 3.32 after 128 MB were written, and
# 2.26 / 3.93 in a world-1 run; the run's optimizer step over its 2.1 M elements 9.9-11.3 ms, where the same
# 21 tensors took 4.7-5.0 ms stepped back to back and 8.2 ms right after a forward and backward of the model.
# A model between the two is priced between them (planner.live._Costs), a larger one as the wide one.
WIDE_UNITS = {"hidden": 256, "ffn": 1024}
WIDE_PREFIX = "wide "
ADAMW_STATE_BYTES = 16  # an element's parameter, gradient and two moments, fp32
ADAMW_STATE_SIZES = (65536, 262144, 1048576, 4194304)
# ZB-H1's fits are ratios of two timings of the same machine (`fit_compute`), not seconds: the machine's
# speed of the moment scales neither (`Calibration.at_speed`)
RATIO_FITS = ("zb_split", "zb_record")


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message says why (it is then measured again)."""


@dataclass(frozen=True)
class Fit:
    """seconds = fixed_s + per_unit_s * work (+ per_item_s * items: the MoE layer's experts, each a module
    call even on no rows; the Mamba-2 scan's steps from chunk to chunk), forward and backward."""

    fwd_fixed_s: float
    fwd_per_unit_s: float
    bwd_fixed_s: float = 0.0
    bwd_per_unit_s: float = 0.0
    fwd_per_item_s: float = 0.0
    bwd_per_item_s: float = 0.0

    def fwd(self, work: float, items: float = 0.0) -> float:
        return self.fwd_fixed_s + self.fwd_per_unit_s * work + self.fwd_per_item_s * items

    def bwd(self, work: float, items: float = 0.0) -> float:
        return self.bwd_fixed_s + self.bwd_per_unit_s * work + self.bwd_per_item_s * items

    def scaled(self, factor: float) -> Fit:
        return Fit(*(factor * v for v in astuple(self)))


@dataclass(frozen=True)
class CommFit:
    """One gloo operation on groups of n ranks while the world's W ranks all communicate.

    Blocking operations ("sync", "sync_short", "sync_long"): `seconds` is what one costs after `gap_s` of
    compute. Asynchronous ones ("async") are measured as a burst (`burst` operations each issued after
    `compute_s` of work, then all waited for): `seconds` is then the whole burst's time, and planner.live
    solves for one operation's duration in its simulation of that same pattern. "contended": one
    asynchronous operation while every rank keeps computing until it completes; `stalls` when it did not
    complete within CONTENDED_CAP_S (it waits for its ranks to stop computing). "post" (`POST_MODE`; ring
    shifts and send_recv): how long posting blocks the rank that posts it (gloo writes the message from the
    calling thread): a ring shift's send/recv batch, measured on the same calls as "sync"; a pipeline
    message's isend (send_recv, `fit_posting`), timed in the engine's own pipeline. "late1", "late2", ...
    (`late_mode`, send_recv only): a receive posted after its send while the sender computes on, from the
    receive's posting (gloo's point-to-point is a rendezvous: the message moves only then), with that many
    of the world's pairs exchanging at once, so that many senders computing
    (engine/calibrate._pipeline_messages); "late0" the same with one pair whose sender blocks in its wait
    after the isend (no rank computing).
    "alone" and "pair" (`ALONE_MODE`, `PAIR_MODE`; asynchronous kinds): one operation posted and waited for,
    and two of the group's posted at once and both waited for, timed in the same blocks after `gap_s` of
    compute (`Calibration.pair_speedup`).
    "early1", "early2", ... (`early_mode`, send_recv only): a message sent to a receive already waiting, the
    sender computing on after its isend, timed one way from the isend's posting to the receive's return."""

    alpha_s: float
    beta_s_per_byte: float
    cpu_fraction: float  # process CPU time over wall time while it runs (gloo threads stay busy)
    burst: int = 0
    compute_s: float = 0.0
    stalls: bool = False  # "contended" mode: it did not complete within CONTENDED_CAP_S under compute
    gap_s: float = 0.0  # blocking modes: the compute before each timed call
    # "async": the CPU seconds of each compute between the burst's operations, one thread's (its solo time;
    # `compute_s` is its wall time, read while every rank sized and timed its own at once); 0 in a file
    # measured before it was recorded
    compute_cpu_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * max(0.0, nbytes)

    def at_speed(self, factor: float) -> CommFit:
        """This operation with the machine's CPU `factor` times slower than when it was timed: the share of it
        its process spent on the CPU (`cpu_fraction`: gloo's threads copying, reducing, in system calls) at
        that speed, the rest (waiting for a peer, a wake-up) as measured; the compute of a burst at that speed.
        Not in the live prediction (`Calibration.at_speed` says why): the live benchmark's alternative."""
        busy = min(1.0, max(0.0, self.cpu_fraction))
        scale = busy * factor + 1.0 - busy
        return replace(self, alpha_s=self.alpha_s * scale, beta_s_per_byte=self.beta_s_per_byte * scale,
                       compute_s=self.compute_s * factor, compute_cpu_s=self.compute_cpu_s * factor)


@dataclass
class Calibration:
    key: str
    created_s: float
    cpus: int
    torch: str
    compute: dict[str, Fit] = field(default_factory=dict)
    engine_units: dict[str, float] = field(default_factory=dict)  # seconds per engine span name
    compute_share: dict[int, float] = field(default_factory=dict)  # world -> slowdown when all compute
    resume_s: dict[int, float] = field(default_factory=dict)  # world -> seconds compute adds after communicating
    comm: dict[str, CommFit] = field(default_factory=dict)  # comm_key(world, kind, n, mode) -> fit
    probe: dict = field(default_factory=dict)  # hardware.probe.ProbeResult's fields: the roofline
    worlds: list[int] = field(default_factory=list)  # worlds whose communication was measured
    # the default Block's forward + backward on one rank alone, the speed the module fits are at (their
    # reference for `at_speed`): timed between their groups (`anchor_reference_s`; before and after them
    # all in an older file); 0: not measured (an older file still)
    reference_s: float = 0.0
    # world -> the group sizes whose communication was measured there (`comm_modes` of each); a world
    # without an entry (a file from before it was kept): the sizes its `comm` keys name
    group_sizes: dict[int, list[int]] = field(default_factory=dict)
    # elements of optimizer state one step cycles through -> the AdamW kernel's seconds per element there over its
    # seconds per element at the smallest size, whose state stays in the caches (`fit_adamw_state`; a ratio of two
    # timings, which the machine's speed of the moment scales alike); empty: not measured (an older file)
    adamw_state: dict[int, float] = field(default_factory=dict)
    # each rank's time for the reference Block over the slowest rank's, as the speed check right before a
    # run found them with every rank timing at once (engine/predict.at_speed_now); () where it timed one rank.
    # Of one moment, so never kept in the file.
    rank_pace: tuple[float, ...] = ()

    def measured_sizes(self, world: int) -> list[int]:
        """The group sizes whose communication was measured at `world` (none: the world was not measured)."""
        if world not in self.worlds:
            return []
        if world in self.group_sizes:
            return sorted(self.group_sizes[world])
        return sorted({n for w, _, n, _ in map(_parse_comm_key, self.comm) if w == world})

    def kind_sizes(self, world: int, kind: str, mode: str) -> list[int]:
        """The group sizes whose `kind` was timed at `world` in `mode`; where none was in that mode, those
        timed in any."""
        keys = [_parse_comm_key(k) for k in self.comm]
        timed = [(n, m) for w, k, n, m in keys if w == world and k == kind]
        return sorted({n for n, m in timed if m == mode} or {n for n, _ in timed})

    def missing_comm(self) -> list[str]:
        """The comm keys a sound calibration has and this one lacks: every operation and mode
        engine/calibrate.comm_task times (`comm_modes`) on every group size measured at each world (at least
        `default_group_sizes`)."""
        missing = []
        for w in self.worlds:
            for n in sorted(set(self.measured_sizes(w)) | set(default_group_sizes(w))):
                missing += [comm_key(w, kind, n, mode) for kind, mode in comm_modes(w, n)
                            if mode not in OPTIONAL_MODES and not _optional_load(w, mode)
                            and comm_key(w, kind, n, mode) not in self.comm]
        return missing

    def comm_fit(self, world: int, kind: str, n: int, mode: str = "sync") -> CommFit:
        key = comm_key(world, kind, n, mode)
        if key in self.comm:
            return self.comm[key]
        if mode == "async" and comm_key(world, kind, n, "sync") in self.comm:
            return self.comm[comm_key(world, kind, n, "sync")]
        raise CalibrationError(f"no calibration of {kind} on groups of {n} at world {world}; measure world {world}")

    def share(self, world: int) -> float:
        """How much slower each of `world` ranks computes than one rank per core (`fit_share`): 1 with no more
        ranks than cores."""
        if world <= max(1, self.cpus):
            return 1.0
        if world in self.compute_share:
            return self.compute_share[world]
        if not self.compute_share:
            return max(1.0, world / self.cpus)
        # more ranks than measured: the cores divide as in processor sharing
        w, s = max(self.compute_share.items())
        return s * max(1.0, world / w)

    def cores(self, world: int) -> float:
        """The cores' worth of compute the ranks of a `world`-rank run share, as measured: with more ranks
        than cores, each of `world` ranks computing at once ran at 1 / share(world) of the speed it has with
        one rank on each core (the scheduler's switches and the caches they cool included), so together they
        get world / share(world) cores (1.80 of 2 for 4 ranks measured 2.22x slower; the cores divided evenly
        would be 2.0x), never more than the machine has (a share below world / cores is the machine's drift
        between the timings). Worlds not measured, or no more ranks than cores: the machine's cores."""
        if world <= self.cpus or world not in self.compute_share:
            return float(self.cpus)
        return min(float(self.cpus), world / self.compute_share[world])

    def at_speed(self, reference_now_s: float) -> tuple[Calibration, float]:
        """(this calibration with its compute at the speed the machine runs now, the factor): the module fits
        and the engine's units scaled by `reference_now_s`, the reference Block timed again now, over
        `reference_s`. A shared machine's speed drifts (one rank's Block took 2.45-4.32 ms within a minute
        here, the engine's default step 4.6-15.8 ms over days). Communication, core sharing and resuming are
        kept as measured; ZB-H1's split is a ratio of two timings and is kept too. Scaling each gloo
        operation's CPU share with the check as well (`CommFit.at_speed`) was tried over four benchmarks of
        the live runs: the named runs read 13.1 % mean |error| with it against 10.7 without, better where the
        check read the machine faster than calibrated (0.55-0.97x) and worse where slower (1.02-2.00x);
        bench/bench_live_prediction.py prints it beside each run."""
        if self.reference_s <= 0 or reference_now_s <= 0:
            return self, 1.0
        factor = reference_now_s / self.reference_s
        compute = {op: f if op in RATIO_FITS else f.scaled(factor) for op, f in self.compute.items()}
        units = {name: factor * s for name, s in self.engine_units.items()}
        return replace(self, compute=compute, engine_units=units), factor

    @property
    def wide_units(self) -> dict[str, float]:
        """The engine's own step on the WIDE_UNITS model (engine.calibrate.engine_units): its spans' seconds by
        name, WIDE_PREFIX taken off ("step" the whole step); empty in a file measured before it was."""
        return {k[len(WIDE_PREFIX):]: v for k, v in self.engine_units.items() if k.startswith(WIDE_PREFIX)}

    def adamw_slowdown(self, elements: float) -> float:
        """How much slower per element the AdamW kernel runs in a step over `elements` (every tensor a rank
        updates) than the "adamw" fit says (`state_slowdown` of `adamw_state`)."""
        return state_slowdown(self.adamw_state, elements)

    def late_fits(self, world: int, n: int) -> list[CommFit] | None:
        """The late receives (`late_mode`) of groups of `n` at `world`, with 1, 2, ... world / 2 senders
        computing, in that order; None when any of them was not measured."""
        return self._by_senders(world, n, late_mode)

    def early_fits(self, world: int, n: int) -> list[CommFit] | None:
        """The messages sent to a waiting receive (`early_mode`), as `late_fits`."""
        return self._by_senders(world, n, early_mode)

    def send_post_fit(self, world: int, schedule: str = POSTING_SCHEDULES[0]) -> CommFit | None:
        """How long posting a pipeline message's isend holds its sender at `world` in `schedule`'s pipeline
        (`fit_posting`; a schedule not timed apart posts as the first of POSTING_SCHEDULES), or None when not
        measured."""
        mode = posting_mode(schedule if schedule in POSTING_SCHEDULES else POSTING_SCHEDULES[0])
        return self.comm.get(comm_key(world, "send_recv", 2, mode))

    def pair_speedup(self, world: int, kind: str, n: int, nbytes: float) -> float | None:
        """Operations' worth of work two asynchronous operations of a group posted at once get through in
        the time of one alone (GLOO_THREADS: gloo's worker threads each run at full speed; 1: no faster than
        one after the other), or None when not measured."""
        alone = self.comm.get(comm_key(world, kind, n, ALONE_MODE))
        pair = self.comm.get(comm_key(world, kind, n, PAIR_MODE))
        if alone is None or pair is None or pair.seconds(nbytes) <= 0:
            return None
        return 2 * alone.seconds(nbytes) / pair.seconds(nbytes)

    def idle_late_fit(self, world: int, n: int) -> CommFit | None:
        """The late receive of groups of `n` at `world` while no rank computes (`late_mode(0)`: the sender
        blocked in its wait), or None when not measured."""
        return self.comm.get(comm_key(world, "send_recv", n, late_mode(0)))

    def _by_senders(self, world: int, n: int, mode) -> list[CommFit] | None:
        """The fits of `mode` at each of `message_loads(world)` in turn: None where one of 1 .. world / 2 pairs
        is missing; the optional loads beyond them while they are there."""
        fits = []
        for k in message_loads(world):
            fit = self.comm.get(comm_key(world, "send_recv", n, mode(k)))
            if fit is None:
                return None if k <= world // 2 else fits
            fits.append(fit)
        return fits

    def probe_result(self):
        """The roofline as hardware.probe.ProbeResult (what the hardware lesson plots), or None."""
        from hardware.probe import ProbeResult

        return ProbeResult(**self.probe) if self.probe else None

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["rank_pace"]
        d["format"] = FORMAT
        d["compute_share"] = {str(k): v for k, v in self.compute_share.items()}
        d["resume_s"] = {str(k): v for k, v in self.resume_s.items()}
        d["adamw_state"] = {str(k): v for k, v in self.adamw_state.items()}
        d["group_sizes"] = {str(w): sorted(sizes) for w, sizes in self.group_sizes.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise CalibrationError("the calibration file is from another version of ShardLab")
        try:
            probe = dict(d["probe"])
            if probe:
                from hardware.probe import ProbeResult

                ProbeResult(**probe)  # the roofline the hardware lesson draws: its fields, or a TypeError
                _numbers({k: v for k, v in probe.items() if k not in ("threads", "dtype", "details") and v is not None})
            cal = cls(key=str(d["key"]), created_s=_finite(d["created_s"]), cpus=int(d["cpus"]),
                      torch=str(d["torch"]),
                      compute={k: Fit(**_numbers(v)) for k, v in d["compute"].items()},
                      engine_units={k: _finite(v) for k, v in d["engine_units"].items()},
                      compute_share={int(k): _finite(v) for k, v in d["compute_share"].items()},
                      resume_s={int(k): _finite(v) for k, v in d["resume_s"].items()},
                      adamw_state={int(k): _finite(v) for k, v in d.get("adamw_state", {}).items()},
                      comm={k: CommFit(**_numbers(v)) for k, v in d["comm"].items()},
                      probe=probe,
                      worlds=[int(w) for w in d["worlds"]], reference_s=_finite(d.get("reference_s", 0.0)),
                      group_sizes={int(w): sorted(int(n) for n in sizes)
                                   for w, sizes in d.get("group_sizes", {}).items()})
            for k in cal.comm:
                _parse_comm_key(k)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:  # int(1e400): OverflowError
            raise CalibrationError(f"the calibration file is malformed ({type(e).__name__}: {e})") from None
        wrong = _impossible(cal)
        if wrong:
            raise CalibrationError(f"the calibration file holds impossible values ({'; '.join(wrong[:3])}"
                                   f"{f'; {len(wrong) - 3} more' if len(wrong) > 3 else ''})")
        return cal


def _parse_comm_key(key: str) -> tuple[int, str, int, str]:
    """(world, kind, n, mode) of a `comm_key`; ValueError for anything else."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0][:1] != "w" or parts[2][:1] != "n":
        raise ValueError(f"{key!r} is not a communication key (w<world>/<kind>/n<size>/<mode>)")
    return int(parts[0][1:]), parts[1], int(parts[2][1:]), parts[3]


def _impossible(cal: Calibration) -> list[str]:
    """What a calibration read from a file holds that no measurement makes (`fit_compute`, `fit_comm`,
    `fit_posting`, `fit_share`, `fit_resume` never fit these): each would crash the prediction or make it
    absurd, so the file is measured again. Every fit coefficient is a time or a time per unit, and each fit
    keeps its terms >= 0 (`nonnegative_fit`, `_fit_items`, the ratios and differences clamped at 0)."""
    wrong = []
    if cal.cpus < 1:
        wrong.append(f"cpus is {cal.cpus}")
    for op, f in cal.compute.items():
        wrong += [f"compute {op} {name} is {v}" for name, v in asdict(f).items() if v < 0]
    wrong += [f"engine unit {name!r} is {s} s" for name, s in cal.engine_units.items() if s < 0]
    if 1 not in cal.compute_share:
        wrong.append("compute_share has no world 1 (one rank alone)")
    # a slowdown: fit_share never fits one below 1 (a world's ranks computing at once never run faster)
    wrong += [f"compute_share[{w}] is {s}" for w, s in cal.compute_share.items() if w < 1 or s < 1.0]
    wrong += [f"resume_s[{w}] is {s}" for w, s in cal.resume_s.items() if w < 1 or s < 0]
    wrong += [f"adamw_state[{n}] is {r}" for n, r in cal.adamw_state.items() if n < 1 or r <= 0]
    for k, f in cal.comm.items():
        wrong += [f"{k} {name} is {v}" for name, v in asdict(f).items()
                  if name != "stalls" and (v < 0 or (name == "cpu_fraction" and v > 1))]
    for w in cal.worlds:
        if w < 2:
            wrong.append(f"world {w} has no communication to measure")
        elif w not in cal.compute_share or w not in cal.resume_s:
            wrong.append(f"world {w} has no core sharing or resuming measured")
        if w in cal.group_sizes and any(n < 2 or w % n for n in cal.group_sizes[w]):
            wrong.append(f"world {w} lists groups of {cal.group_sizes[w]}")
    wrong += [f"group sizes of world {w}, which was not measured" for w in cal.group_sizes if w not in cal.worlds]
    if cal.reference_s < 0:
        wrong.append(f"reference_s is {cal.reference_s}")
    for name in ("matmul_flops_per_s", "memory_bytes_per_s", "bf16_matmul_flops_per_s"):
        v = cal.probe.get(name)
        if isinstance(v, (int, float)) and v <= 0:
            wrong.append(f"probe {name} is {v}")
    return wrong


def _finite(value) -> float:
    """One number of the file: finite (a NaN speed or age would pass every comparison that guards it)."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _numbers(fields: dict) -> dict:
    """A fit's fields as read from the file, each a finite number (a string "1" or a null is not a timing)."""
    for name, value in fields.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} is {value!r}, not a finite number")
    return fields


def speed_words(factor: float) -> str:
    """`Calibration.at_speed`'s factor in words, for the pages and the command line."""
    how = f"{factor:.2f}x slower" if factor >= 1 else f"{1 / factor:.2f}x faster"
    return (f"this machine ran its reference Block {how} right before this run, on the run's own ranks, than "
            "when it was calibrated, "
            "so the prediction's compute was scaled by that (its communication was not)")


# How far the speed check (engine/predict.at_speed_now) may read this machine from its calibration before a
# prediction says it is rough. On a quiet machine it read 0.55-2.00x over four benchmarks of 34 runs each
# (bench/bench_live_prediction.py), and the named runs' predictions held (8.5-16.6 % mean error); with a browser
# drawing the pages on the same 2 cores, 1.4-8.0x, and one error reached 116 %.
BUSY_SPEED_FACTOR = 2.5


def busy_words(factor: float) -> str | None:
    """A warning, for the pages and the command line, when `Calibration.at_speed`'s factor is BUSY_SPEED_FACTOR
    or more from 1; None otherwise."""
    if 1 / BUSY_SPEED_FACTOR < factor < BUSY_SPEED_FACTOR:
        return None
    if factor >= 1:
        return (f"this machine was busy: right before this run it ran its reference computation {factor:.1f}x "
                "slower than when it was calibrated, so other programs (a browser drawing the pages counts, on a "
                "machine of few cores) were using its cores. The prediction scales its compute by that, but a "
                "machine this busy changes speed within a run and stalls its communication: read the comparison "
                "as rough, and run again when the machine is quiet.")
    return (f"the calibration was made on a busy machine: right before this run this machine ran its reference "
            f"computation {1 / factor:.1f}x faster than when it was calibrated. Measure it again when the machine "
            "is quiet (the Hardware lesson's button, or bench --remeasure): its communication timings are of that "
            "busy moment too.")


def comm_key(world: int, kind: str, n: int, mode: str) -> str:
    return f"w{world}/{kind}/n{n}/{mode}"


def posting_mode(schedule: str) -> str:
    """The CommFit mode of a pipeline message's posting timed in `schedule`'s pipeline (POSTING_SCHEDULES):
    POST_MODE for the first, POST_MODE-<schedule> for the others."""
    return POST_MODE if schedule == POSTING_SCHEDULES[0] else f"{POST_MODE}-{schedule}"


def default_group_sizes(world: int) -> list[int]:
    """The group sizes every calibration of `world` measures: pairs and the whole world (those that divide it)."""
    return sorted({n for n in (2, world) if world % n == 0 and n > 1})


def comm_modes(world: int, n: int) -> list[tuple[str, str]]:
    """(kind, mode) of every operation engine/calibrate.comm_task times on groups of `n` ranks at `world`
    (one definition for the measurement and for `load`'s check that a file has all of it)."""
    kinds = [k for k in COMM_KINDS if not (k == "send_recv" and n % 2)]  # pairs: an even group only
    out = [(kind, "sync") for kind in kinds]
    out.append(("ring_shift", POST_MODE))  # the same calls' posting (engine/calibrate._Shift)
    out += [(kind, mode) for mode in (*BLOCKING_MODES, BACK_TO_BACK_MODE) if mode != "sync"
            for kind in SYNC_GAP_KINDS]
    out += [(kind, mode) for mode in ("async", ALONE_MODE, PAIR_MODE, "contended") for kind in ASYNC_KINDS]
    if n % 2 == 0:  # a pipeline's messages (engine/calibrate._pipeline_messages), 1 .. world / 2 pairs at once
        out += [("send_recv", mode(k)) for mode in (late_mode, early_mode) for k in message_loads(world)]
        out.append(("send_recv", late_mode(0)))
    return out


def message_loads(world: int) -> range:
    """The loads a pipeline's messages are timed at (`late_mode`, `early_mode`): k cores' worth of work wanted as
    the message moves, the index planner.eventsim.Send picks its time by. 1 .. world / 2 pairs exchange at once,
    each pair's sender computing (engine/calibrate._pipeline_messages); at world 2, where one pair is all, a
    second load is that pair beside a thread that keeps a core busy (`message_spinners`), as the peer's compute
    or an in-flight bucket all-reduce's gloo thread does: a 2-rank Mamba-2 context-parallel run's state and halo
    messages took 2-6 ms under its data-parallel buckets, against 0.3 ms timed with one pair alone. The loads
    beyond world / 2 are optional: a file without them prices every busier message as the last one timed."""
    return range(1, max(2, world // 2) + 1)


def message_spinners(world: int, load: int) -> int:
    """Busy threads beside the exchanging pairs that make `load` at `world` (`message_loads`)."""
    return max(0, load - world // 2)


def late_mode(senders: int) -> str:
    """The send_recv mode of a receive posted after its send while `senders` ranks compute (CommFit; 0:
    the sender blocked in its wait)."""
    return f"late{senders}"


def early_mode(senders: int) -> str:
    """The send_recv mode of a message sent to a receive already waiting, `senders` ranks computing."""
    return f"early{senders}"


def _optional_load(world: int, mode: str) -> bool:
    """Whether `mode` is a message timed at one of the optional loads of `world` (`message_loads`)."""
    kind = message_mode(mode)
    return kind is not None and message_spinners(world, kind[1]) > 0


def message_mode(mode: str) -> tuple[str, int] | None:
    """("late" or "early", senders computing) of a mode `late_mode` or `early_mode` made, else None."""
    for prefix in ("late", "early"):
        if mode.startswith(prefix) and mode[len(prefix):].isdigit():
            return prefix, int(mode[len(prefix):])
    return None


# -- the machine and its cache file ----------------------------------------------------------------------

def cpu_count() -> int:
    """Cores this process may run on (a container's CPU set, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(torch_version: str) -> str:
    ident = "|".join([platform.node(), _cpu_model(), str(cpu_count()), torch_version, platform.python_version()])
    return hashlib.sha1(ident.encode()).hexdigest()[:12]


def cache_dir() -> Path:
    if os.environ.get("SHARDLAB_CACHE_DIR"):
        return Path(os.environ["SHARDLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardlab"


def cache_path(key: str) -> Path:
    return cache_dir() / f"this-machine-{key}.json"


def load(key: str, now_s: float | None = None) -> tuple[Calibration | None, str]:
    """(calibration, "") from the cache, or (None, why it cannot be used: missing, corrupt, stale)."""
    path = cache_path(key)
    remove_stale_tmp(path.parent)
    if not path.exists():
        return None, "no calibration of this machine yet"
    try:
        cal = Calibration.from_dict(json.loads(path.read_text()))
    except CalibrationError as e:
        return None, f"{e}; measuring again"
    # not JSON, not UTF-8, or nested past Python's limit (JSON of another shape is Calibration.from_dict's)
    except (OSError, ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e) or type(e).__name__
        return None, f"the calibration file {path} is unreadable ({reason}); measuring again"
    if cal.key != key:
        return None, "the calibration file belongs to another machine; measuring again"
    age = (now_s or time.time()) - cal.created_s
    if age > STALE_AFTER_S:
        return None, f"the calibration is {age / 86400:.0f} days old; measuring again"
    if age < -FUTURE_SKEW_S:
        return None, (f"the calibration is dated {-age / 3600:,.1f} hours in the future (the clock was changed, or "
                      "the file edited), so its age is unknown; measuring again")
    missing = [op for op in COMPUTE_FITS if op not in cal.compute]
    if not cal.adamw_state:
        missing.append("the optimizer over more state than the caches hold")
    if "step" not in cal.wide_units:
        missing.append("the engine's own step on a wider model")
    if cal.reference_s <= 0:
        missing.append("the reference Block its speed is checked against")
    # a pipeline's messages (engine/calibrate._pipeline_messages), timed on every even world's pairs, with
    # each number of them exchanging at once
    if any(cal.late_fits(w, 2) is None for w in cal.worlds if w % 2 == 0):
        missing.append("a receive posted after its send")
    if any(cal.idle_late_fit(w, 2) is None for w in cal.worlds if w % 2 == 0):
        missing.append("a receive posted after its send with the sender blocked")
    if any(cal.early_fits(w, 2) is None for w in cal.worlds if w % 2 == 0):
        missing.append("a message sent to a waiting receive")
    if any(cal.send_post_fit(w, schedule) is None for w in cal.worlds for schedule in POSTING_SCHEDULES):
        missing.append("the posting of a pipeline message")
    if any(comm_key(w, "all_reduce", w, PAIR_MODE) not in cal.comm for w in cal.worlds):
        missing.append("two asynchronous operations at once")
    if missing:
        return None, (f"the calibration has no timing of {', '.join(missing)} (an older ShardLab measured it); "
                      "measuring again")
    # every operation the measurement times, on every group size it measured (a file cut short by hand,
    # or by another version): the prediction would refuse each run that needs one, and nothing re-measured
    gaps = cal.missing_comm()
    if gaps:
        return None, (f"the calibration has no timing of {', '.join(gaps[:3])}"
                      f"{f' and {len(gaps) - 3} more' if len(gaps) > 3 else ''}; measuring again")
    return cal, ""


# How engine/predict.ensure_calibration begins its message when the cache folder cannot be written (the process
# keeps the calibration; the next one measures again): the pages find it by these words and warn.
NOT_KEPT_WORDS = "could not keep the calibration in"


def save(cal: Calibration) -> Path:
    """Write atomically: a crash never leaves a half-written calibration."""
    path = cache_path(cal.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cal.to_dict(), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def remove_stale_tmp(folder: Path, now_s: float | None = None) -> list[Path]:
    """Remove the temporary files `save` left in `folder` (a process killed mid-write: SIGKILL skips its
    cleanup) once STALE_TMP_S old, so never another live writer's; returns those removed. Only `save`'s
    names: TMP_PREFIX*.tmp, and the tmp*.tmp of older ShardLab (mkstemp's "tmp" and 8 characters)."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = now_s or time.time()
    for entry in entries:
        name = entry.name
        ours = name.endswith(".tmp") and (name.startswith(TMP_PREFIX) or
                                          (name.startswith("tmp") and len(name) == len("tmp") + 8 + len(".tmp")))
        try:
            if ours and entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime > STALE_TMP_S:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:  # gone meanwhile (another process cleaned it), or not ours to remove
            continue
    return removed


# -- fitting the measurements ------------------------------------------------------------------------

def nonnegative_fit(rows: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Least squares of y = alpha * a + beta * b over rows (a, b, y), both kept >= 0 (a negative cost
    only fits noise: the fit is redone with that term at zero); None when the rows cannot tell the two
    terms apart (one size only). The calibration fits alpha + beta * bytes with it, the collectives
    sweep (engine/sweep.py) the ring model's terms."""
    saa = sum(a * a for a, _, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    say = sum(a * y for a, _, y in rows)
    sby = sum(b * y for _, b, y in rows)
    det = saa * sbb - sab * sab
    if not det > 1e-12 * saa * sbb:
        return None
    alpha, beta = (say * sbb - sby * sab) / det, (saa * sby - sab * say) / det
    if alpha < 0:
        return 0.0, max(0.0, sby / sbb)
    if beta < 0:
        return max(0.0, say / saa), 0.0
    return alpha, beta


def ring_terms(op: str, world: int, size_bytes: float) -> tuple[float, float]:
    """(coefficient of alpha, coefficient of beta) in the op's cost as gloo runs it: T = a * alpha + b * beta,
    the ring's for the gathers and reductions, a pairwise exchange's for all-to-all (n - 1 steps, each rank
    sending (n - 1) / n of its buffer; a ring all-to-all would forward (n - 1) / 2 of it)."""
    n = world
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n * size_bytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, (n - 1) / n * size_bytes
    raise ValueError(f"op {op!r} is unknown; use one of all_gather, reduce_scatter, all_reduce, all_to_all")


def fit_alpha_beta(measurements: list[dict], op: str) -> tuple[float, float]:
    """Least squares of `ring_terms` on the measurements of `op` -> (alpha_s, beta_s_per_byte), both kept
    non-negative (a negative latency would only fit noise), each point's error relative to its time, as the
    sweep's log-log chart shows it: in absolute seconds over sizes 4,096x apart one slow small message had
    set alpha (a 3.7 ms point among 0.3-0.8 ms ones fitted 1.1 ms)."""
    rows = [(*ring_terms(op, m["world"], m["bytes"]), m["seconds"]) for m in measurements if m["op"] == op]
    if len(rows) < 2:
        raise ValueError(f"fitting {op} needs at least two measurements of it, got {len(rows)}")
    fit = nonnegative_fit([(a / t, b / t, 1.0) for a, b, t in rows] if all(t > 0 for *_, t in rows) else rows)
    if fit is None:  # one size only: the latency term cannot be told apart, all of it goes to beta
        sbb = sum(b * b for _, b, _ in rows)
        return 0.0, max(0.0, sum(b * t for _, b, t in rows) / sbb)
    return fit


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """y = a + b x over the points (nonnegative_fit); one size only: its mean, all in a."""
    if not points:
        raise CalibrationError("no measurement to fit")
    fit = nonnegative_fit([(1.0, x, y) for x, y in points])
    return fit if fit is not None else (max(0.0, sum(y for _, y in points) / len(points)), 0.0)


def work(op: str, s: dict) -> float:
    """The work measure each module's time grows with (FLOPs, or elements moved), from its shape."""
    if op == "linear":
        return 2.0 * s["m"] * s["k"] * s["n"]
    if op == "rmsnorm":
        return float(s["m"] * s["d"])
    if op == "attention":  # the projections, and QK^T and PV over the scores the kernel computes
        tokens, hd = s["b"] * s["t"], s["head_dim"]
        proj = 2.0 * tokens * s["d"] * (2 * s["heads"] + 2 * s["kv_heads"]) * hd
        return proj + 4.0 * hd * score_elements(op, s)
    if op == "swiglu":
        return 6.0 * s["b"] * s["t"] * s["d"] * s["ffn"]
    if op == "embed":
        return float(s["b"] * s["t"] * s["d"])
    if op == "head":
        return 2.0 * s["b"] * s["t"] * s["d"] * s["vocab"]
    if op in ("moe", "moe_ep"):
        # the router over every expert, and the experts over the rows they take: each token's top_k copies
        # (under expert parallelism the rank's local experts take every ep rank's copies meant for them, as
        # many rows as the rank sent away when the routing is balanced)
        tokens = s["b"] * s["t"]
        return 2.0 * tokens * s["d"] * s["experts"] + 6.0 * tokens * s["top_k"] * s["d"] * s["ffn"]
    if op == "mamba":
        return _mamba_flops(s)
    if op == "mamba_state":  # the incoming state's outputs C_t . h0 over the rank's tokens
        return state_correction_flops(s["b"] * s["t"], s["heads"], s["head_dim"], s["state"])
    if op in ("ring_block", "ring_diag"):
        return 4.0 * s["b"] * s["heads"] * s["rows"] * s["cols"] * s["head_dim"]
    if op == "adamw":
        return float(s["numel"])
    return 0.0


def _mamba_flops(s: dict) -> float:
    """core/ssd.py's count of one Mamba-2 block, at a shape that may be one rank's (tp's heads and groups,
    cp's tokens)."""
    return mamba_block_flops(s["b"], s["t"], s["d"], s["inner"], s["heads"], s["head_dim"], s["groups"],
                             s["state"], s["chunk"], s["conv"])


def scan_steps(s: dict) -> int:
    """Steps of the SSD scan's loop over chunks (engine/mamba.ssd_scan) in one call on the shape's sequence:
    each a few tensor operations whatever the shape, so the Mamba fit counts them apart from the FLOPs."""
    return max(1, s["t"] // s["chunk"])


def anchor_reference_s(samples: list[dict]) -> float:
    """The speed `fit_compute` puts the module timings at: the median of the reference Block times their
    groups were anchored to (`engine.calibrate._Anchors`), the calibration's `reference_s`; 0 where the
    samples carry none."""
    anchors = [smp["anchor_s"] for smp in samples if smp.get("anchor_s", 0) > 0]
    return statistics.median(anchors) if anchors else 0.0


def at_anchor_speed(samples: list[dict]) -> list[dict]:
    """Each anchored sample's times as they would have read at `anchor_reference_s`: scaled by it over the
    reference Block timed around the sample's group. Samples without an anchor are kept as they are."""
    reference = anchor_reference_s(samples)
    if reference <= 0:
        return samples
    return [dict(smp, fwd_s=smp["fwd_s"] * reference / smp["anchor_s"],
                 bwd_s=smp["bwd_s"] * reference / smp["anchor_s"]) if smp.get("anchor_s", 0) > 0 else smp
            for smp in samples]


def fit_compute(samples: list[dict]) -> tuple[dict[str, Fit], dict[str, float], dict]:
    """(module fits, engine unit seconds, the roofline probe's result as a dict) from
    `engine.calibrate.measure_compute` samples, at one speed of the machine (`at_anchor_speed`)."""
    by_op: dict[str, list[dict]] = {}
    for smp in at_anchor_speed(samples):
        by_op.setdefault(smp["op"], []).append(smp)
    fits: dict[str, Fit] = {}
    for op, rows in by_op.items():
        if op in ("engine_unit", "engine_step", "engine_optimizer", "probe", "block", "copy", "adamw_state"):
            continue
        if op == "zb_split":
            # ZB-H1's two backward halves per second of the plain backward they replace (work = that
            # backward's seconds): forward = BI, backward = BW
            plain = rows[0]["shape"]["plain_bwd_s"]
            fits["zb_split"] = Fit(0.0, rows[0]["fwd_s"] / plain, 0.0, rows[0]["bwd_s"] / plain)
            s = rows[0]["shape"]
            if "record_fwd_s" in s:  # its forward, recording for the split, per second of the plain one
                fits["zb_record"] = Fit(0.0, s["record_fwd_s"] / s["plain_fwd_s"], 0.0, 0.0)
            continue
        if op == "moe":
            # fixed + per expert (each expert runs, even on no rows) + per FLOP: three shapes, three unknowns
            fits["moe"] = _fit_moe(rows)
            continue
        if op == "moe_ep":  # fixed + per local expert + per FLOP, over engine.calibrate.EP_MOE_SHAPES
            fits["moe_ep"] = _fit_items("moe_ep", rows, lambda shape: shape["experts"] // shape["ep"])
            continue
        if op == "mamba":  # fixed + per step of the scan's chunk loop + per FLOP
            fits["mamba"] = _fit_items("mamba", rows, scan_steps, refit=True)
            continue
        if op == "mamba_state":  # fixed + per slice past the first (its own conv and scan) + per FLOP
            fits["mamba_state"] = _fit_relative("mamba_state", rows, lambda shape: shape["slices"] - 1)
            continue
        if op in ("attention", "ring_block", "ring_diag"):  # fixed + per score + per FLOP
            fits[op] = _fit_scores(op, rows)
            continue
        f = _fit_line([(work(op, r["shape"]), r["fwd_s"]) for r in rows])
        b = _fit_line([(work(op, r["shape"]), r["bwd_s"]) for r in rows])
        fits[op] = Fit(f[0], f[1], b[0], b[1])
    blocks = by_op.get("block", [])
    if blocks and {"rmsnorm", "attention", "swiglu"} <= set(fits):
        # what a Block adds around its modules (two residual adds, the module calls)
        s = blocks[0]["shape"]
        parts_f = parts_b = 0.0
        norm_w = s["b"] * s["t"] * s["d"]
        att = {"b": s["b"], "t": s["t"], "d": s["d"], "heads": s["heads"], "kv_heads": s["kv_heads"],
               "head_dim": s["d"] // s["heads"]}
        mlp = {"b": s["b"], "t": s["t"], "d": s["d"], "ffn": s["ffn"]}
        for op, w in (("rmsnorm", norm_w), ("rmsnorm", norm_w), ("attention", work("attention", att)),
                      ("swiglu", work("swiglu", mlp))):
            parts_f += fits[op].fwd(w)
            parts_b += fits[op].bwd(w)
        fits["block_glue"] = Fit(max(0.0, blocks[0]["fwd_s"] - parts_f), 0.0,
                                 max(0.0, blocks[0]["bwd_s"] - parts_b), 0.0)
    opt = by_op.get("engine_optimizer")
    if opt and "adamw" in fits:
        # what the engine's optimizer step adds per tensor around the AdamW kernel (its loop, the state
        # lookups, the recorder): its own step at world 1 against the kernel's fit
        n, numel = opt[0]["shape"]["tensors"], opt[0]["shape"]["numel"]
        slowdown = state_slowdown(fit_adamw_state(samples), numel)
        kernel = n * fits["adamw"].fwd_fixed_s + numel * fits["adamw"].fwd_per_unit_s * slowdown
        fits["optimizer_driver"] = Fit(max(0.0, opt[0]["fwd_s"] - kernel) / n, 0.0)
    units = {r["shape"]["name"]: r["fwd_s"] for r in by_op.get("engine_unit", [])}
    if by_op.get("engine_step"):
        units["step"] = by_op["engine_step"][0]["fwd_s"]
    probe = next((r["probe"] for r in by_op.get("probe", [])), {})
    return fits, units, probe


def fit_adamw_state(samples: list[dict]) -> dict[int, float]:
    """`Calibration.adamw_state` from `engine.calibrate.measure_compute`'s "adamw_state" samples (a step's
    seconds over its elements at each size): each size's seconds per element over the smallest size's."""
    per_element = {int(s["shape"]["numel"]): s["fwd_s"] / s["shape"]["numel"]
                   for s in samples if s["op"] == "adamw_state" and s["fwd_s"] > 0}
    if not per_element:
        return {}
    base = per_element[min(per_element)]
    return {n: v / base for n, v in sorted(per_element.items())}


def log_position(x: float, low: float, high: float) -> float:
    """Where `x` lies from `low` (0) to `high` (1) in log size, held at the ends."""
    if x <= low or high <= low:
        return 0.0
    return min(1.0, math.log(x / low) / math.log(high / low))


def state_slowdown(adamw_state: dict[int, float], elements: float) -> float:
    """The AdamW kernel's seconds per element in a step over `elements` over the "adamw" fit's, which was timed
    on one tensor whose state stays in the caches: `adamw_state` (`fit_adamw_state`) interpolated in log size,
    1 up to its smallest size, its largest's beyond (the state streamed from memory at a steady rate); 1 where
    it was not measured."""
    points = sorted(adamw_state.items())
    if not points or elements <= points[0][0]:
        return 1.0
    for (n0, r0), (n1, r1) in zip(points, points[1:], strict=False):
        if elements <= n1:
            return r0 + (r1 - r0) * log_position(elements, n0, n1)
    return points[-1][1]


# PyTorch's CPU FlashAttention kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, forward and backward),
# which torch.nn.functional.scaled_dot_product_attention runs for the engine's attention on CPU: queries in blocks
# of 32 rows, 64 from 192 tokens, 256 from 768; keys in blocks of 512; with is_causal a query block computes
# only the key blocks up to its last row's position, each whole
SDPA_Q_SPLITS = ((768, 256), (192, 64), (0, 32))  # (queries at least, rows per block)
SDPA_KV_SPLIT = 512


def sdpa_scores(t: int) -> int:
    """Scores one head's causal attention over `t` tokens computes in the CPU kernel (SDPA_Q_SPLITS): every
    t x t up to 512 tokens (one key block holds them all), 3/4 of them at 1,024."""
    q_split = next(rows for least, rows in SDPA_Q_SPLITS if t >= least)
    total = 0
    for m in range(0, t, q_split):
        block = min(q_split, t - m)
        keys = min(m + block, t)
        total += block * min(t, -(-keys // SDPA_KV_SPLIT) * SDPA_KV_SPLIT)
    return total


def score_elements(op: str, s: dict) -> float:
    """The attention scores a module computes: the engine's attention ("attention": b x heads x `sdpa_scores`)
    or one ring step's block ("ring_block"; "ring_diag" the first, masked: b x heads x rows x cols, materialised).
    Each passes through the softmax and its backward, work whose cost per score is the same at any head dim, so
    at the engine's small head dims (16 at the default width) it is not proportional to the FLOPs (`work`): one
    fit line through the FLOPs of short sequences had put a 256 x 256 ring block at 0.49x its time, attention at
    256 tokens 0.80x. The causal mask of the first ring step costs per score too: 1.3x the unmasked block's time
    at 16 x 16 here, 1.8-3.7x at 64 to 256."""
    if op == "attention":
        return float(s["b"] * s["heads"] * sdpa_scores(s["t"]))
    if op in ("ring_block", "ring_diag"):
        return float(s["b"] * s["heads"] * s["rows"] * s["cols"])
    return 0.0


def _fit_scores(op: str, rows: list[dict]) -> Fit:
    """t = a + e * score elements + c * FLOPs (`score_elements`, `_fit_relative`): the shapes span 100x in
    time; in absolute seconds the longest would set every term."""
    return _fit_relative(op, rows, lambda shape: score_elements(op, shape))


def _fit_relative(op: str, rows: list[dict], items) -> Fit:
    """t = a + e * items(shape) + c * work(op, shape), forward and backward, each shape's error relative to its
    time, every term kept >= 0 (`_relative_nonnegative`)."""
    def solve(key: str) -> tuple[float, float, float]:
        return _relative_nonnegative([(1.0, items(r["shape"]), work(op, r["shape"])) for r in rows],
                                     [r[key] for r in rows])

    fa, fe, fc = solve("fwd_s")
    ba, be, bc = solve("bwd_s")
    return Fit(fa, fc, ba, bc, fe, be)


def _relative_nonnegative(xs: list[tuple[float, float, float]], ys: list[float]) -> tuple[float, float, float]:
    """Least squares of y = x . (a, e, c) with each row's error relative to its y, every coefficient >= 0: the
    three-term solution where none is negative, else the best of the two-term ones (`nonnegative_fit`, a third
    term at zero) by relative squared error. Rows with no time carry no weight."""
    rows = [tuple(v / y for v in x) for x, y in zip(xs, ys, strict=True) if y > 0]  # each to fit 1
    if not rows:
        return 0.0, 0.0, 0.0
    coef = _lstsq3(rows, [1.0] * len(rows))
    if min(coef) >= 0:
        return coef

    def error(c) -> float:
        return sum((sum(ci * xi for ci, xi in zip(c, x, strict=True)) - 1.0) ** 2 for x in rows)

    best = None
    for i, j in ((0, 1), (0, 2), (1, 2)):
        pair = nonnegative_fit([(x[i], x[j], 1.0) for x in rows])
        if pair is None:
            continue
        c = [0.0, 0.0, 0.0]
        c[i], c[j] = pair
        if best is None or error(c) < error(best):
            best = c
    return tuple(best) if best is not None else (0.0, 0.0, 0.0)


def _fit_moe(rows: list[dict]) -> Fit:
    return _fit_items("moe", rows, lambda shape: shape["experts"])


def _fit_items(op: str, rows: list[dict], items, refit: bool = False) -> Fit:
    """Least squares of t = a + e * items(shape) + c * work(op, shape), forward and backward. `refit`: a
    negative term only fits noise (one slow measurement among five moved a Mamba fit's backward to
    0 + 3.3 ms per scan step), so that direction is fitted again as fixed + per unit of work alone."""
    def solve(key: str) -> tuple[float, float, float]:
        xs = [(1.0, items(r["shape"]), work(op, r["shape"])) for r in rows]
        ys = [r[key] for r in rows]
        a, e, c = _lstsq3(xs, ys)
        if refit and min(a, e, c) < 0:
            a, c = _fit_line([(x[2], y) for x, y in zip(xs, ys, strict=True)])
            e = 0.0
        return max(0.0, a), max(0.0, e), max(0.0, c)

    fa, fe, fc = solve("fwd_s")
    ba, be, bc = solve("bwd_s")
    return Fit(fa, fc, ba, bc, fe, be)


def _lstsq3(xs: list[tuple[float, float, float]], ys: list[float]) -> tuple[float, float, float]:
    """Normal equations for three unknowns (Cramer's rule) over the columns scaled to a root mean square of 1,
    so that whether they are singular does not hang on their units (seconds per FLOP against per call); falls
    back to a constant when singular."""
    scale = [math.sqrt(sum(x[i] ** 2 for x in xs) / len(xs)) or 1.0 for i in range(3)]
    xs = [tuple(x[i] / scale[i] for i in range(3)) for x in xs]
    ata = [[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)]
    aty = [sum(x[i] * y for x, y in zip(xs, ys, strict=True)) for i in range(3)]

    def det(m):
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    d = det(ata)
    if abs(d) < 1e-12 * len(xs) ** 3:
        return sum(ys) / len(ys), 0.0, 0.0
    out = []
    for i in range(3):
        m = [row[:] for row in ata]
        for r in range(3):
            m[r][i] = aty[r]
        out.append(det(m) / d / scale[i])
    return out[0], out[1], out[2]


def fit_comm(world: int, rows: list[list[dict]]) -> dict[str, CommFit]:
    """Per operation: alpha and beta from the slowest rank's mean time at each size; the mean CPU share."""
    grouped: dict[tuple[str, int, str], dict[int, list[tuple[float, float]]]] = {}
    extra: dict[tuple[str, int, str], tuple[int, float, float]] = {}
    gaps: dict[tuple[str, int, str], float] = {}
    for rank_rows in rows:
        for r in rank_rows:
            key = (r["kind"], r["n"], r["mode"])
            # a burst's process CPU time includes the rank's own compute between the operations it posts
            # (engine/calibrate.py: `burst` computes of `compute_cpu_s` CPU seconds each, one thread): the
            # operations' share is the rest. Counted whole, planner.eventsim charged that compute twice, once as
            # the rank's and once in the operation's weight (at world 2, 0.66 of a core per rank for an
            # all-gather, about 0.2 of it the rank's own compute). Its CPU seconds, not its wall time: with 4
            # ranks on 2 cores one calibration read 0.12-0.35 ms of wall for 0.12-0.15 ms of CPU rank by rank,
            # and taking the wall out left an all-gather of a pair 0.13 of a core where the CPU leaves 0.26
            own = r.get("compute_cpu_s", r.get("compute_s", 0.0))
            cpu_s = max(0.0, r["cpu_s"] - r.get("burst", 0) * own)
            grouped.setdefault(key, {}).setdefault(r["bytes"], []).append((r["seconds"], cpu_s))
            if "compute_s" in r:
                _, wall, cpu = extra.get(key, (0, 0.0, 0.0))
                extra[key] = (r.get("burst", 0), max(wall, r["compute_s"]), max(cpu, r.get("compute_cpu_s", 0.0)))
            gaps[key] = r.get("gap_s", 0.0)
    out = {}
    for (kind, n, mode), by_size in grouped.items():
        points = [(nbytes, max(t for t, _ in v)) for nbytes, v in by_size.items()]
        alpha, beta = _fit_line(points)
        wall = sum(t for v in by_size.values() for t, _ in v)
        cpu = sum(c for v in by_size.values() for _, c in v)
        burst, compute_s, compute_cpu_s = extra.get((kind, n, mode), (0, 0.0, 0.0))
        stalls = mode == "contended" and max(t for _, t in points) >= 0.9 * CONTENDED_CAP_S
        out[comm_key(world, kind, n, mode)] = CommFit(alpha, beta, min(1.0, cpu / wall) if wall > 0 else 0.0,
                                                      burst, compute_s, stalls, gaps[(kind, n, mode)],
                                                      compute_cpu_s)
    return out


def fit_posting(world: int, per_rank: list[list[float]],
                schedule: str = POSTING_SCHEDULES[0]) -> dict[str, CommFit]:
    """How long posting a pipeline message's isend holds its sender (engine/calibrate.pipeline_posting: each
    rank's postings in the engine's own `schedule` pipeline): the mean over every rank's messages, one number
    (the default model's messages are all one size), as send_recv's `posting_mode` of a pair. A posting holds one rank,
    so it is the mean over the ranks, not the slowest rank's as for a collective."""
    seconds = [s for rank in per_rank for s in rank]
    if not seconds:
        raise ValueError(f"the engine's pipeline at world {world} posted no message to time")
    return {comm_key(world, "send_recv", 2, posting_mode(schedule)): CommFit(statistics.fmean(seconds), 0.0, 0.0)}


def fit_share(shared: list[list[dict]], per_core: list[dict]) -> float:
    """Mean slowdown of a Block's forward + backward when the ranks of `shared` run it at once, against the
    same Block timed on one rank per core (every core busy, as the speed check times it: engine/predict.
    at_speed_now) right before and right after them (`per_core`, each such rank's timing). Against one rank
    alone instead, the share read whichever core that rank landed on: this machine's two cores run the Block
    at up to 1.6x apart, and a solo timing moved the share between calibrations (1.86-3.09)."""
    solo = [r["fwd_s"] + r["bwd_s"] for r in per_core]
    together = [r[0]["fwd_s"] + r[0]["bwd_s"] for r in shared]
    mean_solo = sum(solo) / len(solo) if solo else 0.0
    return max(1.0, sum(together) / len(together) / mean_solo) if mean_solo > 0 else 1.0


def fit_resume(rows: list[list[dict]]) -> float:
    """Mean over the ranks of what a Block's forward adds right after communicating (never below 0)."""
    extra = [r[0]["after_comm_s"] - r[0]["after_compute_s"] for r in rows]
    return max(0.0, sum(extra) / len(extra)) if extra else 0.0


def summary_lines(cal: Calibration) -> list[str]:
    """What was measured, in words, for the pages."""
    lines = []
    probe = cal.probe_result()
    if probe is not None:
        lines.append(f"matmul {probe.matmul_flops_per_s / 1e9:,.1f} GFLOP/s fp32, "
                     f"{(probe.bf16_matmul_flops_per_s or math.nan) / 1e9:,.1f} GFLOP/s bf16 "
                     f"({probe.threads} thread{'s' if probe.threads > 1 else ''}); "
                     f"copy {probe.memory_bytes_per_s / 1e9:,.1f} GB/s")
    if "linear" in cal.compute:
        f = cal.compute["linear"]
        lines.append(f"a small matmul costs {f.fwd_fixed_s * 1e6:.1f} us of overhead + its FLOPs at "
                     f"{1 / f.fwd_per_unit_s / 1e9 if f.fwd_per_unit_s else math.inf:,.1f} GFLOP/s")
    if cal.adamw_state:
        largest = max(cal.adamw_state)
        mib = largest * ADAMW_STATE_BYTES / 2**20
        lines.append(f"an AdamW step over {largest / 2**20:,.3g} M elements ({mib:,.0f} MiB of weights, gradients and "
                     f"moments) takes {cal.adamw_slowdown(largest):.2f}x as long per element as over "
                     f"{min(cal.adamw_state) / 2**10:,.0f} Ki, whose state stays in the caches")
    wide = cal.wide_units
    if {"step", "optimizer step", "fwd L1", "bwd L0"} <= set(wide) and "step" in cal.engine_units:
        lines.append(f"the engine's own step on one rank took {cal.engine_units['step'] * 1e3:.1f} ms on the default "
                     f"model and {wide['step'] * 1e3:.1f} ms at width {WIDE_UNITS['hidden']} (a layer "
                     f"{wide['fwd L1'] * 1e3:.2f} ms forward, {wide['bwd L0'] * 1e3:.2f} ms backward, the optimizer "
                     f"step {wide['optimizer step'] * 1e3:.1f} ms), where each layer and the optimizer find the "
                     "caches emptied by what ran before them")
    for w in sorted(cal.worlds):
        ar = cal.comm.get(comm_key(w, "all_reduce", w, "sync"))
        if ar:
            # a fit with no per-byte term: over the swept sizes the bytes' cost was lost in the timing noise
            per_byte = (f"+ {ar.beta_s_per_byte * 1e9:.2f} ns/byte" if ar.beta_s_per_byte > 0 else
                        "at every size swept (its per-byte cost was below the timing noise)")
            b2b = cal.comm.get(comm_key(w, "all_reduce", w, BACK_TO_BACK_MODE))
            if b2b:
                per_byte += f" ({b2b.seconds(1024) * 1e6:,.0f} us for 1 KB right after another)"
            sharing = (f"compute runs {cal.share(w):.2f}x slower with all {w} ranks busy on {cal.cpus} cores than "
                       f"with one on each, and " if w > cal.cpus else "compute runs ")
            lines.append(f"{w} ranks: a gloo all-reduce costs {ar.alpha_s * 1e6:,.0f} us {per_byte}; {sharing}"
                         f"{cal.resume_s.get(w, 0.0) * 1e3:.2f} ms longer right after communicating")
        late = cal.late_fits(w, 2)
        if late:
            idle = cal.idle_late_fit(w, 2)
            lines.append(f"{w} ranks: a 1 KB message whose receive is posted after its send arrives "
                         + (f"{idle.seconds(1024) * 1e3:.2f} ms after the receive with its sender blocked, "
                            if idle else "")
                         + ", ".join(f"{f.seconds(1024) * 1e3:.2f} ms with {k} sender"
                                     f"{'s' if k > 1 else ''} computing" for k, f in enumerate(late, 1)))
        early = cal.early_fits(w, 2)
        if early:
            lines.append(f"{w} ranks: a 1 KB message sent to a receive already waiting arrives "
                         + ", ".join(f"{f.seconds(1024) * 1e3:.2f} ms after its send with {k} sender"
                                     f"{'s' if k > 1 else ''} computing" for k, f in enumerate(early, 1)))
        speedup = cal.pair_speedup(w, "all_reduce", w, PAIR_SUMMARY_BYTES)
        if speedup:
            lines.append(f"{w} ranks: two asynchronous all-reduces of {PAIR_SUMMARY_BYTES // 1024} KB posted at "
                         f"once get through {speedup:.2f} operations' worth in the time of one alone "
                         f"({GLOO_THREADS} if gloo's {GLOO_THREADS} threads each ran at full speed)")
        post = cal.send_post_fit(w)
        if post:
            lines.append(f"{w} ranks: posting a pipeline message (its isend) holds the sender "
                         f"{post.alpha_s * 1e3:.2f} ms on average (timed in the engine's own 1F1B pipeline)")
    if cal.reference_s > 0:
        lines.append(f"the reference Block (the engine's default layer, forward + backward) took "
                     f"{cal.reference_s * 1e3:.2f} ms alone, timed between the modules; each prediction times it "
                     "again (on one rank per core at once: with no more ranks than cores the slowest rank's time, "
                     "with more the cores' mean) and scales compute by the ratio")
    return lines


def gpus(timeout_s: float = 5.0) -> list[tuple[str, float]]:
    """(name, memory in GiB) of each NVIDIA GPU `nvidia-smi` lists; [] without one (or without the tool).
    Asked without importing torch, so a page can list them cheaply."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        name, _, mib = line.rpartition(",")
        try:
            found.append((name.strip(), float(mib) / 1024))
        except ValueError:
            continue
    return found

