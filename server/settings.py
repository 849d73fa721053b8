"""The classroom server's knobs: one place, read from environment variables when the server starts.

    SHARDLAB_MAX_CONCURRENT   live runs executing at once              default: CPU cores // 4, at least 1
    SHARDLAB_MAX_QUEUE        runs waiting before new ones are refused  default: 100
    SHARDLAB_MAX_WORLD        processes one run may start               default: 8
    SHARDLAB_MAX_STEPS        training steps of one run                 default: 20
    SHARDLAB_MAX_PARAMS       parameters of one run's model             default: 5,000,000
    SHARDLAB_MAX_RUN_S        wall-clock seconds of one run             default: 120
    SHARDLAB_RESULT_CACHE     identical runs answered from memory       default: 64 (0 turns it off)

A run uses `world` processes; on a machine with C cores, C // 4 runs at once keeps a 4-process run's
timings meaningful (each process gets about one core) and the server responsive. Every value is shown on
the "About this server" expander of the live panel. A malformed value is reported on every page that
runs something, naming the variable, and no run starts until it is fixed (never a half-configured queue).
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, fields


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
        return max(1, (cores or os.cpu_count() or 1) // 4)

    @classmethod
    def from_env(cls, env: dict | None = None) -> Settings:
        env = os.environ if env is None else env
        values = {"max_concurrent": cls.default_concurrency()}
        for f in fields(cls):
            name = ENV_NAMES[f.name]
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                continue
            kind = float if f.name == "max_run_s" else int
            try:
                value = kind(raw.strip())
            except ValueError:
                example = f.default if f.default is not MISSING else cls.default_concurrency()
                raise SettingsError(f"{name}={raw!r} is not a number; set it to e.g. "
                                    f"{example if isinstance(example, int) else format(example, 'g')}") from None
            least = 0 if f.name == "result_cache" else 1
            if not value >= least or value != value:  # NaN fails both
                raise SettingsError(f"{name}={raw!r} must be at least {least}")
            most, why = MOST.get(f.name, (None, ""))
            if most is not None and not value <= most:  # infinity too
                raise SettingsError(f"{name}={raw!r} must be at most {most:,}: {why}")
            values[f.name] = value
        return cls(**values)

    def rows(self) -> list[dict]:
        """What the "About this server" expander shows."""
        return [{"setting": DESCRIPTIONS[f.name], "value": _show(getattr(self, f.name)),
                 "environment variable": ENV_NAMES[f.name]} for f in fields(self)]


def _show(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


# Upper bounds, each with why: a value past them is a typo, not a machine.
MOST = {
    "max_concurrent": (64, "each run at once is a thread starting its own processes (100,000 of them had "
                           "exhausted the machine's threads); a run gets about one core per process, so more runs "
                           "at once than cores only slows every one"),
    "max_run_s": (86_400, "one day"),
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
    "max_run_s": "wall-clock seconds one run may take",
    "result_cache": "identical runs answered from memory (0: off)",
}
