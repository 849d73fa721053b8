"""Builders for the Collectives lesson: ring-step animations, alpha-beta cost curves, the live sweep.

Pure: data in, Plotly figure (or plain data) out. No Streamlit and no torch here; the engine is
imported only inside the functions that read its results, so the page loads without it.

The ring algorithms drawn step by step (Thakur, Rabenseifner, Gropp 2005, "Optimization of collective
communication operations in MPICH"; scaling book Part 3 "Sharded matmuls", with V the full array):
- all-gather: chip i starts with shard i; at step s it passes shard (i - s + 1) mod N to chip i + 1.
  N - 1 steps, each moving V/N over every link at once.
- reduce-scatter: every chip starts with a full-size partial result; at step s chip i sends its partial
  of shard (i - s) mod N to chip i + 1, which adds its own. After N - 1 steps chip k holds shard k
  summed over all N chips.
- all-reduce = reduce-scatter + all-gather: 2 (N - 1) steps.
- all-to-all: chip i starts with one chunk addressed to every chip; each step every chip forwards the
  chunks not addressed to it, so a chunk for the chip d hops ahead crosses d links.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import plotly.graph_objects as go

from ui.charts import log_axis, rank_color, title_extra_px, wrap_title
from ui.tables import format_seconds
from ui.timeline import KIND_COLORS

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
COLLECTIVE_NAMES = {
    "all_gather": "All-gather",
    "reduce_scatter": "Reduce-scatter",
    "all_reduce": "All-reduce",
    "all_to_all": "All-to-all",
}
MIN_RING, MAX_RING = 2, 8


@dataclass(frozen=True)
class Block:
    """One N-th of an array in a chip's memory.

    Gather/scatter/reduce: `shard` is which N-th of the array, `sources` the chips whose values are
    summed into it (one chip until a reduction adds more). All-to-all: `shard` is the chip the chunk is
    addressed to and `sources` holds the one chip that sent it.
    """
    shard: int
    sources: frozenset[int]


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class RingStep:
    """The ring after `index` steps: what each chip holds (held[chip][slot]) and what crossed the links
    in the step that led here (nothing for the starting state)."""
    index: int
    phase: str
    caption: str
    held: tuple[tuple[Block | None, ...], ...]
    transfers: tuple[Transfer, ...]


def _check_ring(collective: str, n: int) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if isinstance(n, bool) or not isinstance(n, int) or not MIN_RING <= n <= MAX_RING:
        raise ValueError(f"a ring to draw needs {MIN_RING} to {MAX_RING} chips, got {n!r}")


def _freeze(held: list[list[Block | None]]) -> tuple[tuple[Block | None, ...], ...]:
    return tuple(tuple(row) for row in held)


def _gather_step(held, n: int, s: int) -> tuple[Transfer, ...]:
    """Ring all-gather step s (1-based): chip i forwards shard (i - s + 1) mod N to chip i + 1."""
    sends = []
    for i in range(n):
        block = held[i][(i - s + 1) % n]
        sends.append(Transfer(i, (i + 1) % n, (block,)))
    for t in sends:
        held[t.dst][t.blocks[0].shard] = t.blocks[0]
    return tuple(sends)


def _reduce_scatter_step(held, n: int, s: int) -> tuple[Transfer, ...]:
    """Ring reduce-scatter step s: chip i sends its partial of shard (i - s) mod N on and drops it; the
    receiver adds it to its own partial of that shard."""
    sends = []
    for i in range(n):
        slot = (i - s) % n
        sends.append(Transfer(i, (i + 1) % n, (held[i][slot],)))
        held[i][slot] = None
    for t in sends:
        got = t.blocks[0]
        mine = held[t.dst][got.shard]
        held[t.dst][got.shard] = Block(got.shard, got.sources | mine.sources)
    return tuple(sends)


def _all_to_all_slot(block: Block, chip: int) -> int:
    # A chunk waits in the slot of the chip it is addressed to; once home, in the slot of its sender,
    # which is the output layout of torch.distributed.all_to_all (output chunk i came from rank i).
    return min(block.sources) if block.shard == chip else block.shard


def _all_to_all_step(held, n: int) -> tuple[Transfer, ...]:
    """Every chip forwards all chunks not addressed to it to the next chip (store and forward)."""
    sends = []
    for i in range(n):
        moving = tuple(b for b in held[i] if b is not None and b.shard != i)
        for b in moving:
            held[i][_all_to_all_slot(b, i)] = None
        if moving:
            sends.append(Transfer(i, (i + 1) % n, moving))
    for t in sends:
        for b in t.blocks:
            slot = _all_to_all_slot(b, t.dst)
            if held[t.dst][slot] is not None:
                raise AssertionError(f"slot {slot} of chip {t.dst} is taken; the ring schedule is wrong")
            held[t.dst][slot] = b
    return tuple(sends)


def ring_steps(collective: str, n: int) -> list[RingStep]:
    """Every state of `collective` on a unidirectional ring of n chips, the starting state first."""
    _check_ring(collective, n)
    name = COLLECTIVE_NAMES[collective]
    if collective == "all_gather":
        held = [[Block(i, frozenset({i})) if k == i else None for k in range(n)] for i in range(n)]
        start = f"Start: chip i holds shard i, 1/{n} of the array. Goal: every chip holds all {n} shards."
    elif collective == "all_to_all":
        held = [[Block(k, frozenset({i})) for k in range(n)] for i in range(n)]
        start = (f"Start: every chip holds {n} chunks, one addressed to each chip (label sender→receiver). "
                 "Goal: every chunk at its receiver.")
    else:
        held = [[Block(k, frozenset({i})) for k in range(n)] for i in range(n)]
        goal = ("chip k holds shard k summed over all chips" if collective == "reduce_scatter"
                else "every chip holds the whole array summed over all chips")
        start = f"Start: every chip holds its own full-size array (e.g. its gradients). Goal: {goal}."
    steps = [RingStep(0, "start", f"{name}, {n} chips. {start}", _freeze(held), ())]
    last = n - 1
    if collective in ("reduce_scatter", "all_reduce"):
        label = "Reduce-scatter" if collective == "reduce_scatter" else "Phase 1, reduce-scatter"
        for s in range(1, n):
            sent = _reduce_scatter_step(held, n, s)
            done = f" Each chip now holds one shard summed over all {n} chips." if s == last else ""
            caption = (f"{label}, step {s}/{last}: every chip sends one partial shard to the next, which "
                       f"adds its own (Σk = k chips summed in).{done}")
            steps.append(RingStep(len(steps), "reduce-scatter", caption, _freeze(held), sent))
    if collective in ("all_gather", "all_reduce"):
        label = "All-gather" if collective == "all_gather" else "Phase 2, all-gather"
        for s in range(1, n):
            sent = _gather_step(held, n, s)
            done = " Every chip holds the whole array." if s == last else ""
            caption = (f"{label}, step {s}/{last}: every chip passes on the shard it got last (at first its "
                       f"own); all {n} links carry 1/{n} of the array.{done}")
            steps.append(RingStep(len(steps), "all-gather", caption, _freeze(held), sent))
    if collective == "all_to_all":
        for s in range(1, n):
            sent = _all_to_all_step(held, n)
            per_link = max(len(t.blocks) for t in sent)
            done = " Every chunk has arrived." if s == last else ""
            caption = (f"All-to-all, step {s}/{last}: every chip forwards the chunks not addressed to it "
                       f"({per_link} per link); a chunk for the chip d hops ahead crosses d links.{done}")
            steps.append(RingStep(len(steps), "all-to-all", caption, _freeze(held), sent))
    return steps


# ---- drawing the ring ------------------------------------------------------------------------------

SLOT_PITCH = 0.2  # distance between neighbouring blocks, plot units
EMPTY_SLOT_COLOR = "#DDDDDD"
RING_PLOT_PX = 490  # the ring's own height; the step caption above it and the controls below come on top
# bottom: the play and pause buttons, and under them the step slider (beside the buttons, the slider ran under
# them where the ring's column is narrow)
RING_MARGIN_PX = {"l": 10, "r": 10, "b": 110}
# Plotly titles do not wrap; break the caption into lines this long: the ring has three quarters of the page,
# and at a window 800 px wide a line of 95 ran past its right edge
CAPTION_CHARS = 42
CAPTION_LINE_PX = 19  # the caption's line height at its font size


def _ring_radius(n: int) -> float:
    # Seven or eight chips put neighbours' two-row block grids close: a wider ring keeps them apart.
    return 1.0 if n <= 6 else 1.25


def _link_radius(n: int) -> float:
    # Links run as arcs inside the ring of chips, clear of the blocks.
    return _ring_radius(n) - 0.45


def _span(n: int) -> float:
    return _ring_radius(n) + 0.45


def _angle(chip: int, n: int) -> float:
    # Chip 0 at the top, the ring running clockwise.
    return math.pi / 2 - 2 * math.pi * chip / n


def _chip_xy(chip: int, n: int) -> tuple[float, float]:
    a, r = _angle(chip, n), _ring_radius(n)
    return r * math.cos(a), r * math.sin(a)


def _slot_grid(n: int) -> tuple[int, int]:
    """(columns, rows) of a chip's block grid: one row up to 4 blocks, then two rows."""
    cols = n if n <= 4 else math.ceil(n / 2)
    return cols, math.ceil(n / cols)


def _slot_xy(chip: int, slot: int, n: int) -> tuple[float, float]:
    cx, cy = _chip_xy(chip, n)
    cols, rows = _slot_grid(n)
    col, row = slot % cols, slot // cols
    return cx + (col - (cols - 1) / 2) * SLOT_PITCH, cy - (row - (rows - 1) / 2) * SLOT_PITCH


def _arc(src: int, n: int, points: int = 24) -> tuple[list[float], list[float]]:
    """The link src -> src+1 as an arc inside the ring, trimmed at both ends so neighbours' arrows part."""
    span = 2 * math.pi / n
    trim = min(0.12, span * 0.12)
    a0, a1 = _angle(src, n) - trim, _angle(src, n) - span + trim
    angles = [a0 + (a1 - a0) * k / (points - 1) for k in range(points)]
    r = _link_radius(n)
    return [r * math.cos(a) for a in angles], [r * math.sin(a) for a in angles]


def _block_label(block: Block, collective: str) -> str:
    if collective == "all_to_all":
        return f"{min(block.sources)}→{block.shard}"
    if collective == "all_gather":
        return str(block.shard)
    return f"Σ{len(block.sources)}"


def _block_hover(block: Block, collective: str, n: int) -> str:
    if collective == "all_to_all":
        return f"chunk from chip {min(block.sources)} to chip {block.shard}"
    if collective == "all_gather":
        return f"shard {block.shard} (chip {block.shard}'s data)"
    chips = ", ".join(map(str, sorted(block.sources)))
    state = "fully reduced" if len(block.sources) == n else "partial sum"
    return f"shard {block.shard}: {state} of chips {chips} ({len(block.sources)}/{n})"


def _block_color(block: Block, collective: str) -> str:
    # A shard in its chip's colour, as ranks are on every page (all-to-all colours a chunk by its sender, so the
    # receivers' rows end up as rainbows).
    return rank_color(min(block.sources) if collective == "all_to_all" else block.shard)


def _block_px(n: int) -> float:
    """Marker size that fills a slot: the height fixes the scale, the x axis is anchored to it."""
    return 0.9 * SLOT_PITCH * RING_PLOT_PX / (2 * _span(n))


def _slot_trace(step: RingStep, collective: str, n: int) -> go.Scatter:
    xs, ys, colors, opacities, borders, widths, texts, hovers = [], [], [], [], [], [], [], []
    reducing = collective in ("reduce_scatter", "all_reduce")
    for chip, row in enumerate(step.held):
        for slot, block in enumerate(row):
            x, y = _slot_xy(chip, slot, n)
            xs.append(x)
            ys.append(y)
            if block is None:
                colors.append("white")
                opacities.append(1.0)
                borders.append(EMPTY_SLOT_COLOR)
                widths.append(1.5)
                texts.append("")
                hovers.append(f"chip {chip}, slot {slot}: empty")
                continue
            complete = len(block.sources) == n
            colors.append(_block_color(block, collective))
            # A partial sum is drawn faint and darkens as contributions arrive.
            opacities.append(0.3 + 0.7 * len(block.sources) / n if reducing else 1.0)
            borders.append("black" if reducing and complete else "white")
            widths.append(2.5 if reducing and complete else 1.0)
            texts.append(_block_label(block, collective))
            hovers.append(f"chip {chip}: {_block_hover(block, collective, n)}")
    return go.Scatter(
        x=xs, y=ys, mode="markers+text", text=texts, hovertext=hovers, hoverinfo="text", showlegend=False,
        textfont={"size": 10 if collective == "all_to_all" else 12, "color": "black"},
        marker={"symbol": "square", "size": _block_px(n), "color": colors, "opacity": opacities,
                "line": {"color": borders, "width": widths}},
    )


def _link_traces(step: RingStep, collective: str, n: int) -> tuple[go.Scatter, go.Scatter]:
    """Active links this step (thick arrows) and what each carries (a label at the arc's middle)."""
    xs, ys, sizes = [], [], []
    mid_x, mid_y, mid_text, mid_hover, mid_color = [], [], [], [], []
    for t in step.transfers:
        ax, ay = _arc(t.src, n)
        xs += ax + [None]
        ys += ay + [None]
        sizes += [0] * (len(ax) - 1) + [16, 0]
        k = len(ax) // 2
        mid_x.append(ax[k] * 0.8)
        mid_y.append(ay[k] * 0.8)
        labels = [_block_label(b, collective) for b in t.blocks]
        mid_text.append(", ".join(labels) if len(labels) <= 2 else f"{len(labels)} chunks")
        mid_hover.append(f"link {t.src}→{t.dst} carries " + "; ".join(
            _block_hover(b, collective, n) for b in t.blocks))
        mid_color.append(_block_color(t.blocks[0], collective))
    arrows = go.Scatter(
        x=xs, y=ys, mode="lines+markers", hoverinfo="skip", showlegend=False,
        line={"color": KIND_COLORS[collective], "width": 4},  # the collective's colour on every timeline
        marker={"symbol": "arrow", "angleref": "previous", "size": sizes, "color": KIND_COLORS[collective]},
    )
    payload = go.Scatter(
        x=mid_x, y=mid_y, mode="markers+text", text=mid_text, textposition="middle center",
        hovertext=mid_hover, hoverinfo="text", showlegend=False,
        textfont={"size": 10, "color": "black"},
        marker={"symbol": "circle", "size": 24, "color": mid_color, "opacity": 0.5},
    )
    return arrows, payload


def _static_traces(n: int) -> list[go.Scatter]:
    """The idle ring (every link, thin) and the chip names."""
    xs, ys = [], []
    for c in range(n):
        ax, ay = _arc(c, n)
        xs += ax + [None]
        ys += ay + [None]
    ring_trace = go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                            line={"color": "#BBBBBB", "width": 1.5, "dash": "dot"})
    _, rows = _slot_grid(n)
    label_x, label_y = [], []
    for c in range(n):
        x, y = _chip_xy(c, n)
        label_x.append(x)
        label_y.append(y + (rows / 2) * SLOT_PITCH + 0.09)
    labels = go.Scatter(x=label_x, y=label_y, mode="text", text=[f"<b>chip {c}</b>" for c in range(n)],
                        hoverinfo="skip", showlegend=False, textfont={"size": 13})
    return [ring_trace, labels]


def _title(step: RingStep) -> dict:
    # Each frame sets the whole title: a frame that sets only the text drops the font.
    return {"text": f"<b>{wrap_title(step.caption, CAPTION_CHARS)}</b>", "font": {"size": 14}, "x": 0.01,
            "xanchor": "left", "y": 0.98, "yanchor": "top"}


def _caption_px(steps: list[RingStep]) -> int:
    """The top margin that holds the longest step caption, wrapped, above the ring."""
    return 20 + CAPTION_LINE_PX + max(title_extra_px(wrap_title(s.caption, CAPTION_CHARS), CAPTION_LINE_PX)
                                      for s in steps)


def _dynamic_traces(step: RingStep, collective: str, n: int) -> list[go.Scatter]:
    return [_slot_trace(step, collective, n), *_link_traces(step, collective, n)]


def ring_figure(collective: str, n: int, frame_ms: int = 1000) -> go.Figure:
    """Animated ring of n chips running `collective`: play/pause buttons and a step slider."""
    steps = ring_steps(collective, n)
    static = _static_traces(n)
    dynamic_ids = list(range(len(static), len(static) + 3))
    frames = [go.Frame(name=str(s.index), data=_dynamic_traces(s, collective, n), traces=dynamic_ids,
                       layout={"title": _title(s)}) for s in steps]
    fig = go.Figure(data=static + _dynamic_traces(steps[0], collective, n), frames=frames)
    redraw = {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}
    slider_steps = [{"label": "start" if s.index == 0 else str(s.index), "method": "animate",
                     "args": [[str(s.index)], redraw]} for s in steps]
    span = _span(n)
    top = _caption_px(steps)
    fig.update_layout(
        title=_title(steps[0]),
        height=top + RING_PLOT_PX + RING_MARGIN_PX["b"], margin={**RING_MARGIN_PX, "t": top},
        plot_bgcolor="white",
        xaxis={"range": [-span, span], "visible": False},
        yaxis={"range": [-span, span], "visible": False, "scaleanchor": "x"},
        updatemenus=[{
            "type": "buttons", "direction": "left", "x": 0.0, "y": 0.0, "xanchor": "left", "yanchor": "top",
            "pad": {"t": 10, "r": 10},
            "buttons": [
                {"label": "▶ Play", "method": "animate",
                 "args": [None, {"frame": {"duration": frame_ms, "redraw": True}, "fromcurrent": True,
                                 "transition": {"duration": 0}}]},
                {"label": "❚❚ Pause", "method": "animate",
                 "args": [[None], {"mode": "immediate", "frame": {"duration": 0, "redraw": False},
                                   "transition": {"duration": 0}}]},
            ],
        }],
        sliders=[{"active": 0, "steps": slider_steps, "x": 0.0, "len": 1.0, "y": 0.0, "yanchor": "top",
                  "pad": {"t": 50}, "currentvalue": {"visible": False}}],
    )
    return fig


# ---- alpha-beta cost ------------------------------------------------------------------------------

SIZE_AXIS_TITLE = "message size (bytes; all-to-all: per rank)"

def markdown_text(message: str) -> str:
    """An engine or planner message made safe for markdown: a product such as tp*cp reads tp × cp, any other
    * is escaped, so markdown does not eat two of them and set the words between in italics."""
    return re.sub(r"(?<=\w)\*(?=\w)", " × ", message).replace("*", "\\*")


def crossover_bytes(cost_s: Callable[[float], float]) -> float | None:
    """The message size where the bandwidth term equals the latency term (alpha = bytes * beta).

    The alpha-beta models here are affine in bytes (a hierarchy's max of two proportional terms is still
    proportional), so T(B) = T(0) + B * slope and the crossover is T(0) / slope. None: no bandwidth term.
    """
    latency_s = cost_s(0.0)
    probe_bytes = 2.0**30
    slope = (cost_s(probe_bytes) - latency_s) / probe_bytes
    return latency_s / slope if slope > 0 else None


def pow2_sizes(lo_bytes: int, hi_bytes: int) -> list[int]:
    """Every power of two from lo to hi bytes (both rounded to powers of two)."""
    a, b = round(math.log2(lo_bytes)), round(math.log2(hi_bytes))
    return [2**k for k in range(a, b + 1)]


def cost_figure(topology, sizes_bytes: list[int], example_bytes: float | None = None,
                title: str = "") -> go.Figure:
    """Log-log time against message size for the four collectives on `topology`, with the latency-bound
    and bandwidth-bound regions shaded at the all-gather's crossover and each op's crossover marked."""
    fig = go.Figure()
    lo, hi = min(sizes_bytes), max(sizes_bytes)
    for op in COLLECTIVES:
        color = KIND_COLORS[op]  # each collective's colour on every timeline of the app
        times_us = [topology.cost_s(op, b) * 1e6 for b in sizes_bytes]
        # Reduce-scatter costs what all-gather costs: dash it so the line under it stays visible.
        line = {"color": color, "width": 3}
        if op == "reduce_scatter":
            line = {"color": color, "width": 2, "dash": "dash"}
        fig.add_trace(go.Scatter(
            x=sizes_bytes, y=times_us, mode="lines", name=COLLECTIVE_NAMES[op], line=line,
            hovertemplate=f"{COLLECTIVE_NAMES[op]}<br>%{{x:.3s}}B<br>%{{y:.4g}} µs<extra></extra>",
        ))
        cross = crossover_bytes(lambda b, op=op: topology.cost_s(op, b))
        if cross is not None and lo <= cross <= hi:
            fig.add_trace(go.Scatter(
                x=[cross], y=[topology.cost_s(op, cross) * 1e6], mode="markers", showlegend=False,
                marker={"color": color, "size": 10, "symbol": "diamond"},
                hovertemplate=f"{COLLECTIVE_NAMES[op]} crossover: %{{x:.3s}}B, latency = bandwidth term"
                              "<extra></extra>",
            ))
        if example_bytes is not None:
            fig.add_trace(go.Scatter(
                x=[example_bytes], y=[topology.cost_s(op, example_bytes) * 1e6], mode="markers",
                showlegend=False, marker={"color": "black", "size": 11, "symbol": "star"},
                hovertemplate=f"your array, {COLLECTIVE_NAMES[op]}: %{{y:.4g}} µs<extra></extra>",
            ))
    cross = crossover_bytes(topology.all_gather_s)
    if cross is not None and lo < cross < hi:
        for x0, x1, color, text in ((lo, cross, "#4C78A8", "latency-bound"),
                                    (cross, hi, "#F58518", "bandwidth-bound")):
            fig.add_vrect(x0=x0, x1=x1, fillcolor=color, opacity=0.08, line_width=0)
            # Shapes take data coordinates on a log axis, annotations take log10 of them.
            fig.add_annotation(x=math.log10(math.sqrt(x0 * x1)), y=1, yref="paper", yanchor="bottom",
                               text=f"<b>{text}</b>", showarrow=False, font={"color": color, "size": 13})
    if example_bytes is not None:
        fig.add_vline(x=example_bytes, line={"color": "black", "width": 1, "dash": "dash"})
    fig.update_xaxes(type="log", dtick=1, exponentformat="SI", title=SIZE_AXIS_TITLE)
    fig.update_yaxes(type="log", dtick=1, title="time (µs)")
    fig.update_layout(title=title, height=480, margin={"l": 10, "r": 10, "t": 50, "b": 10},
                      legend={"orientation": "h", "y": -0.18})
    return fig


def _latex_seconds(seconds: float) -> str:
    """`format_seconds` in LaTeX: 24.6\\,\\text{ms}, 72.2\\,\\mu\\text{s}."""
    value, unit = format_seconds(seconds).split(" ")
    return rf"{value}\,\mu\text{{s}}" if unit == "µs" else rf"{value}\,\text{{{unit}}}"


def _latex_bytes(nbytes: float) -> str:
    """Decimal units, to sit over a bandwidth in GB/s: 33.55\\,\\text{MB}."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return rf"{nbytes / scale:.4g}\,\text{{{unit}}}"
    return rf"{nbytes:.4g}\,\text{{B}}"


def ring_formula_latex(op: str, n: int, alpha_s: float, bytes_per_s: float, nbytes: float,
                       fill_s: float = 0.0) -> str:
    """The ring / switch formula with this case's numbers substituted, as LaTeX, each time in the unit its
    size reads best in; `fill_s`, the links' measured pipeline fill (`Link.fill_s`), is added once."""
    # [SB] Part 3 and Thakur et al. 2005: T = (N-1) alpha + (N-1)/N V/W; all-reduce twice that.
    factor = 2 if op == "all_reduce" else 1
    lead = "2" if factor == 2 else ""
    latency_s = factor * (n - 1) * alpha_s
    bw_s = factor * (n - 1) / n * nbytes / bytes_per_s
    fill = rf" + {_latex_seconds(fill_s)}_\text{{fill}}" if fill_s else ""
    # the sums on a second line: on one, the formula ran past the page's right edge in a narrow window
    return (rf"\begin{{aligned}}T &= {lead}\Big[({n}-1)\,{_latex_seconds(alpha_s)} + \tfrac{{{n}-1}}{{{n}}}\cdot"
            rf"\tfrac{{{_latex_bytes(nbytes)}}}{{{bytes_per_s / 1e9:.4g}\,\text{{GB/s}}}}\Big]{fill}"
            rf" \\ &= {_latex_seconds(latency_s)} + {_latex_seconds(bw_s)}{fill}"
            rf" = {_latex_seconds(latency_s + bw_s + fill_s)}\end{{aligned}}")


def tree_level(topology) -> object | None:
    """The switch on which `topology`'s all-reduce runs NCCL's double binary trees instead of the ring
    (hardware.collectives.Switch with `trees`: 2 log2 N latency steps beat the ring's 2(N-1) from N = 3
    on, at the ring's bandwidth), the outer level of a hierarchy included; None where it is the ring."""
    from hardware.collectives import Hierarchy, Switch

    level = topology.outer if isinstance(topology, Hierarchy) else topology
    return level if isinstance(level, Switch) and level.trees and level.n > 2 else None


def all_reduce_note(topology, small_bytes: float) -> str | None:
    """In markdown, why the all-reduce is not the ring of the formula on `topology` (None where it is): the
    trees' latency against the ring's, and whether that puts its curve under the all-gather's at
    `small_bytes`."""
    level = tree_level(topology)
    if level is None:
        return None
    n, alpha_s = level.n, level.link.latency_s
    steps = 2 * math.ceil(math.log2(n))
    where = (f"between the {n:,} domains (inside each, the ring)" if level is not topology
             else f"over the {n:,} chips")
    under = ""
    if topology.all_reduce_s(small_bytes) < topology.all_gather_s(small_bytes):
        under = (" So at small sizes, where latency dominates, its curve lies under the all-gather's"
                 + (f", whose ring still pays (N − 1)α = {format_seconds((n - 1) * alpha_s)} here. (With one "
                    "GPU per node, NCCL 2.23 and later run all-gather and reduce-scatter as PAT, whose latency "
                    "also grows as log N; this model keeps the ring for them.)"
                    if level is topology else "."))
    return (f"**All-reduce here is not the ring of the formulas.** Across many nodes NCCL runs it as double "
            f"binary trees {where} when they are faster (Sanders et al. 2009): 2⌈log₂ {n:,}⌉ = {steps} "
            f"latency steps, {format_seconds(steps * alpha_s)}, instead of the ring's 2({n:,} − 1) = "
            f"{2 * (n - 1):,}, {format_seconds(2 * (n - 1) * alpha_s)}; the bandwidth term stays the ring's "
            f"2(N − 1)/N · V/W.{under}")


# ---- live sweep -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class MachineLink:
    """Alpha and beta of this machine's local ranks, fitted from a live sweep (the "this machine" link).

    `alpha_s` and `beta_s_per_byte` are the medians of the per-op fits, the ring model's single link;
    `per_op` keeps each collective's own fit. `link()` turns it into a hardware.collectives.Link.
    """
    world: int
    alpha_s: float
    beta_s_per_byte: float
    per_op: dict[str, tuple[float, float]]
    measurements: tuple[dict, ...]

    @property
    def bytes_per_s(self) -> float | None:
        return 1 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None

    def link(self):
        from hardware.collectives import Link

        if self.bytes_per_s is None:
            raise ValueError("the sweep found no bandwidth term (beta = 0); measure larger messages")
        return Link(self.bytes_per_s, self.alpha_s)


def machine_link(measurements: list[dict], world: int) -> MachineLink:
    """Fit alpha and beta per op (hardware.this_machine.fit_alpha_beta) and summarise them as one link."""
    from hardware.this_machine import fit_alpha_beta

    ops = [op for op in COLLECTIVES if any(m["op"] == op for m in measurements)]
    per_op = {op: fit_alpha_beta(measurements, op) for op in ops}
    return MachineLink(world, statistics.median(a for a, _ in per_op.values()),
                       statistics.median(b for _, b in per_op.values()), per_op, tuple(measurements))


def sweep_figure(result: MachineLink) -> go.Figure:
    """Measured time (points) against each op's fitted ring model (lines), log-log."""
    from hardware.this_machine import ring_terms

    fig = go.Figure()
    values: list[float] = []
    for op in COLLECTIVES:
        if op not in result.per_op:
            continue
        color = KIND_COLORS[op]
        rows = sorted((m["bytes"], m["seconds"]) for m in result.measurements if m["op"] == op)
        values += [s * 1e6 for _, s in rows if s > 0]
        fig.add_trace(go.Scatter(
            x=[b for b, _ in rows], y=[s * 1e6 for _, s in rows], mode="markers",
            name=f"{COLLECTIVE_NAMES[op]} measured",
            marker={"color": color, "size": 9},
            hovertemplate=f"{COLLECTIVE_NAMES[op]} measured<br>%{{x:.3s}}B<br>%{{y:.4g}} µs<extra></extra>",
        ))
        alpha, beta = result.per_op[op]
        grid = pow2_sizes(rows[0][0], rows[-1][0])
        model = []
        for size in grid:
            alpha_terms, beta_terms = ring_terms(op, result.world, size)
            model.append((alpha_terms * alpha + beta_terms * beta) * 1e6)
        values += [v for v in model if v > 0]
        fig.add_trace(go.Scatter(
            x=grid, y=model, mode="lines", name=f"{COLLECTIVE_NAMES[op]} fit",
            line={"color": color, "width": 2, "dash": "dot"},
            hovertemplate=f"{COLLECTIVE_NAMES[op]} model<br>%{{x:.3s}}B<br>%{{y:.4g}} µs<extra></extra>",
        ))
    fig.update_xaxes(type="log", dtick=1, exponentformat="SI", title=SIZE_AXIS_TITLE)
    # every tick written out: Plotly's own had labelled 900 µs "9" and 20,000 "2"
    fig.update_yaxes(**log_axis(values, title="time (µs), slowest rank, median of repeats") if values else
                     {"type": "log", "title": "time (µs), slowest rank, median of repeats"})
    fig.update_layout(title=f"This machine, {result.world} local ranks (gloo over loopback)", height=460,
                      margin={"l": 10, "r": 10, "t": 50, "b": 10}, legend={"orientation": "h", "y": -0.2})
    return fig


def _timed_as(mode: str, gap_s: float) -> str:
    """How the calibration timed an operation (hardware.this_machine.CommFit's modes), in words."""
    from hardware.this_machine import ALONE_MODE, BACK_TO_BACK_MODE, BLOCKING_MODES, PAIR_MODE, POST_MODE, message_mode

    message = message_mode(mode)
    if message:
        how, k = message
        words = {"late": "receive posted after its send", "early": "sent to a receive already waiting"}[how]
        return f"{words}, {k} sender{'s' if k > 1 else ''} computing" if k else f"{words}, its sender blocked"
    if mode == BACK_TO_BACK_MODE:
        return "blocking, right after another"
    after = f"after {format_seconds(gap_s)} of compute"
    if mode in BLOCKING_MODES:
        return f"blocking, {after}"
    return {"contended": "while its ranks compute", POST_MODE: "posting it (the rank is blocked)",
            ALONE_MODE: f"asynchronous, alone, {after}",
            PAIR_MODE: f"two asynchronous at once, {after}"}.get(mode, mode)


CALIBRATION_COLUMN_HELP = {
    "group": "the ranks communicating together, of the run's ranks",
    "timed": "how the calibration timed it: blocking (the rank waits for it) after some compute or right after "
             "another with no compute between; asynchronous (posted, then waited for; two at once: until both "
             "ended); a pipeline message",
    "α (per operation)": "the operation's time without its bytes (per operation, not per ring step)",
    "β (ns per byte)": "each byte's time; ~0: the time did not grow with the message size, within the timing's noise",
    "CPU busy": "the process's CPU time over the wall time while the operation ran (gloo's threads included)",
}


def calibration_rows(cal) -> list[dict]:
    """This machine's calibration of gloo (hardware.this_machine.Calibration), one row per world, group
    size and operation: what the live prediction charges per operation."""
    from hardware.this_machine import POST_MODE

    rows = []
    for key in sorted(cal.comm, key=lambda k: (int(k.split("/")[0][1:]), k)):
        world, kind, n, mode = key.split("/")
        fit = cal.comm[key]
        if mode == "async":
            continue  # measured as bursts; planner/live.py derives one operation's time from them
        # a pipeline's posting is read off the engine's trace (hardware.this_machine.fit_posting): no CPU time
        pipeline_post = (kind, mode) == ("send_recv", POST_MODE)
        # how the row was timed beside the operation, as what tells the rows apart: last, it was cut off at
        # 1,280 px and out of view at 800, and rows that read "2 | 2 | all gather" alike had α from 0.26 to 1.6 ms
        # the group and its world in one narrow column: with both, the timing's words and β did not fit at 1,280 px
        rows.append({"group": f"{int(n[1:])} of {int(world[1:])}", "operation": kind.replace("_", " "),
                     "timed": ("posting its isend, in the engine's own pipeline"
                               if pipeline_post else _timed_as(mode, fit.gap_s)),
                     "α (per operation)": format_seconds(fit.alpha_s),
                     # a fit at 0: the time did not grow with the message size, within the timing's noise
                     # (CALIBRATION_COLUMN_HELP says so; spelt out in each cell, the column hid the next one)
                     "β (ns per byte)": f"{fit.beta_s_per_byte * 1e9:.3f}" if fit.beta_s_per_byte > 0 else "~0",
                     "CPU busy": "not timed" if pipeline_post else f"{fit.cpu_fraction:.0%}"})
    return rows
