"""The context parallel lesson's arithmetic and figures: pure data in, Plotly figures and rows out.

Context parallel splits every sequence over cp chips, Q[B, S_cp, H, d]; each chip's queries still need
the keys and values of the whole (causal) prefix, so K/V travel around a ring (Liu et al. 2023, "Ring
Attention") or are all-gathered (Dubey et al. 2024, Llama 3, sec. 3.3.2). Causal masking makes a
contiguous split unbalanced; the zig-zag split (rank i holds chunks i and 2cp-1-i of 2cp) balances it.
Partial attentions over disjoint key blocks are merged with the online-softmax rule (Milakov &
Gimelshein 2018). The live engine's version is engine/cp.py and engine/ring_attention.py.

No Streamlit and no torch here (engine.config and engine.cli are torch-free), so the page opens fast and
this is tested without a browser.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.timeline import Timeline
from hardware.chips import Chip
from hardware.collectives import group_topology
from hardware.kernels import best_flash_kernel, flash_attention_s
from planner.models import ModelSpec
from ui.charts import log_axis, rank_color, title_extra_px, wrap_title
from ui.timeline import KIND_COLORS

SPLITS = ("contiguous", "zig-zag")
BF16_BYTES = 2  # K/V travel in the training dtype (bf16) on real chips
FP32_BYTES = 4  # the live engine trains in float32
SEQ_LENS = tuple(2**k for k in range(13, 21))  # 8K .. 1M tokens
CP_DEGREES = (2, 4, 8, 16, 32, 64)


def seq_label(tokens: int) -> str:
    return f"{tokens // 2**20}M" if tokens >= 2**20 else f"{tokens // 2**10}K"


# ---- which rank computes which block of the causal attention matrix ----------------------------------

def chunk_owner(chunk: int, cp: int, split: str) -> int:
    """The rank holding sequence chunk `chunk` of 2*cp. Contiguous: rank r holds chunks 2r and 2r+1;
    zig-zag: rank r holds chunks r and 2cp-1-r (engine.ring_attention.zigzag_positions)."""
    if split == "contiguous":
        return chunk // 2
    if split == "zig-zag":
        return chunk if chunk < cp else 2 * cp - 1 - chunk
    raise ValueError(f"split={split!r} must be one of {', '.join(SPLITS)}")


def block_owners(cp: int, split: str) -> list[list[int | None]]:
    """[query chunk][key chunk] -> the rank that computes that block of the causal attention matrix
    (the owner of the queries), None above the diagonal where the mask hides every pair."""
    n = 2 * cp
    return [[chunk_owner(i, cp, split) if j <= i else None for j in range(n)] for i in range(n)]


def rank_work(cp: int, split: str) -> list[dict]:
    """Per rank: full (below-diagonal) blocks, diagonal (half-masked) blocks, and the work in blocks with a
    diagonal block counted as 1/2. With 2cp chunks, contiguous rank r does 4r + 2 of them (the last rank
    4cp - 2, nearly twice the mean 2cp); zig-zag: every rank exactly 2cp."""
    owners = block_owners(cp, split)
    rows = []
    for r in range(cp):
        full = sum(1 for i, row in enumerate(owners) for j, o in enumerate(row) if o == r and j < i)
        diagonal = sum(1 for i, row in enumerate(owners) if row[i] == r)
        rows.append({"rank": r, "full": full, "diagonal": diagonal, "work": full + diagonal / 2})
    return rows


def imbalance(cp: int, split: str) -> float:
    """Slowest rank's work over the mean: the ring waits for the slowest (2 - 1/cp contiguous, 1 zig-zag)."""
    work = [r["work"] for r in rank_work(cp, split)]
    return max(work) / (sum(work) / len(work))


def causal_split_figure(cp: int) -> go.Figure:
    """The causal attention matrix in 2cp x 2cp chunk blocks, coloured by the rank that computes each
    block, contiguous beside zig-zag, and the work per rank of both."""
    n = 2 * cp
    fig = make_subplots(rows=1, cols=3, column_widths=[0.34, 0.34, 0.32], horizontal_spacing=0.08,
                        subplot_titles=("contiguous split", "zig-zag split", "work per rank<br>(blocks)"))
    # a discrete colour scale: each rank owns the band [r, r+1) of z, drawn at r + 0.5
    scale = [[edge / cp, rank_color(k)] for k in range(cp) for edge in (k, k + 1)]
    for col, split in enumerate(SPLITS, start=1):
        owners = block_owners(cp, split)
        z = [[None if o is None else o + 0.5 for o in row] for row in owners]
        text = [[("masked: keys after the queries" if o is None else
                  f"rank {o}: query chunk {i}, key chunk {j}"
                  + (" (diagonal, half masked)" if i == j else ""))
                 for j, o in enumerate(row)] for i, row in enumerate(owners)]
        fig.add_trace(go.Heatmap(z=z, zmin=0, zmax=cp, colorscale=scale, showscale=False, xgap=1, ygap=1,
                                 text=text, hoverinfo="text"), row=1, col=col)
        fig.update_xaxes(title_text="key chunk", range=[-0.5, n - 0.5], row=1, col=col)
        # the axis title on the first matrix only: on the second it lay on the first one's triangle at 800 px
        fig.update_yaxes(title_text="query chunk" if col == 1 else None, autorange="reversed", row=1, col=col)
    for split, pattern in zip(SPLITS, ("/", ""), strict=True):
        work = rank_work(cp, split)
        fig.add_trace(go.Bar(x=[f"r{w['rank']}" for w in work], y=[w["work"] for w in work], name=split,
                             marker={"color": [rank_color(w["rank"]) for w in work],
                                     "pattern": {"shape": pattern}, "line": {"color": "black", "width": 1}},
                             hovertemplate=f"{split}<br>%{{x}}: %{{y}} blocks<extra></extra>"), row=1, col=3)
    # the masked upper-right half of each diagonal block (keys after the queries), blanked out
    xs, ys = [], []
    for i in range(n):
        xs += [i - 0.5, i + 0.5, i + 0.5, i - 0.5, None]
        ys += [i - 0.5, i - 0.5, i + 0.5, i - 0.5, None]
    for col in (1, 2):
        fig.add_trace(go.Scatter(x=xs, y=ys, fill="toself", fillcolor="white", mode="lines",
                                 line={"color": "white", "width": 1}, hoverinfo="skip", showlegend=False),
                      row=1, col=col)
    fig.add_hline(y=2 * cp, line={"dash": "dot", "color": "gray"}, row=1, col=3,
                  annotation_text="mean", annotation_position="top left")
    # the bars' title on two lines, the legend further down: in a window 800 px wide the title ran past the
    # right edge and the legend's title lay on the axis title "key chunk"
    fig.update_layout(barmode="group", height=390, margin={"l": 10, "r": 10, "t": 60, "b": 10},
                      plot_bgcolor="white",
                      legend={"orientation": "h", "y": -0.3, "title": {"text": "bars: "}})
    return fig


# ---- the ring, step by step ------------------------------------------------------------------------

def ring_source(rank: int, step: int, cp: int) -> int:
    """Whose K/V block rank `rank` holds at ring step `step`: it received it from rank-1, which had it
    one step earlier, so the block of rank (rank - step) mod cp (engine.cp._Ring.block)."""
    return (rank - step) % cp


def zigzag_block_part(rank: int, source: int) -> str:
    """Which part of the (2c x 2c) block rank `rank` computes against `source`'s K/V under the causal
    mask, with the zig-zag split (engine.ring_attention.block_plan)."""
    if source == rank:
        return "diagonal, masked"
    if source < rank:
        return "all Q, early K"
    return "late Q, all K"


def ring_rows(cp: int) -> list[dict]:
    """One row per ring step: the K/V block each rank computes on (and which part of it); meanwhile it
    sends that block to rank r+1, except at the last step."""
    return [{"step": step, **{f"rank {r}": f"KV{ring_source(r, step, cp)}: "
                                           f"{zigzag_block_part(r, ring_source(r, step, cp))}"
                              for r in range(cp)}}
            for step in range(cp)]


# ---- the online-softmax (log-sum-exp) merge ----------------------------------------------------------

def block_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q[M, d] against one block k/v[N, d] -> (o[M, d] normalised within the block, m[M] the row max of
    the scores, l[M] the sum of exp(score - m))."""
    s = q @ k.T / np.sqrt(q.shape[-1])
    m = s.max(axis=-1)
    p = np.exp(s - m[:, None])
    l_ = p.sum(axis=-1)
    return p @ v / l_[:, None], m, l_


def merge_partials(o1, m1, l1, o2, m2, l2):
    """Two partial attentions over disjoint key blocks -> the attention over both (Milakov & Gimelshein
    2018, online softmax; FlashAttention, Dao et al. 2022, sec. 3.1):
    m = max(m1, m2), l = l1 e^(m1-m) + l2 e^(m2-m), o = (l1 e^(m1-m) o1 + l2 e^(m2-m) o2) / l."""
    m = np.maximum(m1, m2)
    w1, w2 = l1 * np.exp(m1 - m), l2 * np.exp(m2 - m)
    l_ = w1 + w2
    return (w1[:, None] * o1 + w2[:, None] * o2) / l_[:, None], m, l_


# ---- when the ring hides under the attention compute ---------------------------------------------------

def kv_block_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, cp: int,
                   dtype_bytes: int = BF16_BYTES) -> float:
    """One rank's K and V for one layer: 2 x B x S/cp x kv_heads x d x bytes, the block a ring step sends."""
    return 2 * micro_batch * seq_len / cp * spec.kv_heads * spec.head_dim_ * dtype_bytes


def block_flops(spec: ModelSpec, micro_batch: int, seq_len: int, cp: int, causal_half: bool = True) -> float:
    """Forward FLOPs of one ring step: Q[B, S/cp, H, d] . K^T and P . V against one K/V block of S/cp keys,
    2 x 2 x B (S/cp)^2 H d (two matmuls, 2 FLOPs per multiply-add); under the causal mask with the zig-zag
    split every off-diagonal step computes exactly half of it (block_plan: c x 2c of the 2c x 2c pairs)."""
    full = 4 * micro_batch * (seq_len / cp) ** 2 * spec.heads * spec.head_dim_
    return full / 2 if causal_half else full


def hidden_threshold_tokens(spec: ModelSpec, link_bytes_per_s: float, attention_flops_per_s: float,
                            dtype_bytes: int = BF16_BYTES) -> float:
    """S/cp above which the K/V transfer of a step hides under its (half-block) compute, latency ignored:
    2 B (S/cp) kv d e / W <= 2 B (S/cp)^2 H d / F  <=>  S/cp >= (kv / H) e F / W, F the attention kernel's
    FLOP/s at the shard (the rate the verdict's compute time runs at: the kernel's long-sequence plateau had
    put the threshold at 1,275 tokens on TPU v5p while a 1,024-token shard hid, slower there)."""
    return spec.kv_heads / spec.heads * dtype_bytes * attention_flops_per_s / link_bytes_per_s


def overlap_row(spec: ModelSpec, chip: Chip, cp: int, seq_len: int, micro_batch: int = 1,
                stride: int = 1) -> dict:
    """One ring step of one layer (forward) for a cp group whose members are `stride` ranks apart: the
    K/V transfer (hardware.collectives on the group's link) against the block's attention on the chip's
    best FlashAttention kernel (hardware.kernels), and the all-gather variant's bytes, time and K/V
    memory beside it."""
    topo = group_topology(chip, cp, stride, achievable=True)
    kv_bytes = kv_block_bytes(spec, micro_batch, seq_len, cp)
    transfer_s = topo.p2p_s(kv_bytes)
    flops = block_flops(spec, micro_batch, seq_len, cp)
    compute_s = flash_attention_s(chip, flops, seq_len / cp, best_flash_kernel(chip), spec.head_dim_)[0]
    latency_s = topo.p2p_s(0.0)  # alpha and the link's pipeline fill (Link.fill_s), once per message
    link_bytes_per_s = kv_bytes / (transfer_s - latency_s) if transfer_s > latency_s else None
    return {
        "cp": cp, "seq_len": seq_len, "topology": topo.describe(),
        "kv_block_bytes": kv_bytes, "transfer_s": transfer_s, "block_flops": flops, "compute_s": compute_s,
        # transfer_s = alpha_s + fill_s + bandwidth_s, each shown on the page
        "alpha_s": latency_s - topo.fill_s, "fill_s": topo.fill_s, "bandwidth_s": transfer_s - latency_s,
        "hidden": transfer_s <= compute_s,
        # cp-1 transfers per layer's forward; whatever each step's compute cannot cover waits
        "ring_exposed_s": (cp - 1) * max(0.0, transfer_s - compute_s),
        "link_bytes_per_s": link_bytes_per_s,
        "attention_flops_per_s": flops / compute_s,  # the kernel's rate at this shard
        "threshold_tokens": (hidden_threshold_tokens(spec, link_bytes_per_s, flops / compute_s) if link_bytes_per_s
                             else float("inf")),
        # all-gather: the same (cp-1) blocks sent, but before any attention starts, and every rank keeps
        # all cp blocks (Dubey et al. 2024 sec. 3.3.2)
        "allgather_s": topo.all_gather_s(cp * kv_bytes),
        "ring_sent_bytes": (cp - 1) * kv_bytes,
        "allgather_sent_bytes": (cp - 1) * kv_bytes,
        "ring_kv_held_bytes": 2 * kv_bytes,  # the block being computed on and the one arriving
        "allgather_kv_held_bytes": cp * kv_bytes,
    }


def overlap_figure(spec: ModelSpec, chip: Chip, cp: int, seq_len: int, stride: int = 1) -> go.Figure:
    """Per ring step, transfer and compute time against the sequence length (log-log): where the compute
    line is above, the ring is hidden."""
    rows = [overlap_row(spec, chip, cp, s, stride=stride) for s in SEQ_LENS]
    x = list(SEQ_LENS)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[r["transfer_s"] * 1e6 for r in rows], mode="lines+markers",
                             name="K/V block transfer", line={"color": KIND_COLORS["send/recv"]}))
    fig.add_trace(go.Scatter(x=x, y=[r["compute_s"] * 1e6 for r in rows], mode="lines+markers",
                             name="attention of one step (half block)", line={"color": KIND_COLORS["forward"]}))
    here = overlap_row(spec, chip, cp, seq_len, stride=stride)
    fig.add_vline(x=seq_len, line={"dash": "dot", "color": "black"})
    state = "hidden" if here["hidden"] else "exposed"
    ys = [r[k] * 1e6 for r in rows for k in ("transfer_s", "compute_s") if r[k] > 0]
    # on lines that fit a narrow window: on one line the title ran past the chart's right edge
    title = (wrap_title(f"{spec.name} on {chip.name}, cp = {cp}: one ring step of one layer")
             + f"<br>(dotted line: your S = {seq_label(seq_len)}, the transfer {state} there)")
    extra = title_extra_px(title)
    fig.update_layout(title=title,
                      height=380 + extra, margin={"l": 10, "r": 10, "t": 50 + extra, "b": 10},
                      xaxis={"title": "sequence length S (tokens)", "type": "log", "tickvals": x,
                             "ticktext": [seq_label(s) for s in x]},
                      # 1-2-5 ticks with their values written out: Plotly's own label every minor tick
                      yaxis=log_axis(ys, title="time per step (µs)") if ys else
                      {"title": "time per step (µs)", "type": "log"},
                      legend={"orientation": "h", "y": -0.25})
    return fig


# ---- the live runs -------------------------------------------------------------------------------------

def live_kv_bytes_formula(cfg) -> float:
    """K/V (and dK/dV) bytes one rank sends per optimizer step over all attention layers (engine/cp.py):
    ring (3cp - 2) blocks, all-gather 2(cp - 1), with one block = 2 x B x kv_heads x S/cp x d x 4."""
    m, cp = cfg.model, cfg.parallel.degree("cp", cfg.world)
    batch = cfg.micro_batch_size * cfg.micro_batches
    block = 2 * batch * m.kv_heads * m.seq_len // cp * m.head_dim * FP32_BYTES
    blocks = 3 * cp - 2 if cfg.parallel.cp_variant == "ring" else 2 * (cp - 1)
    return blocks * block * m.layers


def kv_bytes_per_step(timeline: Timeline, rank: int, steps: int) -> float:
    """Bytes `rank` sent in the cp group as K/V and dK/dV (not the gradients, also summed over cp), per
    optimizer step."""
    return sum(s.bytes for s in timeline.for_rank(rank)
               if s.lane == "comm" and s.group == "cp" and "kv" in s.name) / steps


def kv_overlap_fraction(timeline: Timeline, rank: int) -> float | None:
    """Fraction of the K/V send/recv time during which the same rank computed a ring attention block;
    None when the rank had no K/V transfer on the ring (the all-gather variant)."""
    total, under = timeline.overlap(
        rank, comm=lambda s: s.lane == "comm" and s.group == "cp" and ("send" in s.name or "recv" in s.name),
        compute=lambda s: s.lane == "compute" and s.name.startswith("attn"))
    return under / total if total else None


def live_rows(runs: list[tuple[str, object, dict, Timeline]]) -> list[dict]:
    """One row per (variant, cfg, summary, timeline): check, K/V bytes against the formula, overlap,
    activation memory and step time of rank 0."""
    rows = []
    for variant, cfg, summary, timeline in runs:
        overlap = kv_overlap_fraction(timeline, 0)
        rows.append({
            "variant": variant,
            "check": "passed" if summary.ok else "FAILED",
            "K/V bytes sent per step (rank 0)": f"{kv_bytes_per_step(timeline, 0, summary.steps):,.0f}",
            "formula": f"{live_kv_bytes_formula(cfg):,.0f}",
            "K/V transfer under attention": "-" if overlap is None else f"{overlap:.0%}",
            "activations (rank 0)": f"{summary.memory_bytes[0]['activations_peak'] / 1024:,.0f} KiB",
            "step time": f"{summary.step_time_s * 1e3:.1f} ms",
        })
    return rows
