"""The classroom server's knobs: one place, read from environment variables when the server starts.

    SHARDLAB_MAX_CONCURRENT   live runs executing at once              default: CPU cores // 4, at least 1
    SHARDLAB_MAX_QUEUE        runs waiting before new ones are refused  default: 100
    SHARDLAB_MAX_WORLD        processes one run may start               default: 8
    SHARDLAB_MAX_STEPS        training steps of one run (and the Lab's Steps box)  default: 20
    SHARDLAB_MAX_PARAMS       parameters of one run's model             default: 5,000,000
    SHARDLAB_MAX_RUN_S        wall-clock seconds of one press of Run, all its runs together  default: 120
    SHARDLAB_RESULT_CACHE     identical runs answered from memory       default: 64 (0 turns it off)

A run uses `world` processes; on a machine with C cores (the ones this process may use: a container's CPU
set), C // 4 runs at once keeps a 4-process run's timings meaningful (each process gets about one core) and
the server responsive. Every value is shown on the "About this server" expander of the live panel.
`./run.sh` checks them before it starts the server (`python -m server.settings`), so a malformed value stops
it at once, naming the variable; a server started otherwise reports it on every page that runs something,
and no run starts until it is fixed (never a half-configured queue).
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import MISSING, dataclass, fields

from engine.config import MAX_WORLD


class SettingsError(ValueError):
    """An environment variable of the server holds a value it cannot use."""


@dataclass(frozen=True)
class Settings:
    max_concurrent: int
    max_queue: int = 100
    max_world: int = 8
    max_steps: int = 20
    max_params: int = 5_000_000
    max_run_s: float = 120.0
    result_cache: int = 64

    @staticmethod
    def default_concurrency(cores: int | None = None) -> int:
        """A quarter of the cores this process may run on: the container's CPU set (sched_getaffinity), not the
        host's cores, which os.cpu_count() gives. A cgroup CPU quota (docker --cpus) is seen by neither."""
        from hardware.this_machine import cpu_count

        return max(1, (cores or cpu_count() or 1) // 4)

    @classmethod
    def from_env(cls, env: dict | None = None) -> Settings:
        env = os.environ if env is None else env
        values = {"max_concurrent": cls.default_concurrency()}
        for f in fields(cls):
            name = ENV_NAMES[f.name]
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                continue
            seconds = f.name == "max_run_s"
            value = _number(raw, whole=not seconds)
            shown = f"{name}={_quoted(raw)}"
            if value is None:
                example = f.default if f.default is not MISSING else cls.default_concurrency()
                what = "a number of seconds" if seconds else "a whole number"
                raise SettingsError(f"{shown} must be {what}, e.g. {format(example, 'g') if seconds else example}")
            least, why = LEAST.get(f.name, (1, ""))
            if not value >= least:
                raise SettingsError(f"{shown} must be at least {least}{why}")
            most, why = MOST.get(f.name, (math.inf, ""))
            if not value <= most:  # infinity too
                raise SettingsError(f"{shown} must be at most {most:,}: {why}")
            values[f.name] = float(value) if seconds else value
        return cls(**values)

    def rows(self) -> list[dict]:
        """What the "About this server" expander shows."""
        return [{"setting": DESCRIPTIONS[f.name], "value": _show(getattr(self, f.name)),
                 "environment variable": ENV_NAMES[f.name]} for f in fields(self)]


# A whole number as people write one: 5000000, 5_000_000, 5,000,000 (the docs' own format), 5e6 or 10.0
_GROUPED = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")


def _number(raw: str, whole: bool) -> int | float | None:
    """The value of `raw`, or None where it is no number (or, for `whole`, no whole one). NaN is none."""
    text = raw.strip()
    if _GROUPED.fullmatch(text):
        text = text.replace(",", "")
    try:
        return int(text)  # exact (a float would round 99999999999999999999)
    except ValueError:
        if re.fullmatch(r"[+-]?\d+", text):  # digits past Python's 4,300 for int(): a number, far too big
            return -math.inf if text.startswith("-") else math.inf
    try:
        value = float(text)
    except ValueError:
        return None
    if math.isnan(value) or (whole and not (math.isfinite(value) and value.is_integer())):
        return None  # inf, by contrast, is a number: "must be at most" says what is wrong with it
    return int(value) if whole else value


def _quoted(raw: str, most: int = 40) -> str:
    """`raw` as a message quotes it, cut to `most` characters: a value 5,000 digits long had been echoed whole."""
    if len(raw) <= most:
        return repr(raw)
    return f"{raw[:most]!r}... ({len(raw):,} characters)"


def _show(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


# Lower bounds other than 1, with why
LEAST = {
    "result_cache": (0, ""),
    # 1 had passed the check and refused every lesson's run at its first press ("2 processes is more than this
    # server allows (1)")
    "max_world": (2, ": every live lesson runs 2 processes or more (the Hardware page's calibration too)"),
}
# Upper bounds, each with why: a value past them is a typo, not a machine.
MOST = {
    "max_concurrent": (64, "each run at once is a thread starting its own processes (100,000 of them had "
                           "exhausted the machine's threads); a run gets about one core per process, so more runs "
                           "at once than cores only slows every one"),
    "max_queue": (10_000, "each waiting run holds its student's page open on the server, polling it; a class "
                          "is tens of students, and a queue this long would wait hours"),
    "max_world": (MAX_WORLD, f"the engine starts at most {MAX_WORLD} local processes (engine/config.py)"),
    "max_steps": (100_000, "the Lab's Steps box goes up to it, and one day (the most SHARDLAB_MAX_RUN_S "
                           "allows) ends a run long before"),
    "max_run_s": (86_400, "one day"),
    "max_params": (10 ** 10, "ten billion parameters' fp32 weights, gradients and Adam moments are 160 GB in every "
                             "process of a run"),
    "result_cache": (10_000, "each answer kept holds a finished run's timelines in the server's memory; a class "
                             "repeats tens of runs"),
}

ENV_NAMES = {
    "max_concurrent": "SHARDLAB_MAX_CONCURRENT",
    "max_queue": "SHARDLAB_MAX_QUEUE",
    "max_world": "SHARDLAB_MAX_WORLD",
    "max_steps": "SHARDLAB_MAX_STEPS",
    "max_params": "SHARDLAB_MAX_PARAMS",
    "max_run_s": "SHARDLAB_MAX_RUN_S",
    "result_cache": "SHARDLAB_RESULT_CACHE",
}
DESCRIPTIONS = {
    "max_concurrent": "live runs executing at once",
    "max_queue": "runs that may wait in the queue",
    "max_world": "processes one run may start",
    "max_steps": "training steps of one run",
    "max_params": "parameters of one run's model",
    "max_run_s": "wall-clock seconds of one press of Run, all its runs together",
    "result_cache": "identical runs answered from memory (0: off)",
}


# The other SHARDLAB_* variables ShardLab reads (the cache folder; what a server passes its workers): not knobs,
# but not misspellings either
OTHER_NAMES = ("SHARDLAB_CACHE_DIR", "SHARDLAB_PARENT_PID", "SHARDLAB_POOL_ADDR", "SHARDLAB_POOL_KEY",
               "SHARDLAB_WORLD", "SHARDLAB_RANK", "SHARDLAB_INIT", "SHARDLAB_DEVICE", "SHARDLAB_COLLECTIVE_TIMEOUT_S")


def unknown_names(env: dict) -> list[str]:
    """What to say of each SHARDLAB_* variable that is no setting: a misspelt knob (SHARDLAB_MAX_CONCURENT)
    had been ignored without a word, the server running on the default."""
    import difflib

    known = set(ENV_NAMES.values()) | set(OTHER_NAMES)
    out = []
    for name in sorted(n for n in env if n.startswith("SHARDLAB_") and n not in known):
        near = difflib.get_close_matches(name, sorted(known), n=1)
        out.append(f"{name} is not one of its settings" + (f" (did you mean {near[0]}?)" if near else ""))
    return out


def port_problem(port: str, network: bool) -> str | None:
    """Why the server cannot listen on `port` (not a port number, or taken), else None: checked before the
    address is printed for the class (it had printed http://...:abc, and 99999 had ended in a traceback)."""
    import socket

    if not re.fullmatch(r"[0-9]{1,5}", port.strip()) or not 1 <= int(port) <= 65535:
        return f"--server.port {port!r} must be a whole number from 1 to 65535, e.g. --server.port 8600"
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket: a closed
        try:                                                         # connection's TIME_WAIT does not count
            probe.bind(("0.0.0.0" if network else "127.0.0.1", int(port)))
        except OSError as e:
            return (f"port {int(port)} cannot be used ({e.strerror}: another server is on it?); choose another "
                    f"with --server.port, e.g. --server.port {int(port) + 1 if int(port) < 65535 else 8600}")
    return None


def other_servers(root: str | None = None) -> list[tuple[int, str]]:
    """(pid, port) of the ShardLab servers already running from this folder (`root`, the working directory):
    a second one runs its students' processes on the same cores with a queue of its own, so neither's
    SHARDLAB_MAX_CONCURRENT holds (two presses on two servers: 12.1 s a run against 8.3)."""
    from pathlib import Path

    root = os.path.realpath(root or os.getcwd())
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:  # no /proc (macOS): nothing to say
        return []
    found = []
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            words = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
            cwd = os.path.realpath(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if cwd == root and "streamlit" in " ".join(words) and "app.py" in words:
            port = next((w.split("=", 1)[1] for w in words if w.startswith("--server.port=")), None)
            port = port or next((b for a, b in zip(words, words[1:]) if a == "--server.port"), "8501")
            found.append((int(entry.name), port))
    return found


def main(argv: list[str] = ()) -> int:
    """`python -m server.settings [--port N] [--network]`: check the environment's settings and the port, as
    ./run.sh does before it starts the server (a malformed value had shown no sign until a student opened a
    page). Exit 2 with the message."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m server.settings")
    ap.add_argument("--port")
    ap.add_argument("--network", action="store_true")
    args = ap.parse_args(list(argv))
    try:
        Settings.from_env()
        for problem in unknown_names(dict(os.environ)):
            raise SettingsError(problem)
    except SettingsError as e:
        print(f"ShardLab's settings: {e}. Fix it (docs/classroom.md, \"The knobs\") and start again.",
              file=sys.stderr)
        return 2
    if args.port is not None and (problem := port_problem(args.port, args.network)):
        print(f"ShardLab: {problem}.", file=sys.stderr)
        return 2
    for pid, port in other_servers():  # a warning: two servers can be meant (two ports, two classes)
        print(f"ShardLab: another ShardLab server is running from this folder (process {pid}, port {port}). Both "
              "would run their students' processes on the same cores, each with a queue of its own, so neither's "
              f"limits hold: stop it (kill {pid}) unless that is what you want.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
