"""The one timeline format shared by the live engine (measured) and the planner (predicted).

A `Timeline` is a flat list of `Span`s: one span is one thing one rank did for a while, on one lane:
``compute`` (a layer's forward, a backward, an optimizer step), ``comm`` (a collective or a
send/recv) or ``idle`` (a pipeline bubble, a wait). Pages draw and animate any Timeline the same way,
so a predicted step and a measured step can stand side by side.

This module must not import torch: the planner and the pages use it without the engine. It also says
what a pipeline step looks like on it: its bubbles (idle spans between a rank's F/B/BI/BW compute), which
a measured pipeline timeline gets in the calling process (engine/run.py) so that it carries the same
"bubble" spans as the simulator's predicted one (core/schedules/simulate.py).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace

LANES = ("compute", "comm", "idle")


@dataclass(frozen=True)
class Span:
    rank: int
    lane: str  # one of LANES
    name: str  # e.g. "fwd L3", "all_reduce", "send act"
    start_s: float
    end_s: float
    bytes: int = 0  # bytes this rank sent for a comm span (0 for compute)
    flops: float = 0.0  # floating-point operations of a compute span
    step: int = 0
    micro_batch: int | None = None
    group: str = ""  # process group / mesh axis of a comm span, e.g. "dp", "tp"
    is_async: bool = False  # issued without blocking the compute stream

    def __post_init__(self):
        if self.lane not in LANES:
            raise ValueError(f"span lane must be one of {LANES}, got {self.lane!r}")
        if self.end_s < self.start_s:
            raise ValueError(f"span {self.name!r} on rank {self.rank} ends before it starts")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


_COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def span_kind(span: Span) -> str:
    """The kind of work of a span, from its lane and name ("fwd L3", "all_gather", "send act" ...): what
    the pages colour it by and what a prediction is compared with a measurement by."""
    if span.lane == "idle":
        return "idle"
    name = span.name.lower()
    if span.lane == "comm":
        for kind in _COMM_KINDS:
            if kind in name or kind.replace("_", "-") in name or kind.replace("_", " ") in name:
                return kind
        if any(word in name for word in ("send", "recv", "p2p")):
            return "send/recv"
        return "other comm"
    if name.startswith("recompute"):
        return "recompute"  # a layer's forward run again before its backward (activation checkpointing)
    if name.startswith(("fwd", "forward", "f ")) or name == "f":
        return "forward"
    if name.startswith(("bwd", "backward", "b ", "bi", "bw")) or name == "b":
        return "backward"
    if name.startswith(("opt", "adam", "step")):
        return "optimizer"
    return "other compute"


def kind_label(kind: str) -> str:
    """A kind of work (`span_kind`) as a page or a message writes it: the collectives hyphenated as in prose
    ("all-reduce"), the rest as they are."""
    return kind.replace("_", "-") if kind in _COMM_KINDS else kind


def _merged(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_seconds(intervals) -> float:
    """Length of the union of (start, end) intervals: overlapping ones count once."""
    return sum(b - a for a, b in _merged(intervals))


def difference(a, b) -> list[tuple[float, float]]:
    """(union of a) without (union of b), as sorted disjoint intervals."""
    out, cuts = [], _merged(b)
    for lo, hi in _merged(a):
        for c_lo, c_hi in cuts:
            if c_hi <= lo or c_lo >= hi:
                continue
            if c_lo > lo:
                out.append((lo, c_lo))
            lo = max(lo, c_hi)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return out


def intersection_seconds(a, b) -> float:
    """Length of (union of a) intersected with (union of b)."""
    ma, mb, total, i, j = _merged(a), _merged(b), 0.0, 0, 0
    while i < len(ma) and j < len(mb):
        lo, hi = max(ma[i][0], mb[j][0]), min(ma[i][1], mb[j][1])
        total += max(0.0, hi - lo)
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    source: str = "measured"  # "measured" (live engine) or "predicted" (planner)
    meta: dict = field(default_factory=dict)

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def extend(self, spans: Iterable[Span]) -> None:
        self.spans.extend(spans)

    @property
    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.spans})

    @property
    def start_s(self) -> float:
        return min((s.start_s for s in self.spans), default=0.0)

    @property
    def end_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def after_warm_up(self) -> Timeline:
        """The spans of every step after the first (a measured run's warm-up, where the first calls run and
        the optimizer's state is allocated), or all of them when there is one step only."""
        steps = {s.step for s in self.spans}
        if len(steps) < 2:
            return self
        first = min(steps)
        return Timeline([s for s in self.spans if s.step != first], source=self.source, meta=self.meta)

    def for_rank(self, rank: int) -> list[Span]:
        return sorted((s for s in self.spans if s.rank == rank), key=lambda s: s.start_s)

    def busy_seconds(self, rank: int, lane: str) -> float:
        """Seconds a rank's lane was busy, overlapping spans on the lane counted once."""
        return union_seconds([(s.start_s, s.end_s) for s in self.spans if s.rank == rank and s.lane == lane])

    def overlap(self, rank: int, comm=None, compute=None) -> tuple[float, float]:
        """(seconds of communication, seconds of it that ran while the same rank computed) for `rank`:
        the one overlap measure of every page. Each side is the union of its spans (nested or
        concurrent spans count once); `comm` and `compute` select spans (default: the lanes). The rank
        computes in its compute spans except while it waits inside one: in a blocking operation (a tensor-
        parallel layer's all-reduce lies inside the layer's span, which had read it 100 % hidden) or an idle
        span (a ring step waiting for its block)."""
        comm = comm or (lambda s: s.lane == "comm")
        compute = compute or (lambda s: s.lane == "compute")
        spans = [s for s in self.spans if s.rank == rank]
        a = [(s.start_s, s.end_s) for s in spans if comm(s)]
        waits = [(s.start_s, s.end_s) for s in spans
                 if s.lane == "idle" or (s.lane == "comm" and not s.is_async)]
        busy = difference([(s.start_s, s.end_s) for s in spans if compute(s)], waits)
        return union_seconds(a), intersection_seconds(a, busy)

    def comm_bytes(self, rank: int) -> int:
        return sum(s.bytes for s in self.spans if s.rank == rank and s.lane == "comm")

    def normalized(self) -> Timeline:
        """The same timeline with time 0 at its first span."""
        t0 = self.start_s
        spans = [replace(s, start_s=s.start_s - t0, end_s=s.end_s - t0) for s in self.spans]
        return Timeline(spans, self.source, dict(self.meta))

    def to_dict(self) -> dict:
        return {"source": self.source, "meta": self.meta, "spans": [asdict(s) for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict) -> Timeline:
        return cls([Span(**s) for s in d["spans"]], d.get("source", "measured"), d.get("meta", {}))

    def to_chrome_trace(self) -> dict:
        """Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

        One process per rank, one thread per lane, complete ("X") events in microseconds.
        Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
        """
        t0 = self.start_s
        events: list[dict] = []
        for rank in self.ranks:
            events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                           "args": {"name": f"rank {rank}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                           "args": {"sort_index": rank}})
            for tid, lane in enumerate(LANES):
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                               "args": {"name": lane}})
        for s in self.spans:
            args = {"step": s.step}
            if s.micro_batch is not None:
                args["micro_batch"] = s.micro_batch
            if s.bytes:
                args["bytes"] = s.bytes
            if s.flops:
                args["flops"] = s.flops
            if s.group:
                args["group"] = s.group
            if s.is_async:
                args["async"] = True
            events.append({
                "ph": "X", "name": s.name, "cat": s.lane, "pid": s.rank, "tid": LANES.index(s.lane),
                "ts": (s.start_s - t0) * 1e6, "dur": s.duration_s * 1e6, "args": args,
            })
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, **{k: str(v) for k, v in self.meta.items()}}}

    def write_chrome_trace(self, path: str) -> None:
        """Write atomically (`write_json`)."""
        write_json(path, self.to_chrome_trace())


def strict_json(obj, indent: int | None = None, default=None) -> str:
    """JSON that strict parsers read: a non-finite float (a diverged run's loss) becomes null, where Python's
    json writes NaN or Infinity, which are not JSON."""
    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(obj), indent=indent, allow_nan=False, default=default)


def write_json(path: str, obj, indent: int | None = None) -> None:
    """Write `obj` as strict JSON (no NaN or Infinity tokens), atomically, so a crash never leaves a half-written
    file; the file gets the permissions of any new file here (the umask), not the private ones of the temporary
    file it is written as. A link is written through, to the file it names; a device or a pipe (/dev/null,
    /dev/stdout, a FIFO) is written into, never replaced."""
    import os
    import tempfile

    text = strict_json(obj, indent=indent)
    if _special_file(path):
        _write_into(path, text)
        return
    target = os.path.realpath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# How long a write into a named pipe waits for a program to open its other end: a pipe nobody reads would
# otherwise block the command for ever (`--trace >(gzip > t.gz)` has its reader already)
PIPE_READER_WAIT_S = 10.0


def _special_file(path: str) -> bool:
    """Whether `path` names something that is written into rather than replaced: a device or a pipe (/dev/null,
    /dev/stderr, a FIFO), followed through links, /dev/fd's too."""
    import os
    import stat

    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # nothing there yet (or a link to nothing): a new file
        return False


def _same_file(path: str, stream) -> bool:
    """Whether `path` is the file, pipe or terminal `stream` writes to (not when both are /dev/null)."""
    import os

    try:
        a, b = os.stat(path), os.fstat(stream.fileno())
    except (OSError, AttributeError, ValueError):  # no such path, or a stream with no file (pytest's capture)
        return False
    null = os.stat(os.devnull)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) != (null.st_dev, null.st_ino)  # /dev/null keeps nothing


def _write_into(path: str, text: str) -> None:
    """Write `text` into a device or a pipe; a pipe no program opens for reading within PIPE_READER_WAIT_S raises
    OSError (ENXIO) saying so, where a plain open would wait for ever."""
    import errno
    import os
    import stat
    import time

    if not stat.S_ISFIFO(os.stat(path).st_mode):
        with open(path, "w") as f:
            f.write(text)
        return
    deadline = time.monotonic() + PIPE_READER_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO at once while no reader has it open
            break
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                if e.errno == errno.ENXIO:
                    raise OSError(errno.ENXIO, f"no program opened the pipe to read it within {PIPE_READER_WAIT_S:.0f} "
                                  "s") from None
                raise
            time.sleep(0.05)
    os.set_blocking(fd, True)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def unwritable_reason(path: str, inputs: tuple[str, ...] = (), result_on_stdout: bool = True) -> str | None:
    """Why a file cannot be written at `path`, the path first ("/tmp: it is a folder; ..."), or None: checked
    before a run, so a bad path costs no run. `inputs`: files the command reads, which it must not write over;
    `result_on_stdout`: the command prints its result on standard output, which the file must not be."""
    import os

    if not path.strip():
        return "'': it names no file; give a path such as out.json"
    target = os.path.realpath(path)  # a link names the file written (Timeline.write_chrome_trace)
    directory = os.path.dirname(target)
    if os.path.isdir(path):
        return f"{path}: it is a folder; name a file, e.g. out.json"
    if path.endswith(("/", os.sep)):  # "out/" names a folder, even one not made yet
        return f"{path}: it ends in '/', so it names a folder; name a file, e.g. {path}out.json"
    # /dev/stdout, or the file stdout goes to: the result printed there would be replaced or mixed with the file
    if result_on_stdout and _same_file(path, sys.stdout):
        return (f"{path}: it is where this command prints its result (standard output); write the file elsewhere, "
                "e.g. out.json")
    for other in inputs:
        if os.path.exists(path) and os.path.exists(other) and os.path.samefile(path, other):
            return f"{path}: it is {other}, which this command reads; choose another path"
    if _special_file(path):  # a device or a pipe: written into, in place
        return None if os.access(path, os.W_OK) else f"{path}: it is not writable; choose another path"
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"{path}: {directory} is a file, not a folder"
    if not os.path.isdir(directory):
        return f"{path}: its folder {directory} does not exist"
    try:
        longest = os.pathconf(directory, "PC_NAME_MAX")
    except (AttributeError, ValueError, OSError):  # no pathconf here, or this file system does not say
        longest = -1
    if 0 < longest < len(os.fsencode(os.path.basename(target))):  # -1: no limit
        return f"{path}: its file name is longer than the {longest} bytes a name may have here; choose a shorter one"
    if not os.access(directory, os.W_OK | os.X_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        return f"{path}: it is not writable; choose another path"
    # os.access answers yes to root everywhere, /proc and /sys included: open it as the write will (a new file
    # made and removed again, an existing one opened to append and left as it was)
    try:
        if os.path.exists(target):
            open(target, "ab").close()
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.remove(target)
    except OSError as e:
        return f"{path}: a file cannot be written there ({e.strerror}); choose another path"
    return None


# -- pipeline steps on the timeline ---------------------------------------------------------------------
# The compute kinds of core/schedules/build.py: spans named "F s1", "BW s0", ... (engine/pipeline).
PIPELINE_KINDS = ("F", "B", "BI", "BW")


def _pipeline_spans(timeline: Timeline, step: int) -> list[Span]:
    """The F / B / BI / BW compute spans of one step (engine/pipeline/executor.py names them "F s1", "BW s0", ...)."""
    return [s for s in timeline.spans if s.step == step and s.lane == "compute"
            and s.name.split(" ")[0] in PIPELINE_KINDS]


def measured_bubble_fraction(timeline: Timeline, step: int) -> float:
    """(pipeline makespan - busiest rank's compute) / that compute, from the F/B/BI/BW spans of one step:
    the simulator's definition (core/schedules/simulate.Simulation), Narayanan et al. 2021 eq. 1's ratio."""
    spans = _pipeline_spans(timeline, step)
    makespan_s = max(s.end_s for s in spans) - min(s.start_s for s in spans)
    busy_s = max(sum(s.duration_s for s in spans if s.rank == r) for r in {s.rank for s in spans})
    return (makespan_s - busy_s) / busy_s


def bubble_spans(timeline: Timeline) -> list[Span]:
    """Per step and rank, an idle "bubble" span for every gap between its pipeline compute spans, from the
    step's first pipeline op on any rank to its last (what the simulator draws as `.`), less the rank's other
    compute in it: a rank done early runs its optimizer step there (drawn as idle under it, it had been)."""
    compute: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (step, rank) -> its compute, one pass
    for s in timeline.spans:
        if s.lane == "compute":
            compute.setdefault((s.step, s.rank), []).append((s.start_s, s.end_s))
    out = []
    for step in sorted({s.step for s in timeline.spans}):
        spans = _pipeline_spans(timeline, step)
        if not spans:
            continue
        first_s, last_s = min(s.start_s for s in spans), max(s.end_s for s in spans)
        for rank in sorted({s.rank for s in spans}):
            busy = _merged(compute[step, rank])
            idle_from = first_s
            for start, end in [*busy, (last_s, last_s)]:
                if start > idle_from and idle_from < last_s:
                    out.append(Span(rank, "idle", "bubble", idle_from, min(start, last_s), step=step))
                idle_from = max(idle_from, end)
    return out
