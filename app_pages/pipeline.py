"""Lesson: pipeline parallel. Schedules as pictures (GPipe, 1F1B, interleaved 1F1B, ZB-H1), their bubbles
and activation memory, what a pipeline costs on real chips, and a live pipeline run on this machine."""

import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.link_params import follow_sidebar
from app_pages.live_panel import run_live, show_live
from app_pages.metric_row import metric, metric_row
from app_pages.text_table import text_table
from core.schedules import SCHEDULE_NAMES, ScheduleError, formula_bubble_fraction
from hardware.chips import CHIPS
from planner.models import MODEL_PRESETS
from ui.collectives import markdown_text
from ui.exercises import bubble_micro_batches, gpipe_bubble
from ui.live import LIVE_STEPS, representative_step
from ui.pipeline import (
    SCHEDULE_LABELS,
    bubble_in_words,
    comparison,
    comparison_table,
    formula_latex,
    held_micro_batches,
    in_flight_figure,
    measured_op_times,
    op_times,
    real_chip_view,
    schedule_figure,
    simulate_schedule,
)
from ui.tables import format_bytes

B_OVER_F = [1.0, 1.5, 2.0, 3.0]
COMM_OVER_F = [0.0, 0.1, 0.25, 0.5, 1.0]
REAL_PP = [2, 4, 8, 16, 32]
REAL_M = [1, 2, 4, 8, 16, 32, 64, 128]

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]
spec = MODEL_PRESETS[choices.model]

st.title("Pipeline parallel")
st.markdown(
    """
**Pipeline parallel** splits the model by depth: the layers are cut into **p stages**, stage i lives on
chip i, and a batch flows through them one after the other. Only the activations at the cut travel, from
one chip to the next, point to point:
"""
)
st.latex(r"\text{In}[B, D] \rightarrow \text{stage}_0 \rightarrow \text{stage}_1 \rightarrow \cdots "
         r"\rightarrow \text{stage}_{p-1} \rightarrow \text{loss}")
st.markdown(
    """
Each chip holds 1/p of the weights and sends one activation tensor per micro-batch per cut (and gets one
gradient back): far fewer bytes than tensor or data parallel, which is why pipeline parallel goes on the
slowest links (across nodes). The price is time. Stage 1 cannot start before stage 0 has finished, and
the backward pass runs the other way, so while the pipeline fills and drains some chips wait: the
**bubble**. Splitting the batch into **m micro-batches** keeps more stages busy at once. The schedule decides
in which order each stage runs the forward (F) and backward (B) of its micro-batches:

- **GPipe** (Huang et al. 2019): all forwards, then all backwards. Every stage keeps the activations of all
  m micro-batches until their backward.
- **1F1B** (PipeDream-Flush, Narayanan et al. 2021 §2.2): after a short warm-up each stage alternates one
  forward and one backward, so stage i holds at most p - i micro-batches. Same bubble, far less memory.
- **Interleaved 1F1B** (Narayanan et al. 2021 §2.2): each chip holds v smaller chunks of layers
  (chip r has stages r, p + r, ...); a micro-batch visits every chip v times, so filling and draining take
  1/v as long. More point-to-point messages, and m must be a multiple of p.
- **ZB-H1** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward is split into BI (the input
  gradient dL/dx, which the previous stage waits for) and BW (the weight gradient dL/dW, which nobody waits
  for). BW is deferred to fill the cool-down bubble; the activations held are 1F1B's.

The bubble fraction is the idle time over the ideal compute time m (t_F + t_B) (Narayanan et al. 2021 eq. 1):
"""
)
c1, c2 = st.columns(2, vertical_alignment="bottom")  # level where a heading wraps (800 px)
c1.markdown("GPipe and 1F1B")
c1.latex(r"\text{bubble} = " + formula_latex("1f1b"))
c2.markdown("Interleaved 1F1B, v chunks per chip")
c2.latex(r"\text{bubble} = " + formula_latex("interleaved-1f1b"))
# a row of its own: in a third of the page the formula ran past its column (cut at 1,280 px and at 800)
st.markdown("ZB-H1 (m ≥ p)")
st.latex(r"\text{bubble} = " + formula_latex("zb-h1"))
st.markdown("With t_F = t_BI = t_BW the ZB-H1 bubble is (p - 1)/(3m), a third of 1F1B's "
            "(Qi et al. 2023 §2.1).")

st.header("See a schedule")
st.markdown(
    """
Pick a schedule and watch it run: one row per chip, time to the right, one cell per forward or backward
of one micro-batch (the number in the cell), grey where the chip idles. Press **Play** to sweep through
the step. The times are relative: t_F, one forward of one micro-batch through a chip's layers, is 1.
"""
)
# two a row, the schedule beside its chunks: four in one cut "Interleaved 1F1B" to "Interleaved 1I" in a
# 1,024-px window
w1, w2 = st.columns(2)
schedule = w1.selectbox("Schedule", SCHEDULE_NAMES, index=1, format_func=SCHEDULE_LABELS.get, key="schedule",
                        bind="query-params")
v = w2.slider("Chunks per chip v (interleaved)", 1, 4, 2, key="virtual", bind="query-params",
              disabled=schedule != "interleaved-1f1b",
              help="Model chunks per chip; only interleaved 1F1B uses more than one.")
w3, w4 = st.columns(2)
p = w3.slider("Stages p (chips)", 2, 8, 4, key="stages", bind="query-params")
m = w4.slider("Micro-batches m", 1, 16, 8, key="micro_batches", bind="query-params")
w5, w6 = st.columns(2)
b_over_f = w5.select_slider("Backward time t_B / t_F", B_OVER_F, value=2.0, key="t_b", bind="query-params",
                            help="A backward does about twice a forward's FLOPs. ZB-H1 splits it evenly "
                                 "into BI and BW.")
comm_over_f = w6.select_slider("Transfer time / t_F", COMM_OVER_F, value=0.0, key="t_comm",
                               bind="query-params",
                               help="How long one activation or gradient takes to reach the next chip.")
times = op_times(b_over_f, comm_over_f)

try:
    sim = simulate_schedule(schedule, p, m, v, times)
except ScheduleError as e:
    sim = None
    st.error(markdown_text(f"{SCHEDULE_LABELS[schedule]} cannot run with p = {p}, m = {m}: {e}."))

if sim is not None:
    v_used = sim.schedule.virtual_stages
    formula = formula_bubble_fraction(schedule, p, m, v_used, times)
    # named as the table's columns below: "Bubble fraction (formula)" was cut in an 800-px window
    bubble_help = "The bubble fraction: idle time over the ideal compute time m (t_F + t_B)."
    with metric_row():
        metric("Simulated bubble", f"{sim.bubble_fraction:.3f}", help=bubble_help)
        metric("Formula bubble", f"{formula:.3f}", help=bubble_help)
        metric("Step time", f"{sim.makespan_s:.2f} t_F", help="ideal (no bubble): m (t_F + t_B) = "
               f"{sim.ideal_s:.2f} t_F")
    if comm_over_f > 0:
        st.caption("The formula leaves the transfers out; the simulation waits for each one, so its bubble "
                   "is larger.")
    elif schedule == "zb-h1" and m < p:
        st.caption("ZB-H1's formula assumes m ≥ p; with fewer micro-batches trust the simulation.")
    st.plotly_chart(schedule_figure(sim, title=f"{SCHEDULE_LABELS[schedule]}, p = {p}, m = {m}"
                                    + (f", v = {v_used}" if v_used > 1 else "")), key="schedule_grid")
    if v_used > 1:
        st.caption("With v chunks a cell shows micro-batch and chunk: 3B is the forward of micro-batch 3 on "
                   "chunk b (stage p + r of chip r), 3b its backward.")

st.subheader("All four schedules, same p and m")
st.caption(f"p = {p}, m = {m}, interleaved with v = {v}; times as above. \"held\": peak micro-batches of "
           "activations a chip keeps.")
sims, rows = comparison(p, m, v, times)
table, notes = comparison_table(rows)
text_table(table)
for note in notes:
    st.caption(markdown_text(note))
st.markdown(
    f"""
The memory side: a micro-batch's activations stay on a chip from its forward until its backward
(B, or BI for ZB-H1). GPipe keeps all **m = {m}** on every chip; 1F1B keeps **p - i** on chip i
({", ".join(str(min(p - i, m)) for i in range(p))} here), and the first chip's p is what must fit.
Interleaving warms up longer, so it holds more (counted in micro-batches' worth of a chip's layers, since a
chunk is 1/v of them).
"""
)
if sims:
    st.plotly_chart(in_flight_figure(sims, schedule), key="in_flight")
if "zb-h1" in sims:
    pending = sims["zb-h1"].peak_weight_grads_pending
    # in words, rank by rank (a Python list had been printed: "up to [1, 2, 3, 4]")
    counts = (f"{', '.join(map(str, pending[:-1]))} and {pending[-1]} deferred BW on ranks 0 to {len(pending) - 1}"
              if len(pending) > 1 else f"{pending[0]} deferred BW")
    st.caption(f"ZB-H1 also keeps, per chip, the inputs of up to {counts} (layer inputs and output gradients, "
               "smaller than a full activation set: Qi et al. 2023 Table 1).")

st.header(f"On real chips: {spec.name} on {chip.name}")
sidebar_pp = choices.mesh["pp"]
r1, r2 = st.columns(2)
start_pp = sidebar_pp if sidebar_pp in REAL_PP else 4
follow_sidebar("real_pp", start_pp)
real_pp = r1.select_slider("Stages p", REAL_PP, value=start_pp,
                           key="real_pp", bind="query-params",
                           help="Starts at the sidebar mesh's pp when that is one of these, again whenever it changes.")
real_m = r2.select_slider("Micro-batches m per step", REAL_M, value=16, key="real_m", bind="query-params")
tp = choices.mesh["tp"]
stride = choices.device_mesh().stride("pp")
try:
    view = real_chip_view(spec, chip, real_pp, real_m, tp=tp, stride=stride)
except ValueError as e:
    st.error(markdown_text(f"{e}."))
    st.stop()
if len(set(view.layers_per_stage)) > 1:
    st.warning(f"{spec.layers} layers do not split evenly into {real_pp} stages "
               f"({', '.join(map(str, view.layers_per_stage))}): the stage with more layers paces the "
               f"pipeline. Choose p dividing {spec.layers}.")
with metric_row():
    metric("Layers per stage", ", ".join(map(str, sorted(set(view.layers_per_stage), reverse=True))))
    # the stage in the help: "Activations on stage 0, 1F1B" was cut in a 1,024-px window
    metric("Activations, 1F1B", f"{view.activation_bytes_1f1b / 1e9:,.1f} GB",
           help=f"On stage 0, which holds the most: min(p, m) = {min(real_pp, real_m)} micro-batches held")
    metric("Activations, GPipe", f"{view.activation_bytes_gpipe / 1e9:,.1f} GB",
           help=f"On stage 0, like every stage: m = {real_m} micro-batches held")
st.markdown(
    f"""
One micro-batch (1 sequence of {spec.seq_len:,} tokens) leaves a stage as
In[S, D] = {spec.seq_len:,} x {spec.hidden:,} bf16 values{f", split over tp = {tp}" if tp > 1 else ""}:
**{view.p2p_bytes / 1e6:,.1f} MB** ({format_bytes(view.p2p_bytes)}, as the tensor-parallel lesson writes it), sent
to the next stage in **{view.p2p_s * 1e6:,.0f} µs** (α
{(view.latency_s - view.fill_s) * 1e6:,.1f} µs + T_fill {view.fill_s * 1e6:,.0f} µs, the time a message spends filling
the link's pipeline, + bytes/W {view.bandwidth_s * 1e6:,.0f} µs) on the links of the pp group: {view.link}. Its forward
through one stage takes at least **{view.stage_forward_s * 1e3:,.2f} ms** at the chip's peak bf16 FLOP/s, so
the transfer is about {view.p2p_s / view.stage_forward_s:.1%} of it{
": pipeline parallel is cheap in bytes, and its real cost is the bubble" if view.p2p_s < 0.2 * view.stage_forward_s else
": with stages this thin the sends are not small beside the work, unless they overlap it, and the bubble comes on top"
}: {bubble_in_words(real_pp, real_m)}.
"""
)
st.caption(f"Planner arithmetic (planner/memory.py, hardware/collectives.py): bf16, flash attention, no "
           f"recomputation, no sequence parallel, tp = {tp} from the sidebar; the pp group's chips are "
           f"{stride} ranks apart (pp is the outermost mesh axis), achievable link bandwidth.")

show_exercises([bubble_micro_batches(p), gpipe_bubble(p, m)])

st.header("Run it for real")
st.markdown(
    """
Below, a small Llama-style Transformer trains on **real processes of this machine**, its layers split into
stages, each rank walking its action list of the schedule above (the same data) with point-to-point sends
and receives over gloo. The run is checked against one process training the whole model on the whole
batch. Step 0 warms up; the bubble is measured on the step after it whose time is nearest the run's mean
(the one the measured timeline below draws).
"""
)
# two a row, as the schedule's controls above
l1, l2 = st.columns(2)
live_schedule = l1.selectbox("Schedule", SCHEDULE_NAMES, index=SCHEDULE_NAMES.index(schedule),
                             format_func=SCHEDULE_LABELS.get, key="live_schedule")
live_v = l2.select_slider("Chunks per rank (interleaved)", [1, 2], value=2, key="live_v",
                          disabled=live_schedule != "interleaved-1f1b")
l3, l4 = st.columns(2)
live_world = l3.select_slider("Processes (stages)", [2, 4], value=2, key="live_world")
live_m = l4.select_slider("Micro-batches", [2, 4, 8], value=4, key="live_m")

if st.button("Run on this machine", type="primary"):
    from dataclasses import replace

    from engine.config import ModelConfig, ParallelConfig, RunConfig

    v_live = live_v if live_schedule == "interleaved-1f1b" else 1
    # As the CLI builds it: the smallest model every stage gets whole layers of (engine/cli.py).
    model = replace(ModelConfig(), layers=max(ModelConfig.layers, live_world * v_live))
    # the lessons' steps (ui.live.LIVE_STEPS): the warm-up and four measured, so the step drawn and timed beside
    # its prediction is the one nearest their mean, not whatever one step did on a machine the browser shares
    cfg = RunConfig(model=model, world=live_world, steps=LIVE_STEPS, micro_batches=live_m,
                    parallel=ParallelConfig(strategy="pp", schedule=live_schedule, virtual_stages=v_live))
    run_live("live_pp", [(SCHEDULE_LABELS[live_schedule], cfg)], hint="try fewer micro-batches or processes")

for live in show_live("live_pp"):
    from core.timeline import measured_bubble_fraction

    cfg, summary, timeline = live.cfg, live.summary, live.timeline
    name, pp_live, v_live = cfg.parallel.schedule, cfg.world, cfg.parallel.virtual_stages
    step = representative_step(summary)
    measured = measured_bubble_fraction(timeline, step)
    op = measured_op_times(timeline, step, v_live)
    predicted = simulate_schedule(name, pp_live, cfg.micro_batches, v_live, op)
    # the details in the help: "Bubble, simulated with the measured op times" was cut in a 1,024-px window
    with metric_row():
        metric("Bubble, measured", f"{measured:.3f}", help=f"On step {step}, the one the measured timeline draws")
        metric("Bubble, simulated", f"{predicted.bubble_fraction:.3f}",
               help="The schedule simulated with the measured op times (below)")
        metric("Bubble, formula", f"{formula_bubble_fraction(name, pp_live, cfg.micro_batches, v_live):.3f}")
    st.caption(f"The simulation uses step {step}'s mean times per rank's layers, t_F = "
               f"{op.forward_s * 1e3:.2f} ms and t_B = {op.backward_s * 1e3:.2f} ms, and no transfer time. "
               "The measured bubble also holds every send and receive and the Python overhead around them, "
               "which on this tiny model are not small against the compute (interleaving sends v times as "
               "many messages), and the jitter of processes sharing a few cores. On real chips the compute "
               "is far larger and the formula holds better.")
    held = held_micro_batches(predicted)
    text_table([{"rank": r, "activations held, measured peak (KiB)": round(mem["activations_peak"] / 1024),
                 "micro-batches held, schedule": f"{held[r]:g}",  # 2, 5.5: not 2.0000
                 "bytes sent per step (KiB)": round(sent / cfg.steps / 1024)}
                for r, (mem, sent) in enumerate(zip(summary.memory_bytes, summary.comm_bytes, strict=True))])
    st.caption("Measured activations are the tensors each rank keeps for its backward. The last stage also "
               "keeps the logits (vocabulary-sized), so it can hold more than its count says; ZB-H1 keeps "
               "the inputs of its deferred BW too.")
