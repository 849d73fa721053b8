"""Lesson: Transformer vs Mamba. The Mamba-2 block and its scan, FLOPs per token as the sequence grows, what
each strategy moves per layer, the planner's fastest layout for each architecture on the sidebar's chips,
and live runs of both with context parallel done three ways."""

import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.live_panel import run_live, show_live
from app_pages.text_table import text_table
from engine.cli import COMMAND
from engine.config import ConfigError  # torch-free: the page checks the input before any worker starts
from hardware.chips import CHIPS
from planner.case import Cluster
from planner.models import SpecError
from planner.presets import default_global_batch
from ui.exercises import attention_crossover, state_passing_chain
from ui.live import LIVE_STEP_CHOICES, LIVE_STEPS
from ui.mamba import (
    LIVE_VARIANTS,
    SEQ_LENS,
    best_rows,
    comm_rows,
    flops_figure,
    lesson_models,
    live_argv,
    live_findings,
    live_rows,
    model_rows,
    position_embedding_note,
    seq_label,
    why_they_differ,
)
from ui.tables import batch_words, shell_lines

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]
mesh = choices.mesh

st.title("Transformer vs Mamba")
st.markdown(
    r"""
A Transformer layer mixes positions with **attention**: every token looks at every earlier token, so the
work per token grows with the sequence length S, and each chip must see the keys and values of all earlier
positions. A **state-space model** mixes positions through a fixed-size **state** carried along the
sequence instead. Mamba-2 (Dao & Gu 2024, "Transformers are SSMs") does it per head h, with P channels
per head and a state of N numbers per channel:
"""
)
# the decay on a line of its own: on one line the three ran past the page's right edge in a narrow window
st.latex(r"\begin{gathered}h_t = a_t\,h_{t-1} + \Delta_t\, x_t B_t^{\top}, \qquad y_t = h_t\,C_t + D\,x_t, \\"
         r"a_t = e^{\Delta_t A}\in(0,1)\end{gathered}")
st.markdown(
    """
Here x_t is the token's input to the head (P numbers), B_t and C_t (N numbers each) say what the token
writes into the state and reads out of it, and Δ_t (how much this token matters) and the decay a_t are
computed from the token itself: the state forgets selectively. The state h_t is a P x N matrix per head,
**the same size at position 10 and at position 1,000,000**: no K/V cache that grows with S.

The layer around it: the token's vector goes through five projections (z, x, B, C, Δ), a short causal
convolution over the last 4 positions, the scan above, a norm gated by z, and one output projection.
Heads share B and C in **groups** (G groups of H/G heads), which matters for tensor parallel below. A
Mamba-2 model has no MLP: a layer is just norm, this mixer, and the residual, so it takes about twice as
many layers as a Transformer of the same size.

**The chunked scan (SSD).** Run step by step, the recurrence is S small sequential updates: slow on a
GPU. Mamba-2's SSD algorithm cuts the sequence into chunks of Q positions (Q = 256 in Mamba-2): inside a
chunk the outputs are a small masked Q x Q matmul, attention-like; between chunks only the state is
carried. Matmul-shaped work, and per token it depends on Q, **not on S**: linear in the sequence
where attention is quadratic.
"""
)

st.header("Same size, two architectures")
seq_len = st.select_slider("Sequence length S", SEQ_LENS, value=32768, format_func=seq_label, key="ssm_seq_len",
                           bind="query-params")
specs = lesson_models(seq_len)
st.markdown(
    """
GPT-3 2.7B (Brown et al. 2020, Table 2.1), Mamba-2 2.7B (the released state-spaces/mamba2-2.7b) and a
hybrid of this lesson's own: Mamba-2 2.7B with every eighth layer attention (12.5 %, near the tenth of
attention layers Dao & Gu found best in their hybrids, sec. 9.2.3), and 8 groups of SSM heads (as NVIDIA's
Nemotron-H has) so that tensor parallel can split it.
"""
)
text_table(model_rows(specs, seq_len))
if note := position_embedding_note(specs[0]):
    st.caption(note)
st.plotly_chart(flops_figure(specs, SEQ_LENS), key="ssm_flops")
st.caption("Forward FLOPs per token (planner/flops.py; attention's scores over the full S x S square, the "
           "convention of Narayanan et al. 2021). Dotted: the part that mixes positions, attention's "
           "Q·Kᵀ and P·V or the scan and conv. Training costs about 3x the forward.")

st.header("What each strategy moves, per layer")
tp, cp, dp = mesh.get("tp", 1), mesh.get("cp", 1), mesh.get("dp", 1)
unset = [name for name, degree in (("tp", tp), ("cp", cp)) if degree == 1]
hint = f" Set {' or '.join(unset)} above 1 in the sidebar to see {'them' if len(unset) > 1 else 'it'}." if unset else ""
st.markdown(
    f"""
For the sidebar's mesh (tp = {tp}, cp = {cp}, dp = {dp}) on {chip.name}, one layer, one sequence of
S = {seq_len:,}, in bf16 (the SSM states in fp32, and the gradients summed over dp in fp32, as Megatron-Core sums
a bf16 model's), counted as what the busiest chip sends.{hint}

- **Tensor parallel** splits a Mamba-2 layer by heads (Dao & Gu sec. 8): z, x and Δ by heads, B and C by
  groups, so **each rank must hold whole groups**, and then the conv, the scan and the group-wise norm need
  nothing from the other ranks. One all-reduce leaves the layer (after the output projection), one enters
  it in backward: **half** a Transformer layer's two (attention's and the MLP's). Mamba-2 2.7B has a single
  group: it cannot be split at all.
- **Context parallel by state passing**: every rank scans its slice of the sequence from a zero state,
  in parallel; then the final states travel rank to rank in sequence order, each rank adding its own
  slice's state to the one it received, and each rank corrects its outputs with the state that came in.
  One small P x N state per head per hop, but **cp − 1 hops one after the other**: rank r waits for r − 1
  (2(cp − 1) in the hybrid, whose slices are zig-zagged for its attention layers: out and back).
  Backward sends the states' gradients the other way. (The conv's last 3 inputs also cross each boundary.)
- **Context parallel by all-to-all** (as DeepSpeed-Ulysses does for attention): switch from "all heads, a
  slice of the sequence" to "H/cp heads, the whole sequence", scan, switch back. Two all-to-alls each way
  (x, B, C and Δ in, y out), no chain. As ShardLab's engine runs it, tp x cp must divide the heads and the
  groups; Megatron-Core's also moves the gate z and repeats B and C when cp exceeds the groups.
- **Ring attention** (the context-parallel lesson) sends K/V blocks around the ring, overlapped with the
  attention blocks they meet.
"""
)
moved_rows = comm_rows(specs, tp, cp, dp, chip.key)
if moved_rows:
    text_table(moved_rows)
    st.caption("From the planner's own records of each operation (planner/costs.py). Operations count a ring's "
               "steps and a chain's hops one after the other; state passing's are the chain's cp − 1 hops (2(cp − "
               "1) zig-zagged) plus one exchange of the conv's last inputs across the boundaries, each way; "
               "bytes are what the busiest chip sends (the "
               "chain's hops run on different chips: one state per chip, two in the hybrid's zig-zag; an "
               "all-reduce sends 2 (n − 1)/n of its buffer, an all-to-all (n − 1)/n); time at the link's "
               "achievable bandwidth, before overlap.")
else:
    st.info("On one chip (tp = cp = dp = 1) nothing moves between chips: set tp, cp or dp above 1 in the sidebar.",
            icon=":material/info:")

st.header("The fastest layout for each")
n = choices.num_chips
st.markdown(
    f"""
The planner searches every layout of the sidebar's **{n:,} {chip.name}** for each model at S = {seq_len:,},
{batch_words(seq_len, n)}, and keeps the fastest that fits in memory (a few seconds for the three models).
"""
)
setup = (seq_len, chip.key, n)
if st.button("Search the fastest layout of each", key="ssm_search", type="primary"):
    from planner.api import compare_architectures

    batch = default_global_batch(seq_len, n)
    with st.spinner("Searching the layouts of each model ..."):
        try:
            # the same search for the same setup (a class opens the same page): computed once per server
            search_all = st.cache_data(compare_architectures, max_entries=64, show_spinner=False)
            st.session_state["ssm_search_results"] = (setup, search_all(specs, Cluster(chip.key, n),
                                                                        global_batch=batch))
        except SpecError as e:
            st.session_state.pop("ssm_search_results", None)
            st.warning(f"The planner cannot search this setup: {e}.")
found = st.session_state.get("ssm_search_results")
if found is not None and found[0] == setup:
    results = found[1]
    text_table(best_rows(results, specs, n))  # seven columns wrap: a grid had hidden "exposed comm" at 1,400 px
    st.caption("MFU (model FLOPs utilisation): the model's FLOPs per second over all the chips' peak. Here "
               "attention's scores count over the causal half (what a causal kernel computes); the planner "
               "page's MFU counts the full square, which overstates long-context Transformers.")
    st.markdown("\n".join(f"- {line}" for line in why_they_differ(results, specs, seq_len)))
elif found is not None:
    st.caption("The sequence length or the sidebar changed since the last search: search again.")

show_exercises([attention_crossover(specs[0]), state_passing_chain(specs[1], cp if cp > 1 else 4)])

st.header("Run it for real")
st.markdown(
    """
Below, the live engine trains a small Transformer and a small Mamba-2 model (`engine/mamba.py`, the chunked
scan above in plain torch) on **real processes of this machine**, each with context parallel over all
ranks: the Transformer with ring attention, Mamba-2 with state passing and with the all-to-all
(`engine/ssm_cp.py`). Each is checked against one process training the whole sequence. In the timelines,
look at the state passing's `send state` / `recv state`: the last rank cannot correct its outputs until
every rank before it has passed its state on.
"""
)
c1, c2 = st.columns(2)
world = c1.select_slider("Processes (cp)", [2, 4], value=2, key="ssm_live_world")
steps = c2.select_slider("Optimizer steps", LIVE_STEP_CHOICES, value=LIVE_STEPS, key="ssm_live_steps")
st.code(shell_lines("\n".join(f"{COMMAND} " + " ".join(live_argv(v, world, steps)) + " --check"
                              for v in LIVE_VARIANTS)), language="bash", wrap_lines=True)
try:
    from engine.cli import config_from_args, run_parser

    parser = run_parser("python -m engine run")
    configs = {v: config_from_args(parser.parse_args(live_argv(v, world, steps))) for v in LIVE_VARIANTS}
except ConfigError as e:
    configs = None
    st.error(f"This run cannot start: {e}.", icon=":material/block:")
if st.button("Run all three on this machine", type="primary", disabled=configs is None, key="ssm_live_run"):
    run_live("live_ssm", list(configs.items()), hint="try 2 processes or fewer steps")
live = show_live("live_ssm")
if live:
    text_table(live_rows(live), columns_from="run")
    st.markdown("\n".join(f"- {line}" for line in live_findings(live)))
    st.markdown(
        """
What to expect, and why: ring attention can send the next K/V block **while** the current block's
attention computes; state passing cannot send a state before the scan that makes it is done, so nothing
hides it, and the last rank waits for every hop before it; the all-to-all moves the layer's activations,
all ranks at once, with nothing to overlap either. On a few shared CPU cores the times are indicative
(the processes take turns on the cores); the counts and bytes are exact.
"""
    )
