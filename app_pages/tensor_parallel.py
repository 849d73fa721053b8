"""Lesson: tensor parallel (Megatron) and sequence parallel, analytic on real chips, live on this machine."""

import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.link_params import drop_link_values_not_taken, follow_sidebar, link_values
from app_pages.live_panel import run_live, show_live
from app_pages.text_table import text_table
from engine.cli import COMMAND
from hardware.chips import CHIPS
from planner.bounds import tensor_parallel_bound
from planner.models import MODEL_PRESETS
from ui.bound_meter import bound_figure
from ui.collectives import markdown_text
from ui.exercises import largest_compute_bound_tp, tp_bytes_per_layer
from ui.live import LIVE_STEP_CHOICES, LIVE_STEPS
from ui.state import ignored_link_message
from ui.tables import count, format_bytes, format_seconds, shell_lines, three_figures
from ui.tensor_parallel import (
    MAX_TP,
    MEMORY_MODES,
    activation_bytes,
    activation_figure,
    bound_bases_table,
    group_links_chip,
    live_rows,
    refused_degrees_text,
    scaling_figure,
    scaling_rows,
    split_figure,
    tp_degrees,
)

TP_MICRO_BATCHES = [1, 2, 4, 8]  # the micro-batch slider's options (sequences per chip)

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]
spec = MODEL_PRESETS[choices.model]
domain = chip.scaleup_domain

st.title("Tensor and sequence parallel")
st.markdown(
    """
Data parallel copies the whole model onto every chip. When one layer's weights or activations no longer
fit, or one chip is too slow for a layer, **split every matmul itself across chips**. Megatron-LM
(Shoeybi et al. 2019) does it for the Transformer with one trick: a pair of matmuls is split so that
only **one** all-reduce is needed per pair. The first matmul of the MLP is split by its output
**columns**: every chip gets the whole input and computes its own slice of the hidden units, with no
communication at all. The second is split by its input **rows**, the slice of hidden units the chip
already has, so every chip produces a full-size but *partial* output, and an all-reduce sums them:
"""
)
# Each layer's matmul under its name, and the all-reduce on a line of its own: side by side, the row-parallel
# line ran past the page's right edge, its all-reduce out of sight.
st.latex(r"""
\begin{array}{l}
\text{column-parallel:} \\
\qquad \text{In}[B, S, D] \cdot W_{in}[D, F_{tp}] \rightarrow H[B, S, F_{tp}] \\
\text{row-parallel:} \\
\qquad H[B, S, F_{tp}] \cdot W_{out}[F_{tp}, D] \rightarrow \text{Out}[B, S, D]\{U_{tp}\} \\
\qquad \;\xrightarrow{\text{all-reduce}}\; \text{Out}[B, S, D]
\end{array}""")
st.markdown(
    """
The nonlinearity between them (GeLU, or SwiGLU's gate times up) works element by element on the hidden
units, so each chip applies it to its own slice: no communication in between. **Attention splits the same
way, by heads**: Q, K and V projections are column-parallel (each chip computes whole heads), the heads are
independent until the output projection, which is row-parallel. Grouped-query attention adds one rule:
the KV heads are split too, so **tp must divide the KV heads, or the KV heads must divide tp**, in which
case each KV head is *replicated* on the tp/kv_heads chips that hold its query heads (and the copies'
gradients are summed).

Pick the tensor-parallel degree t for the model in the sidebar:
"""
)
valid_tp, refused_tp = tp_degrees(spec)
wanted = min(choices.mesh["tp"], MAX_TP) if choices.mesh["tp"] > 1 else min(8, domain, MAX_TP)
default_tp = max(t for t in valid_tp if t <= wanted)
# A degree that cannot split this model (from a link, or kept from another model) is replaced, and said.
asked = st.session_state.get("tp_degree", st.query_params.get("tp_degree"))
if asked is not None and str(asked) not in map(str, valid_tp):
    why = refused_tp.get(int(asked), "not offered") if str(asked).isdecimal() else "not a whole number"
    st.info(markdown_text(f"t = {asked} cannot split {spec.name} ({why}); showing t = {default_tp}."),
            icon=":material/link_off:")
    st.session_state["tp_degree"] = default_tp
follow_sidebar("tp_degree", default_tp)
tp = st.select_slider("Tensor-parallel degree t", valid_tp, value=default_tp, key="tp_degree", bind="query-params",
                      help="Chips one layer is split over: only the degrees that split this model's heads, "
                           "KV heads and MLP. Starts at the sidebar's tp, again whenever that changes.")
if refused_tp:
    st.caption(f"Not offered for {spec.name}: {refused_degrees_text(refused_tp)}.")
# a micro-batch the slider does not offer had been replaced silently: said, and taken out of the link first
_values = link_values()
_bad_link = drop_link_values_not_taken({"tp_micro_batch": TP_MICRO_BATCHES})
if _bad_link:
    st.info(ignored_link_message(_bad_link, _values), icon=":material/link_off:")
micro_batch = st.select_slider("Micro-batch b (sequences per chip)", TP_MICRO_BATCHES, value=1,
                               key="tp_micro_batch", bind="query-params")
st.plotly_chart(split_figure(spec.hidden, spec.ffn, spec.heads, spec.kv_heads, tp), key="tp_split")
per_rank = spec.heads // tp
kv = (f"{count(spec.kv_heads // tp, 'KV head')} of its own" if spec.kv_heads >= tp
      else f"a copy of one KV head, shared with {count(tp // spec.kv_heads - 1, 'neighbour')}")
st.caption(f"{spec.name}: D = {spec.hidden:,}, F = {spec.ffn:,}"
           f"{' per expert' if spec.is_moe else ''}, {spec.heads} query heads and {spec.kv_heads} KV "
           f"heads. With t = {tp} each chip holds {spec.ffn // tp:,} of the F columns of W_in and rows "
           f"of W_out, {count(per_rank, 'query head')} and {kv}. Black outlines mark one KV head each.")

st.subheader("The conjugate operators f and g")
st.markdown(
    """
Where does the communication go in the backward pass? Megatron brackets each parallel region with two
operators that are each other's transpose (Shoeybi et al. 2019, sec. 3, fig. 3):

| operator | forward | backward | where |
|---|---|---|---|
| **f** | identity (every chip already has the whole input) | all-reduce of the input's gradient | in front of the column-parallel layer |
| **g** | all-reduce of the partial outputs | identity (the gradient of a sum is copied to every term) | after the row-parallel layer |

Per layer that is one g in the attention block and one in the MLP in the forward, and their two f's in the
backward: **4 all-reduces of b·s·h values per layer**, on the critical path (each layer waits for its
sum before it can go on).
"""  # noqa: E501 (a markdown table: one row per line)
)

st.header("Sequence parallel: the same bytes, less memory")
st.markdown(
    """
Between the parallel regions, the LayerNorms (RMSNorms), dropouts and residual adds still run on the
**whole** activation `X[B, S, D]` on every chip: the same work t times, and the same activations stored
t times. Korthikanti et al. (2022) noticed that an all-reduce *is* a reduce-scatter followed by an
all-gather. Split them apart, and the activations between the regions can stay **split along the
sequence**, `X[B, S_tp, D]`, where norms and dropouts work on S/t positions each:
"""
)
# each step under its name: beside it, the arrows ran past the page's right edge
st.latex(r"""
\begin{array}{l}
\text{leave the row-parallel layer (}\bar g\text{):} \\
\qquad \text{Out}[B, S, D]\{U_{tp}\} \xrightarrow{\text{reduce-scatter}} \text{Out}[B, S_{tp}, D] \\
\text{enter the column-parallel layer (}g\text{):} \\
\qquad X[B, S_{tp}, D] \xrightarrow{\text{all-gather}} X[B, S, D]
\end{array}""")
st.caption("Korthikanti et al. name these two g and ḡ, in their own notation: their g (the all-gather) is not "
           "the g of the table above (Shoeybi et al.'s all-reduce), which sequence parallel splits into this "
           "reduce-scatter and that all-gather.")
st.markdown(
    """
On a ring a reduce-scatter and an all-gather each send (t−1)/t of the array, together exactly the
2(t−1)/t of the all-reduce they replace: **sequence parallel moves the same bytes** (backward swaps the
two), as long as the gathered input is kept for the weight gradient. Megatron-LM frees it to save that memory
too and gathers it again in the backward: 1.25x the bytes, which the planner counts. What falls is the memory.
Per layer and chip, for the GPT layer Korthikanti et al. analyse (s sequence length, b micro-batch, h hidden,
a heads, t tensor-parallel degree, 16-bit activations; their eq. 1-2 and Table 2):
"""
)
# Each formula under its name, the rows spaced: in two columns the longest name pushed the formulas past the
# page's right edge, and the stacked fractions of neighbouring rows ran into each other.
st.latex(r"""
\def\arraystretch{1.6}
\begin{array}{l}
\text{one chip (eq. 1):} \\ \qquad sbh\left(34 + \frac{5as}{h}\right) \\
""" + " \\\\\n".join(f"\\text{{{label}:}} \\\\ \\qquad {eq}" for label, eq in MEMORY_MODES.values()) + r"""
\end{array}""")
st.markdown(
    """
Tensor parallel alone splits only the 24 sbh inside the regions and the attention scores (5as²b); the
10 sbh of norm and dropout inputs stay whole on every chip. Sequence parallel splits those too, so
everything is divided by t. **Selective recomputation** then drops the attention scores (softmax,
its dropout mask), which are cheap to recompute and huge at long sequence lengths.
"""
)
mem = activation_bytes(spec, micro_batch, tp)
st.plotly_chart(activation_figure(spec, micro_batch, tp, chip.hbm_bytes), key="tp_activations")
# three figures, in the table and the sentence under it alike ("0.143 GB" had stood beside "0.14 GB")
mem_rows = [{"recipe": "one chip (no parallelism)", "per layer per chip": three_figures(mem["none"] / 1e9, "GB"),
             f"x {spec.layers} layers": f"{mem['none'] * spec.layers / 1e9:,.1f} GB"}]
mem_rows += [{"recipe": f"{label}, t = {tp}", "per layer per chip": three_figures(mem[mode] / 1e9, "GB"),
              f"x {spec.layers} layers": f"{mem[mode] * spec.layers / 1e9:,.1f} GB"}
             for mode, (label, _) in MEMORY_MODES.items()]
st.dataframe(mem_rows, hide_index=True, width="stretch")
st.markdown(
    f"For {spec.name} at t = **{tp}** and b = {micro_batch}: tensor parallel alone keeps "
    f"**{three_figures(mem['tp'] / 1e9, 'GB')}** per layer per chip, sequence parallel "
    f"**{three_figures(mem['tp+sp'] / 1e9, 'GB')}** "
    f"({1 - mem['tp+sp'] / mem['tp']:.0%} less), and with selective recomputation "
    f"**{three_figures(mem['tp+sp+selective'] / 1e9, 'GB')}**. All {spec.layers} layers of one micro-batch need "
    f"{mem['tp+sp+selective'] * spec.layers / 1e9:,.1f} GB of activations that way, against "
    f"{chip.hbm_bytes / 1e9:.0f} GB of HBM on {chip.name} (weights and optimizer state come on top)."
)
st.caption("The equations count the GPT recipe with materialised attention and dropout; the same s, b, h, a "
           "are used for every preset. planner/memory.py generalises the terms to GQA, SwiGLU and "
           "FlashAttention for the planner.")

st.header("Communication per layer, and why TP stays inside a node")
rows = scaling_rows(spec, chip, micro_batch, sorted({1, 2, 4, 8, 16} | {tp}), choices.num_chips)
here = next(r for r in rows if r["tp"] == tp)
v_bytes = micro_batch * spec.seq_len * spec.hidden * 2
st.markdown(
    f"""
Each of the 4 collectives per layer handles the whole activation array, V = b·s·h·2 bytes
(bf16) = **{format_bytes(v_bytes)}** for {spec.name}. Each chip sends, per layer and micro-batch,
"""
)
st.latex(r"4 \times \frac{2(t-1)}{t} \times b\,s\,h \times 2 \text{ bytes}")
if tp == 1:
    st.markdown("With t = 1 there is nothing to send: move the slider.")
else:
    st.markdown(
        f"which at t = **{tp}** is **{format_bytes(here['comm_bytes'])}**, the same with and without "
        f"sequence parallel. On {chip.name} ({here['topology']}) that takes "
        f"**{format_seconds(here['comm_s'])}** per layer, against **{format_seconds(here['compute_s'])}** "
        "of forward and backward compute "
        "(planner estimate of the whole layer, attention, MLP and memory-bound ops, at achievable FLOP/s and "
        f"bandwidth): communication is **{here['comm_s'] / here['compute_s']:.0%}** of the compute time, "
        "and in the forward Megatron cannot hide it, because the next operation needs the sum (the backward's "
        "input-gradient all-reduces can run under the weight-gradient matmuls)."
    )
if tp > 1:
    bound = tensor_parallel_bound(spec, group_links_chip(chip, tp, choices.num_chips), micro_batch * spec.seq_len, tp)
    st.plotly_chart(bound_figure(bound, f"The scaling book's rule at t = {tp}, one MLP, one pass"), key="tp_bound")
    verdict = "Compute-bound" if bound.compute_bound else "Communication-bound"
    st.markdown(f"**{verdict}** by the rule: one MLP's matmuls take {bound.math_s / bound.comm_s:,.2f}x its "
                f"all-gather + reduce-scatter, per pass at peak rates. {bound.rule}. Both sides grow with "
                "the tokens, so the batch does not help: only a wider MLP (larger F) or a smaller t does. "
                "(Latency left out. Megatron's forward all-reduces cannot overlap, for the next operation needs the "
                "sum, so on a GPU even compute-bound TP pays that communication in full, unless a collective "
                "matmul or userbuffers overlap splits it.)")
    st.markdown(
        "The meter and the estimate above count different things, so their ratios differ:\n\n"
        + bound_bases_table(bound, here) + "\n\n"
        "The rule asks whether one MLP's matmuls could hide its own communication. The estimate adds up "
        "what the whole layer spends: attention (long at s = "
        f"{spec.seq_len:,}) and the memory-bound ops add time but no TP bytes, so the layer has more math "
        "to set against its communication than its MLP alone. Both ratios fall as t grows."
    )
title = f"{spec.name} on {chip.name}: one layer, b = {micro_batch}, s = {spec.seq_len:,}"
st.plotly_chart(scaling_figure(rows, tp, domain, title), key="tp_scaling")
by_tp = {r["tp"]: r for r in rows}
inside = [r for r in rows if r["inside_domain"] and r["tp"] > 1]
outside = [r for r in rows if not r["inside_domain"]]
lines = [
    "What keeps tensor parallel inside one scale-up domain (the 8 GPUs of an NVLink node, an NVL72 rack, "
    "a TPU slice):",
    "* **The ratio only gets worse with t.** Compute per chip falls as 1/t, but the bytes each chip sends "
    "grow towards 4 x 2V: " + ", ".join(f"t = {r['tp']}: {r['comm_s'] / r['compute_s']:.0%}" for r in inside)
    + " of the compute time.",
]
if outside:
    jump = outside[0]
    last = by_tp[max(r["tp"] for r in inside)] if inside else None
    change = (
        f"Per layer the communication goes from {format_seconds(last['comm_s'])} at t = {last['tp']} to "
        f"{format_seconds(jump['comm_s'])} ({jump['comm_s'] / last['comm_s'] - 1:+.0%}) while compute only "
        f"falls to {format_seconds(jump['compute_s'])}: communication is now "
        f"{jump['comm_s'] / jump['compute_s']:.0%} of compute. " if last else "")
    lines.append(
        f"* **Crossing the domain.** At t = {jump['tp']} the group spans {jump['tp'] // domain} nodes of "
        f"{domain} GPUs, whose network cards give each GPU {chip.scaleout_bytes_per_s / 1e9:.0f} GB/s "
        f"instead of {chip.scaleup_link}'s {chip.scaleup_bytes_per_s / 1e9:.0f} GB/s (both the datasheets' "
        f"peaks; the times use the share of each a collective achieves). {change}"
        f"NCCL runs one ring per network card through every GPU of the group, so each card carries only "
        f"about 1/{domain} of the array (twice for an all-reduce: reduce, then gather), "
        f"without which the network's part would be about {domain} times larger. This estimate assumes the cards "
        "are free, but they also "
        "carry the data- and pipeline-parallel traffic, contention this model does not count.")
spread = by_tp[max(by_tp)]
lines.append(
    "* **Where the group lands.** The dotted line puts the tp group's members on different nodes (tp "
    "outermost in the mesh): every byte crosses the network, "
    f"{format_seconds(spread['comm_spread_s'])} per layer at t = {spread['tp']} instead of "
    f"{format_seconds(spread['comm_s'])}. That is why meshes put tp innermost, on consecutive chips.")
lines.append(
    "\nNarayanan et al. (2021, sec. 5.4, takeaway 1) measured the same: use tensor parallel up to the GPUs of "
    "one server, and pipeline parallel across servers.")
st.markdown("\n".join(lines))
if domain >= MAX_TP:
    st.caption(f"{chip.name}'s scale-up domain holds {domain:,} chips, so no tp on this slider leaves it; "
               "pick an 8-GPU node such as h100 in the sidebar to see the crossing.")

show_exercises([largest_compute_bound_tp(spec, chip, micro_batch * spec.seq_len, choices.num_chips)]
               + ([tp_bytes_per_layer(tp, micro_batch, spec.seq_len, spec.hidden, here["comm_bytes"])]
                  if here is not None and tp > 1 else []))

st.header("Run it for real")
st.markdown(
    """
Below, the small Llama-style Transformer of the live engine trains on **real processes of this machine**
with Megatron tensor parallel (`engine/tp.py`: column- and row-parallel linears, heads split, a
vocabulary-parallel embedding and cross-entropy), once **without** and once **with** sequence parallel.
Both are checked against one process training the whole model, and every collective is traced.
"""
)
c1, c2, c3, c4 = st.columns(4)
world = c1.select_slider("Processes (tp)", [2, 4], value=2, key="tp_live_world")
heads = c2.select_slider("Query heads", [1, 2, 4, 8], value=4, key="tp_live_heads")
kv_heads = c3.select_slider("KV heads", [1, 2, 4, 8], value=2, key="tp_live_kv_heads")
steps = c4.select_slider("Optimizer steps", LIVE_STEP_CHOICES, value=LIVE_STEPS, key="tp_live_steps")
st.code(shell_lines(f"{COMMAND} --strategy tp [--sequence-parallel] --world {world} --heads {heads} "
                    f"--kv-heads {kv_heads} --steps {steps} --check"), language="bash", wrap_lines=True)

if st.button("Run TP and TP + SP on this machine", type="primary"):
    from engine.cli import config_from_args, run_parser
    from engine.config import ConfigError

    try:
        configs = []
        for sp in (False, True):
            argv = ["--strategy", "tp", "--world", str(world), "--heads", str(heads), "--kv-heads",
                    str(kv_heads), "--steps", str(steps)] + (["--sequence-parallel"] if sp else [])
            # exactly what `python -m engine run ...` builds and validates
            cfg = config_from_args(run_parser("python -m engine run").parse_args(argv))
            configs.append(("TP + SP" if sp else "TP", cfg))
        run_live("live_tp", configs, hint="try 2 processes or fewer steps")
    except ConfigError as e:
        st.session_state.pop("live_tp", None)
        st.error(markdown_text(f"This run cannot start: {e}."), icon=":material/block:")

live = show_live("live_tp")
if live:
    from engine.tp import tp_comm_bytes

    runs = [(r.label, r.summary, r.timeline, sum(tp_comm_bytes(r.cfg).values())) for r in live]
    text_table(live_rows(runs), columns_from="run")
if len(live) == 2:  # the comparison needs both (a press stopped in its second run keeps the first)
    (_, tp_sum, _, tp_formula), (_, sp_sum, _, sp_formula) = runs
    tp_bytes = tp_sum.comm_bytes[0] / tp_sum.steps
    sp_bytes = sp_sum.comm_bytes[0] / sp_sum.steps
    tp_act = tp_sum.memory_bytes[0]["activations_peak"]
    sp_act = sp_sum.memory_bytes[0]["activations_peak"]
    st.markdown(
        f"Bytes each rank sent per step: TP **{tp_bytes:,.0f}**, TP + SP **{sp_bytes:,.0f}** "
        f"({sp_bytes / tp_bytes - 1:+.1%}; the formula says {tp_formula:,.0f} and {sp_formula:,.0f}). "
        "The all-reduce column of TP became all-gather + reduce-scatter with the same total; the few extra "
        "bytes of TP + SP are the norms' weight gradients, which see only S/t positions per rank and are "
        "summed over tp. Activation memory autograd kept for backward: "
        f"**{tp_act / 1024:,.0f} KiB** against **{sp_act / 1024:,.0f} KiB** with sequence parallel "
        f"({1 - sp_act / tp_act:.0%} less): the norm and residual inputs are now S/t long on each rank."
    )
