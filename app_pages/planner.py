"""Lesson: plan a real training run: memory, step time and MFU of the sidebar setup, and the search."""

import math

import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.link_params import drop_link_values_not_taken, link_values
from app_pages.metric_row import memory_metric, metric, metric_row, peak_words
from app_pages.text_table import search_table, text_table
from hardware.chips import CHIPS
from planner import assumptions, estimate, make_case, search, step_time_band_s
from planner.api import leanest
from planner.case import Cluster, Parallel, mesh_parallel
from planner.flops import total_params
from planner.models import MODEL_PRESETS, SpecError
from planner.presets import default_global_batch
from planner.simulate import USABLE_HBM_FRACTION, usable_hbm_bytes
from planner.timeline import DRAWN
from ui.charts import breakdown_figure, memory_figure
from ui.exercises import training_state_chips
from ui.meshes import schedule_words
from ui.state import ignored_link_message
from ui.tables import count, format_step, search_counts
from ui.timeline import densest_row, timeline_figure

TOKENS_PER_BATCH = [2**i for i in range(19, 26)]  # 0.5M .. 32M tokens
LAYOUT_MODES = ["my mesh (sidebar)", "let the planner choose"]
SEARCH_TOPS = [3, 5, 10]
MAX_ANIMATED_SPANS = 3000  # above this the browser struggles to animate; the chart is drawn still
FINE_BARS = 500  # more bars than this in one row of the timeline: each is under a pixel of the page's width
SAME_STEP = 0.0005  # a recipe value that moves the step by less is listed as making no difference

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]
spec = MODEL_PRESETS[choices.model]
n = choices.num_chips

st.title("Plan a training run")
st.markdown(
    f"""
Every lesson before this one looked at one strategy. Real runs combine them on a **device mesh**: the
chips are arranged as a grid whose axes are data parallel (dp), tensor parallel (tp), pipeline parallel
(pp), context parallel (cp) and expert parallel (ep), and the product of the degrees is the chip count.
The **planner** predicts what one training step of **{spec.name}** costs on **{n:,} x {chip.name}**
with the mesh in the sidebar ({choices.mesh_label()}), or with the layout it picks for that many chips: memory per
chip, step time, **model FLOPs
utilisation (MFU**: the model's FLOPs per step, about 6 x parameters x tokens plus attention, over step time
x chips x the chip's peak FLOP/s; recomputation does not count), where the time goes, and a predicted timeline
in the same format as the live runs.
Its numbers come from the chip table (hardware/), op-level benchmarks (GEMM, attention kernels,
nccl-tests) and published formulas; how far to trust them is measured on published runs below.
"""
)


def tokens_label(tokens: int) -> str:
    """A batch as the slider shows it and a link writes it: "0.5M", "4M"."""
    return f"{tokens / 2**20:g}M"


def word(value) -> str:
    """A picked value as the page says it: a flag on or off, as the recipe table below writes it."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value)


# A bound widget drops a link value that is none of its options without a word: said here, and taken out of the
# link before the widgets read it, as the Lab does (a value that is no finite number the app shell has said)
_bound = {"batch_tokens": [tokens_label(t) for t in TOKENS_PER_BATCH], "layout_mode": LAYOUT_MODES,
          "search_top": SEARCH_TOPS}
_values = link_values()  # as the link had them, for the message
_bad_link = drop_link_values_not_taken(_bound)
if _bad_link:
    st.info(ignored_link_message(_bad_link, _values), icon=":material/link_off:")

c1, c2, c3 = st.columns(3)
tokens = c1.select_slider("Global batch (tokens per step)", TOKENS_PER_BATCH, value=2**22, key="batch_tokens",
                          bind="query-params", format_func=tokens_label)
mode = c2.radio("Layout", LAYOUT_MODES, key="layout_mode",
                bind="query-params", help="With 'choose', only the chip count of the sidebar is kept.")
top = c3.select_slider("Layouts to rank in the search", SEARCH_TOPS, value=5, key="search_top", bind="query-params")

# The sidebar's ep is a mesh axis of its own; the planner (like Megatron-LM) counts expert-parallel ranks
# inside the data-parallel group, since attention and dense layers are data parallel over them too.
parallel = mesh_parallel(choices.device_mesh(), spec) if mode.startswith("my") else Parallel()
# The batch the slider asks for, in whole sequences: a multiple of the mesh's data-parallel degree (each
# data-parallel rank reads its own sequences; tp, pp and cp ranks share theirs), and with the planner
# choosing, as many as asked (it keeps the layouts whose dp divides them). It had been rounded to a multiple
# of the chip count: 0.5M tokens on 16,384 chips became 134M, whatever the slider said.
data_ranks = parallel.dp or 1  # with the planner choosing: any dp that divides the batch
global_batch = default_global_batch(spec.seq_len, data_ranks, tokens)
try:
    # every layout of these chips and this batch: what the search ranks, and what is left where none of them fits
    search_case = make_case(spec, Cluster(chip.key, n), global_batch=global_batch)
    case = make_case(spec, Cluster(chip.key, n), global_batch=global_batch, parallel=parallel)
    with st.spinner("Simulating the step ..."):
        est = estimate(case)
except SpecError as e:
    # what to change, by the field that failed: letting the planner choose keeps the chip count and the batch,
    # so it is offered for a mesh that does not fit the model only
    if e.field.startswith("parallel."):
        advice = ("Change the mesh in the sidebar (the degrees must fit the model: tp divides the heads and kv "
                  "heads, ep the experts, pp at most the layers)" + (", or let the planner choose."
                                                                     if mode.startswith("my") else "."))
    elif e.field.startswith(("cluster.", "parallel")):
        advice = f"Change the mesh in the sidebar: its degrees multiply to the chip count ({n:,} now)."
    elif e.field == "training.global_batch":
        advice = "Choose another global batch with the slider above, or another mesh in the sidebar."
    else:
        advice = "Change the setup in the sidebar or the global batch above."
    st.error(f"The planner cannot use this setup: {e}. {advice}")
    st.stop()

lay = est.layout
etp = f" (etp={lay.etp}: experts {'whole' if lay.experts_folded else 'split by tp'})" \
    if spec.is_moe and lay.tp > 1 else ""
st.markdown(f"**Layout:** dp={lay.dp}, tp={lay.tp}, pp={lay.pp}, cp={lay.cp}, ep={lay.ep}{etp}; "
            f"ZeRO-{lay.zero_stage}; micro-batch {lay.micro_batch}; recompute {lay.recompute_label}; "
            + (f"schedule {schedule_words(lay)}; " if lay.pp > 1 else "")
            + f"global batch {global_batch:,} sequences of {spec.seq_len:,} tokens"
            + (f" ({global_batch * spec.seq_len / 2**20:,.3g}M tokens: the slider's {tokens_label(tokens)} rounded to "
               + (f"whole sequences, at least one per data-parallel rank, dp={data_ranks})." if parallel.dp else
                  "whole sequences).")
               if abs(global_batch * spec.seq_len / tokens - 1) > 0.1 else "."))
if lay.ep > 1:
    sidebar = (f": here the sidebar's dp={choices.mesh['dp']} x ep={choices.mesh['ep']}" if mode.startswith("my")
               else "")
    st.caption(f"In Megatron-LM's degrees, which the planner uses, dp counts every data-parallel rank of the attention "
               f"and dense layers, the expert-parallel ranks among them{sidebar}.")
if est.chosen:  # (planner.api.chosen_fields leaves out what does nothing for this model and layout)
    picked = {k: v for block in est.chosen.values() for k, v in block.items()}
    # with nothing that fits, planner.layout_search.choose returns the layout needing the least memory
    st.caption("Chosen by the planner (what a current framework does; where frameworks differ, "
               + ("the fastest that fits" if est.fits else "the leanest (none fits)") + "): "
               + ", ".join(f"{k}={word(v)}" for k, v in picked.items()))

@st.cache_data(show_spinner=False)
def _accuracy():
    """(runs, mean |error|, max |error|) of the fitted-on and the held-out published runs, the held-out
    runs' signed errors, and llm-foundry's tables: (runs, mean |error|, max |error|) and the mean signed
    error of its runs with and without activation checkpointing."""
    from planner.validation import (
        HELDOUT_RUNS,
        PUBLISHED_RUNS,
        checkpointed,
        llmfoundry_sweep_runs,
        load_published_runs,
        summarize,
        validate,
    )

    held = validate(load_published_runs(HELDOUT_RUNS))
    sweep_runs = llmfoundry_sweep_runs()
    sweep = validate(sweep_runs)
    by_checkpointing = {flag: [r.error for r, run in zip(sweep, sweep_runs, strict=True) if checkpointed(run) is flag]
                        for flag in (True, False)}
    gpus = [run["cluster"]["num_chips"] for run in sweep_runs]
    return (summarize(validate(load_published_runs(PUBLISHED_RUNS))), summarize(held), [r.error for r in held],
            (*summarize(sweep), min(gpus), max(gpus)), {k: sum(v) / len(v) for k, v in by_checkpointing.items()})


@st.cache_data(show_spinner=False)
def _held_out_bands():
    """The held-out runs written as unseen runs are (attention stated, every other recipe field null): how many
    published steps lie within the span of the run's unstated fields, above it, below it."""
    from planner.validation import HELDOUT_RUNS, attention_stated_only, load_published_runs, validate

    rows = validate([attention_stated_only(r) for r in load_published_runs(HELDOUT_RUNS)], bands=True)
    return (sum(r.within_band for r in rows), sum(r.published_s > r.band_s[1] for r in rows),
            sum(r.published_s < r.band_s[0] for r in rows), len(rows))


@st.cache_data(show_spinner=False)
def _feature_ab():
    """The published A/Bs of one recipe field beside the planner's predicted gain (planner.validation)."""
    from planner.validation import feature_ab

    return feature_ab()


@st.cache_data(show_spinner=False)
def _gpu_steps():
    """One H200's recorded training steps beside the planner's prediction (planner.gpu_steps): table rows, and
    the words that sum them up."""
    from planner.gpu_steps import comparisons

    steps = comparisons()
    kernel = {"flash": "FA2 (PyTorch)", "cudnn": "cuDNN"}
    rows = []
    for c in steps:
        row = {"step on one H200": f"{c.label}, {kernel[c.backend]}", "measured ms": f"{c.measured_s * 1e3:.1f}",
               "predicted ms": f"{c.predicted_s * 1e3:.1f}", "error": f"{c.error:+.1%}"}
        for cls in ("gemm", "attention", "memory-bound"):
            row[cls] = f"{c.measured.get(cls, 0) * 1e3:.0f} / {c.predicted[cls] * 1e3:.0f}"
        row["GPU idle"] = f"{c.idle_share:.1%}"
        rows.append(row)
    gemm = [c.predicted["gemm"] / c.measured["gemm"] - 1 for c in steps]
    cudnn = [abs(c.predicted["attention"] / c.measured["attention"] - 1) for c in steps if c.backend == "cudnn"]
    fa2 = [1 - c.predicted["attention"] / c.measured["attention"] for c in steps if c.backend == "flash"]

    def up(x):  # a bound, rounded up to a whole percent
        return f"{math.ceil(100 * x)}%"

    words = (f"The GPU sits idle under {up(max(c.idle_share for c in steps))} of a step; the planner's GEMMs come "
             f"out {min(gemm):.0%}-{max(gemm):.0%} slower than the traced ones (inside a step the clock runs higher "
             f"than in the GEMM-only benchmarks the chip table cites), its cuDNN attention within {up(max(cudnn))} "
             f"of the traced, its FlashAttention-2 {min(fa2):.0%}-{max(fa2):.0%} shorter than PyTorch's traced one; "
             f"whole steps {min(c.error for c in steps):+.0%} to {max(c.error for c in steps):+.0%}.")
    return rows, words


def _than_measured(error: float) -> str:
    return f"{abs(error):.0%} {'shorter' if error < 0 else 'longer'} than measured"


mem = est.memory.as_dict()
with metric_row():
    metric("Step time", format_step(est.step_time_s))
    metric("MFU", f"{est.mfu * 100:,.1f} %",
           help=f"Attention's scores counted over the full S x S square, the convention of Megatron-LM's "
                f"papers (Narayanan et al. 2021) and PaLM's appendix: a causal kernel computes about half of "
                f"it, so at long context this MFU overstates the work done and can pass 100 %. Counting the "
                f"causal half only: {est.mfu_causal * 100:,.1f} %. Both over step time x chips x "
                f"{peak_words(est.result)}.")
    metric("Model TFLOP/s per chip", f"{est.model_tflops_per_chip:,.0f}")
    memory_metric(mem["total"], est.fits)
if chip.kind == "gpu":
    st.caption("Read the step time as the best this layout could do: on published runs of dense models on "
               "H100 and A100 GPUs the planner predicts faster steps (higher MFU) than were measured; "
               "'How far to trust these numbers' below has the errors.")


@st.cache_data(show_spinner=False, max_entries=32)
def _leanest(case):
    """The layout of `case`'s free fields needing the least memory per chip (planner.api.leanest); None where no
    layout divides the model and the batch (the sidebar's tp may be wider than the search's scale-up domain)."""
    try:
        return leanest(case)
    except SpecError:
        return None


def either(items: list[str]) -> str:
    """"a", "a or b", "a, b or c"."""
    return ", ".join(items[:-1]) + (" or " if len(items) > 1 else "") + items[-1]


def no_fit_advice(shown, others_fit: bool, untried: list[str]) -> str:
    """What could make the layout `shown` (an estimate that does not fit) fit, and nothing that cannot: another
    layout of these chips where one fits (`others_fit`; `untried`: what the sidebar's mesh leaves to try), more
    chips, a chip whose HBM holds `shown` (Estimate.fits_on), a smaller batch where the weights, gradients and
    optimizer state alone fit (the batch moves only the activations: 16 bytes a parameter of Llama 3 405B on one
    chip fit no batch)."""
    fixes = ["more chips"]
    bigger = [k for k in shown.fits_on if CHIPS[k].hbm_bytes > chip.hbm_bytes]  # as the sidebar lists them
    if bigger:
        fixes.append(f"a chip with more HBM ({', '.join(bigger[:3])}{' or another' if len(bigger) > 3 else ''})")
    held = shown.memory.as_dict()
    states = held["total"] - held["activations"]
    usable = usable_hbm_bytes(shown.result.chip)
    if states <= usable and global_batch > default_global_batch(spec.seq_len, data_ranks, TOKENS_PER_BATCH[0]):
        fixes.append("a smaller batch")
    words = (f"Another layout of these {n:,} chips fits: try "
             + (f"{either(untried)} in the sidebar's mesh, or " if untried else "")
             + f"let the planner choose; or use {either(fixes)}.") if others_fit else f"Use {either(fixes)}."
    if states > usable:
        words += (f" The weights, gradients and optimizer state alone take {states / 1e9:,.0f} GB per chip here, "
                  "whatever the batch.")
    return words


if not est.fits:
    usable = usable_hbm_bytes(est.result.chip)
    if mode.startswith("my"):
        # what the sidebar's mesh could still change; ZeRO shards nothing over one data-parallel rank
        untried = [what for what, used in (("ZeRO-3", lay.zero_stage == 3 or lay.dp * lay.cp == 1),
                                           ("more tp", lay.tp >= chip.scaleup_domain), ("pp", lay.pp > 1),
                                           ("full recomputation", lay.recompute == "full"))
                   if not used]
        # one chip has one layout; else whether any layout of these chips fits (the planner's leanest)
        advice = no_fit_advice(est, n > 1 and getattr(_leanest(search_case), "fits", False), untried)
    else:  # the planner's choice is the leanest layout of these chips already
        advice = f"No layout of {count(n, 'chip')} fits. {no_fit_advice(est, False, [])}"
    st.warning(f"This layout needs {mem['total'] / 1e9:,.1f} GB per chip, more than the "
               f"{usable / 1e9:,.1f} GB of {chip.name}'s {chip.hbm_bytes / 1e9:,.0f} GB it can use (the runtime, "
               f"communication buffers and fragmentation take about {1 - USABLE_HBM_FRACTION:.0%}). {advice}")


@st.cache_data(show_spinner=False, max_entries=32)
def _assumptions(case, _est):
    """The estimate's unstated recipe fields, each other value simulated on the same layout (planner.api), and the
    span of steps they give. Keyed on the case: `_est` is its estimate."""
    found = assumptions(case, _est)
    return found, step_time_band_s(_est, found)


found, (fastest, slowest) = _assumptions(case, est)
if found:
    with st.expander("What the unstated recipe is worth"):
        fields = sorted({a.field for a in found})
        st.markdown(
            f"The case states the model, the chips and the batch; how the framework runs it ({len(fields)} recipe "
            "fields here: attention kernel, overlaps, fused kernels, precision of the gradients, ...) it leaves "
            "to the planner, which takes what a current framework does. Each other value, one at a time on this "
            f"same layout, moves the predicted step between **{format_step(fastest, est.step_time_s)}** and "
            f"**{format_step(slowest, est.step_time_s)}** "
            f"({fastest / est.step_time_s - 1:+.0%} to {slowest / est.step_time_s - 1:+.0%}"
            + ("; values that would not fit in memory are in the table, not in that span"
               if est.fits and any(not a.fits for a in found) else "")
            + "): a run that states how it was executed can be predicted more closely than one that does not.")
        moving = [a for a in found if abs(a.change) >= SAME_STEP]
        # "assumed → instead" in one column: six did not fit the 434 px expander at 800 px, "fits" out of view
        text_table([{"field": a.field.removeprefix("training."),
                     "assumed → instead": f"{word(a.assumed)} → {word(a.alternative)}",
                     "step instead": format_step(a.step_time_s, est.step_time_s),
                     "change": f"{a.change:+.1%}", "fits": "yes" if a.fits else "no"} for a in moving])
        idle = sorted({a.field.removeprefix("training.") for a in found if abs(a.change) < SAME_STEP}
                      - {a.field.removeprefix("training.") for a in moving})
        if idle:
            st.caption(f"Making no difference to this step (under {SAME_STEP:.2%}): {', '.join(idle)}.")

st.subheader("Why it costs what it does")
st.markdown("\n".join(f"- {line}" for line in est.explanation))

# One under the other: side by side, half the page cut the breakdown's longest label ("data-parallel sync
# (reduce-scatter, weight gather)") at its left edge and laid the memory legend on its axis title.
st.plotly_chart(memory_figure(mem, usable_hbm_bytes(est.result.chip)), key="planner_memory")
st.plotly_chart(breakdown_figure(est.breakdown, est.step_time_s, zero_stage=est.layout.zero_stage),
                key="planner_breakdown")

timeline = est.timeline
st.plotly_chart(timeline_figure(timeline, title="Predicted timeline of one step (one chip per pipeline stage)",
                                animate=len(timeline.spans) <= MAX_ANIMATED_SPANS, rows_by_kind=True),
                key="planner_timeline")
st.caption("One row per kind of work on each stage's chip: forward and backward passes, each collective "
           "(hidden ones overlap the compute rows, exposed ones add to the step), the optimizer and pipeline "
           "bubbles; the same span format as the live engine's measured timelines. Hover a bar for its name, "
           "timing, micro-batch and, for a collective, its bytes where the planner counts them. Drawn here: "
           f"{DRAWN[timeline.meta['drawn']]}."
           + (f" With up to {densest:,} bars in one row, each is narrower than a pixel and a row that alternates "
              "with another (forward with backward) looks solid: drag across the chart to zoom in and see them "
              "apart." if (densest := densest_row(timeline)) > FINE_BARS else ""))

show_exercises([training_state_chips(total_params(spec), spec.name, chip)])

(fitted_n, fitted_mean, fitted_max), (held_n, held_mean, held_max), held_errors, sweep, by_ckpt = _accuracy()
fast = [e for e in held_errors if e < 0]
with st.expander("How far to trust these numbers"):
    st.markdown(
        f"Step time predicted against published training runs: **{fitted_n} Megatron-LM runs on A100** "
        f"(2021-22): mean error {fitted_mean:.1%}, worst {fitted_max:.1%}; **{held_n} other published runs** "
        f"(H100, H200, B200, GB200, A100, TPU v4-v6e; dense and MoE; planner/data/heldout-runs.json, no "
        f"constant chosen on them): mean error {held_mean:.1%}, worst {held_max:.1%}. {len(fast)} of the "
        f"{held_n} come out faster than published (by up to {-min(held_errors):.0%}), "
        f"{held_n - len(fast)} slower (by up to {max(held_errors):.0%}). It is too optimistic above all for "
        "GPU runs of 2021-24, of PyTorch-native stacks and with experts (MoE): its kernel rates are today's best "
        "benchmarks and it hides what the framework says it overlaps; NeMo's 2025 dense runs and MaxText's come "
        f"closest. On llm-foundry's own throughput tables ({sweep[0]} runs of its MPT models under FSDP on "
        f"{sweep[3]} to {sweep[4]} H100s or A100s) the mean error is {sweep[1]:.1%}, worst "
        f"{sweep[2]:.1%}; on average the predicted step is {_than_measured(by_ckpt[True])} for runs with "
        f"activation checkpointing, {_than_measured(by_ckpt[False])} for runs without it. `bench/bench_planner.py` "
        "prints every run and the error by source. Read its step times as the best this layout could do, and "
        "compare layouts with each other rather than with a cluster's stopwatch.")
    gpu_rows, gpu_words = _gpu_steps()
    st.markdown(
        "**Checked on a real GPU, kernel by kernel.** One H200 ran single-GPU training steps of three models in "
        "PyTorch, one of them at two sequence lengths (`bench/bench_gpu_step.py`); each step's kernels were "
        "traced and summed by class, beside the planner's prediction of the same step (the class columns: traced "
        f"/ predicted ms). {gpu_words} In the GPT rows the memory-bound column is high: the bench runs a rotary "
        "embedding there that the planner's GPT recipe does not have. What one GPU cannot show is the rest of a "
        "cluster: communication, waiting on the slowest GPU, the framework's own time.")
    # two tables: the eight columns in one ran past the 434 px expander at 800 px even wrapped
    step, whole = next(iter(gpu_rows[0])), ("measured ms", "predicted ms", "error")
    text_table([{k: row[k] for k in (step, *whole)} for row in gpu_rows])
    st.caption("Each step's kernels by class, traced / predicted ms, and the share of the step the GPU sat idle:")
    text_table([{k: v for k, v in row.items() if k not in whole} for row in gpu_rows])

    within, above, below, runs = _held_out_bands()
    st.markdown(
        "**What the unstated recipe explains.** Written as an unseen run is written (its attention kernel stated, "
        "every other recipe field left to the planner), the published step of the held-out runs lies within the "
        f"span of their unstated fields (each field's other values, one at a time, on the same layout: the table "
        f"'What the unstated recipe is worth' above) in **{within} of {runs}**; {above} ran slower than the slowest "
        f"of those predictions, {below} faster than the fastest. So the planner's misses are not only its guesses "
        "of the recipe.")

    ab_words = "; ".join(
        f"{ab.label}: measured **{ab.measured_gain:+.0%}**, predicted **{ab.predicted_gain:+.0%}**"
        for ab in _feature_ab())
    st.markdown(
        "**Checked against published A/Bs.** The same run measured with one recipe field off and on "
        f"(planner/data/feature-ab.json), the throughput the field gains: {ab_words}. The expert all-to-all "
        "overlap (`ep_comm_overlap`) hides more in the planner than in these runs, so read its gain as an upper "
        "bound.")

st.header("Search every layout")
st.markdown(
    f"""
The search enumerates every way to factor {count(n, 'chip')} into dp x tp x pp x cp (in Megatron-LM's notation, where
ep is carved from the dp ranks, or with whole experts, etp 1, from tp x cp x dp; the sidebar's mesh keeps ep an
axis of its own), with each ep, ZeRO stage,
micro-batch size, recomputation choice and pipeline schedule; drops what does not divide the model or does not
fit in memory; and ranks the rest by simulated step time. The space is small enough
to cover completely (no sampling, unlike learned or heuristic searches), with branch and bound to skip
layouts that cannot enter the top {top}.
"""
)
if st.button("Find the fastest layouts", type="primary"):
    with st.spinner("Searching ..."):
        st.session_state["planner_search"] = (search_case, top, search(search_case, top=top))
searched_case, searched_top, report = st.session_state.get("planner_search", (None, None, None))
if report is not None and (searched_case, searched_top) != (search_case, top):
    # the sidebar, the batch or the count moved since: the results were another setup's (they had stayed, under
    # this one's heading)
    del st.session_state["planner_search"]
    report = None
    st.caption("The setup changed since the last search: press the button to search this one.")
if report is not None:
    st.caption(f"{search_counts(report)} ({spec.name} on {n:,} x {chip.name}). Equal step times are ranked by "
               "memory per "
               "chip, then by fewer chips in model-parallel groups (tp x pp x cp): the simpler layout first.")
    if report.ranked:  # an empty table had been drawn above "No layout fits"
        search_table(report, by_axis=True)
    for i, r in enumerate(report.ranked, start=1):
        with st.expander(f"#{i}: why", expanded=i == 1):
            st.markdown("\n".join(f"- {line}" for line in r.explanation))
    if not report.ranked:
        lean = _leanest(search_case)
        st.warning(f"No layout of {count(n, 'chip')} fits in memory. {no_fit_advice(lean, False, [])}"
                   if lean is not None else f"No layout of {count(n, 'chip')} divides the model and the batch: "
                   "change the mesh's chip count in the sidebar or the batch above.")
