"""Lesson 1: Hardware & roofline."""

import streamlit as st
from plotly import colors as plotly_colors

from app_pages.exercise_panel import show_exercises
from app_pages.live_panel import run_task
from app_pages.metric_row import metric, metric_row
from engine.predict import cached_calibration
from hardware.chips import CHIPS
from hardware.roofline import matmul_cost
from hardware.this_machine import summary_lines
from ui.charts import OperatingPoint, RooflineSeries, roofline_figure
from ui.exercises import compute_bound_tokens, ridge_point
from ui.tables import CHIP_COLUMN_HELP, chip_table_rows, count, format_bytes, format_flops, format_seconds

POW2_SIZES = [2**i for i in range(0, 17)]  # 1 .. 65,536
DTYPES = ["bf16", "fp16", "fp8"]

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]

st.title("Hardware & roofline")
st.markdown(
    """
Three numbers decide almost everything in this guide:

- **C**, how many floating-point operations per second (FLOP/s) a chip's matrix units do;
- **W_hbm**, how many bytes per second its memory (HBM) delivers to them;
- **W_link**, how many bytes per second it can send to other chips (NVLink / ICI inside a node or
  slice, InfiniBand / data-centre network beyond).

Every operation needs both arithmetic and data. Whichever takes longer sets the time, because the
chip overlaps the two when it can.
"""
)

st.header("The chips side by side")
st.caption("Dense (no sparsity) peak numbers from the vendors' datasheets; bandwidths per direction. "
           "Hover a column name for its meaning; the sources are listed below the table.")
# every chip without scrolling (it had shown ten of them), and the chip's name pinned: at 1,280 px the last
# column (the scale-up domain) is reached by scrolling sideways, and the names stay beside it
st.dataframe(chip_table_rows(CHIPS.values()), hide_index=True, width="stretch", height="content", column_config={
    "Chip": st.column_config.Column(pinned=True),
    # fp8 is text (a dash where a chip has none): aligned as the numbers beside it
    # the domain's words ("16x16x16 torus, 6 links per chip") wide enough to read once scrolled to
    **{name: st.column_config.Column(help=text, alignment="right" if name == "fp8 TFLOP/s" else None,
                                     width="large" if name == "Scale-up domain" else None)
       for name, text in CHIP_COLUMN_HELP.items()}})
with st.expander("Sources for every number"):
    for c in CHIPS.values():
        st.markdown(f"**{c.name}**")
        st.markdown("\n".join(f"- `{field}`: {src}" for field, src in c.sources.items()))

st.header("Arithmetic intensity and the roofline")
st.markdown("Take the matmul at the heart of every Transformer layer: a batch of **B** tokens of width "
            "**D** multiplied by a weight matrix of **D x F**. In scaling-book notation, "
            "`In[B, D] . W[D, F] -> Out[B, F]`.")
# Each formula on a line of its own: side by side they ran past the page's right edge in a narrow window. The
# times in two boxes: a second line in the box of the fractions cut their tops.
st.latex(r"\begin{gathered}\text{FLOPs} = 2BDF \\"
         r"\text{bytes} = p\,(BD + DF + BF) \quad (p = \text{bytes per number})\end{gathered}")
st.latex(r"T_\text{math} = \frac{\text{FLOPs}}{C} \qquad T_\text{mem} = \frac{\text{bytes}}{W_\text{hbm}}")
st.latex(r"T \approx \max(T_\text{math},\, T_\text{mem})")
st.markdown("Divide the two: the chip is **compute-bound** exactly when the **arithmetic intensity** "
            "of the operation beats the chip's own ratio, the **ridge point**:")
st.latex(r"I = \frac{\text{FLOPs}}{\text{bytes}} \;>\; I^{*} = \frac{C}{W_\text{hbm}}")
st.markdown("For a weight matrix much larger than the batch (D, F >> B) in bf16, "
            r"$I \approx \frac{2BDF}{2DF} = B$: **the batch size in tokens is the intensity**. "
            "Below the ridge the matrix units wait for memory; above it memory waits for them.")

left, right = st.columns([1, 2])
with left:
    tokens = st.select_slider("Tokens in the batch (B)", POW2_SIZES, value=128, key="tokens",
                              bind="query-params",
                              help="Rows of the input: batch size x sequence length handled at once.")
    d_model = st.select_slider("Input width (D)", POW2_SIZES[6:], value=4096, key="d_model",
                               bind="query-params")
    d_ff = st.select_slider("Output width (F)", POW2_SIZES[6:], value=4096, key="d_ff", bind="query-params")
    dtype = st.radio("Number format", DTYPES, horizontal=True, key="dtype", bind="query-params")
    # wrap: in this narrow column a one-line label was cut to "Achievable instea..."
    achievable = st.toggle("Achievable instead of spec", key="achievable", bind="query-params", wrap=True,
                           help="Datasheet peaks are never reached. Achievable numbers are what large "
                                "matmuls and copies really get (sources in the chip table).")
with right:  # above the chart it picks for: in the narrow column its chips were cut to "A100 80G..."
    # wrap: in a column the chips would stay on one scrolling row, hiding the third
    # in the link too (the chips' keys), so a shared view compares the same chips
    compare = st.multiselect("Compare with", [k for k in CHIPS if k != chip.key],
                             default=[k for k in ("a100-80gb", "b200", "tpu-v5e") if k != chip.key],
                             format_func=lambda k: CHIPS[k].name, wrap=True, key="compare", bind="query-params")

if dtype not in chip.dtypes:
    st.warning(f"{chip.name} has no {dtype} matrix units, so this uses bf16. It supports: "
               f"{', '.join(chip.dtypes)}." + (" For fp8 pick a chip such as H100, H200 or B200."
                                               if dtype == "fp8" else ""))
    dtype = "bf16"

cost = matmul_cost(tokens, d_model, d_ff, dtype, chip, achievable=achievable)
# each chip its colour by its place in the chip table, this machine one of its own (green): a chip had kept
# its colour only while the chips before it in "Compare with" stayed
MACHINE_COLOR = "#1CA71C"
_chip_palette = [c for c in plotly_colors.qualitative.Dark24 if c != MACHINE_COLOR]
chip_color = {key: _chip_palette[i % len(_chip_palette)] for i, key in enumerate(CHIPS)}
series = [RooflineSeries(f"{chip.name} ({dtype})", chip.peak_flops_per_s(dtype, achievable),
                         chip.hbm_bw(achievable), highlight=True, color=chip_color[chip.key])]
skipped = []
for key in compare:
    other = CHIPS[key]
    if dtype not in other.dtypes:
        skipped.append(other.name)
        continue
    series.append(RooflineSeries(other.name, other.peak_flops_per_s(dtype, achievable), other.hbm_bw(achievable),
                                 color=chip_color[key]))
if "probe" not in st.session_state:  # a calibration already cached on this machine: no need to measure
    cached = cached_calibration()
    if cached is not None:
        st.session_state["probe"] = cached.probe_result()
        st.session_state["calibration_lines"] = summary_lines(cached)
probe = st.session_state.get("probe")
if probe is not None:
    series.append(RooflineSeries("This machine (CPU, fp32, measured)", probe.matmul_flops_per_s,
                                 probe.memory_bytes_per_s, color=MACHINE_COLOR))
point = OperatingPoint(f"B={tokens}, D={d_model}, F={d_ff}", cost.intensity, cost.achieved_flops_per_s)
kind = "achievable" if achievable else "spec"

with right:
    roofline = roofline_figure(series, [point], title=f"Roofline ({kind})")
    # the legend names the star: written beside it, the label lay across the other chips' lines
    roofline.update_traces(mode="markers", selector={"name": point.label})
    st.plotly_chart(roofline, key="roofline")
    if skipped:
        st.caption(f"Not drawn (no {dtype} matrix units): {', '.join(skipped)}.")

verdict = f"{cost.bound}-bound"
with metric_row():
    metric("Arithmetic intensity", f"{cost.intensity:,.1f} FLOP/B")
    metric(f"Ridge point ({chip.name})", f"{cost.ridge:,.1f} FLOP/B")
    metric("Time", format_seconds(cost.time_s))
    metric("Bound by", cost.bound)
st.markdown(
    f"On **{chip.name}** ({kind} numbers, {dtype}) this matmul does {format_flops(cost.flops)} and moves "
    f"{format_bytes(cost.bytes)}: {format_seconds(cost.compute_s)} of math against {format_seconds(cost.memory_s)} "
    f"of memory traffic, so it is **{verdict}** and reaches {cost.achieved_flops_per_s / 1e12:,.1f} TFLOP/s "
    f"of the {chip.peak_flops_per_s(dtype, achievable) / 1e12:,.0f} available."
)
if cost.bound == "memory":
    needed = next((b for b in POW2_SIZES
                   if matmul_cost(b, d_model, d_ff, dtype, chip, achievable=achievable).bound == "compute"), None)
    if needed is None:
        st.info(f"With D={d_model} and F={d_ff} no batch up to {POW2_SIZES[-1]:,} tokens makes this matmul "
                f"compute-bound on {chip.name}: the weights are too small to be reused enough. "
                "Make D and F larger.")
    else:
        lo, hi = needed // 2, needed  # the smallest batch that is compute-bound lies in (lo, hi]: bisect
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if matmul_cost(mid, d_model, d_ff, dtype, chip, achievable=achievable).bound == \
                "compute" else (mid, hi)
        st.info(f"Batch at least **{hi:,} tokens** ({needed:,} in the powers of two the slider steps through) to "
                f"cross the ridge on {chip.name}. This is why training uses large batches per chip, and why "
                "decoding one token at a time is memory-bound.")

st.subheader("Spec versus achievable")
st.markdown(
    """
Datasheet numbers are upper bounds. Real matmuls reach a fraction of peak FLOP/s (tile shapes,
clock throttling under power limits, kernel launch gaps), and real copies a fraction of peak
bandwidth. The fractions used here are stated, with their sources, per chip; the toggle above
redraws every roofline with them. The planner uses the achievable numbers, never the spec.
"""
)

show_exercises([ridge_point(chip, dtype, achievable), compute_bound_tokens(chip, d_model, d_ff, dtype, achievable)])

st.header("Measure this machine")
st.markdown(
    "The same two numbers for the computer running ShardLab: fp32 and bf16 matmuls give **C**, and "
    "copying a large array gives **W** (bytes read plus bytes written), measured on one of the engine's "
    "ranks. They are part of one calibration of this machine that the live lessons also use to predict "
    "every run (each module of the engine, every gloo operation, how the cores are shared): measured once, "
    "in about 25 s for 2-process runs (a 4-process run measures about 45 s more the first time it comes), and "
    "kept in your cache folder for 30 days. Its roofline joins the chips in the chart above."
)
# as wide as its words (in a quarter-width column, 109 px at 800, it had read "Measure ag...")
measure = st.button("Measure this machine" if probe is None else "Measure again", type="primary", width="content")
task = None
if measure:
    from engine.predict import ensure_calibration
    from server.queue import Task

    def calibrate(progress, stop, remeasure=probe is not None):
        return ensure_calibration([2], remeasure=remeasure, progress=progress, stop=stop)

    task = Task("calibration:2", 2, calibrate, calibrates=True)
# followed on every run of the page: a widget moved while the measurement waits or runs does not lose it
done = run_task("Measuring this machine", task, what="measurement", hint="close other programs and measure again")
if done is not None:
    cal, _messages = done
    st.session_state["probe"] = cal.probe_result()
    st.session_state["calibration_lines"] = summary_lines(cal)
    st.rerun()
if probe is not None:
    with metric_row():
        metric("Matmul (fp32)", f"{probe.matmul_flops_per_s / 1e9:,.1f} GFLOP/s")
        metric("Memory bandwidth", f"{probe.memory_bytes_per_s / 1e9:,.2f} GB/s")
        metric("Ridge point", f"{probe.matmul_flops_per_s / probe.memory_bytes_per_s:,.1f} FLOP/B")
    ratio = chip.peak_flops_per_s("bf16") / probe.matmul_flops_per_s
    st.markdown(f"{chip.name} does {ratio:,.0f} times more bf16 FLOP/s than this machine's fp32 matmuls on "
                f"{count(probe.threads, 'thread')}, as one rank of the live engine runs them.")
    with st.expander("How it was measured, and the rest of the calibration"):
        st.markdown("\n".join(f"- {line}" for line in probe.details + st.session_state.get("calibration_lines", [])))
