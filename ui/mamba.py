"""The Transformer-vs-Mamba lesson's builders: the live runs' command lines, what their timelines show of the
sequence-mixing traffic over cp, and the planner's side-by-side figures. No Streamlit here."""

from __future__ import annotations

from dataclasses import dataclass, replace

import plotly.graph_objects as go

from core.timeline import Timeline, union_seconds
from planner.api import flops_per_token_by_seq, layer_comm_bytes
from planner.flops import total_params
from planner.models import ATTENTION, MAMBA, MODEL_PRESETS, SSM_PRESETS, ModelSpec, SpecError
from ui.charts import PALETTE, log_axis
from ui.tables import count, format_bytes, format_seconds

# The three ways the lesson splits a sequence over cp ranks, as `python -m engine run` arguments.
LIVE_VARIANTS: dict[str, list[str]] = {
    "Transformer, ring attention": ["--arch", "transformer", "--cp-variant", "ring"],
    "Mamba-2, state passing": ["--arch", "mamba2", "--ssm-cp", "state"],
    "Mamba-2, all-to-all": ["--arch", "mamba2", "--ssm-cp", "alltoall"],
}

# Span names of the sequence-mixing layers' own cp traffic (engine/cp.py, engine/ssm_cp.py): not the
# gradient all-reduce, which every cp run also does over the same ranks.
_MIXING_WORDS = ("kv", "state", "halo", "all_to_all")


def live_argv(variant: str, world: int, steps: int) -> list[str]:
    return ["--strategy", "cp", "--world", str(world), "--steps", str(steps), *LIVE_VARIANTS[variant]]


def _mixing(span) -> bool:
    return span.lane == "comm" and span.group == "cp" and any(w in span.name for w in _MIXING_WORDS)


def _mixing_compute(span) -> bool:
    return span.lane == "compute" and span.name.startswith(("attn", "scan"))


def mixing_bytes_per_step(timeline: Timeline, rank: int, steps: int) -> float:
    return sum(s.bytes for s in timeline.for_rank(rank) if _mixing(s)) / steps


def mixing_overlap(timeline: Timeline, rank: int) -> float | None:
    """Fraction of the rank's sequence-mixing transfer time during which it computed attention blocks or
    scans (None without such transfers)."""
    total, under = timeline.overlap(rank, comm=_mixing, compute=_mixing_compute)
    return under / total if total else None


def mixing_in_flight_s(timeline: Timeline, rank: int, steps: int) -> float:
    """Seconds per step during which the rank had a sequence-mixing transfer in flight (the union of their
    spans: a blocking receive's span is the rank's wait for its peer)."""
    return union_seconds((s.start_s, s.end_s) for s in timeline.for_rank(rank) if _mixing(s)) / steps


def transfers_per_layer(timeline: Timeline, rank: int, steps: int, layers: int) -> float:
    return sum(1 for s in timeline.for_rank(rank) if _mixing(s) and s.bytes) / steps / layers


@dataclass(frozen=True)
class LiveNumbers:
    label: str
    passed: bool
    sent_bytes: float  # per step, rank 0
    transfers: float  # per layer and step, rank 0
    overlap: float | None  # of rank 0's transfer time, under its attention blocks or scans
    in_flight_s: float  # per step, the last rank
    step_s: float


def live_numbers(run) -> LiveNumbers:
    s, t, m = run.summary, run.timeline, run.cfg.model
    return LiveNumbers(run.label, s.ok, mixing_bytes_per_step(t, 0, s.steps),
                       transfers_per_layer(t, 0, s.steps, m.layers), mixing_overlap(t, 0),
                       mixing_in_flight_s(t, run.cfg.world - 1, s.steps), s.step_time_s)


def live_rows(runs) -> list[dict]:
    """One row per finished LiveRun: check, the cp traffic of the sequence mixing, how much of it ran under
    compute, how long the last rank had it in flight, and the step time."""
    rows = []
    for run in runs:
        n = live_numbers(run)
        last = run.cfg.world - 1
        rows.append({
            "run": n.label,
            "check": "passed" if n.passed else "FAILED",
            "cp bytes per step, rank 0": f"{n.sent_bytes / 1024:,.1f} KiB",
            "transfers per layer, rank 0": f"{n.transfers:.0f}",
            "under compute, rank 0": "-" if n.overlap is None else f"{n.overlap:.0%}",
            f"in flight, rank {last}": f"{n.in_flight_s * 1e3:.1f} ms",
            "step": f"{n.step_s * 1e3:.1f} ms",
        })
    return rows


def live_findings(runs) -> list[str]:
    """What these measured runs show, in sentences built from their own numbers."""
    numbers = [live_numbers(r) for r in runs]
    most = max(numbers, key=lambda n: n.sent_bytes)
    others = [n for n in numbers if n is not most]
    # one run where a press ended early (app_pages.live_panel keeps the runs that finished): nothing to rank
    out = [f"Bytes over cp: {most.label} {most.sent_bytes / 1024:,.1f} KiB per step from rank 0." if not others else
           f"Most bytes over cp: {most.label} ({most.sent_bytes / 1024:,.1f} KiB per step from rank 0); "
           + ", ".join(f"{n.label} {n.sent_bytes / 1024:,.1f} KiB" for n in others) + "."]
    for n in numbers:
        if n.overlap is not None:
            out.append(f"{n.label}: {n.overlap:.0%} of rank 0's transfer time ran while it computed attention "
                       f"blocks or scans; the last rank had these transfers in flight {n.in_flight_s * 1e3:.1f} ms "
                       "per step.")
    return out


# -- the planner's side: the same-size models, their FLOPs, what each strategy moves, the best layouts --

TRANSFORMER, MAMBA2 = "GPT-3 2.7B", "Mamba-2 2.7B"
HYBRID = "Hybrid 2.7B (this lesson's)"
SEQ_LENS = [2048, 8192, 32768, 131072, 524288]


def hybrid_spec() -> ModelSpec:
    """Mamba-2 2.7B with every 8th layer attention (32 query heads, 8 KV heads): about the 10 % of attention
    layers Dao & Gu 2024 (sec. 9.2.3) found best in their hybrids; 8 groups of SSM heads, as Nemotron-H
    has, so that tensor parallel can split its Mamba layers. Not a released model."""
    base = SSM_PRESETS[MAMBA2]
    pattern = "".join(ATTENTION if i % 8 == 7 else MAMBA for i in range(base.layers))
    return replace(base, name=HYBRID, heads=32, kv_heads=8, layer_pattern=pattern, ssm_groups=8)


def lesson_models(seq_len: int) -> list[ModelSpec]:
    """The Transformer, the Mamba-2 model and the hybrid, all near 2.7B parameters, at `seq_len`."""
    return [replace(spec, seq_len=seq_len) for spec in (MODEL_PRESETS[TRANSFORMER], SSM_PRESETS[MAMBA2],
                                                         hybrid_spec())]


def seq_label(s: int) -> str:
    return f"{s // 1024}K" if s >= 1024 else str(s)


def flops_figure(specs: list[ModelSpec], seq_lens: list[int]) -> go.Figure:
    """Forward FLOPs per token against the sequence length: the weights' part is flat, attention's scores
    grow with S, the SSD scan's does not."""
    fig = go.Figure()
    values: list[float] = []
    for i, spec in enumerate(specs):
        rows = flops_per_token_by_seq(spec, seq_lens)
        values += [v / 1e9 for r in rows for v in (r["total"], r["attention"] + r["ssm"]) if v > 0]
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(x=seq_lens, y=[r["total"] / 1e9 for r in rows], mode="lines+markers",
                                 name=f"{spec.name}: total", line={"color": color, "width": 3},
                                 hovertemplate="S = %{x:,}<br>%{y:.2f} GFLOP per token<extra>" + spec.name
                                               + "</extra>"))
        mixing = [(r["attention"] + r["ssm"]) / 1e9 for r in rows]
        fig.add_trace(go.Scatter(x=seq_lens, y=mixing, mode="lines", name=f"{spec.name}: attention + scan",
                                 line={"color": color, "dash": "dot"},
                                 hovertemplate="S = %{x:,}<br>%{y:.3f} GFLOP per token mixing positions"
                                               "<extra>" + spec.name + "</extra>"))
    fig.update_layout(xaxis={"type": "log", "title": "sequence length S (tokens)", "tickvals": seq_lens,
                             "ticktext": [seq_label(s) for s in seq_lens]},
                      yaxis=log_axis(values, title="forward GFLOP per token"), height=420,
                      legend={"orientation": "h", "y": -0.25}, margin={"t": 30})
    return fig


def model_rows(specs: list[ModelSpec], seq_len: int) -> list[dict]:
    rows = []
    for spec in specs:
        f = flops_per_token_by_seq(spec, [seq_len])[0]
        kinds = spec.layer_kinds
        rows.append({  # the layers' words last: before the numbers, at 800 px they pushed them out of view
            "model": spec.name,
            "parameters": f"{total_params(spec) / 1e9:.2f} B",
            f"forward GFLOP per token at {seq_label(seq_len)}": f"{f['total'] / 1e9:.2f}",
            "of which mixing positions": f"{(f['attention'] + f['ssm']) / f['total']:.0%}",
            "layers": _layers_label(kinds),
        })
    return rows


def position_embedding_note(spec: ModelSpec) -> str | None:
    """Why a GPT-style model grows with S: it learns one position embedding of D numbers per position
    (planner.flops.total_params), so past the length its preset was trained at, the table counts what the
    model would need, not what was released. None within that length."""
    preset = {**MODEL_PRESETS, **SSM_PRESETS}.get(spec.name)
    if preset is None or not spec.gpt_style or spec.seq_len <= preset.seq_len:
        return None
    grown = (spec.seq_len - preset.seq_len) * spec.hidden
    return (f"{spec.name} learns one position embedding ({spec.hidden:,} numbers) per position: at "
            f"S = {spec.seq_len:,} that is {_millions(grown)} parameters more than the released model, trained "
            f"at S = {preset.seq_len:,}, so {total_params(spec) / 1e9:.2f} B in all. The other two models learn "
            "no position embeddings.")


def _millions(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:,.0f} M"


def _layers_label(kinds) -> str:
    mamba, attention = kinds.count(MAMBA), sum(1 for k in kinds if k in (ATTENTION, False, True))
    parts = [f"{attention} attention + MLP" if mamba == 0 else f"{attention} attention" if attention else "",
             f"{mamba} Mamba-2" if mamba else ""]
    return " + ".join(p for p in parts if p)


STRATEGY_NAMES = {"tp": "TP", "cp_ring": "CP: ring attention", "cp_state": "CP: state passing",
                  "cp_alltoall": "CP: all-to-all", "dp": "DP: gradients, once per step"}


def comm_rows(specs: list[ModelSpec], tp: int, cp: int, dp: int, chip: str, micro_batch: int = 1) -> list[dict]:
    """Per model, layer kind (a hybrid's Mamba-2 and attention layers apart) and strategy: what one layer
    sends from its busiest chip per micro-batch (the planner's own communication records), or why tensor
    parallel cannot split that layer (the layer's other strategies then shown at tp = 1)."""
    rows = []
    for spec in specs:
        kinds = [MAMBA, ATTENTION] if spec.has_ssm and ATTENTION in spec.layer_kinds else (
            [MAMBA] if spec.has_ssm else [spec.layer_kinds[0]])
        for kind in kinds:
            layer = _kind_label(kind)
            try:
                moved = layer_comm_bytes(spec, kind, tp=tp, cp=cp, dp=dp, micro_batch=micro_batch, chip=chip)
            except SpecError:
                why = (count(spec.ssm_groups, "SSM group") if kind == MAMBA else
                       f"{spec.heads} heads" if spec.heads % tp else "its widths")  # what tp does not divide
                rows.append({"model": spec.name, "layer": layer, "strategy": f"TP = {tp}",
                             "operations fwd + bwd": f"impossible: {why}", "bytes fwd + bwd": "—", "time": "—"})
                moved = layer_comm_bytes(spec, kind, tp=1, cp=cp, dp=dp, micro_batch=micro_batch, chip=chip)
                layer += " at tp = 1"
            for name, r in moved.items():
                rows.append({"model": spec.name, "layer": layer, "strategy": STRATEGY_NAMES.get(name, name),
                             "operations fwd + bwd": f"{r['ops_fwd']} + {r['ops_bwd']}",
                             "bytes fwd + bwd": f"{format_bytes(r['bytes_fwd'])} + {format_bytes(r['bytes_bwd'])}",
                             "time": format_seconds(r["time_s"])})
    return rows


def _kind_label(kind) -> str:
    return {MAMBA: "Mamba-2", ATTENTION: "attention"}.get(kind, "attention + MLP")


def layout_label(layout: dict, spec: ModelSpec) -> str:
    axes = [f"{a}={layout[a]}" for a in ("dp", "tp", "pp", "cp") if layout[a] > 1] or ["one chip"]
    extra = [f"mb {layout['micro_batch']}", f"ZeRO-{layout['zero_stage']}"]
    if layout["recompute"] != "none":
        layers = layout.get("recompute_layers")
        extra.append(f"{layout['recompute']} recompute" + (f" of {layers} layers a chunk" if layers else ""))
    if layout["cp"] > 1 and spec.has_ssm:
        extra.append("state passing" if layout.get("ssm_cp") == "state" else "all-to-all")
    return " x ".join(axes) + ", " + ", ".join(extra)


def best_rows(results: list[dict], specs: list[ModelSpec], chips: int) -> list[dict]:
    """One row per model from planner.api.compare_architectures: its fastest layout and what it costs."""
    rows = []
    for res, spec in zip(results, specs, strict=True):
        if not res["ranked"]:
            rows.append({"model": spec.name, "fastest layout": "nothing fits on these chips"})
            continue
        best = res["ranked"][0]
        b = best["breakdown_s"]
        comm = sum(v for k, v in b.items() if k.endswith("_comm"))
        rows.append({
            "model": spec.name, "fastest layout": layout_label(best["layout"], spec),
            "step": format_seconds(best["step_time_s"]),
            "tokens/s per chip": f"{res['tokens_per_s'] / chips:,.0f}",
            "MFU (causal)": f"{best['mfu_causal']:.0%}",
            "memory per chip": f"{best['memory_bytes_per_chip'] / 1e9:.1f} GB",  # the planner's (decimal) GB
            "exposed comm": f"{comm / best['step_time_s']:.1%}",
        })
    return rows


def why_they_differ(results: list[dict], specs: list[ModelSpec], seq_len: int) -> list[str]:
    """Sentences comparing the fastest layouts, from their numbers."""
    out = []
    by_name = {spec.name: (res, spec) for res, spec in zip(results, specs, strict=True) if res["ranked"]}
    if TRANSFORMER in by_name and MAMBA2 in by_name:
        (tr, ts), (mr, ms) = by_name[TRANSFORMER], by_name[MAMBA2]
        t_lay, m_lay = tr["ranked"][0]["layout"], mr["ranked"][0]["layout"]
        ft, fm = (flops_per_token_by_seq(s, [seq_len])[0] for s in (ts, ms))
        out.append(f"At S = {seq_len:,}, attention's scores are {ft['attention'] / ft['total']:.0%} of the "
                   f"Transformer's forward FLOPs per token; the Mamba-2 scan is {fm['ssm'] / fm['total']:.0%} of "
                   f"Mamba-2's, at any S. "
                   + (f"Mamba-2 trains {mr['tokens_per_s'] / tr['tokens_per_s']:.2f}x the Transformer's tokens "
                      "per second here." if mr["tokens_per_s"] > tr["tokens_per_s"] else
                      f"The Transformer trains {tr['tokens_per_s'] / mr['tokens_per_s']:.2f}x Mamba-2's tokens per "
                      "second here: at this length attention is still cheap, and Mamba-2's scan runs as small, "
                      "memory-bound matmuls."))
        if t_lay["tp"] != m_lay["tp"]:
            out.append(f"The Transformer uses tp={t_lay['tp']}, Mamba-2 tp={m_lay['tp']}: Mamba-2 2.7B has "
                       f"ngroups={ms.ssm_groups}, and tensor parallel must give each rank whole groups of "
                       f"heads (their B, C and norm), so it cannot split this model at all.")
        if t_lay["cp"] != m_lay["cp"]:
            out.append(f"Context parallel: cp={t_lay['cp']} for the Transformer, cp={m_lay['cp']} for Mamba-2. "
                       "A Transformer's activations and attention work grow with S and are spread by cp at the "
                       "price of a K/V ring; Mamba-2's state passing sends one small state per layer, but the "
                       "hops are a chain that no compute hides.")
        for name, (res, _) in by_name.items():
            # the explanation's recomputation line (its peak memory with it), not the MFU line that mentions
            # recomputation: that MFU counts attention's full square, the table's the causal half
            for line in res["ranked"][0]["explanation"]:
                if ("recomput" in line.lower() and not line.startswith("MFU")
                        and res["ranked"][0]["layout"]["recompute"] != "none"):
                    out.append(f"{name}: {line}")
    return out
