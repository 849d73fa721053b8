"""Lesson: data parallel, ZeRO-1/2/3 and FSDP, analytic on real chips and live on this machine."""

import plotly.graph_objects as go
import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.live_panel import run_live, show_live
from app_pages.text_table import text_table
from hardware.chips import CHIPS
from hardware.collectives import group_topology
from planner.bounds import data_parallel_bound
from planner.costs import group_links_chip
from planner.flops import total_params
from planner.memory import zero_bytes_per_param
from planner.models import MODEL_PRESETS
from ui.bound_meter import bound_figure, verdict_text
from ui.charts import MEMORY_COLORS, title_extra_px, wrap_title
from ui.dp_lesson import LIVE_STRATEGIES, comm_formula_text, expected_comm_bytes_per_step, expected_memory
from ui.exercises import fsdp_batch, smallest_fitting_zero_stage
from ui.live import LIVE_STEP_CHOICES, LIVE_STEPS
from ui.tables import count

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]
spec = MODEL_PRESETS[choices.model]
dp = choices.mesh["dp"]

st.title("Data parallel, ZeRO and FSDP")
st.markdown(
    """
**Data parallel** is the first thing anyone does with more than one chip: every chip holds the whole
model and takes its own slice of the batch. In scaling-book notation the batch dimension is sharded
over the data-parallel axis and the weights are replicated:
"""
)
st.latex(r"\text{In}[B_{dp}, D] \cdot W[D, F] \rightarrow \text{Out}[B_{dp}, F]")
st.markdown(
    """
Forward and backward need no communication at all. The price comes after the backward pass: each chip
holds gradients of its own slice of the batch, and before the optimizer step they must be **summed
over all chips** (an all-reduce of every gradient), so every replica takes the same step.
Frameworks start the all-reduce of a layer's gradients as soon as backward has produced them
(**bucketing**), so most of it hides under the backward of the layers below.
"""
)

st.header("Memory: who holds what")
st.markdown(
    """
Mixed-precision Adam keeps, per parameter: the bf16 weight (2 bytes), its bf16 gradient (2 bytes), and
an fp32 master copy with two fp32 moments (12 bytes): **16 bytes per parameter**
(Rajbhandari et al. 2019, "ZeRO", Figure 1). Megatron-LM keeps and reduces bf16 training's gradients in fp32
(4 bytes, 18 per parameter); the planner counts what a run states (`grad_reduce_in_fp32`).
Plain data parallel repeats all of it on every chip.
**ZeRO** removes the repetition in three stages, each sharding one more item over the N_d data-parallel
chips:
"""
)
st.latex(r"""
\begin{array}{lll}
\text{DP:} & (2 + 2 + 12)\,\Psi & \\
\text{ZeRO-1 (optimizer state):} & (2 + 2)\,\Psi + 12\,\Psi / N_d & \\
\text{ZeRO-2 (+ gradients):} & 2\,\Psi + (2 + 12)\,\Psi / N_d & \\
\text{ZeRO-3 / FSDP (+ weights):} & (2 + 2 + 12)\,\Psi / N_d &
\end{array}""")

# each data-parallel rank holds its tp x pp shard of the model: the states ZeRO divides over dp are those
psi_model = total_params(spec)
shard = choices.mesh.get("tp", 1) * choices.mesh.get("pp", 1)
psi = psi_model / shard
shard_words = f" (each chip's 1/{shard} shard under tp x pp = {shard})" if shard > 1 else ""
stages = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
per_stage = [zero_bytes_per_param(stage, dp) for stage in range(4)]
fig = go.Figure()
for i, (part, kind) in enumerate((("weights", "params"), ("gradients", "grads"), ("optimizer state", "optimizer"))):
    fig.add_trace(go.Bar(x=stages, y=[p[i] * psi / 1e9 for p in per_stage], name=part,
                         marker_color=MEMORY_COLORS[kind]))
fig.add_hline(y=chip.hbm_bytes / 1e9, line_dash="dash", annotation_text=f"{chip.name} HBM")
fig.update_layout(barmode="stack", yaxis_title="GB per chip (no activations)", height=380,
                  title=f"{spec.name} ({psi_model / 1e9:.1f}B parameters"
                        + (f", {psi / 1e9:.2f}B per tp x pp shard" if shard > 1 else "")
                        + f") over dp = {count(dp, 'chip')}",
                  margin={"l": 10, "r": 10, "t": 50, "b": 10})
st.plotly_chart(fig, key="zero_memory")
fits = [s for s, p in zip(stages, per_stage, strict=True) if sum(p) * psi <= chip.hbm_bytes]
st.markdown(
    f"With dp = **{dp}** (sidebar), the model states of {spec.name}{shard_words} need "
    + ", ".join(f"{s} **{sum(p) * psi / 1e9:,.1f} GB**" for s, p in zip(stages, per_stage, strict=True))
    + f" per chip, against {chip.hbm_bytes / 1e9:.0f} GB of HBM on {chip.name}: "
    + (f"{', '.join(fits)} fit{'s' if len(fits) == 1 else ''} before any activation."
       if fits else "none fits: shard the model " + ("further (more" if shard > 1 else "itself too (")
       + "tensor or pipeline parallel), or raise dp.")
)

st.header("Communication: what each stage costs")
st.markdown(
    """
A ring all-reduce is a reduce-scatter followed by an all-gather, so **ZeRO-1 and ZeRO-2 move exactly the
bytes plain DP moves**: reduce-scatter the gradients (each chip now holds the summed gradient of its
shard), update that shard, all-gather the new weights. ZeRO-3 / FSDP also frees the weights of a layer
after using them, so it all-gathers them twice (forward and backward): **1.5x the bytes of DP**, each
gather prefetched one layer ahead so it hides under compute.
"""
)
grad_bytes = 2 * psi
dp_stride = choices.device_mesh().stride("dp")  # the dp group's members are this many ranks apart
# the dp group's links in a job of the sidebar's mesh (a TPU's slice: planner.costs.group_links_chip), for the
# table, the bound meter and the exercise alike
links = group_links_chip(chip, dp * dp_stride, choices.num_chips)
topo = group_topology(links, dp, stride=dp_stride, achievable=True)
rows = [
    # the collectives' words last: before the numbers, at 800 px they pushed the time out of view
    {"strategy": "DP / ZeRO-1 / ZeRO-2", "bytes per chip": f"{2 * (dp - 1) / dp * grad_bytes / 1e9:,.2f} GB",
     "time": f"{topo.all_reduce_s(grad_bytes) * 1e3:,.1f} ms",
     "collectives per step": "all-reduce (= reduce-scatter + all-gather)"},
    {"strategy": "ZeRO-3 / FSDP", "bytes per chip": f"{3 * (dp - 1) / dp * grad_bytes / 1e9:,.2f} GB",
     "time": f"{(2 * topo.all_gather_s(grad_bytes) + topo.reduce_scatter_s(grad_bytes)) * 1e3:,.1f} ms",
     "collectives per step": "2 all-gathers + 1 reduce-scatter"},
]
if dp == 1:  # a group of one sends nothing: no table of zeros over a link that is not used
    st.caption("With dp = 1 in the sidebar there is one replica and no gradient sync: nothing is sent. Set dp "
               "above 1 to see what each stage moves.")
else:
    text_table(rows)
    st.caption(f"bf16 gradients of {spec.name}{shard_words} ({grad_bytes / 1e9:,.1f} GB) over {topo.describe()}, "
               "achievable link bandwidth. Whether this time is exposed depends on how much backward compute it "
               "hides under.")

st.subheader("The bound meter: can the communication hide under the math?")
st.markdown(
    "Per layer, the math that the data-parallel communication can hide under, against that communication: "
    "DP all-reduces each layer's gradients under the rest of the backward, FSDP all-gathers each layer's "
    "weights under the previous layer's work. Both grow with the layer's size P, but only the math grows with "
    "the tokens each chip processes, so there is a batch per chip above which the communication hides: "
    "**C / W**, the chip's FLOP/s over the bandwidth of the links the group uses (the scaling book's rule, "
    "peak numbers, latency left out)."
)
bound_tokens = st.select_slider("Tokens per chip per step", [256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
                                value=4096, key="bound_tokens", bind="query-params")
if dp == 1:
    st.caption("With dp = 1 in the sidebar there is nothing to communicate: set dp above 1.")
else:
    for col, fsdp in zip(st.columns(2), (False, True), strict=True):
        bound = data_parallel_bound(spec, links, bound_tokens, dp, dp_stride, fsdp=fsdp)
        col.plotly_chart(bound_figure(bound, "FSDP / ZeRO-3" if fsdp else "DP / ZeRO-1/2"),
                         key=f"bound_{'fsdp' if fsdp else 'dp'}")
        col.markdown(verdict_text(bound))

show_exercises(([fsdp_batch(spec, links, dp, dp_stride)]
                if dp > 1 else []) + [smallest_fitting_zero_stage(psi, spec.name, chip, dp, shard)])

st.header("Run it for real")
st.markdown(
    """
Below, a small Llama-style Transformer trains for a few steps on **real processes of this machine**,
sharded by the strategy you pick, with `torch.distributed` over gloo. The run is checked against one
process training the same model on the whole batch (loss, gradients, weights and Adam state), and every
rank's compute and communication is recorded: press **Play** under the timeline to watch a step.
"""
)
# The strategy names are long: a row of their own, wide enough for the longest, where a third of the row cut
# them to "ZeRO-3 / FSDP (+ weig".
strategy_label = st.selectbox("Strategy", list(LIVE_STRATEGIES), index=4, key="live_strategy", width=360)
c1, c2, c3 = st.columns(3)
world = c1.select_slider("Processes", [1, 2, 3, 4], value=2, key="live_world")
steps = c2.select_slider("Optimizer steps", LIVE_STEP_CHOICES, value=LIVE_STEPS, key="live_steps")
micro_batches = c3.select_slider("Micro-batches (gradient accumulation)", [1, 2, 4], value=1, key="live_mb")

if st.button("Run on this machine", type="primary"):
    from engine.config import ModelConfig, ParallelConfig, RunConfig

    strategy, zero_stage, dp_comm = LIVE_STRATEGIES[strategy_label]
    cfg = RunConfig(model=ModelConfig(), world=world, steps=steps, micro_batches=micro_batches,
                    parallel=ParallelConfig(strategy=strategy, zero_stage=zero_stage, dp_comm=dp_comm))
    run_live("live_dp", [(strategy_label, cfg)], hint="try fewer processes or steps")

for live in show_live("live_dp"):
    cfg, summary = live.cfg, live.summary
    psi_small = cfg.model.params
    stage = cfg.parallel.stage
    want = expected_memory(psi_small, stage, cfg.world)
    mem_fig = go.Figure()
    for part in ("params", "grads", "optimizer"):
        mem_fig.add_trace(go.Bar(name=f"{part} (measured)", marker_color=MEMORY_COLORS[part],
                                 x=[f"rank {r}" for r in range(cfg.world)],
                                 y=[m[part] / 1e3 for m in summary.memory_bytes]))
    mem_fig.add_trace(go.Scatter(name="ZeRO formula (params + grads + optimizer)", mode="markers",
                                 marker={"symbol": "line-ew-open", "size": 40, "color": "black"},
                                 x=[f"rank {r}" for r in range(cfg.world)], y=[sum(want.values()) / 1e3] * cfg.world))
    title = wrap_title(f"Model states per rank, measured from the tensors (fp32: 4 + 4 + 8 bytes per parameter, "
                       f"Ψ = {psi_small:,})")  # on one line it ran past the chart's edge at 800 px
    mem_fig.update_layout(barmode="stack", yaxis_title="kB per rank", height=340 + title_extra_px(title), title=title,
                          margin={"l": 10, "r": 10, "t": 50 + title_extra_px(title), "b": 10})
    st.plotly_chart(mem_fig, key="live_memory")
    per_step = [b / cfg.steps for b in summary.comm_bytes]
    last_unit = cfg.model.hidden * cfg.model.vocab + cfg.model.hidden  # the head: final norm + output matrix
    formula = expected_comm_bytes_per_step(psi_small, stage, cfg.world, cfg.micro_batches, last_unit)
    why = {0: "one all-reduce after the last micro-batch; the others accumulate locally",
           1: "reduce-scatter the gradients, all-gather the updated weights, once per step",
           2: "every micro-batch's gradients reduce-scattered (a rank keeps only its shard), the weights "
              "all-gathered once",
           3: "every micro-batch all-gathers the weights for forward and for backward and reduce-scatters the "
              f"gradients, except the last unit (the head, Ψ_last = {last_unit:,}), kept gathered from its "
              "forward into its backward"}[stage]
    st.markdown(
        f"Bytes sent per rank per step: **{per_step[0]:,.0f}**; the ring formula "
        f"{comm_formula_text(stage)} with x = (N-1)/N x 4 bytes, m = {cfg.micro_batches} micro-batch(es), "
        f"N = {cfg.world}, gives **{formula:,.0f}** ({why})."
    )
