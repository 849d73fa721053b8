"""The N-D mesh lesson's pieces: published layouts, how each axis of a mesh lands on the hardware, and the
mesh scaled down to this machine's processes. Pure: data in, rows and figures out. Rank order, strides and
what each axis means come from the one mesh convention (core/mesh.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go

from core.mesh import AXES, Mesh, label
from hardware.chips import Chip
from hardware.collectives import group_topology
from planner.bounds import FsdpTpTradeoff
from ui.charts import PALETTE
from ui.tables import format_bytes, format_seconds
from ui.timeline import KIND_COLORS


@dataclass(frozen=True)
class Preset:
    model: str  # a planner.models preset
    chip: str  # a hardware/chips.toml key
    mesh: dict[str, int]  # the sidebar's axes (dp, tp, pp, cp, ep)
    zero_stage: int
    source: str
    global_batch: int | None = None  # sequences per step as published; None: planner.presets.default_global_batch
    recipe: tuple[tuple[str, object], ...] = ()  # training fields as published (planner.case.Training), as pairs


PRESETS = {
    "Llama 3 405B on 16,384 H100": Preset(
        "Llama 3 405B", "h100", {"dp": 128, "tp": 8, "pp": 16, "cp": 1, "ep": 1}, 3,
        "Dubey et al. 2024, *The Llama 3 Herd of Models*, Table 4: TP 8, CP 1, PP 16, DP 128 for 8K-token "
        "sequences (the 128K-token phase used CP 16 and DP 8), 16M-token batches: 2,048 sequences of 8,192; the "
        "data-parallel axis shards with FSDP.", global_batch=2048),
    "DeepSeek-V3 on 2,048 H800": Preset(
        "DeepSeek-V3", "h800", {"dp": 2, "tp": 1, "pp": 16, "cp": 1, "ep": 64}, 1,
        "DeepSeek-AI 2024, arXiv 2412.19437, section 3.2: 16-way pipeline, 64-way expert parallel over 8 "
        "nodes, ZeRO-1 data parallel, no tensor parallel. Its 128 data-parallel ranks per stage are ep 64 x "
        "dp 2 in this guide's mesh (ep ranks are data parallel for the dense layers). Batch: 15,360 sequences of "
        "4,096 tokens (section 4.2, after a ramp from 3,072 over the first 469B tokens); FP8 training (section "
        "3.3) and DualPipe, which hides the all-to-alls under another micro-batch's compute (section 3.2.1).",
        global_batch=15360, recipe=(("dtype", "fp8"), ("ep_comm_overlap", True))),
    "Llama 3 8B on 64 TPU v5p": Preset(
        "Llama 3 8B", "tpu-v5p", {"dp": 16, "tp": 4, "pp": 1, "cp": 1, "ep": 1}, 3,
        "An example layout, not a published run: FSDP over 16 chips and tensor parallel over 4 neighbours "
        "along one axis of the torus (a v5p slice has no separate network inside it: every axis is ICI)."),
}

# What one axis's group moves per step (the lessons say how much and why).
AXIS_TRAFFIC = {
    "tp": "activations: all-reduces (or all-gathers and reduce-scatters) inside every layer, forward and back",
    "cp": "keys and values passed around a ring in every attention layer",
    "ep": "tokens to their experts and back: two all-to-alls per MoE layer, forward and back",
    "dp": "gradients (all-reduce or reduce-scatter) and, with FSDP, weights (all-gather) once per step",
    "fsdp": "weights (all-gather) and gradients (reduce-scatter) once per step, each layer ahead of use",
    "pp": "one activation per micro-batch per stage boundary, forward, and its gradient back",
}
# The planner's group (planner.simulate.sent_bytes_per_step) each axis's bytes are counted in: its dp
# group is every data-parallel rank of a layer, so dp and fsdp share one count.
AXIS_SENT = {"tp": "tp", "cp": "cp", "ep": "ep", "dp": "dp", "fsdp": "dp", "pp": "pp"}
# The planner's breakdown keys (planner/simulate.BREAKDOWN_KEYS) each axis's communication lands in.
AXIS_BREAKDOWN = {"tp": ("tp_comm",), "cp": ("cp_comm",), "ep": ("ep_comm",), "dp": ("dp_comm", "zero3_comm"),
                  "pp": ("pp_comm",)}


MAX_DRAWN = 64  # ranks drawn in the mesh figure


def placement(chip: Chip, n: int, stride: int) -> str:
    """Where a group of n ranks `stride` apart runs: inside one scale-up domain, across domains, or both."""
    domain = chip.scaleup_domain
    inside = f"one {chip.scaleup_link} domain" if chip.kind == "gpu" else "one slice (ICI)"
    across = "the network between nodes" if chip.kind == "gpu" else "DCN between slices"
    if n * stride <= domain:
        return inside
    if stride >= domain:
        return across
    return f"both: {inside}, then {across}"


def axis_rows(mesh: Mesh, chip: Chip, breakdown: dict[str, float] | None = None,
              step_s: float | None = None, sent: dict[str, float] | None = None) -> list[dict]:
    """One row per axis of degree > 1, innermost first: its group, where it lands, what it moves, and (with
    the planner's estimate of this layout) the bytes one chip sends over it per step and the communication
    time it leaves exposed."""
    rows = []
    for axis in reversed(mesh.names):
        n = mesh.degree(axis)
        if n == 1:
            continue
        stride = mesh.stride(axis)
        # as text: a link may carry degrees whose product no table column's integer type holds
        row = {"axis": axis, "degree": f"{n:,}", "members apart": f"{stride:,}",
               "rank 0's group": _group_text(mesh.group_of(0, axis)),
               "lands on": placement(chip, n, stride)}
        if sent is not None:
            row["sent per step, per chip"] = format_bytes(sent.get(AXIS_SENT[axis], 0.0))
        if breakdown is not None and step_s:
            exposed = sum(breakdown.get(k, 0.0) for k in AXIS_BREAKDOWN.get(axis, ()))
            row["exposed per step"] = f"{format_seconds(exposed)} ({exposed / step_s:.1%})"
        row["moves"] = AXIS_TRAFFIC[axis]
        row["links"] = group_topology(chip, n, stride, achievable=True).describe()
        rows.append(row)
    return rows


def _group_text(ranks: list[int]) -> str:
    if len(ranks) <= 4:
        return "{" + ", ".join(map(str, ranks)) + "}"
    return "{" + f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}" + "}"


def _shown_groups(mesh: Mesh, axis: str, shown: int) -> dict[int, list[int]]:
    """The groups of `axis` among the first `shown` ranks: {group's first member: its shown ranks}. A group is
    named by its first member (the rank with this axis's coordinate 0): computed per shown rank, so a mesh of
    any size draws at once."""
    groups: dict[int, list[int]] = {}
    for r in range(shown):
        groups.setdefault(mesh.rank_of({**mesh.coords(r), axis: 0}), []).append(r)
    return groups


def mesh_figure(mesh: Mesh, chip: Chip, axis: str, max_ranks: int = MAX_DRAWN) -> go.Figure:
    """The first `max_ranks` ranks as squares, one row per node (GPU) or per 16 chips (TPU), each group of
    `axis` with two or more of them drawn in a colour of its own (colours repeat after len(PALETTE) groups);
    a rank whose partners are all beyond the drawn ones in grey. Rank 0's group is outlined."""
    per_row = chip.scaleup_domain if chip.kind == "gpu" and chip.scaleup_domain <= 16 else 16
    shown = min(mesh.world, max_ranks)
    count = mesh.group_count(axis)
    mine = set(mesh.group_of(0, axis))
    fig = go.Figure()
    colored = 0
    for first, ranks in _shown_groups(mesh, axis, shown).items():
        if len(ranks) > 1:
            color, text_color = PALETTE[colored % len(PALETTE)], "white"
            colored += 1
        else:
            color, text_color = KIND_COLORS["idle"], "#333"
        fig.add_trace(go.Scatter(
            x=[r % per_row for r in ranks], y=[r // per_row for r in ranks], mode="markers+text",
            text=[str(r) for r in ranks], textfont={"color": text_color, "size": 11},
            marker={"symbol": "square", "size": 30, "color": color,
                    "line": {"width": [3 if r in mine else 0 for r in ranks], "color": "black"}},
            name=f"{axis} group of rank {first}", showlegend=False,
            hovertemplate=f"rank %{{text}}<br>{axis} group of rank {first} ({count:,} groups)<extra></extra>"))
    rows = math.ceil(shown / per_row)
    unit = "node" if chip.kind == "gpu" and chip.scaleup_domain <= 16 else "chips"
    labels = [f"{unit} {i}" if unit == "node" else f"{i * per_row}-{(i + 1) * per_row - 1}"
              for i in range(rows)]
    n, stride = mesh.degree(axis), mesh.stride(axis)
    which = f"the first {shown} of {mesh.world:,} ranks" if shown < mesh.world else "all ranks"
    fig.update_layout(
        # which ranks are drawn on a line of its own: on one line the title ran past a narrow window's edge
        title=f"{axis} groups: {count:,} group{'s' if count > 1 else ''} of {n} ranks, {stride} "
              f"apart<br>({which})",
        height=110 + 42 * rows, margin={"l": 80, "r": 10, "t": 70, "b": 10},
        xaxis={"visible": False, "range": [-0.7, per_row - 0.3]},
        yaxis={"autorange": "reversed", "tickmode": "array", "tickvals": list(range(rows)), "ticktext": labels,
               "showgrid": False, "zeroline": False},
        plot_bgcolor="white")
    return fig


def mesh_caption(mesh: Mesh, axis: str, max_ranks: int = MAX_DRAWN) -> str:
    """What the colours of mesh_figure(mesh, chip, axis) mean, for the groups it draws."""
    shown = min(mesh.world, max_ranks)
    sizes = [len(ranks) for ranks in _shown_groups(mesh, axis, shown).values()]
    colored = sum(1 for n in sizes if n > 1)
    stride = mesh.stride(axis)
    text = "Each square is a rank (a chip), one row per node (16 chips a row on a TPU or an NVL72 rack). "
    if not colored:
        text += (f"The {axis} groups' members are {stride:,} ranks apart, so the {shown} ranks drawn are each in "
                 "a different group (grey): their partners are beyond them. ")
    else:
        text += "Squares of one colour form one group of the chosen axis"
        if colored > len(PALETTE):
            text += f" (the {colored} groups drawn share {len(PALETTE)} colours: hover a square for its group)"
        text += (f"; a grey square's partners, {stride:,} ranks apart, are beyond the ranks drawn. "
                 if colored < len(sizes) else ". ")
    return text + ("Rank 0's group is outlined. Inner axes (tp) group neighbours, outer axes (pp) group chips far "
                   "apart.")


def scaled_down(mesh: dict[str, int], max_world: int = 8) -> dict[str, int]:
    """The mesh's axes of degree > 1 at degree 2 each, dropping the axes of smallest degree (then the
    outermost) until at most `max_world` processes remain: the same kinds of groups, small enough to run."""
    kept = [a for a in AXES if mesh.get(a, 1) > 1]
    while 2 ** len(kept) > max_world:
        kept.remove(min(kept, key=lambda a: (mesh[a], AXES.index(a))))
    return {a: 2 for a in kept} or {"dp": 1}


def sidebar_mesh(layout) -> dict[str, int] | None:
    """A planner layout (Megatron-LM's degrees, planner.case.Layout, its experts split by tp) as the sidebar's
    axes (core/mesh.py): ep carved out of dp. None where the layout's ep groups reach over cp's ranks too (ep
    does not divide dp: the planner carves ep out of dp x cp), which the sidebar cannot draw (Mixtral on 16
    H100s: dp=4, cp=2, ep=8 had read "pp=2,cp=2,ep=8", 32 chips, and applied dp=0)."""
    if layout.dp % layout.ep:
        return None
    return {"dp": layout.dp // layout.ep, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep}


def layout_label(layout) -> str:
    """A layout's mesh as the sidebar writes it ("dp=4,tp=2"), or in the planner's degrees with where its experts
    go where the sidebar cannot draw it (`sidebar_mesh`): "pp=2,dp=4,cp=2, ep=8 over dp x cp"."""
    mesh = sidebar_mesh(layout)
    if mesh is not None:
        return label(mesh)
    dense = label({"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp})
    return f"{dense}, ep={layout.ep} over dp x cp"


# The number columns of `search_rows`, each with its decimals: a float column drops a trailing zero ("60" beside
# "60.8")
SEARCH_FORMATS = {"step s": "%.3f", "MFU %": "%.1f", "GB/chip": "%.1f"}


def search_rows(report, by_axis: bool = False) -> list[dict]:
    """One row per ranked layout of a planner search (planner.api.SearchReport): its mesh in the sidebar's axes
    (`by_axis`: a column per Megatron-LM degree, as the planner page shows them), what else tells two layouts of
    one mesh apart (ZeRO, micro-batch, recomputation; the schedule where a layout has stages), step, MFU, memory.
    Shown with SEARCH_FORMATS."""
    rows = []
    piped = any(r.result.layout.pp > 1 for r in report.ranked)  # a schedule column only where one has stages
    moe = report.case.model.is_moe  # the experts' tp split (etp) is a degree of an MoE model's layout only
    for i, r in enumerate(report.ranked, start=1):
        lay = r.result.layout
        if by_axis:
            mesh = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep} | (
                {"etp": lay.etp} if moe else {})
        else:
            mesh = {"mesh": layout_label(lay)}
        rows.append({"rank": i, **mesh, "ZeRO": lay.zero_stage, "micro-batch": lay.micro_batch,
                     "recompute": lay.recompute_label}
                    | ({"schedule": schedule_words(lay)} if piped else {})
                    | {"step s": r.result.step_time_s, "MFU %": 100 * r.result.mfu,
                       "GB/chip": r.result.memory.total_bytes / 1e9})
    return rows


def schedule_words(lay) -> str:
    """A layout's pipeline schedule ("interleaved-1f1b v=2"), "" without stages, where there is none to run."""
    return f"{lay.pp_schedule} v={lay.virtual_stages}" if lay.pp > 1 else ""



def tradeoff_figure(t: FsdpTpTradeoff) -> go.Figure:
    """Per layer's forward, for every split of the chips into X-way FSDP x Y-way TP: the weights FSDP gathers,
    the activations TP moves, their sum against the math, and the optimum X_opt marked."""
    x = [r.fsdp for r in t.rows]
    fig = go.Figure()
    # the sum wide, pale and underneath (zorder), so that where one part is nearly all of it both lines show
    series = [("FSDP: the MLP's weights all-gathered", [r.fsdp_s for r in t.rows], KIND_COLORS["all_gather"], "solid"),
              ("TP: its activations gathered and reduce-scattered", [r.tp_s for r in t.rows],
               KIND_COLORS["reduce_scatter"], "solid"),
              ("communication, both", [r.comm_s for r in t.rows], KIND_COLORS["send/recv"], "wide"),
              (f"the MLP's {'three' if t.matrices == 3 else 'two'} matmuls (the math to hide under)",
               [r.math_s for r in t.rows], KIND_COLORS["forward"], "dot")]
    for name, ys, color, dash in series:
        wide = dash == "wide"
        # nothing to move (no FSDP at X = 1, no TP at Y = 1) has no place on a log axis: a gap
        fig.add_trace(go.Scatter(x=x, y=[v * 1e6 if v > 0 else None for v in ys], name=name, mode="lines+markers",
                                 line={"color": color, "dash": "solid" if wide else dash, "width": 8 if wide else 2},
                                 opacity=0.45 if wide else 1.0, marker={"size": 10 if wide else 6},
                                 zorder=0 if wide else 1,
                                 customdata=[r.tp for r in t.rows],
                                 hovertemplate="X = %{x} FSDP x Y = %{customdata} TP<br>%{y:,.1f} µs<extra>"
                                               + name + "</extra>"))
    # in data units: this Plotly places a vline on a log axis itself (log10 had put it at 2.7)
    if t.x_opt is not None and t.x_opt <= max(x):
        fig.add_vline(x=t.x_opt, line={"color": "#444", "dash": "dot"},
                      annotation={"text": f"X_opt = {t.x_opt:,.1f}", "showarrow": False, "yanchor": "bottom"})
    # a third of a decade of room above and below every line: the math, flat, had lain on the plot's top edge
    drawn = [v * 1e6 for _, ys, _, _ in series for v in ys if v > 0]
    span = [math.log10(min(drawn)) - 0.3, math.log10(max(drawn)) + 0.3] if drawn else None
    fig.update_layout(xaxis={"type": "log", "title": "X, the FSDP degree (Y = N / X tensor parallel)",
                             "tickvals": x, "ticktext": [f"{v:,}" for v in x]},
                      yaxis={"type": "log", "title": "time per layer's forward (µs)", "dtick": 1, "range": span},
                      height=430,
                      title="Communication against math, per layer's forward",
                      legend={"orientation": "h", "y": -0.3}, margin={"t": 60})
    return fig


def search_figure(report) -> go.Figure:
    """The ranked layouts of a planner search: step time (bars) and memory per chip (markers, right axis)."""
    def name(lay) -> str:
        # with the ZeRO stage: two layouts of one mesh had read alike ("2. dp=4,cp=2" and "4. dp=4,cp=2")
        return ", ".join(p for p in (layout_label(lay), schedule_words(lay), f"ZeRO-{lay.zero_stage}") if p)

    # the bars by rank, each layout named in its hover and in the table above: as tick labels the names ran
    # into the legend at 1,280 px, tilted, and into each other at 800
    ranks = [str(i) for i in range(1, len(report.ranked) + 1)]
    names = [name(r.result.layout) for r in report.ranked]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=ranks, y=[r.result.step_time_s for r in report.ranked], name="step time (s)",
                         marker_color=KIND_COLORS["forward"], customdata=names,
                         hovertemplate="%{x}. %{customdata}<br>step %{y:.3f} s<extra></extra>"))
    fig.add_trace(go.Scatter(x=ranks, y=[r.result.memory.total_bytes / 1e9 for r in report.ranked],
                             name="memory per chip (GB)", mode="markers", yaxis="y2", customdata=names,
                             marker={"color": KIND_COLORS["other compute"], "size": 12, "symbol": "diamond"},
                             hovertemplate="%{x}. %{customdata}<br>%{y:.1f} GB per chip<extra></extra>"))
    fig.update_layout(yaxis={"title": "step time (s)", "rangemode": "tozero"},
                      # its own round ticks (synced to the step axis they had read 16.2, 32.4, ...), no grid of its own
                      yaxis2={"title": "memory per chip (GB)", "overlaying": "y", "side": "right",
                              "rangemode": "tozero", "tickmode": "auto", "showgrid": False},
                      xaxis={"title": "rank (the table above)", "type": "category"}, height=380,
                      legend={"orientation": "h", "y": -0.3}, margin={"t": 30})
    return fig


def tradeoff_text(t: FsdpTpTradeoff) -> str:
    b = t.best
    # a colon after the layout, not a comma: "Y = 1, 783 us" had read as "Y = 1,783 us"
    return (f"At X = {b.fsdp:,} and Y = {b.tp:,}: {format_seconds(b.comm_s)} of communication per layer's "
            f"forward against {format_seconds(b.math_s)} of math.")
