"""The expert parallel lesson's arithmetic and figures: pure data in, numbers, Plotly figures and rows out.

A Mixture-of-Experts layer (Shazeer et al. 2017; GShard, Lepikhin et al. 2020) routes each token to the
top k of E expert MLPs. Expert parallel puts E/ep whole experts on each of the ep ranks:

    In[T, D] --router--> top-k of E --all-to-all (dispatch)--> rows at their experts' ranks
    W_in[E_ep, D, F] . W_out[E_ep, F, D] on each rank's own rows
    rows --all-to-all (combine)--> back home, out[t] = sum_k weight_k * expert_k(In[t])

The routing simulation is seeded numpy: a Zipf-skewed router, top-k drawn without replacement (Gumbel
top-k), GShard's capacity ceil(C * G * k / E) per expert per group of G tokens, first choices before
second choices and earlier tokens first (the engine's `capacity_keep` order). Costs use
`hardware.collectives` (alpha-beta all-to-all) and `planner.costs.matmul_s`.

No Streamlit and no torch here (engine.config is torch-free), so the page opens fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.moe import expert_capacity
from core.timeline import Timeline
from engine.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, validate
from hardware.chips import Chip
from hardware.collectives import Hierarchy, group_topology
from hardware.kernels import matmul_s
from planner.costs import group_links_chip
from planner.flops import active_params, layer_params, total_params
from planner.models import MODEL_PRESETS, ModelSpec
from ui.charts import log_axis, rank_color, span_legend, title_extra_px, wrap_title
from ui.timeline import KIND_COLORS

BF16_BYTES = 2  # tokens travel in bf16 (DeepSeek-V3 dispatches in FP8: 1 byte; arXiv 2412.19437 sec. 3.3)
# Dispatch + combine forward, and their transposes backward: GShard (Lepikhin et al. 2020) Algorithm 2.
A2A_PER_LAYER = 4
# The routing charts' own marks, none of them a kind of work on the timelines (ui.timeline.KIND_COLORS) nor a rank's
# colour (ui.charts.RANK_COLORS): dropped copies a light neutral, hatched; the capacity a dashed dark grey
# and the balanced load a dotted black, both on a white halo so they read across any rank's bar (rank 5's #222A2A
# is near black) and apart where they coincide (CF = 1).
DROPPED_COLOR, DROPPED_HATCH = "#F2F2F2", "#8C8C8C"
CAPACITY_COLOR, BALANCED_COLOR, HALO_COLOR = "#5C5C5C", "black", "white"
# the cost chart's shading where the ep group spans several domains: neutral, so the pink all-to-all lines read
SPAN_COLOR = "#7F7F7F"
PLACEMENT_TEXT_MIN_PX = 14  # a placement bar shorter than this gets no expert names (specks of text)
MOE_PRESETS = [name for name, spec in MODEL_PRESETS.items() if spec.is_moe]


# ---- the model's parameters -------------------------------------------------------------------------

def moe_numbers(spec: ModelSpec) -> dict[str, float]:
    """Total and active parameters, and one expert's and one MoE layer's routed-expert parameters."""
    moe = layer_params(spec, True)
    return {"total": total_params(spec), "active": active_params(spec),
            "per_expert": moe.experts / spec.experts, "experts_per_layer": moe.experts,
            "experts_all_layers": moe.experts * spec.moe_layers}


def ep_config_error(experts: int, top_k: int, ep: int) -> str | None:
    """The engine's own message when ep ranks cannot hold `experts` whole experts, else None."""
    model = replace(ModelConfig(), mlp="moe", experts=experts, top_k=min(top_k, experts))
    try:
        validate(RunConfig(model=model, world=ep, parallel=ParallelConfig(strategy="ep")))
    except ConfigError as e:
        return str(e)
    return None


def placement_figure(experts: int, ep: int) -> go.Figure:
    """Experts as cells, one row per ep rank, coloured by the rank that holds them (E/ep per rank)."""
    per_rank = experts // ep
    # 28 px a rank (22 px bars) below the title and above the x axis, up to 460 px in all
    height, margin = min(50 + PLACEMENT_XAXIS_PX + 28 * ep, 460), {"l": 10, "r": 10, "t": 40, "b": 10}
    named = per_rank <= 16 and placement_bar_px(height, margin, ep) >= PLACEMENT_TEXT_MIN_PX
    fig = go.Figure()
    for r in range(ep):
        fig.add_trace(go.Bar(x=[1] * per_rank, y=[f"rank {r}"] * per_rank, orientation="h",
                             marker={"color": rank_color(r), "line": {"color": "white", "width": 1}},
                             text=[f"E{r * per_rank + j}" for j in range(per_rank)] if named else None,
                             textposition="inside", insidetextanchor="middle", textangle=0,
                             hovertext=[f"expert {r * per_rank + j} on rank {r}" for j in range(per_rank)],
                             hoverinfo="text", showlegend=False))
    plural = "s" if per_rank > 1 else ""
    ranks = (f"ep = {ep} ranks: {per_rank} whole expert{plural} each" if ep != 1
             else f"ep = 1 rank: all {per_rank} on it")
    fig.update_layout(barmode="stack", height=height, margin=margin, bargap=PLACEMENT_BARGAP,
                      title=f"{experts} experts over {ranks}",
                      # slot j is the bar from j to j + 1: its number under its middle
                      xaxis={"title": "local expert slot", "showticklabels": per_rank <= 32,
                             "tickvals": [j + 0.5 for j in range(per_rank)],
                             "ticktext": [str(j) for j in range(per_rank)]},
                      yaxis={"autorange": "reversed"}, plot_bgcolor="white")
    return fig


PLACEMENT_BARGAP = 0.2  # Plotly's default, set so the bar height below is the one drawn
PLACEMENT_XAXIS_PX = 40  # what the x axis's numbers and title take below the bars (Plotly's automargin)


def placement_bar_px(height: int, margin: dict, ep: int) -> float:
    """The height in pixels of one rank's bar in a placement figure `height` px tall with `margin`."""
    return (height - margin["t"] - margin["b"] - PLACEMENT_XAXIS_PX) / ep * (1 - PLACEMENT_BARGAP)


# ---- the routing simulation -------------------------------------------------------------------------

def capacity(capacity_factor: float | None, group_tokens: int, top_k: int, experts: int) -> int | None:
    """The expert capacity (core.moe.expert_capacity); None without a capacity factor."""
    return None if capacity_factor is None else expert_capacity(capacity_factor, group_tokens, top_k, experts)


@dataclass(frozen=True)
class Routing:
    """(token, choice) pairs per source rank and expert: `routed[src, e]` chosen, `kept[src, e]` inside
    capacity. Expert e lives on rank e // (E/ep)."""

    routed: np.ndarray
    kept: np.ndarray
    ep: int
    top_k: int
    tokens_per_rank: int
    capacity_per_group: int | None
    groups: int  # capacity groups over all ranks

    @property
    def experts(self) -> int:
        return self.routed.shape[1]

    @property
    def tokens_per_expert(self) -> np.ndarray:
        return self.routed.sum(0)

    @property
    def dropped_per_expert(self) -> np.ndarray:
        return (self.routed - self.kept).sum(0)

    @property
    def processed_per_rank(self) -> np.ndarray:
        return self.kept.sum(0).reshape(self.ep, -1).sum(1)

    @property
    def matrix(self) -> np.ndarray:
        """[source rank, destination rank]: kept rows each rank sends to each rank (diagonal: stays)."""
        return self.kept.reshape(self.ep, self.ep, -1).sum(2)

    @property
    def dropped(self) -> int:
        return int((self.routed - self.kept).sum())

    @property
    def capacity_line(self) -> int | None:
        """Most rows one expert can take from all groups together."""
        return None if self.capacity_per_group is None else self.capacity_per_group * self.groups

    def stats(self) -> dict[str, float]:
        return {"expert_max_over_mean": max_over_mean(self.tokens_per_expert),
                "rank_max_over_mean": max_over_mean(self.processed_per_rank),
                "dropped_fraction": self.dropped / max(int(self.routed.sum()), 1)}


def max_over_mean(counts) -> float:
    mean = float(np.mean(counts))
    return float(np.max(counts)) / mean if mean > 0 else 0.0


def router_probabilities(experts: int, zipf_s: float) -> np.ndarray:
    """Expert e gets weight 1/(e+1)^s, normalised: s = 0 is a perfectly balanced router, larger s sends
    more tokens to the low-numbered experts (Zipf's law)."""
    weights = 1.0 / np.arange(1, experts + 1) ** zipf_s
    return weights / weights.sum()


def simulate_routing(tokens_per_rank: int, experts: int, top_k: int, ep: int, capacity_factor: float | None,
                     zipf_s: float, seed: int = 0, group_tokens: int | None = None) -> Routing:
    """Route `tokens_per_rank` tokens on each of `ep` ranks to top_k of `experts` and apply the capacity
    per group of `group_tokens` tokens (default: a rank's whole batch is one group)."""
    group_tokens = group_tokens or tokens_per_rank
    if experts % ep or tokens_per_rank % group_tokens or not 1 <= top_k <= experts:
        raise ValueError(f"need experts={experts} divisible by ep={ep}, tokens_per_rank={tokens_per_rank} by "
                         f"group_tokens={group_tokens}, and 1 <= top_k={top_k} <= experts")
    rng = np.random.default_rng(seed)
    log_p = np.log(router_probabilities(experts, zipf_s))
    n = ep * tokens_per_rank
    # Gumbel top-k: the k largest of log p + Gumbel noise are k experts drawn without replacement in
    # proportion to p (Kool et al. 2019, "Stochastic Beams and Where to Find Them", sec. 3).
    uniform = rng.random((n, experts), dtype=np.float32)
    scores = log_p.astype(np.float32) - np.log(-np.log(uniform + np.float32(1e-12)))
    chosen = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k] if top_k < experts else \
        np.tile(np.arange(experts), (n, 1))
    order = np.take_along_axis(scores, chosen, 1).argsort(axis=1)[:, ::-1]
    chosen = np.take_along_axis(chosen, order, 1)  # first choice first
    cap = capacity(capacity_factor, group_tokens, top_k, experts)
    keep = capacity_keep(chosen, group_tokens, experts, cap)
    src = np.repeat(np.arange(ep), tokens_per_rank * top_k)
    flat = src * experts + chosen.reshape(-1)
    routed = np.bincount(flat, minlength=ep * experts).reshape(ep, experts)
    kept = np.bincount(flat[keep.reshape(-1)], minlength=ep * experts).reshape(ep, experts)
    return Routing(routed, kept, ep, top_k, tokens_per_rank, cap, n // group_tokens)


def capacity_keep(chosen: np.ndarray, group_tokens: int, experts: int, cap: int | None) -> np.ndarray:
    """chosen[N, k] -> keep[N, k]: in each group of `group_tokens` consecutive tokens an expert accepts
    its first `cap` assignments, all first choices before any second choice and earlier tokens first
    (GShard Algorithm 1's order; numpy twin of engine.model.capacity_keep)."""
    n, k = chosen.shape
    if cap is None:
        return np.ones((n, k), dtype=bool)
    groups = n // group_tokens
    slot_major = chosen.reshape(groups, group_tokens, k).transpose(0, 2, 1).reshape(-1)
    key = np.repeat(np.arange(groups), group_tokens * k) * experts + slot_major
    by_key = np.argsort(key, kind="stable")
    sorted_key = key[by_key]
    position = np.empty(key.size, dtype=np.int64)
    position[by_key] = np.arange(key.size) - np.searchsorted(sorted_key, sorted_key, side="left")
    return (position < cap).reshape(groups, k, group_tokens).transpose(0, 2, 1).reshape(n, k)


def load_tops(tokens_per_expert, dropped_per_expert, ep: int, capacity_line: int | None,
              rank_counts=None) -> tuple[float, float]:
    """The tallest of a `load_figure`'s experts (bars, the balanced mean, the capacity) and of its ranks: two
    figures drawn to compare take the larger of each, so their bars stand on one scale."""
    routed, kept = np.asarray(tokens_per_expert), np.asarray(tokens_per_expert) - np.asarray(dropped_per_expert)
    ranks = rank_counts if rank_counts is not None else kept.reshape(ep, -1).sum(1)
    top = max([float(routed.max(initial=0)), routed.sum() / max(1, routed.size),
               *([capacity_line] if capacity_line is not None else [])])
    return top, float(np.max(ranks, initial=0))


def load_figure(tokens_per_expert, dropped_per_expert, ep: int, capacity_line: int | None, title: str,
                rank_counts=None, tops: tuple[float, float] | None = None) -> go.Figure:
    """Bars per expert (kept in the owning rank's colour, dropped in grey), the capacity and the balanced
    mean as lines; beside them the rows each ep rank processes. `tops`: the y ranges' tops (`load_tops`), else
    this figure's own."""
    routed = np.asarray(tokens_per_expert)
    dropped = np.asarray(dropped_per_expert)
    experts = routed.size
    per_rank = experts // ep
    kept = routed - dropped
    ranks = rank_counts if rank_counts is not None else kept.reshape(ep, per_rank).sum(1)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.72, 0.28], horizontal_spacing=0.08,
                        subplot_titles=("(token, choice) pairs per expert", "rows per ep rank"))
    x = list(range(experts))
    fig.add_trace(go.Bar(x=x, y=kept, name="kept (in the colour of the expert's rank)",
                         marker={"color": [rank_color(e // per_rank) for e in x]},
                         hovertemplate="expert %{x}: %{y} kept<extra></extra>"), row=1, col=1)
    if dropped.sum() > 0:
        # an expert that dropped nothing gets no bar (a bar of height 0 would still draw its outline)
        fig.add_trace(go.Bar(x=x, y=[d if d else None for d in dropped.tolist()], name="dropped (over capacity)",
                             marker={"color": DROPPED_COLOR, "line": {"color": DROPPED_HATCH, "width": 1},
                                     "pattern": {"shape": "/", "fgcolor": DROPPED_HATCH, "size": 6}},
                             hovertemplate="expert %{x}: %{y} dropped<extra></extra>"), row=1, col=1)
    mean = routed.sum() / experts
    ends = [-0.5, experts - 0.5]
    # the capacity (wide dashes) under the balanced load (fine dots): where they coincide, at CF = 1, both show
    same = capacity_line is not None and math.isclose(capacity_line, mean)
    balanced = {"color": BALANCED_COLOR, "dash": "dot", "width": 2}
    lines = [] if capacity_line is None else [
        (capacity_line, "capacity (= the balanced load here)" if same else "capacity",
         {"color": CAPACITY_COLOR, "dash": "dash", "width": 4})]
    _lines(fig, ends, [*lines, (mean, "balanced load", balanced)], col=1)
    # ranks by number under an axis title: "rank 0", "rank 1" ... had been turned on end and run into each other
    # in a narrow window
    fig.add_trace(go.Bar(x=[str(r) for r in range(ep)], y=ranks, showlegend=False,
                         marker={"color": [rank_color(r) for r in range(ep)]},
                         hovertemplate="rank %{x}: %{y} rows<extra></extra>"), row=1, col=2)
    _lines(fig, [str(r) for r in (0, ep - 1)], [(float(np.mean(ranks)), None, balanced)], col=2)
    lines = wrap_title(title)
    extra = title_extra_px(lines)
    # the title hangs from the top, its lines clear of the panels' titles; the legend clear of "expert"
    fig.update_layout(barmode="stack", height=360 + extra, bargap=0.15,
                      title={"text": lines, "y": 1, "yref": "container", "yanchor": "top", "pad": {"t": 12}},
                      margin={"l": 10, "r": 10, "t": 60 + extra, "b": 10},
                      legend={"orientation": "h", "y": -0.28})
    fig.update_xaxes(title_text="expert", row=1, col=1)
    # categories: Plotly reads "0", "1" as numbers and had ticked the ranks -0.5, 0, 0.5, 1, 1.5
    fig.update_xaxes(title_text="ep rank", tickangle=0, type="category", row=1, col=2)
    # every expert numbered while they fit (16 at most), and room above the tallest bar and the capacity line
    if experts <= 16:
        fig.update_xaxes(dtick=1, row=1, col=1)
    top, rank_top = tops or load_tops(tokens_per_expert, dropped_per_expert, ep, capacity_line, rank_counts)
    fig.update_yaxes(range=[0, 1.12 * top or 1.0], row=1, col=1)
    fig.update_yaxes(range=[0, 1.12 * rank_top or 1.0], row=1, col=2)
    return fig


def _lines(fig: go.Figure, x: list, lines: list[tuple[float, str | None, dict]], col: int) -> None:
    """Horizontal lines (y, legend name or None, line style) on white halos, so they read across the bars of any
    rank's colour: every halo first, then the lines in order, so a line drawn on another still shows it."""
    for y, _, line in lines:
        fig.add_trace(go.Scatter(x=x, y=[y] * 2, mode="lines", showlegend=False, hoverinfo="skip",
                                 line={"color": HALO_COLOR, "width": line["width"] + 3}), row=1, col=col)
    for y, name, line in lines:
        fig.add_trace(go.Scatter(x=x, y=[y] * 2, mode="lines", line=line, name=name, showlegend=name is not None,
                                 hovertemplate=f"{name or 'balanced load'}: %{{y:,.0f}}<extra></extra>"),
                      row=1, col=col)


def matrix_figure(matrix, title: str) -> go.Figure:
    """The all-to-all as a heatmap: rows a source rank sends to each destination rank."""
    m = np.asarray(matrix)
    ep = m.shape[0]
    labels = [f"rank {r}" for r in range(ep)]
    fig = go.Figure(go.Heatmap(z=m, x=labels, y=labels, colorscale="Blues", colorbar={"title": "rows"},
                               text=m if ep <= 16 else None, texttemplate="%{text}" if ep <= 16 else None,
                               hovertemplate="%{y} -> %{x}: %{z} rows<extra></extra>"))
    fig.update_layout(height=min(140 + 40 * ep, 520), title=title,
                      margin={"l": 10, "r": 10, "t": 50, "b": 10},
                      xaxis={"title": "destination rank (holds the experts)"},
                      yaxis={"title": "source rank (holds the tokens)", "autorange": "reversed"})
    return fig


# ---- cost on real chips -----------------------------------------------------------------------------

def a2a_bytes(tokens: int, top_k: int, hidden: int, ep: int,
              dtype_bytes: int = BF16_BYTES) -> dict[str, float]:
    """Bytes one rank sends per MoE layer, balanced routing and no drops: each of the T*k token copies
    of D values lands on a uniformly chosen rank, so (ep-1)/ep of them leave ([SB] Part 12 all-to-all;
    planner.costs EP term; engine/ep.py docstring). One all-to-all, and the A2A_PER_LAYER of a step."""
    held = tokens * top_k * hidden * dtype_bytes
    one = held * (ep - 1) / ep
    return {"held": held, "one": one, "per_layer_step": A2A_PER_LAYER * one}


def expert_mlp_s(spec: ModelSpec, chip: Chip, tokens: int, ep: int) -> float:
    """Forward + backward seconds of one rank's routed experts for `tokens` tokens per rank, balanced:
    E/ep experts of ep*T*k/E rows each, In[R, D] . W_in[D, 2F] and H[R, F] . W_out[F, D] (SwiGLU),
    the backward twice the forward ([SB] Part 4); as in planner.costs."""
    n_in = 2 if spec.mlp == "swiglu" else 1
    rows = max(1.0, ep * tokens * spec.top_k / spec.experts)
    fwd = spec.experts / ep * (matmul_s(chip, "bf16", rows, spec.hidden, n_in * spec.ffn)
                               + matmul_s(chip, "bf16", rows, spec.ffn, spec.hidden))
    return 3 * fwd


def cost_rows(spec: ModelSpec, chip: Chip, tokens: int, eps: list[int], job_chips: int = 1) -> list[dict]:
    """Per ep that divides E: bytes and seconds of the 4 all-to-alls of one MoE layer (forward +
    backward) with the ep group on consecutive chips (`a2a_s`) and one chip per scale-up domain
    (`a2a_spread_s`), the experts' compute, and the expert weights each chip holds (bf16, all MoE layers).
    A TPU row's links are those of the slice a job of `job_chips` (the sidebar's mesh; at least ep) takes
    (`cluster_chip`); a GPU's are its node's. `domains`: the scale-up domains ep consecutive chips touch;
    `rows_leaving_domain`: see `rows_leaving_domain`."""
    domain = chip.scaleup_domain
    rows = []
    for ep in eps:
        if spec.experts % ep:
            continue
        b = a2a_bytes(tokens, spec.top_k, spec.hidden, ep)
        links = group_links_chip(chip, ep, job_chips)
        near = group_topology(links, ep, achievable=True)
        spread = group_topology(links, ep, stride=links.scaleup_domain, achievable=True)
        rows.append({"ep": ep, "inside_domain": ep <= domain, "topology": near.describe(),
                     "domains": math.ceil(ep / domain), "rows_leaving_domain": rows_leaving_domain(near, ep, domain),
                     "bytes": b["per_layer_step"],
                     "a2a_s": A2A_PER_LAYER * near.all_to_all_s(b["held"]),
                     "a2a_spread_s": A2A_PER_LAYER * spread.all_to_all_s(b["held"]),
                     "compute_s": expert_mlp_s(spec, chip, tokens, ep),
                     "expert_weights_bytes": BF16_BYTES * spec.experts * layer_params(spec, True).experts
                     / spec.experts * spec.moe_layers / ep})
    return rows


def rows_leaving_domain(topology, ep: int, domain: int) -> int | None:
    """Of every ep rows a chip sends (balanced), how many leave its scale-up domain of `domain` chips as the cost
    model (`topology`, hardware.collectives.group_topology) has it: none inside one domain, ep - domain across
    whole domains (a hierarchy), None where the domain does not divide the group and the model puts every rank
    on the flat scale-out network (every row that leaves the chip crosses it)."""
    if ep <= domain:
        return 0
    return ep - topology.domain_size if isinstance(topology, Hierarchy) else None


def cost_figure(rows: list[dict], chosen_ep: int, domain: int, title: str, unit: str = "node") -> go.Figure:
    """All-to-all and expert compute per MoE layer against ep (log-log), the scale-up domain shaded;
    `unit` names one scale-up domain ("node" of GPUs, TPU "slice")."""
    rows = [r for r in rows if r["ep"] > 1]
    eps = [r["ep"] for r in rows]
    fig = go.Figure()
    compute, a2a = KIND_COLORS["forward"], KIND_COLORS["all_to_all"]  # the app's palette (ui/timeline)
    fig.add_trace(go.Scatter(x=eps, y=[r["compute_s"] * 1e3 for r in rows], mode="lines+markers",
                             line={"color": compute}, name="expert MLP compute (fwd + bwd)"))
    fig.add_trace(go.Scatter(x=eps, y=[r["a2a_s"] * 1e3 for r in rows], mode="lines+markers",
                             line={"color": a2a}, name="4 all-to-alls, ep group on consecutive chips"))
    fig.add_trace(go.Scatter(x=eps, y=[r["a2a_spread_s"] * 1e3 for r in rows], mode="lines+markers",
                             line={"dash": "dot", "color": a2a}, name=f"4 all-to-alls, one chip per {unit}"))
    chosen = next((r for r in rows if r["ep"] == chosen_ep), None)
    if chosen is not None:
        fig.add_trace(go.Scatter(x=[chosen_ep] * 2, y=[chosen["compute_s"] * 1e3, chosen["a2a_s"] * 1e3],
                                 mode="markers", name=f"ep = {chosen_ep}",
                                 marker={"size": 14, "symbol": "circle-open", "color": "black"}))
    if eps and domain < max(eps):
        fig.add_vrect(x0=domain * math.sqrt(2), x1=max(eps), fillcolor=SPAN_COLOR, opacity=0.12, line_width=0)
        fig.add_trace(span_legend(f"shaded: the ep group spans several {domain}-chip {unit}s", SPAN_COLOR))
    values = [r[k] * 1e3 for r in rows for k in ("compute_s", "a2a_s", "a2a_spread_s") if r[k] > 0]
    lines = wrap_title(title)
    extra = title_extra_px(lines)
    fig.update_layout(height=400 + extra, title=lines, margin={"l": 10, "r": 10, "t": 50 + extra, "b": 10},
                      xaxis={"type": "log", "tickvals": eps, "title": "expert-parallel degree ep"},
                      yaxis=log_axis(values, title="ms per MoE layer per micro-batch") if values else
                      {"type": "log", "title": "ms per MoE layer per micro-batch"},
                      legend={"orientation": "h", "y": -0.25})
    return fig


# ---- the live run -----------------------------------------------------------------------------------

def a2a_bytes_by_name(timeline: Timeline, rank: int, steps: int) -> dict[str, float]:
    """Bytes `rank` sent per step: the counts exchange, dispatch and combine all-to-alls (forward and
    backward together), and everything else (the dense gradients' all-reduce)."""
    out = {"counts": 0.0, "dispatch": 0.0, "combine": 0.0, "other": 0.0}
    for span in timeline.spans:
        if span.rank != rank or span.lane != "comm":
            continue
        part = next((p for p in ("counts", "dispatch", "combine") if f"all_to_all {p}" in span.name), "other")
        out[part] += span.bytes / steps
    return out


def live_step_tokens(config: dict) -> int:
    """T of a live run's formula: the tokens one rank routes per optimizer step, micro-batches x micro-batch size
    x sequence length (a run summary's `config`)."""
    return config["micro_batches"] * config["micro_batch_size"] * config["model"]["seq_len"]


def measured_a2a_formula(summary, hidden: int, dtype_bytes: int = 4) -> float:
    """Bytes per rank per step of the dispatch and combine all-to-alls with balanced routing, at the
    measured drop rate: A2A_PER_LAYER * T * k * (1 - dropped) * D * bytes * (ep-1)/ep per layer, T
    `live_step_tokens`."""
    load = summary.stats["expert_load"]
    tokens = live_step_tokens(summary.config)
    ep = load["ep"]
    return sum(A2A_PER_LAYER * tokens * load["top_k"] * (1 - layer["dropped_fraction"]) * hidden * dtype_bytes
               * (ep - 1) / ep for layer in load["layers"].values())


def live_load_rows(summary) -> list[dict]:
    """One row per MoE layer of a live run's `stats["expert_load"]`, a field per count: the page shows them
    on their side (`text_table(..., columns_from="layer")`), a column per layer and a row per expert and ep
    rank. With the counts of eight experts joined in one cell, at 800 px each cell wrapped to four lines
    and the rank's header to four more."""
    rows = []
    for name, layer in summary.stats["expert_load"]["layers"].items():
        routed = {f"routed to expert {e}": count for e, count in enumerate(layer["tokens_per_expert"])}
        kept = {f"rows on ep rank {r}": count for r, count in enumerate(layer["processed_per_ep_rank"])}
        rows.append({"layer": name, **routed, "dropped": int(sum(layer["dropped_per_expert"])),
                     "dropped fraction": f"{layer['dropped_fraction']:.1%}", **kept,
                     "busiest expert / mean": f"{layer['expert_max_over_mean']:.2f}",
                     "busiest rank / mean": f"{layer['ep_rank_max_over_mean']:.2f}"})
    return rows


def live_a2a_text(sent: dict[str, float], summary, hidden: int, steps: int) -> str:
    """The live panel's paragraph on the bytes rank 0 sent per step (`a2a_bytes_by_name`) against the balanced
    formula (`measured_a2a_formula`), T as that formula counts it (`live_step_tokens`)."""
    load = summary.stats["expert_load"]
    formula = measured_a2a_formula(summary, hidden)
    cfg = summary.config
    return (
        f"Bytes rank 0 sent per step: dispatch **{sent['dispatch']:,.0f}**, combine **{sent['combine']:,.0f}** "
        "(each counts its forward all-to-all and that one's own backward, \"... bwd\", which sends the transposed "
        "rows: as much as the other's forward, so the two are always equal), counts "
        f"{sent['counts']:,.0f}, dense gradients' all-reduce {sent['other']:,.0f}; in all "
        f"**{summary.comm_bytes[0] / steps:,.0f}**. The balanced formula 4 x T x k x (1 - dropped) x D x 4 bytes "
        f"x (ep-1)/ep over the {len(load['layers'])} MoE layers gives **{formula:,.0f}** for dispatch + combine "
        f"(T = m x b x s = {cfg['micro_batches']} x {cfg['micro_batch_size']} x {cfg['model']['seq_len']} = "
        f"{live_step_tokens(cfg):,} tokens per rank per step, D = {hidden}, fp32); the measured "
        f"{sent['dispatch'] + sent['combine']:,.0f} differs by how unevenly this router spread the rows."
    )
