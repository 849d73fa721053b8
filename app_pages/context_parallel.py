"""Lesson: context parallel. The sequence split over chips, the causal load balance (zig-zag), ring attention
step by step with the log-sum-exp merge, when the ring hides under the compute on real chips, and live
ring / all-gather runs on this machine."""

import numpy as np
import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.link_params import follow_sidebar
from app_pages.live_panel import run_live, show_live
from app_pages.text_table import text_table
from engine.cli import COMMAND
from engine.config import ConfigError  # torch-free: the page checks the input before any worker starts
from hardware.chips import CHIPS
from planner.costs import cluster_chip
from planner.memory import korthikanti_bytes
from planner.models import MODEL_PRESETS
from ui.collectives import markdown_text
from ui.context_parallel import (
    CP_DEGREES,
    SEQ_LENS,
    block_attention,
    causal_split_figure,
    imbalance,
    live_rows,
    merge_partials,
    overlap_figure,
    overlap_row,
    rank_work,
    ring_rows,
    seq_label,
)
from ui.exercises import ring_hiding_shard, ring_kv_held
from ui.live import LIVE_STEP_CHOICES, LIVE_STEPS
from ui.tables import count, format_bytes, format_flops, format_seconds, shell_lines


def live_config(world: int, seq_len: int, variant: str, steps: int = 1):
    """The RunConfig `python -m engine run --strategy cp --world W --seq-len S --cp-variant V --steps N
    --check` builds; raises engine.config.ConfigError (e.g. seq_len not divisible by 2*cp)."""
    from engine.cli import config_from_args, run_parser

    argv = ["--strategy", "cp", "--world", str(world), "--seq-len", str(seq_len), "--cp-variant", variant,
            "--steps", str(steps), "--check"]
    return config_from_args(run_parser("python -m engine run").parse_args(argv))

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]
spec = MODEL_PRESETS[choices.model]

st.title("Context parallel")
st.markdown(
    """
Every other strategy so far keeps each sequence whole on a chip. At long context that stops working:
the activations a layer keeps for its backward grow **linearly** with the sequence length S, and the
attention compute grows with **S²** (each of S queries looks at up to S keys). Long-context training
(128K tokens and beyond) splits the **sequence itself** over cp chips:
"""
)
# K and V on a line of their own: on one line the three ran past the page's right edge in a narrow window
st.latex(r"\begin{gathered}\text{In}[B, S_{cp}, D] \qquad Q[B, S_{cp}, H, d] \\"
         r"K, V[B, S, H_{kv}, d] \text{ needed by every chip}\end{gathered}")
sbh = korthikanti_bytes(spec.seq_len, 1, spec.hidden, spec.heads, 1, "tp+sp+selective")
st.markdown(
    f"""
Norms, projections, the MLP and the loss work token by token, so they need only the chip's own S/cp
tokens. Attention is the one place that mixes tokens: a query needs the keys and values of **every earlier
position**, which now live on other chips. So **K and V must visit every rank**. For {spec.name} at its
S = {spec.seq_len:,}, one sequence keeps about 34·s·h = **{format_bytes(sbh)}** per layer
(Korthikanti et al. 2022, selective recomputation) and {format_bytes(sbh * spec.layers)} over its
{spec.layers} layers; at 1M tokens that is {2**20 / spec.seq_len:.0f}x more, on one chip, before
weights and optimizer state.
"""
)

st.subheader("The causal mask makes a plain split unfair")
st.markdown(
    """
Cut the sequence into 2·cp equal chunks. With a **contiguous** split rank r gets chunks 2r and 2r+1; but
under the causal mask a query only looks **back**, so the first rank's queries see almost nothing and the
last rank's see everything. Each ring step waits for the slowest rank, so the whole ring runs at the
speed of the last one. The **zig-zag** (head-tail) split (Llama 3, Dubey et al. 2024 sec. 3.3.2;
Megatron-LM) gives rank i chunks **i and 2cp−1−i**, one early and one late, and every rank gets the same
work. Each block below is (S/2cp) queries x (S/2cp) keys, coloured by the rank that computes it:
"""
)
cp_pic = st.select_slider("cp for the picture", [2, 3, 4, 6, 8], value=4, key="cp_split", bind="query-params")
st.plotly_chart(causal_split_figure(cp_pic), key="cp_split_figure")
contiguous, zigzag = rank_work(cp_pic, "contiguous"), rank_work(cp_pic, "zig-zag")
st.markdown(
    f"""
Counting a diagonal block (half masked) as 1/2: with the **contiguous** split rank r computes
**4r + 2** blocks, from {contiguous[0]['work']:g} on rank 0 to {contiguous[-1]['work']:g} on rank
{cp_pic - 1}; the slowest does **{imbalance(cp_pic, 'contiguous'):.2f}x** the mean (2 − 1/cp). With
**zig-zag** every rank computes exactly **2·cp = {zigzag[0]['work']:g}** blocks ({zigzag[0]['full']} full and
2 diagonal): chunk i brings i + 1/2 blocks and chunk 2cp−1−i brings 2cp − i − 1/2, together 2cp for
every i. In tokens, with c = S/2cp per chunk: zig-zag (2cp − 1)·c² + c(c + 1) = 2cp·c² + c query-key
pairs on every rank, exactly.
"""
)

st.header("Ring attention, step by step")
st.markdown(
    f"""
Ring attention (Liu et al. 2023) arranges the cp ranks in a ring. At step 0 every rank attends its queries
to its **own** K/V block. Then, at step k, **rank r holds the K/V block of rank r − k** (mod cp): while it
computes attention against that block it already **sends the block on** to rank r + 1 and receives the next
one from rank r − 1, so after cp steps every query has seen every key. With the zig-zag split, every
step except the diagonal one is exactly **half a block** (all queries against the early half of an earlier
rank's keys, or the late half of the queries against all of a later rank's keys), and the masked diagonal
block leaves about as many query-key pairs, so the steps take the same time on every rank. For
cp = {cp_pic}, the block each rank holds at each step and the part of it the mask leaves to compute
(meanwhile it sends the block on to rank r + 1, except at the last step):
"""
)
text_table(ring_rows(cp_pic))
st.markdown(
    """
Each step gives a **partial** attention: a softmax over only one block of keys. They are merged exactly
with the online-softmax rule (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022 sec. 3.1). Keep
per query row the running max m of the scores, the sum l of exp(score − m), and the output o normalised
by l; a new block (m₂, l₂, o₂) merges as
"""
)
# o in a box of its own: on one line the three ran past the page's right edge in a narrow window (and a
# second line in the same box cuts the top of a fraction)
st.latex(r"m = \max(m_1, m_2), \qquad \ell = \ell_1 e^{m_1 - m} + \ell_2 e^{m_2 - m},")
st.latex(r"o = \frac{\ell_1 e^{m_1 - m}\, o_1 + \ell_2 e^{m_2 - m}\, o_2}{\ell}")
st.markdown(
    "The engine keeps one number per row instead of two, the **log-sum-exp** L = m + log ℓ, which "
    "reads the same:"
)
st.latex(r"\begin{gathered}L = \log\left(e^{L_1} + e^{L_2}\right), \\"  # one line ran past a narrow page
         r"o = e^{L_1 - L}\, o_1 + e^{L_2 - L}\, o_2\end{gathered}")
rng = np.random.default_rng(0)
q, k, v = rng.normal(size=(8, 16)), rng.normal(size=(12, 16)), rng.normal(size=(12, 16))
full, _, _ = block_attention(q, k, v)
merged, _, _ = merge_partials(*block_attention(q, k[:5], v[:5]), *block_attention(q, k[5:], v[5:]))
st.caption(f"Checked here with numpy: 8 queries against 12 random keys split 5 + 7 and merged, against "
           f"one softmax over all 12: largest difference {np.abs(merged - full).max():.1e}.")
st.markdown(
    """
The backward pass runs the ring again: each rank recomputes a block's probabilities from the saved L
(FlashAttention's backward), and the **dK, dV** of each block travel with it and end up at the block's
owner after a full turn. The live engine writes this by hand (`engine/cp.py`), because autograd cannot
differentiate through a send.
"""
)

st.header("When does the ring hide under the compute?")
st.markdown(
    """
One ring step sends one K/V block while computing one block of attention. With B sequences per chip,
H query heads and H_kv KV heads of width d, e bytes per value (bf16: 2), link bandwidth W (one direction)
and achievable FLOP/s F:
"""
)
# each formula under its name: beside it, the transfer's ran past the page's right edge in a narrow window
st.latex(r"""
\begin{array}{l}
\text{transfer of one block:} \\[0.4em]
\qquad T_{comm} = \alpha + T_{fill} + \dfrac{2 \cdot B \cdot \frac{S}{cp} \cdot H_{kv} \cdot d \cdot e}{W} \\[1.2em]
\text{attention of one step:} \\[0.4em]
\qquad T_{comp} = \dfrac{\tfrac12 \cdot 4 \cdot B \left(\frac{S}{cp}\right)^2 H\, d}{F}
\end{array}""")
st.markdown(
    """
α is the link's latency and T_fill the time a message spends filling the link's pipeline before it
flows at W, once per message (measured from NCCL's bandwidth curves: `Link.fill_s` in
hardware/collectives.py); for small blocks these two, not the bytes, decide. The 4·B·(S/cp)²·H·d are the
two matmuls Q·Kᵀ and P·V of a full block (2 FLOPs per multiply-add); the ½ is the causal mask with the
zig-zag split, where every off-diagonal step computes exactly half a block. The ratio of the bandwidth
term to the compute does not depend on B or d: the transfer **hides** (α and T_fill aside) when
"""
)
st.latex(r"\frac{S}{cp} \;\ge\; \frac{H_{kv}}{H} \cdot e \cdot \frac{F}{W}")
st.markdown(
    "Communication grows with S/cp and compute with (S/cp)², so a long enough shard always hides the ring; "
    "grouped-query attention (H_kv < H) makes the K/V blocks smaller still. Pick the degree and the length:"
)
c1, c2 = st.columns(2)
default_cp = choices.mesh["cp"] if choices.mesh["cp"] in CP_DEGREES else 8
follow_sidebar("cp_degree", default_cp)
cp = c1.select_slider("Context-parallel degree cp", CP_DEGREES, value=default_cp, key="cp_degree",
                      bind="query-params", help="Starts at the sidebar's cp, again whenever that changes.")
seq_len = c2.select_slider("Sequence length S", SEQ_LENS, value=131072, key="cp_seq_len", bind="query-params",
                           format_func=seq_label)
stride = choices.device_mesh().stride("cp")  # the cp group strides over the ep and tp ranks inside it
# the links of a job as large as the mesh (a TPU's slice: planner.costs.cluster_chip), for the row and its chart
job_chip = cluster_chip(chip, max(choices.num_chips, cp * stride), None)
row = overlap_row(spec, job_chip, cp, seq_len, stride=stride)
shard = seq_len // cp
if row["hidden"]:
    cover = row["compute_s"] / row["transfer_s"]
    verdict = f"The ring is **hidden** (compute covers the transfer {cover:.1f}x)."
else:
    verdict = (f"The ring is **exposed**: each of the cp − 1 = {cp - 1} steps waits "
               f"{format_seconds(row['transfer_s'] - row['compute_s'])}, "
               f"{format_seconds(row['ring_exposed_s'])} per layer's forward.")
st.markdown(
    f"""
For {spec.name} (H = {spec.heads}, H_kv = {spec.kv_heads}, d = {spec.head_dim_}) on {chip.name}, B = 1,
S = {seq_label(seq_len)}, cp = **{cp}** (group: {row['topology']}; members {count(stride, 'rank')} apart, past the
ep x tp ranks inside each, whole heads on each): each rank holds S/cp = **{shard:,}** tokens, a K/V block is
**{format_bytes(row['kv_block_bytes'])}** and takes **{format_seconds(row['transfer_s'])}** to pass on
(α {format_seconds(row['alpha_s'])} + T_fill {format_seconds(row['fill_s'])} + bytes/W
{format_seconds(row['bandwidth_s'])}), while its attention step computes {format_flops(row['block_flops'])} in
**{format_seconds(row['compute_s'])}**. {verdict} Threshold on this link: S/cp ≥
**{row['threshold_tokens']:,.0f}** tokens (the bytes alone; α and T_fill come on top).
"""
)
st.plotly_chart(overlap_figure(spec, job_chip, cp, seq_len, stride=stride), key="cp_overlap")
st.caption("Bandwidth W and latency α are those of the cp group's link in hardware/collectives.py at "
           "achievable efficiency; F is the attention kernel's rate at the shard's length (hardware/kernels.py). "
           "Tensor parallel inside the cp "
           "ranks would divide the heads, and so the bytes and the FLOPs of a step alike, by tp. The "
           "backward sends K/V again plus dK/dV (2x the bytes) against about 2.5x the compute "
           "(FlashAttention's 5 matmuls to 2), so it hides sooner; the planner (planner/costs.py) charges "
           "only what each pass cannot hide.")

st.subheader("The all-gather variant")
st.markdown(
    """
Instead of a ring, all-gather K/V once per layer and let every rank attend its queries to the whole
sequence (backward: reduce-scatter dK/dV). Llama 3 trains long context this way (Dubey et al. 2024
sec. 3.3.2): it is simpler, works for any mask (e.g. documents packed in one sequence), and with
grouped-query attention K/V are small next to Q. It sends the **same** (cp − 1) blocks as the ring's
forward, but before any attention can start, and every rank keeps **all** cp blocks:
"""
)
# short cells, the words in the caption: at 800 px the notes in the cells had pushed the exposed time out of view
st.dataframe([
    {"variant": "ring", "K/V sent": format_bytes(row["ring_sent_bytes"]),
     "K/V held": format_bytes(row["ring_kv_held_bytes"]), "exposed time": format_seconds(row["ring_exposed_s"])},
    {"variant": "all-gather", "K/V sent": format_bytes(row["allgather_sent_bytes"]),
     "K/V held": format_bytes(row["allgather_kv_held_bytes"]), "exposed time": format_seconds(row["allgather_s"])},
], hide_index=True, width="stretch")
st.caption("Per layer, forward. K/V held: the ring's block in use and the one arriving, against the all-gather's "
           "whole sequence. The all-gather's time is exposed unless the next layer's is prefetched.")

show_exercises([ring_hiding_shard(spec, chip, cp, seq_len, row), ring_kv_held(row)])

st.header("Run it for real")
st.markdown(
    """
Below, the small Llama-style Transformer of the live engine trains on **real processes of this machine**
with context parallel (`engine/cp.py`): zig-zag split, ring attention with `isend`/`irecv` overlapped
with each block's attention and a hand-written backward, then the all-gather variant. Both are checked
against one process training the whole sequence, and every transfer is traced.
"""
)
c1, c2, c3 = st.columns(3)
world = c1.select_slider("Processes (cp)", [2, 4], value=2, key="cp_live_world")
live_seq = c2.number_input("Sequence length (tokens)", min_value=2, max_value=256, value=32, step=1,
                           key="cp_live_seq_len", help="Must be a multiple of 2·cp: the zig-zag split cuts "
                           "each sequence into 2·cp equal chunks.")
steps = c3.select_slider("Optimizer steps", LIVE_STEP_CHOICES, value=LIVE_STEPS, key="cp_live_steps")
st.code(shell_lines(f"{COMMAND} --strategy cp --cp-variant {{ring,allgather}} --world {world} "
                    f"--seq-len {live_seq} --steps {steps} --check"), language="bash", wrap_lines=True)

try:
    configs = {variant: live_config(world, int(live_seq), variant, steps)
               for variant in ("ring", "allgather")}
except ConfigError as e:
    configs = None
    st.error(markdown_text(f"This run cannot start: {e}."), icon=":material/block:")

if st.button("Run ring and all-gather on this machine", type="primary", disabled=configs is None):
    run_live("live_cp", list(configs.items()), hint="try 2 processes or fewer steps")

live = show_live("live_cp")
if live:
    runs = [(r.label, r.cfg, r.summary, r.timeline) for r in live]
    table = live_rows(runs)
    text_table(table, columns_from="variant")
    if len(live) == 2:  # the comparison needs both (a press stopped in its second run keeps the first)
        ring, gather = table
        sent = "K/V bytes sent per step (rank 0)"
        st.markdown(
            f"""
The ring sends (3cp − 2) K/V-sized blocks per layer and step: cp − 1 forward, and in the backward
cp − 1 K/V blocks again plus cp dK/dV blocks (each block's gradient travels home). The all-gather sends
2(cp − 1): one all-gather and one reduce-scatter. So the ring moves more bytes
({ring[sent]} against {gather[sent]}), in exchange for two things: its transfers run **while**
attention computes ({ring['K/V transfer under attention']} of the send/recv time here), and it never
holds the whole sequence's K/V: activations kept for backward {ring['activations (rank 0)']} against
{gather['activations (rank 0)']}. On this tiny model the gradient all-reduce over the cp ranks dwarfs both
(the weights are replicated), and on shared CPU cores the measured overlap is only indicative.
"""
        )
    st.caption("In the timelines above, brown bars (send/recv) are the K/V and dK/dV blocks in flight; the "
               "yellow 'post kv L…' bars are the rank handing each block to gloo (its own thread writes the "
               "message, so the rank cannot compute meanwhile); the grey 'attn L… ring k' spans inside each "
               "layer's forward and backward are the attention blocks they overlap, and the idle row shows "
               "where a rank waited for a block to arrive. Hover for names and bytes.")
