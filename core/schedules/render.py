"""A simulated schedule as text: the rank x time grid of the pictures in core/schedules/build.py."""

from __future__ import annotations

from core.schedules.build import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
)
from core.schedules.simulate import Simulation


def render_ascii(simulation: Simulation, wrap_cells: int | None = None) -> str:
    """The rank x time grid as text: one cell per shortest compute op, `.` where a rank idles.

    Each op prints as its kind (BI as B, BW as W, as in Qi et al.'s figures) and micro-batch; when v > 1
    as micro-batch and chunk letter instead, upper case for forward (`3B`: forward of micro-batch 3 on
    chunk b), lower case for backward. An op is padded with `-` over the cells it lasts. Times that are not
    multiples of the shortest op are rounded to the nearest cell. wrap_cells cuts long rows into blocks.
    """
    sched, v = simulation.schedule, simulation.schedule.virtual_stages
    durations = [simulation.times.duration_s(a, v) for rank in sched.actions for a in rank if a.is_compute]
    cell_s = min(durations)
    letter = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}

    def label(a: Action) -> str:
        if v == 1:
            return letter[a.kind] + str(a.micro_batch)
        chunk = "abcdefghijklmnopqrstuvwxyz"[a.chunk]
        return str(a.micro_batch) + (chunk.upper() if a.kind == FORWARD else chunk)

    width = max(len(label(a)) for rank in sched.actions for a in rank if a.is_compute)
    num_cells = round(simulation.makespan_s / cell_s)
    rows = []
    for actions, intervals in zip(sched.actions, simulation.intervals_s, strict=True):
        row = ["." * width] * num_cells
        for a, (start, end) in zip(actions, intervals, strict=True):
            if a.is_compute:
                first, last = round(start / cell_s), round(end / cell_s)
                row[first] = label(a).ljust(width, "-")
                for cell in range(first + 1, last):
                    row[cell] = "-" * width
        rows.append(row)
    step = wrap_cells or num_cells
    blocks = ["\n".join(f"r{rank} {''.join(row[first:first + step]).rstrip('.')}".rstrip()
                        for rank, row in enumerate(rows))
              for first in range(0, num_cells, step)]
    return "\n\n".join(blocks)
