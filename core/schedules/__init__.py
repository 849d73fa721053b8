"""Pipeline schedules as data, torch-free, below both engines: `build` (the actions of every rank, with
pictures of each schedule), `check` (whether a schedule can run), `simulate` (timing it, and the papers'
bubble formulas), `render` (the grid as text)."""

from core.schedules.build import (
    ACTION_KINDS,
    ACTIVATION,
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMPUTE_KINDS,
    FORWARD,
    GRADIENT,
    RECV,
    SCHEDULE_NAMES,
    SEND,
    Action,
    Schedule,
    ScheduleError,
    compute_orders,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    stage_units,
    zb_h1,
)
from core.schedules.check import check_schedule
from core.schedules.render import render_ascii
from core.schedules.simulate import OpTimes, Simulation, formula_bubble_fraction, simulate

__all__ = [
    "ACTION_KINDS", "ACTIVATION", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "COMPUTE_KINDS", "FORWARD",
    "GRADIENT", "RECV", "SCHEDULE_NAMES", "SEND", "Action", "OpTimes", "Schedule", "ScheduleError", "Simulation",
    "check_schedule", "compute_orders", "formula_bubble_fraction", "gpipe", "interleaved_1f1b", "make_schedule",
    "one_f_one_b", "render_ascii", "simulate", "stage_units", "zb_h1",
]
