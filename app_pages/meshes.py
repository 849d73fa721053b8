"""Lesson: putting it together, N-D meshes: how real runs combine the strategies, how each axis lands on the
hardware, what the planner predicts for the layout, and the same mesh scaled down and run for real."""

import pandas
import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.live_panel import run_live, server_max_world, show_live
from app_pages.metric_row import memory_metric, metric, metric_row, peak_words
from app_pages.text_table import search_table
from core.mesh import Mesh
from hardware.chips import CHIPS
from planner.bounds import cross_pod_bound, fsdp_tp_tradeoff
from planner.case import Cluster, Parallel, SpecError, mesh_parallel
from planner.costs import cluster_chip
from planner.models import MODEL_PRESETS
from planner.presets import default_global_batch, make_case
from planner.simulate import sent_bytes_per_step
from ui.exercises import axes_leaving_the_domain
from ui.meshes import (
    PRESETS,
    axis_rows,
    layout_label,
    mesh_caption,
    mesh_figure,
    scaled_down,
    search_figure,
    sidebar_mesh,
    tradeoff_figure,
    tradeoff_text,
)
from ui.tables import batch_words, count, format_step, search_counts

choices = st.session_state["choices"]

st.title("Putting it together: N-D meshes")
st.markdown(
    """
Real training runs use several strategies at once. The chips form a **mesh**, a grid with one axis per
strategy: every chip has a coordinate on each axis, and the chips that differ only along one axis form that
axis's **group**, which runs that strategy's collectives. Llama 3 405B trained on 16,384 H100 as tensor
parallel 8 x pipeline 16 x data parallel 128; DeepSeek-V3 on 2,048 H800 as pipeline 16 x expert parallel 64 x
data parallel.

Which ranks form a group depends on the **rank order**. This guide (like Megatron-LM and
`torch.distributed.DeviceMesh`) lays ranks out with the last axis fastest, in the order
`pp, dp, fsdp, cp, ep, tp`: tensor-parallel partners are consecutive ranks, so they share a node and its
NVLink, while pipeline stages are the farthest apart. The order follows the traffic: tp talks inside every
layer, cp and ep every attention or MoE layer, dp and fsdp once per step (overlapped with compute), pp one
activation per micro-batch. dp, fsdp and ep ranks read different sequences of the batch (ep's ranks are data
parallel for the dense layers and split the experts), cp ranks different positions of the same sequences.
"""
)

options = ["the sidebar's setup", *PRESETS]
which = st.selectbox("Layout", options, key="mesh_preset", bind="query-params")
published_batch, recipe = None, {}  # a published layout's own batch and recipe (Preset.global_batch, .recipe)
if which == options[0]:
    model_name, chip_key, mesh_axes, zero_stage = choices.model, choices.chip, dict(choices.mesh), 0
    st.caption("The sidebar's model, chip and mesh. Choose one of the published layouts above to compare.")
else:
    preset = PRESETS[which]
    model_name, chip_key, mesh_axes, zero_stage = preset.model, preset.chip, dict(preset.mesh), preset.zero_stage
    published_batch, recipe = preset.global_batch, dict(preset.recipe)
    st.caption(preset.source)

    def _apply(p=preset) -> None:
        # A callback runs before the next script run, when the sidebar's widgets may still be changed.
        st.session_state["model"], st.session_state["chip"] = p.model, p.chip
        for axis, degree in p.mesh.items():
            st.session_state[axis] = degree
        st.session_state["mesh_preset"] = options[0]

    st.button("Apply to the sidebar (and the link)", on_click=_apply,
              help="Loads this model, chip and mesh into the sidebar, so every page shows this layout. The "
                   "sidebar has no batch, ZeRO stage or recipe: the published ones stay with this preset, so "
                   "the sidebar's numbers (with its default batch) differ from the ones shown here.")

chip = CHIPS[chip_key]
mesh = Mesh(mesh_axes)
spec = MODEL_PRESETS[model_name]
label = " x ".join(f"{a}={d}" for a, d in mesh.axes if d > 1) or "one chip"
global_batch = published_batch or default_global_batch(spec.seq_len, mesh.world)  # sequences per step
st.subheader(f"{spec.name} on {mesh.world:,} {chip.name}: {label}")

st.markdown("### How each axis lands on the hardware")
shown_axes = [a for a in reversed(mesh.names) if mesh.degree(a) > 1]
estimate = None
try:
    from planner.api import estimate as planner_estimate

    n = mesh.world
    case = make_case(spec, Cluster(chip.key, n), global_batch=global_batch,
                     parallel=mesh_parallel(mesh, spec), zero_stage=zero_stage or None, **recipe)
    estimate = planner_estimate(case)
except SpecError as e:
    st.warning(f"The planner cannot cost this layout: {e}. The mapping below still holds.")
# the links of a job of the mesh's chips (a TPU's slice: planner.costs.cluster_chip)
rows = axis_rows(mesh, cluster_chip(chip, mesh.world, None), estimate.breakdown if estimate else None,
                 estimate.step_time_s if estimate else None,
                 sent_bytes_per_step(estimate.result) if estimate else None)
if not rows:
    st.info("One chip: nothing to split. Set a mesh in the sidebar or choose a published layout.")
else:
    axis = st.radio("Draw the groups of", shown_axes, horizontal=True, key="mesh_axis", bind="query-params")
    st.plotly_chart(mesh_figure(mesh, chip, axis), key="mesh_groups")
    st.caption(mesh_caption(mesh, axis))
    # A table, not a data grid: its long "moves" and "links" texts wrap instead of being cut. A column per axis:
    # with a column per quantity, nine of them ran past the page's right edge in a narrow window, "links" out
    # of sight.
    st.table(pandas.DataFrame(rows).set_index("axis").T)
    st.caption("members apart: the stride, the product of the degrees of the axes inside this one "
               "(core/mesh.py). sent per step: what one chip of the first pipeline stage sends over the axis "
               "in one optimizer step, ring algorithms (an all-reduce sends 2(n-1)/n of its array); dp and "
               "fsdp share one count, the planner's data-parallel group. links: the topology the group's "
               "collectives run on, at achievable bandwidth (hardware/collectives.py). exposed per step: the "
               "planner's estimate of the communication of this axis that compute does not hide, for this "
               f"model with {batch_words(spec.seq_len, mesh.world, published_batch)}."
               + (f" Under ZeRO-2 each of the step's {estimate.result.micro_batches} micro-batches reduce-scatters "
                  "its own gradients (a chip keeps only its shard between them), so the data-parallel axis sends "
                  "that many times the gradients, mostly hidden under the backward."
                  if estimate is not None and estimate.layout.zero_stage == 2 and estimate.result.micro_batches > 1
                  else ""))
if estimate is not None:
    with metric_row():
        # "on the cluster": the live run below has a "Predicted step time" of its own, on this machine
        metric("Predicted step time (this cluster)", format_step(estimate.step_time_s),
               help=f"The planner's step on {mesh.world:,} {chip.name}, not the live run's on this machine "
                    "below")
        metric("MFU", f"{estimate.mfu * 100:,.1f} %",
               help="Model FLOPs utilisation: the model's FLOPs per step (about 6 x parameters x tokens, plus "
                    f"attention) over step time x chips x {peak_words(estimate.result)}.")
        memory_metric(estimate.memory.total_bytes, estimate.fits)
    st.markdown("\n".join(f"- {line}" for line in estimate.explanation))
    st.caption("The planner page has the full breakdown, the predicted timeline and a search over every "
               "layout of this many chips.")


show_exercises([axes_leaving_the_domain(mesh, chip)] if rows else [])

st.markdown("### FSDP or tensor parallel?")
chips = max(1, mesh.world // mesh.degree("pp"))
tokens = global_batch * spec.seq_len
if chips == 1:
    st.markdown("Each pipeline stage here is one chip: there is nothing for FSDP or tensor parallel to split. "
                "Give the stage more chips (dp or tp in the sidebar) to see the trade-off.")
else:
    trade = fsdp_tp_tradeoff(spec, cluster_chip(chip, mesh.world, None), tokens, chips)  # the job's slice on a TPU
    st.markdown(
        f"""
Both split the {count(chips, 'chip')} of one pipeline stage, and they move different things: **FSDP moves weights**
(each layer's are all-gathered before use), **tensor parallel moves activations** (gathered into and
reduce-scattered out of every layer). Splitting the chips as X-way FSDP x Y-way TP (X · Y = {chips:,}), the
weights each chip gathers shrink as Y grows and the activations it moves shrink as X grows, so their sum
has a minimum (the scaling book, Part 5). For {spec.name} with {tokens:,} tokens per step on {chip.name},
per layer's forward, counted as the scaling book counts it: the MLP's {
"three matmuls (SwiGLU's gate, up and down; the book's MLP has two)" if trade.matrices == 3 else "two matmuls"
} of D = {spec.hidden:,} by F = {(spec.dense_ffn_ if spec.is_moe else spec.ffn):,}, the most communication per
FLOP of the layer{
" (a dense MLP's width: the experts' own all-to-all is the expert-parallel page's)" if spec.is_moe else ""}:
"""
    )
    st.plotly_chart(tradeoff_figure(trade), key="mesh_tradeoff")
    st.markdown(f"{trade.rule} {tradeoff_text(trade)}")
pod = chip.scaleup_domain  # an NVLink domain (8 GPUs in a node, 72 in a GB200 NVL72 rack) or a TPU slice
pods = max(1, mesh.world // pod)
replicas = max(1, pods // mesh.degree("pp"))  # the pods of one pipeline stage read different sequences
unit = "pod" if chip.kind != "gpu" else "node" if pod <= 8 else "NVLink domain"
pods_here = (f"This mesh fits in one {unit}: nothing crosses the network." if pods == 1 else
             f"This mesh spans {pods:,} {unit}s; each pipeline stage's {replicas:,} read different sequences."
             if replicas > 1 else f"This mesh spans {pods:,} {unit}s, split between its pipeline stages: no "
             "data-parallel sync crosses the network.")
st.markdown(
    f"""
**Across pods.** Beyond one {'TPU pod' if chip.kind != 'gpu' else chip.scaleup_link + ' node'} the network is much
slower, so real runs keep FSDP and TP inside and run plain data parallel between them: one gradient all-reduce per
step, under the backward. {cross_pod_bound(spec, chip, tokens / replicas).rule}. {pods_here}
"""
)

st.markdown("### Let the planner choose")
st.markdown(
    f"The planner's search ranks every way to factor {count(mesh.world, 'chip')} into pp x dp x cp x ep x tp "
    "(with each "
    "ZeRO stage, micro-batch size, recomputation and schedule) that fits in memory, by simulated step time. "
    "**Apply** loads a layout's mesh into the sidebar, so every page shows it.")
if st.button("Search the layouts of this many chips", key="mesh_search"):
    from planner.api import search

    n = mesh.world
    with st.spinner("Searching ..."):
        try:  # the same model, chips and batch, every layout field left for the planner to choose
            # the experts split by tp, as the sidebar's mesh draws its ep axis (Parallel.etp)
            free = make_case(spec, Cluster(chip.key, n), global_batch=global_batch,
                             parallel=Parallel(etp="tp" if spec.is_moe else None), **recipe)
            st.session_state["mesh_search_report"] = search(free, top=5)
        except SpecError as e:
            st.session_state.pop("mesh_search_report", None)
            st.warning(f"The planner cannot search this setup: {e}.")
report = st.session_state.get("mesh_search_report")
# the search of this model, chip and chip count only (a chip changed in the sidebar had kept the last one's)
if report is not None and (report.case.cluster.num_chips, report.case.cluster.chip, report.case.model.name) == (
        mesh.world, chip.key, spec.name):
    search_table(report)
    st.plotly_chart(search_figure(report), key="mesh_search_chart")
    st.caption(f"{search_counts(report)}. The fastest, in words:")
    if report.ranked:
        st.markdown("\n".join(f"- {line}" for line in report.ranked[0].explanation))

        best = sidebar_mesh(report.ranked[0].result.layout)

        def _apply_layout(degrees=best, m=model_name, c=chip_key) -> None:
            st.session_state["model"], st.session_state["chip"] = m, c
            for axis, degree in degrees.items():
                st.session_state[axis] = degree
            st.session_state["mesh_preset"] = options[0]

        if best is None:  # its experts over dp x cp: the sidebar carves ep out of dp alone
            st.caption("The fastest layout's expert-parallel groups reach over the context-parallel ranks too, "
                       "which the sidebar's mesh (ep carved out of dp) cannot draw: it cannot be applied there.")
        elif which == options[0] and Mesh(best).axes == mesh.axes:  # a button that visibly did nothing
            st.caption(f"The fastest mesh, {layout_label(report.ranked[0].result.layout)}, is the sidebar's already.")
        else:
            st.button("Apply the fastest to the sidebar", on_click=_apply_layout, key="mesh_apply_best")
    else:
        st.warning("No layout fits in memory: use more chips, a chip with more HBM, or a smaller model.")

st.header("Run it for real")
# a server allowing fewer processes (SHARDLAB_MAX_WORLD) gets a smaller run, not a refusal it has no control for
most = server_max_world(8)
small = scaled_down(mesh_axes, most)
small_label = ",".join(f"{a}={d}" for a, d in small.items())
allowed = "" if most == 8 else ", as this server allows (SHARDLAB_MAX_WORLD)"
st.markdown(
    f"""
The same kinds of groups, small enough for this machine: every axis of degree > 1 at degree 2 (at most
{most} processes{allowed}; the axes with the smallest degrees go first when there are too many), on a small model
of the same family. Each run is checked against a single-process run of the same model, as on every lesson.
This layout: **{small_label}** on {count(Mesh(small).world, 'process')}.
"""
)
if st.button("Run it", type="primary", key="mesh_run"):
    from engine.config import ModelConfig, ParallelConfig, RunConfig, strategy_for

    axes = tuple((a, d) for a, d in Mesh(small).axes)
    moe = small.get("ep", 1) > 1 or spec.experts > 1
    model = ModelConfig(layers=2 * small.get("pp", 1), mlp="moe" if moe else "dense")
    stage = zero_stage if small.get("dp", 1) > 1 or small.get("fsdp", 1) > 1 else 0
    cfg = RunConfig(model=model, parallel=ParallelConfig(strategy_for(axes), mesh=axes, zero_stage=stage),
                    world=Mesh(small).world, steps=3, micro_batches=2 if small.get("pp", 1) > 1 else 1)
    run_live("mesh_live", [(small_label, cfg)], hint="try a layout with fewer axes")
show_live("mesh_live")
