"""Pipeline-parallel lesson builders: the schedule grid, the activations held, the comparison table and the
planner's view on real chips. Pure: data in, Plotly figures and table rows out.

Every picture comes from `core.schedules` (the same schedules the live executor runs): a schedule is
built by `make_schedule`, timed by `simulate`, and drawn here as a rank x time grid

    rank 0 | F0 F1 F2 F3 .  .  .  B0 B1 ...      one cell per compute action, coloured by kind
    rank 1 | .  F0 F1 F2 .  .  B0 ...            (F, B, BI, BW), labelled with its micro-batch;
    ...                                          grey is a bubble (the rank idles)
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.colors
import plotly.graph_objects as go

from core.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    SCHEDULE_NAMES,
    OpTimes,
    ScheduleError,
    Simulation,
    formula_bubble_fraction,
    make_schedule,
    simulate,
)
from core.timeline import Timeline
from hardware.chips import Chip
from hardware.collectives import group_topology
from planner.case import Layout
from planner.flops import forward_flops
from planner.memory import in_flight_layers, layer_activation_bytes
from planner.models import ModelSpec
from planner.stages import layer_split
from ui.tables import NO_VALUE
from ui.timeline import BACKWARD_INPUT_COLOR, BACKWARD_WEIGHT_COLOR, add_time_animation
from ui.timeline import KIND_COLORS as TIMELINE_COLORS

SCHEDULE_LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved 1F1B", "zb-h1": "ZB-H1"}
SCHEDULE_COLORS = {"gpipe": "#E45756", "1f1b": "#4C78A8", "interleaved-1f1b": "#F58518", "zb-h1": "#54A24B"}
KIND_LABELS = {FORWARD: "F (forward)", BACKWARD: "B (backward)", BACKWARD_INPUT: "BI (backward, input grad)",
               BACKWARD_WEIGHT: "BW (backward, weight grad)", "bubble": "bubble (idle)"}
# the app's palette (ui/timeline.py): the same colour for the same work on every chart
KIND_COLORS = {FORWARD: TIMELINE_COLORS["forward"], BACKWARD: TIMELINE_COLORS["backward"],
               BACKWARD_INPUT: BACKWARD_INPUT_COLOR, BACKWARD_WEIGHT: BACKWARD_WEIGHT_COLOR,
               "bubble": TIMELINE_COLORS["idle"]}
FORMULA_TEXT = {"gpipe": "(p-1)/m", "1f1b": "(p-1)/m", "interleaved-1f1b": "(p-1)/(v m)",
                "zb-h1": "(p-1) max(tF, tBI, tF+tBI-tBW) / (m (tF+tBI+tBW))"}
CHUNK_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Plotly fits a label inside its bar less 3 px a side and uniformtext hides it under 8 px: an interleaved
# forward (t_F / v) is about 9 px wide in a 1,024-px window and 7 px at 800, so every one of them was hidden. A
# label that fits its whole cell in a plot NARROW_PLOT_PX wide is drawn as it is (Plotly neither shrinks nor
# hides it), so it shows at any width from there up; the others stay Plotly's to fit, shown where the window
# is wide enough.
NARROW_PLOT_PX = 400  # the grid's plot area in an 800-px window with the sidebar open (408 px measured)
LABEL_FONT_PX = 10
LABEL_CHAR_PX = 6  # the widest digit or letter of a 10-px label (Source Sans: 5.8 px), and a little room
ACTIVATION_BYTES_PER_VALUE = 2  # bf16 activations sent between stages


def formula_latex(name: str) -> str:
    """The paper's bubble fraction for `name`, in LaTeX (equal op times, no communication)."""
    if name in ("gpipe", "1f1b"):
        return r"\frac{p-1}{m}"  # Narayanan et al. 2021 eq. 1
    if name == "interleaved-1f1b":
        return r"\frac{p-1}{v\,m}"  # Narayanan et al. 2021 §2.2
    if name == "zb-h1":
        # Qi et al. 2023 §2.1, T_B being our BI; the max for t_BW > t_F (core.schedules.formula_bubble_fraction)
        return r"\frac{(p-1)\,\max(t_F,\; t_{BI},\; t_F + t_{BI} - t_{BW})}{m\,(t_F + t_{BI} + t_{BW})}"
    raise ScheduleError(f"unknown schedule {name!r}: choose one of {SCHEDULE_NAMES}")


def op_times(backward_over_forward: float, comm_over_forward: float = 0.0) -> OpTimes:
    """Op times in units of t_F: the backward takes `backward_over_forward` t_F, split evenly into BI and BW
    for ZB-H1 (equal halves is Qi et al. 2023's t_BI = t_BW case); a transfer takes `comm_over_forward`
    t_F."""
    half = backward_over_forward / 2
    return OpTimes(forward_s=1.0, backward_input_s=half, backward_weight_s=half, comm_s=comm_over_forward)


def simulate_schedule(name: str, p: int, m: int, v: int, times: OpTimes) -> Simulation:
    """Build and time one schedule; v is used by interleaved 1F1B only. Raises ScheduleError."""
    return simulate(make_schedule(name, p, m, v if name == "interleaved-1f1b" else 1), times)


@dataclass(frozen=True)
class Cell:
    """One compute action on the grid: times in units of t_F."""

    rank: int
    kind: str
    micro_batch: int
    chunk: int
    stage: int
    start: float
    end: float

    def label(self, virtual_stages: int) -> str:
        """The micro-batch; with v > 1 also the chunk, upper case forward, lower case backward (`3B`)."""
        if virtual_stages == 1:
            return str(self.micro_batch)
        letter = CHUNK_LETTERS[self.chunk]
        return f"{self.micro_batch}{letter.upper() if self.kind == FORWARD else letter}"

    def text(self, virtual_stages: int) -> str:
        """The label as its cell shows it: with v > 1 the chunk's letter under the micro-batch (`3<br>B`), a
        character narrower, for a chunk's forward is 1/v as wide as a whole forward."""
        label = self.label(virtual_stages)
        return label if virtual_stages == 1 else f"{label[:-1]}<br>{label[-1]}"


def fits_narrow_plot(text: str, duration: float, x_max: float) -> bool:
    """Whether `text` (lines split by <br>) fits the width of a cell `duration` long on an axis to `x_max`,
    in a plot NARROW_PLOT_PX wide."""
    return duration / x_max * NARROW_PLOT_PX >= LABEL_CHAR_PX * max(len(line) for line in text.split("<br>"))


def grid_cells(sim: Simulation) -> list[Cell]:
    """Every compute action of every rank with its simulated start and end (SEND / RECV left out)."""
    cells = []
    for rank, (actions, intervals) in enumerate(zip(sim.schedule.actions, sim.intervals_s, strict=True)):
        for a, (start, end) in zip(actions, intervals, strict=True):
            if a.is_compute:
                cells.append(Cell(rank, a.kind, a.micro_batch, a.chunk, a.stage, start, end))
    return cells


def bubble_cells(sim: Simulation) -> list[tuple[int, float, float]]:
    """(rank, start, end) of every gap in a rank's compute, up to the end of the step."""
    gaps = []
    by_rank: dict[int, list[Cell]] = {}
    for c in grid_cells(sim):
        by_rank.setdefault(c.rank, []).append(c)
    for rank in range(sim.schedule.num_ranks):
        busy_until = 0.0
        for c in sorted(by_rank.get(rank, []), key=lambda c: c.start):
            if c.start > busy_until + 1e-12:
                gaps.append((rank, busy_until, c.start))
            busy_until = max(busy_until, c.end)
        if sim.makespan_s > busy_until + 1e-12:
            gaps.append((rank, busy_until, sim.makespan_s))
    return gaps


def _rank_label(rank: int) -> str:
    return f"rank {rank}"


def schedule_figure(sim: Simulation, title: str = "", frames: int = 40, animate: bool = True) -> go.Figure:
    """The rank x time grid of `sim`: one bar per compute action labelled with its micro-batch, grey bubbles;
    with `animate`, Play and a slider sweep a cursor through the step and reveal the work as it happens.
    Each kind of work is up to two traces, one legend entry: the cells whose label is drawn whole at any width
    (fits_narrow_plot) and the cells whose label Plotly fits or hides."""
    v = sim.schedule.virtual_stages
    t_end = sim.makespan_s
    x_max = t_end * 1.01
    series: dict[tuple[str, bool], list[tuple[int, float, float, str, str]]] = {}
    for c in grid_cells(sim):
        text = c.text(v)
        whole = fits_narrow_plot(text, c.end - c.start, x_max)
        series.setdefault((c.kind, whole), []).append((c.rank, c.start, c.end, c.label(v), text))
    for rank, start, end in bubble_cells(sim):
        series.setdefault(("bubble", True), []).append((rank, start, end, "", ""))
    order = list(KIND_COLORS)
    groups = sorted(series, key=lambda g: (order.index(g[0]), not g[1]))
    rows = [_rank_label(r) for r in range(sim.schedule.num_ranks)]

    def widths(group: tuple[str, bool], t: float | None) -> dict:
        items = series[group]
        ends = [end if t is None else max(start, min(end, t)) for _, start, end, _, _ in items]
        return {"x": [e - start for (_, start, _, _, _), e in zip(items, ends, strict=True)],
                "base": [start for _, start, _, _, _ in items]}

    def cursor(t: float) -> dict:
        return {"x": [t, t], "y": [rows[0], rows[-1]]}

    fig = go.Figure()
    in_legend = set()
    for kind, whole in groups:
        items = series[kind, whole]
        fig.add_trace(go.Bar(
            orientation="h", y=[_rank_label(r) for r, _, _, _, _ in items], name=KIND_LABELS[kind],
            legendgroup=kind, showlegend=kind not in in_legend,
            marker={"color": KIND_COLORS[kind], "line": {"width": 1, "color": "white"}},
            text=[text for _, _, _, _, text in items], textposition="inside", insidetextanchor="middle",
            textfont={"size": LABEL_FONT_PX}, constraintext="none" if whole else "both",
            customdata=[[label, end - start] for _, start, end, label, _ in items],
            hovertemplate=(f"{KIND_LABELS[kind]} micro-batch %{{customdata[0]}}<br>start %{{base:.2f}} t_F, "
                           "lasts %{customdata[1]:.2f} t_F<extra></extra>"),
            **widths((kind, whole), None),
        ))
        in_legend.add(kind)
    fig.add_trace(go.Scatter(mode="lines", line={"color": "black", "width": 2}, name="now", showlegend=False,
                             hoverinfo="skip", **cursor(t_end)))
    fig.update_layout(
        title=title, barmode="overlay", bargap=0.15, height=max(260, 44 * len(rows) + 150),
        uniformtext={"minsize": 8, "mode": "hide"},
        margin={"l": 10, "r": 10, "t": 50 if title else 20, "b": 10},
        legend={"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom"},
        xaxis={"title": "time (units of t_F, one forward through a rank's layers)", "range": [0, x_max]},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(rows))},
    )
    if animate and frames > 1:
        times = [t_end * i / (frames - 1) for i in range(frames)]
        fig.frames = [go.Frame(name=f"{t:.4f}",
                               data=[go.Bar(**widths(g, t)) for g in groups] + [go.Scatter(**cursor(t))],
                               traces=list(range(len(groups) + 1))) for t in times]
        add_time_animation(fig, times, [f"{t:.4f}" for t in times], "t_F", frame_ms=120)
    return fig


def held_micro_batches(sim: Simulation) -> list[float]:
    """Peak activations each rank holds, in micro-batches' worth of its layers (a chunk is 1/v of them)."""
    v = sim.schedule.virtual_stages
    return [held / v for held in sim.peak_in_flight]


def _faded(color: str, alpha: float = 0.35) -> str:
    """A "#RRGGBB" colour at `alpha`, as Plotly's "rgba(...)"."""
    r, g, b = plotly.colors.hex_to_rgb(color)
    return f"rgba({r}, {g}, {b}, {alpha})"


def in_flight_figure(sims: dict[str, Simulation], chosen: str) -> go.Figure:
    """Grouped bars: peak activations held per rank for each schedule; the chosen one drawn solid."""
    fig = go.Figure()
    for name, sim in sims.items():
        held = held_micro_batches(sim)
        fig.add_trace(go.Bar(
            x=[_rank_label(r) for r in range(len(held))], y=held, name=SCHEDULE_LABELS[name],
            # the bars faded, not their numbers (a trace's opacity would fade its labels too), and in the legend too:
            # faded in their colour's alpha, which the legend's swatch shows (it ignored the marker's opacity)
            marker={"color": SCHEDULE_COLORS[name] if name == chosen else _faded(SCHEDULE_COLORS[name])},
            text=[f"{h:g}" for h in held], textposition="outside", textfont={"color": "#333"},
            hovertemplate=f"{SCHEDULE_LABELS[name]}, %{{x}}: %{{y:g}} micro-batches<extra></extra>",
        ))
    # the axis title short: "micro-batches of activations held (peak)" rose past the plot into the title
    fig.update_layout(barmode="group", height=340, yaxis_title="micro-batches held (peak)",
                      # two lines: in one, the title ran past the plot's right edge in a 1,024-px window
                      title="Activation memory: micro-batches whose forward<br>ran and whose backward has not",
                      margin={"l": 10, "r": 10, "t": 70, "b": 10}, legend={"orientation": "h", "y": -0.15})
    return fig


def comparison(p: int, m: int, v: int, times: OpTimes) -> tuple[dict[str, Simulation], list[dict]]:
    """Every schedule for the same p and m (v for interleaved): the simulations that build, and one table
    row per schedule with its formula, the simulated bubble and the activations held; a schedule that
    cannot run says why in `note`."""
    sims: dict[str, Simulation] = {}
    rows = []
    for name in SCHEDULE_NAMES:
        row = {"schedule": SCHEDULE_LABELS[name], "formula": FORMULA_TEXT[name], "formula bubble": None,
               "simulated bubble": None, "held, rank 0": None, "held, last rank": None, "note": ""}
        try:
            sim = simulate_schedule(name, p, m, v, times)
        except ScheduleError as e:
            row["note"] = str(e)
            rows.append(row)
            continue
        sims[name] = sim
        held = held_micro_batches(sim)
        row.update({"formula bubble": formula_bubble_fraction(name, p, m, sim.schedule.virtual_stages, times),
                    "simulated bubble": sim.bubble_fraction, "held, rank 0": held[0],
                    "held, last rank": held[-1]})
        if times.comm_s > 0:
            row["note"] = "the formula leaves communication out"
        elif name == "zb-h1" and m < p:
            row["note"] = "the formula assumes m >= p"
        rows.append(row)
    return sims, rows


def comparison_table(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """`comparison`'s rows for display: numbers as text, "—" where a schedule cannot run (a table shows a
    missing number as "None"), and the notes taken out of the table as one line each (a grid cell cuts a
    sentence off), schedules with the same note named together."""
    shown = []
    notes: dict[str, list[str]] = {}
    for row in rows:
        runs = row["simulated bubble"] is not None
        shown.append({  # the formula's text last: first, at 800 px it pushed the numbers out of view
            "schedule": row["schedule"],
            **{k: f"{row[k]:.3f}" if runs else NO_VALUE for k in ("formula bubble", "simulated bubble")},
            **{k: f"{row[k]:.3g}" if runs else NO_VALUE for k in ("held, rank 0", "held, last rank")},
            "formula": row["formula"],
        })
        if row["note"]:
            note = row["note"] if runs else f"cannot run here: {row['note']}"
            notes.setdefault(note, []).append(row["schedule"])
    return shown, [f"{', '.join(names)}: {note}." for note, names in notes.items()]


def bubble_in_words(p: int, m: int) -> str:
    """1F1B's bubble on real chips, in markdown. (p - 1)/m is the idle time over the ideal compute time
    (Narayanan et al. 2021 eq. 1), not a share of the step: the step is compute plus bubble, so the idle
    share is (p - 1)/(m + p - 1)."""
    ratio = (p - 1) / m
    return (f"with 1F1B it idles (p − 1)/m = **{ratio:.3g}×** the compute time here, so **{ratio / (1 + ratio):.1%}** "
            "of the step is bubble, (p − 1)/(m + p − 1)")


@dataclass(frozen=True)
class RealChipView:
    """What pipeline parallel means for one real model on one real chip (planner/ arithmetic)."""

    layers_per_stage: tuple[int, ...]
    activation_bytes_1f1b: float  # first stage, peak, one micro-batch of `micro_batch` sequences
    activation_bytes_gpipe: float
    p2p_bytes: float  # one micro-batch's activations from one stage to the next (per tp rank)
    p2p_s: float
    stage_forward_s: float  # lower bound: one micro-batch's forward on one stage at peak bf16 FLOP/s
    link: str
    latency_s: float = 0.0  # of p2p_s: the link's alpha and its pipeline fill (Link.fill_s), once per message
    fill_s: float = 0.0  # of latency_s: the fill

    @property
    def bandwidth_s(self) -> float:
        """Of p2p_s: the bytes over the link's bandwidth."""
        return self.p2p_s - self.latency_s


def real_chip_view(spec: ModelSpec, chip: Chip, pp: int, micro_batches: int, tp: int = 1,
                   stride: int = 1, micro_batch: int = 1) -> RealChipView:
    """Layers per stage, first-stage activations under 1F1B and GPipe, and the stage-to-stage transfer.

    The pp group's consecutive members are `stride` = tp * cp * dp ranks apart (pp is the outermost mesh
    axis, as in the planner). Activations sent between stages are In[B_mb, S, D] in bf16, split over the
    tp ranks (Megatron-LM sends each tp rank's 1/tp and all-gathers after: Narayanan et al. 2021 §4.1).
    """
    if pp > spec.layers:
        raise ValueError(f"{pp} stages for {spec.layers} layers: choose pp <= {spec.layers}")
    first_stage_layers = layer_split(spec.layers, pp)[0]
    acts = {}
    for schedule in ("1f1b", "gpipe"):
        lay = Layout(dp=1, tp=tp, pp=pp, pp_schedule=schedule, micro_batch=micro_batch)
        per_layer = max(layer_activation_bytes(spec, lay, spec.is_moe),
                        layer_activation_bytes(spec, lay, False))
        acts[schedule] = in_flight_layers(0, lay, micro_batches, first_stage_layers) * per_layer
    tokens = micro_batch * spec.seq_len
    p2p_bytes = tokens * spec.hidden * ACTIVATION_BYTES_PER_VALUE / tp
    topo = group_topology(chip, pp, stride=stride, achievable=True)
    stage_forward_s = forward_flops(spec, tokens) / pp / tp / chip.bf16_flops_per_s
    return RealChipView(tuple(sum(chunks) for chunks in layer_split(spec.layers, pp)), acts["1f1b"],
                        acts["gpipe"], p2p_bytes, topo.p2p_s(p2p_bytes), stage_forward_s, topo.describe(),
                        topo.p2p_s(0.0), topo.fill_s)


def measured_op_times(timeline: Timeline, step: int, virtual_stages: int) -> OpTimes:
    """Mean op times of one measured step, per rank's layers (a chunk's span times v), no comm time:
    the simulator fed with them predicts the bubble the run should have had."""
    durations: dict[str, list[float]] = {}
    for s in timeline.spans:
        kind = s.name.split(" ")[0]
        if s.step == step and s.lane == "compute" and kind in KIND_LABELS:
            durations.setdefault(kind, []).append(s.duration_s * virtual_stages)
    if FORWARD not in durations or not ({BACKWARD, BACKWARD_INPUT} & durations.keys()):
        raise ValueError(f"step {step} of the timeline has no pipeline forward and backward spans")

    def mean(kind: str) -> float:
        return sum(durations[kind]) / len(durations[kind])

    if BACKWARD_INPUT in durations:
        return OpTimes(mean(FORWARD), mean(BACKWARD_INPUT), mean(BACKWARD_WEIGHT))
    return OpTimes(mean(FORWARD), mean(BACKWARD) / 2, mean(BACKWARD) / 2)
