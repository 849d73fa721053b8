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
from ui.charts import PALETTE


@dataclass(frozen=True)
class Preset:
    model: str  # a planner.models preset
    chip: str  # a hardware/chips.toml key
    mesh: dict[str, int]  # the sidebar's axes (dp, tp, pp, cp, ep)
    zero_stage: int
    source: str


PRESETS = {
    "Llama 3 405B on 16,384 H100": Preset(
        "Llama 3 405B", "h100", {"dp": 128, "tp": 8, "pp": 16, "cp": 1, "ep": 1}, 3,
        "Dubey et al. 2024, *The Llama 3 Herd of Models*, Table 4: TP 8, CP 1, PP 16, DP 128 for 8K-token "
        "sequences (the 128K-token phase used CP 16 and DP 8); the data-parallel axis shards with FSDP."),
    "DeepSeek-V3 on 2,048 H800": Preset(
        "DeepSeek-V3", "h800", {"dp": 2, "tp": 1, "pp": 16, "cp": 1, "ep": 64}, 1,
        "DeepSeek-AI 2024, arXiv 2412.19437, section 3.2: 16-way pipeline, 64-way expert parallel over 8 "
        "nodes, ZeRO-1 data parallel, no tensor parallel. Its 128 data-parallel ranks per stage are ep 64 x "
        "dp 2 in this guide's mesh (ep ranks are data parallel for the dense layers)."),
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
# The planner's breakdown keys (planner/simulate.BREAKDOWN_KEYS) each axis's communication lands in.
AXIS_BREAKDOWN = {"tp": ("tp_comm",), "cp": ("cp_comm",), "ep": ("ep_comm",), "dp": ("dp_comm", "zero3_comm"),
                  "pp": ("pp_comm",)}


def placement(chip: Chip, n: int, stride: int) -> str:
    """Where a group of n ranks `stride` apart runs: inside one scale-up domain, across domains, or both."""
    domain = chip.scaleup_domain
    inside = "one NVLink domain" if chip.kind == "gpu" else "one slice (ICI)"
    across = "the network between nodes" if chip.kind == "gpu" else "DCN between slices"
    if n * stride <= domain:
        return inside
    if stride >= domain:
        return across
    return f"both: {inside}, then {across}"


def axis_rows(mesh: Mesh, chip: Chip, breakdown: dict[str, float] | None = None,
              step_s: float | None = None) -> list[dict]:
    """One row per axis of degree > 1, innermost first: its group, where it lands, what it moves, and (with
    the planner's breakdown of this layout) the communication time it leaves exposed per step."""
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
        if breakdown is not None and step_s:
            exposed = sum(breakdown.get(k, 0.0) for k in AXIS_BREAKDOWN.get(axis, ()))
            row["exposed per step"] = f"{exposed:.3g} s ({exposed / step_s:.1%})"
        row["moves"] = AXIS_TRAFFIC[axis]
        row["links"] = group_topology(chip, n, stride, achievable=True).describe()
        rows.append(row)
    return rows


def _group_text(ranks: list[int]) -> str:
    if len(ranks) <= 4:
        return "{" + ", ".join(map(str, ranks)) + "}"
    return "{" + f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}" + "}"


def mesh_figure(mesh: Mesh, chip: Chip, axis: str, max_ranks: int = 64) -> go.Figure:
    """The first `max_ranks` ranks as squares, one row per node (GPU) or per 16 chips (TPU), each coloured
    by the group of `axis` it belongs to; rank 0's group is outlined."""
    per_row = chip.scaleup_domain if chip.kind == "gpu" and chip.scaleup_domain <= 16 else 16
    shown = min(mesh.world, max_ranks)
    # A group is named by its first member (the rank with this axis's coordinate 0): computed per shown
    # rank, so a mesh of any size draws at once.
    first = [mesh.rank_of({**mesh.coords(r), axis: 0}) for r in range(shown)]
    index = {f: i for i, f in enumerate(dict.fromkeys(first))}
    group_of = {r: index[f] for r, f in enumerate(first)}
    count = mesh.group_count(axis)
    mine = set(mesh.group_of(0, axis))
    fig = go.Figure()
    for g in sorted({group_of[r] for r in range(shown)}):
        ranks = [r for r in range(shown) if group_of[r] == g]
        fig.add_trace(go.Scatter(
            x=[r % per_row for r in ranks], y=[r // per_row for r in ranks], mode="markers+text",
            text=[str(r) for r in ranks], textfont={"color": "white", "size": 11},
            marker={"symbol": "square", "size": 30, "color": PALETTE[g % len(PALETTE)],
                    "line": {"width": [3 if r in mine else 0 for r in ranks], "color": "black"}},
            name=f"{axis} group {g}", showlegend=False,
            hovertemplate=f"rank %{{text}}<br>{axis} group {g} of {count:,}<extra></extra>"))
    rows = math.ceil(shown / per_row)
    unit = "node" if chip.kind == "gpu" else "chips"
    labels = [f"{unit} {i}" if chip.kind == "gpu" else f"{i * per_row}-{(i + 1) * per_row - 1}"
              for i in range(rows)]
    n, stride = mesh.degree(axis), mesh.stride(axis)
    which = f"the first {shown} of {mesh.world:,} ranks" if shown < mesh.world else "all ranks"
    fig.update_layout(
        title=f"{axis} groups: {count:,} group{'s' if count > 1 else ''} of {n} ranks, {stride} "
              f"apart ({which})",
        height=90 + 42 * rows, margin={"l": 80, "r": 10, "t": 50, "b": 10},
        xaxis={"visible": False, "range": [-0.7, per_row - 0.3]},
        yaxis={"autorange": "reversed", "tickmode": "array", "tickvals": list(range(rows)), "ticktext": labels,
               "showgrid": False, "zeroline": False},
        plot_bgcolor="white")
    return fig


def scaled_down(mesh: dict[str, int], max_world: int = 8) -> dict[str, int]:
    """The mesh's axes of degree > 1 at degree 2 each, dropping the axes of smallest degree (then the
    outermost) until at most `max_world` processes remain: the same kinds of groups, small enough to run."""
    kept = [a for a in AXES if mesh.get(a, 1) > 1]
    while 2 ** len(kept) > max_world:
        kept.remove(min(kept, key=lambda a: (mesh[a], AXES.index(a))))
    return {a: 2 for a in kept} or {"dp": 1}


def sidebar_mesh(layout) -> dict[str, int]:
    """A planner layout (Megatron-LM's degrees, planner.case.Layout) as the sidebar's axes (core/mesh.py)."""
    mesh = layout.mesh
    return {a: mesh.degree(a) for a in ("dp", "tp", "pp", "cp", "ep")}


def search_rows(report) -> list[dict]:
    """One row per ranked layout of a planner search (planner.api.SearchReport), in the sidebar's axes."""
    rows = []
    for i, r in enumerate(report.ranked, start=1):
        lay, mesh = r.result.layout, sidebar_mesh(r.result.layout)
        rows.append({"rank": i, "mesh": label(mesh),
                     "ZeRO": lay.zero_stage, "step s": round(r.result.step_time_s, 3),
                     "MFU %": round(100 * r.result.mfu, 1), "GB/chip": round(r.result.memory.total_bytes / 1e9, 1),
                     "schedule": f"{lay.pp_schedule} v={lay.virtual_stages}" if lay.pp > 1 else ""})
    return rows

