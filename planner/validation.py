"""Predicted vs published step times of the runs in ../shared/validation/published-runs.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner.api import estimate

# the repository sits beside ../shared (DESIGN.md)
PUBLISHED_RUNS = Path(__file__).resolve().parents[2] / "shared" / "validation" / "published-runs.json"


@dataclass(frozen=True)
class ValidationRow:
    name: str
    source: str
    published_s: float
    predicted_s: float
    mfu: float
    tflops_per_chip: float
    chosen: dict

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted_s - self.published_s) / self.published_s


def load_published_runs(path: str | Path = PUBLISHED_RUNS) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def validate(runs: list[dict]) -> list[ValidationRow]:
    rows = []
    for run in runs:
        est = estimate(run)
        rows.append(ValidationRow(run["name"], run.get("source", ""), run["published"]["step_time_s"],
                                  est.step_time_s, est.mfu, est.tflops_per_chip, est.chosen))
    return rows
