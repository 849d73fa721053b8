"""The tensor / sequence parallel lesson's arithmetic and figures: pure data in, Plotly figures and rows out.

Megatron-LM tensor parallelism (Shoeybi et al. 2019, sec. 3) splits a matmul pair over t chips:

    column-parallel:  In[B, S, D] . W_in[D, F_tp]   -> H[B, S, F_tp]           (no communication)
    row-parallel:     H[B, S, F_tp] . W_out[F_tp, D] -> Out[B, S, D]{U_tp}      (all-reduce over tp)

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) replaces each all-reduce by a reduce-scatter
after the row layer and an all-gather before the column layer: the same ring bytes, while the norms and
dropouts in between hold S/t of the sequence. Activation memory per layer follows their Table 2
(`planner.memory.korthikanti_bytes`); communication is costed with `hardware.collectives`.

No Streamlit and no torch here (engine.config is torch-free), so the page opens fast and this is tested
without a browser.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.timeline import Timeline
from engine.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, validate
from hardware.chips import Chip
from hardware.collectives import Topology, group_topology
from planner.bounds import Bound
from planner.case import Layout
from planner.costs import group_links_chip, layer_cost
from planner.memory import korthikanti_bytes
from planner.models import ModelSpec
from ui.charts import log_axis, rank_color, span_legend
from ui.collectives import markdown_text
from ui.tables import format_seconds
from ui.timeline import KIND_COLORS, span_kind

MAX_TP = 16
BF16_BYTES = 2  # Korthikanti et al. 2022 count 16-bit activations; TP moves them in bf16 too
# Megatron-LM pads the vocabulary to a multiple of 128 x tp (--make-vocab-size-divisible-by 128), so the
# vocabulary never decides whether a tp fits a real model.
VOCAB_PAD = 128
TP_COLLECTIVES_PER_LAYER = 4  # 2 forward (attention, MLP) + 2 backward: Korthikanti et al. 2022 sec. 4.2.2

# mode of korthikanti_bytes -> (label, equation in the paper's notation)
MEMORY_MODES = {
    "tp": ("Tensor parallel", r"sbh\left(10 + \frac{24}{t} + \frac{5as}{ht}\right)"),
    "tp+sp": ("Tensor + sequence parallel", r"\frac{sbh}{t}\left(34 + \frac{5as}{h}\right)"),
    "tp+sp+selective": ("TP + SP + selective recomputation", r"\frac{34\,sbh}{t}"),
}


# ---- which tp fits a model --------------------------------------------------------------------------

def tp_config_error(spec: ModelSpec, tp: int) -> str | None:
    """The engine's own ConfigError message when `tp` cannot split `spec`'s layers, else None.

    The engine validates the same rules a real run must obey (heads, KV heads, ffn and, with sequence
    parallel, the sequence divisible by tp); the shape is passed as a dense layer of the model's attention
    width, because Megatron also splits each expert's ffn by tp and pads the vocabulary."""
    width = spec.heads * spec.head_dim_
    vocab = -(-spec.vocab // (VOCAB_PAD * tp)) * VOCAB_PAD * tp
    model = replace(ModelConfig(), layers=1, hidden=width, heads=spec.heads, kv_heads=spec.kv_heads,
                    ffn=spec.ffn, vocab=vocab, seq_len=spec.seq_len, mlp="dense")
    cfg = RunConfig(model=model, world=tp, parallel=ParallelConfig(strategy="tp", sequence_parallel=tp > 1))
    try:
        validate(cfg)
    except ConfigError as e:
        return str(e)
    return None


def tp_degrees(spec: ModelSpec) -> tuple[list[int], dict[int, str]]:
    """(the degrees 1..MAX_TP that split `spec`, {each other degree: why not}): the slider offers only the
    first, the page says why the others are missing."""
    valid, refused = [], {}
    for t in range(1, MAX_TP + 1):
        problem = tp_config_error(spec, t)
        if problem:
            refused[t] = problem
        else:
            valid.append(t)
    return valid, refused


def refused_degrees_text(refused: dict[int, str]) -> str:
    """{t: the engine's message} -> "t = 3, 5, 6 (heads=32 is not divisible by tp); ...", one entry per reason,
    in markdown. This lesson has no cp, so the engine's tp*cp is tp."""
    by_reason: dict[str, list[int]] = {}
    for t, why in refused.items():
        by_reason.setdefault(re.sub(r"tp(\*cp)?=\d+", "tp", why.split(":")[0]), []).append(t)
    return markdown_text("; ".join(f"t = {', '.join(map(str, ts))} ({reason})" for reason, ts in by_reason.items()))


def head_owners(heads: int, kv_heads: int, tp: int) -> tuple[list[int], list[list[int]]]:
    """(owner rank of each query head, ranks holding each KV head).

    Query heads are split in contiguous blocks of heads/tp. A KV head serves the heads/kv_heads query heads
    of its group, so it lives on the ranks owning them: one rank when tp <= kv_heads, tp/kv_heads copies
    when tp > kv_heads (engine/tp.py replicates it and sums the copies' gradients)."""
    per_rank = heads // tp
    q_owner = [h // per_rank for h in range(heads)]
    group = heads // kv_heads
    kv_ranks = [sorted({q_owner[h] for h in range(k * group, (k + 1) * group)}) for k in range(kv_heads)]
    return q_owner, kv_ranks


# ---- the split picture -------------------------------------------------------------------------------

def _boxes(rects: list[tuple[float, float, float, float]]) -> tuple[list, list]:
    """Closed outlines of rectangles (x0, x1, y0, y1), separated by None, for one filled Scatter trace."""
    xs, ys = [], []
    for x0, x1, y0, y1 in rects:
        xs += [x0, x1, x1, x0, x0, None]
        ys += [y0, y0, y1, y1, y0, None]
    return xs, ys


def _rank_trace(rank: int, rects, text: str, first: bool) -> go.Scatter:
    xs, ys = _boxes(rects)
    return go.Scatter(x=xs, y=ys, fill="toself", mode="lines", fillcolor=rank_color(rank),
                      line={"color": "white", "width": 1}, name=f"rank {rank}", legendgroup=f"rank {rank}",
                      showlegend=first, hoveron="fills", hoverinfo="text", text=text)


def split_figure(hidden: int, ffn: int, heads: int, kv_heads: int, tp: int) -> go.Figure:
    """W_in split by columns, W_out by rows and the attention heads, one colour per tp rank.

    Axes are in matrix elements (rows downward), so each rank's block is exactly D x F/tp, F/tp x D."""
    if tp < 1 or ffn % tp or heads % tp:
        raise ValueError(f"tp={tp} must divide ffn={ffn} and heads={heads}")
    f_tp = ffn // tp
    q_owner, kv_ranks = head_owners(heads, kv_heads, tp)
    # The two matrices side by side, the heads under them across the width: three panels in a row left each
    # too narrow in a window 1,024 px wide, their titles and axis titles running into each other.
    fig = make_subplots(rows=2, cols=2, column_widths=[0.6, 0.4], row_heights=[0.68, 0.32],
                        specs=[[{}, {}], [{"colspan": 2}, None]], horizontal_spacing=0.12, vertical_spacing=0.2,
                        subplot_titles=(f"W_in[D, F_tp] by columns:<br>{hidden:,} x {f_tp:,} each",
                                        f"W_out[F_tp, D] by rows:<br>{f_tp:,} x {hidden:,} each",
                                        f"Heads: {heads // tp} query head(s) per rank"))
    group = heads // kv_heads
    for r in range(tp):
        cols = (r * f_tp, (r + 1) * f_tp)
        fig.add_trace(_rank_trace(r, [(cols[0], cols[1], 0, hidden)],
                                  f"rank {r}: W_in[:, {cols[0]:,}:{cols[1]:,}]", True), row=1, col=1)
        fig.add_trace(_rank_trace(r, [(0, hidden, cols[0], cols[1])],
                                  f"rank {r}: W_out[{cols[0]:,}:{cols[1]:,}, :]", False), row=1, col=2)
        q_cells = [(h, h + 1, 0, 1) for h in range(heads) if q_owner[h] == r]
        # a KV head is drawn under its query group; a replicated one shows each holder's part of the group
        kv_cells = [(h, h + 1, 1.3, 2.3) for h in range(heads) if q_owner[h] == r]
        kv_text = ", ".join(f"KV head {k}" + (" (copy)" if len(ranks) > 1 else "")
                            for k, ranks in enumerate(kv_ranks) if r in ranks)
        first_q = q_owner.index(r)
        fig.add_trace(_rank_trace(r, q_cells + kv_cells, f"rank {r}: query heads "
                                  f"{first_q}..{first_q + heads // tp - 1}; {kv_text}", False), row=2, col=1)
    for k in range(kv_heads):  # one outline per KV head, so a head shared by several ranks reads as one
        fig.add_shape(type="rect", x0=k * group, x1=(k + 1) * group, y0=1.3, y1=2.3,
                      line={"color": "black", "width": 2}, row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1, title_text="D (rows of W_in)")
    # W_out's rows on its right: on the left, between the two matrices, its axis title lay over W_in's last block
    fig.update_yaxes(autorange="reversed", row=1, col=2, title_text="F (rows of W_out)", side="right",
                     automargin=True)
    # the matrices' dimensions as 2k, 4k: "0 1000 2000 3000 4000" ran into each other under W_out at 800 px
    for col in (1, 2):
        fig.update_xaxes(tickformat="~s", row=1, col=col)
        fig.update_yaxes(tickformat="~s", row=1, col=col)
    fig.update_xaxes(title_text="F (columns)", row=1, col=1)
    fig.update_xaxes(title_text="D (columns)", row=1, col=2)
    fig.update_xaxes(title_text="head index", row=2, col=1)
    fig.update_yaxes(autorange="reversed", tickvals=[0.5, 1.8], ticktext=["Q", "KV"], row=2, col=1)
    fig.update_layout(height=580, margin={"l": 10, "r": 10, "t": 60, "b": 10}, plot_bgcolor="white",
                      legend={"orientation": "h", "y": -0.12, "yanchor": "top"})  # under the heads' axis title
    return fig


# ---- activation memory (Korthikanti et al. 2022 Table 2) ---------------------------------------------

def activation_bytes(spec: ModelSpec, micro_batch: int, tp: int) -> dict[str, float]:
    """Bytes of activations one layer keeps per chip, per mode of `korthikanti_bytes`, plus "none"
    (one chip, eq. 1) and "full" (full recomputation keeps only the layer input, 2sbh)."""
    s, b, h, a = spec.seq_len, micro_batch, spec.hidden, spec.heads
    out = {"none": korthikanti_bytes(s, b, h, a)}
    out |= {mode: korthikanti_bytes(s, b, h, a, tp, mode) for mode in MEMORY_MODES}
    out["full"] = korthikanti_bytes(s, b, h, a, tp, "full")
    return out


def activation_figure(spec: ModelSpec, micro_batch: int, chosen_tp: int, hbm_bytes: float) -> go.Figure:
    """GB of activations per layer per chip against tp, one line per recipe, the chosen tp marked."""
    tps = list(range(1, MAX_TP + 1))
    per_tp = [activation_bytes(spec, micro_batch, t) for t in tps]
    fig = go.Figure()
    for mode, (label, _) in MEMORY_MODES.items():
        fig.add_trace(go.Scatter(x=tps, y=[p[mode] / 1e9 for p in per_tp], name=label, mode="lines+markers"))
    chosen = activation_bytes(spec, micro_batch, chosen_tp)
    fig.add_trace(go.Scatter(x=[chosen_tp] * len(MEMORY_MODES), y=[chosen[m] / 1e9 for m in MEMORY_MODES],
                             mode="markers", marker={"size": 14, "symbol": "circle-open", "color": "black"},
                             name=f"tp = {chosen_tp}"))
    fig.add_trace(go.Scatter(x=[tps[0], tps[-1]], y=[hbm_bytes / spec.layers / 1e9] * 2, mode="lines",
                             line={"dash": "dot", "color": "black"},
                             name=f"HBM / {spec.layers} layers: above it activations alone fill the chip"))
    values = [p[m] / 1e9 for p in per_tp for m in MEMORY_MODES] + [hbm_bytes / spec.layers / 1e9]
    fig.update_layout(height=440, xaxis_title="tensor-parallel degree t",
                      yaxis=log_axis(values, title="GB per layer per chip"),
                      margin={"l": 10, "r": 10, "t": 50, "b": 10}, legend={"orientation": "h", "y": -0.2},
                      title=f"{spec.name}: activations of one layer, s={spec.seq_len:,}, b={micro_batch}, "
                            f"h={spec.hidden:,}, a={spec.heads}")
    return fig


# ---- communication per layer -------------------------------------------------------------------------

def tp_comm_bytes_per_layer(spec: ModelSpec, micro_batch: int, tp: int,
                            dtype_bytes: int = BF16_BYTES) -> float:
    """Bytes each chip sends per layer per micro-batch, forward + backward:
    4 all-reduces of V = b*s*h*dtype bytes (Korthikanti et al. 2022 sec. 4.2.2), each 2(t-1)/t V on a ring
    (Patarasuk & Yuan 2009). Sequence parallel sends the same: all-gather + reduce-scatter, (t-1)/t V each."""
    v = micro_batch * spec.seq_len * spec.hidden * dtype_bytes
    return TP_COLLECTIVES_PER_LAYER * 2 * (tp - 1) / tp * v


def tp_comm_seconds_per_layer(topo: Topology, spec: ModelSpec, micro_batch: int, sequence_parallel: bool,
                              dtype_bytes: int = BF16_BYTES) -> float:
    """Seconds of the 4 TP collectives of one layer on `topo` (alpha-beta, hardware.collectives)."""
    v = micro_batch * spec.seq_len * spec.hidden * dtype_bytes
    one = topo.all_gather_s(v) + topo.reduce_scatter_s(v) if sequence_parallel else topo.all_reduce_s(v)
    return TP_COLLECTIVES_PER_LAYER * one


def scaling_rows(spec: ModelSpec, chip: Chip, micro_batch: int, tps: list[int], job_chips: int = 1) -> list[dict]:
    """Per tp: the group's topology, TP bytes and seconds per layer, and the layer's compute seconds
    (forward + backward matmuls and memory-bound ops, `planner.costs.layer_cost`, FlashAttention).

    `comm_s` is tp innermost in the mesh (consecutive ranks, stride 1: NVLink while t fits the scale-up
    domain); `comm_spread_s` puts the tp group's members a whole domain apart (tp outermost), so every
    byte crosses the scale-out network. A TPU group's links are those of the slice a job of `job_chips`
    (the sidebar's mesh; at least t) takes (`group_links_chip`: small slices do not wrap around); a GPU's are
    its node's, and each row's compute that of a job of t chips, as before."""
    rows = []
    for t in tps:
        hw = group_links_chip(chip, t, job_chips)
        topo = group_topology(hw, t, achievable=True)
        spread = group_topology(hw, t, stride=hw.scaleup_domain, achievable=True)
        cost = layer_cost(spec, Layout(dp=1, tp=t, pp=1, micro_batch=micro_batch), hw, "bf16", spec.is_moe,
                          chip.scaleup_domain)
        rows.append({"tp": t, "topology": topo.describe(), "inside_domain": t <= chip.scaleup_domain,
                     "comm_bytes": tp_comm_bytes_per_layer(spec, micro_batch, t),
                     "comm_s": tp_comm_seconds_per_layer(topo, spec, micro_batch, False),
                     "comm_sp_s": tp_comm_seconds_per_layer(topo, spec, micro_batch, True),
                     "comm_spread_s": tp_comm_seconds_per_layer(spread, spec, micro_batch, False),
                     "compute_s": cost.fwd_compute_s + cost.bwd_compute_s})
    return rows


def bound_bases_table(bound: Bound, row: dict) -> str:
    """The bound meter's and the planner estimate's math against communication side by side, in markdown,
    each saying what it counts: the meter is the scaling book's rule (one MLP, one pass, peak rates), the
    estimate `row` of `scaling_rows` is the whole layer, forward and backward, at achievable rates."""
    # One column per basis: with one per quantity, five columns ran past the page's right edge in a window 800
    # px wide, the ratios out of sight.
    rule = ("one MLP, one pass: its matmuls at peak FLOP/s, its all-gather + reduce-scatter at the links' full "
            "bandwidth")
    estimate = (f"the whole layer, forward and backward: attention, MLP and the memory-bound ops, and its "
                f"{TP_COLLECTIVES_PER_LAYER} all-reduces, at achievable FLOP/s and bandwidth")
    return "\n".join([
        "| | bound meter (the rule) | planner estimate |", "|---|---|---|",
        f"| counts | {rule} | {estimate} |",
        f"| math | {format_seconds(bound.math_s)} | {format_seconds(row['compute_s'])} |",
        f"| communication | {format_seconds(bound.comm_s)} | {format_seconds(row['comm_s'])} |",
        f"| math / communication | **{bound.math_s / bound.comm_s:,.2f}x** | "
        f"**{row['compute_s'] / row['comm_s']:,.2f}x** |",
    ])


def scaling_figure(rows: list[dict], chosen_tp: int, domain: int, title: str) -> go.Figure:
    """Compute and TP communication per layer against tp (log-log), the scale-up domain's edge shaded."""
    tps = [r["tp"] for r in rows]
    fig = go.Figure()
    # the app's palette (ui/timeline.KIND_COLORS, as the planner's breakdown colours tensor-parallel collectives)
    compute, comm = KIND_COLORS["forward"], KIND_COLORS["reduce_scatter"]
    fig.add_trace(go.Scatter(x=tps, y=[r["compute_s"] * 1e3 for r in rows], name="compute (fwd + bwd)",
                             mode="lines+markers", line={"color": compute}))
    sending = [r for r in rows if r["tp"] > 1]  # t = 1 sends nothing, which a log axis cannot show
    fig.add_trace(go.Scatter(x=[r["tp"] for r in sending], y=[r["comm_s"] * 1e3 for r in sending],
                             mode="lines+markers", line={"color": comm},
                             name="TP communication, tp innermost (= SP's all-gathers + reduce-scatters)"))
    fig.add_trace(go.Scatter(x=[r["tp"] for r in sending], y=[r["comm_spread_s"] * 1e3 for r in sending],
                             mode="lines+markers",
                             line={"dash": "dot", "color": comm}, name="TP communication, tp group spread over nodes"))
    chosen = next((r for r in rows if r["tp"] == chosen_tp), None)
    if chosen is not None:
        marked = [chosen["compute_s"] * 1e3] + ([chosen["comm_s"] * 1e3] if chosen_tp > 1 else [])
        fig.add_trace(go.Scatter(x=[chosen_tp] * len(marked), y=marked,
                                 mode="markers", name=f"tp = {chosen_tp}",
                                 marker={"size": 14, "symbol": "circle-open", "color": "black"}))
    if domain < max(tps):
        # shaded from halfway (on the log axis) between the domain size and the next power of two
        fig.add_vrect(x0=domain * math.sqrt(2), x1=max(tps), fillcolor="#E45756", opacity=0.08, line_width=0)
        fig.add_trace(span_legend(f"shaded: the tp group spans several {domain}-chip domains", "#E45756"))
    values = [r[k] * 1e3 for r in rows for k in ("compute_s", "comm_s", "comm_spread_s") if r[k] > 0]
    fig.update_layout(height=400, xaxis={"type": "log", "tickvals": tps, "title": "tensor-parallel degree t"},
                      yaxis=log_axis(values, title="ms per layer per micro-batch"),
                      title=title, margin={"l": 10, "r": 10, "t": 50, "b": 10},
                      legend={"orientation": "h", "y": -0.25})
    return fig


# ---- the live runs -----------------------------------------------------------------------------------

def comm_bytes_by_kind(timeline: Timeline, rank: int, steps: int) -> dict[str, float]:
    """Bytes `rank` sent per step, by collective kind (all_reduce, all_gather, reduce_scatter, ...)."""
    out: dict[str, float] = {}
    for span in timeline.spans:
        if span.rank == rank and span.lane == "comm":
            kind = span_kind(span)
            out[kind] = out.get(kind, 0.0) + span.bytes / steps
    return out


def live_rows(runs: list[tuple[str, dict, Timeline, int]]) -> list[dict]:
    """One row per live run (label, summary, timeline, formula bytes per step): rank 0's measured bytes
    per step by kind and in all, the engine's formula, and the activation memory autograd saved."""
    rows = []
    for label, summary, timeline, formula in runs:
        steps = summary.steps
        kinds = comm_bytes_by_kind(timeline, 0, steps)
        activations = summary.memory_bytes[0]["activations_peak"]
        rows.append({"run": label,
                     "bytes sent per step (rank 0)": f"{summary.comm_bytes[0] / steps:,.0f}",
                     "formula (engine.tp)": f"{formula:,.0f}",
                     "all-reduce": f"{kinds.get('all_reduce', 0):,.0f}",
                     "all-gather": f"{kinds.get('all_gather', 0):,.0f}",
                     "reduce-scatter": f"{kinds.get('reduce_scatter', 0):,.0f}",
                     "activations (rank 0)": f"{activations / 1024:,.0f} KiB",
                     "step time": f"{summary.step_time_s * 1e3:,.1f} ms"})
    return rows
