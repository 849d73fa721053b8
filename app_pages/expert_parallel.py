"""Lesson: Mixture-of-Experts and expert parallel: routing, the two all-to-alls, their cost on real chips,
a live run."""

import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.link_params import drop_link_values_not_taken, follow_sidebar, link_values
from app_pages.live_panel import run_live, show_live
from app_pages.text_table import text_table
from engine.cli import COMMAND
from hardware.chips import CHIPS
from planner.bounds import expert_parallel_bound
from planner.costs import group_links_chip
from planner.models import MODEL_PRESETS
from ui.bound_meter import bound_figure, verdict_text
from ui.exercises import a2a_leaving_share, ep_expert_width
from ui.expert_parallel import (
    MOE_PRESETS,
    a2a_bytes,
    a2a_bytes_by_name,
    capacity,
    cost_figure,
    cost_rows,
    ep_config_error,
    live_a2a_text,
    live_load_rows,
    load_figure,
    load_tops,
    matrix_figure,
    moe_numbers,
    placement_figure,
    simulate_routing,
)
from ui.live import LIVE_STEP_CHOICES, LIVE_STEPS
from ui.state import ignored_link_message
from ui.tables import count, format_bytes, format_seconds, shell_lines

TOKENS = [64, 128, 256, 512, 1024, 2048]
EXPERTS = [4, 6, 8, 16, 32, 64, 128, 256]
TOP_KS = [1, 2, 4, 8]
SIM_EPS = [1, 2, 4, 8, 16, 32]
CAPACITIES = ["0.5", "0.75", "1.0", "1.25", "1.5", "2.0", "none"]
SKEW_RANGE = (0.0, 1.5)
MICRO_BATCHES = [1, 2, 4]

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]
domain = chip.scaleup_domain

st.title("Expert parallel")
# A bound widget drops a link value that is none of its options without a word: said here, and taken out of the
# link before the widgets read it, as the planner does (a value that is no finite number the app shell has said).
# Checked in two goes, each before its widgets: the model-ep slider's options follow the MoE model picked first.
_link_note = st.empty()
_link_values = link_values()
_ignored: dict[str, str] = {}


def _check_link(options: dict, ranges: dict | None = None) -> None:
    """Drop from the link the values of `options`'s keys that are none of them (and of `ranges`'s number sliders
    that are out of range), and say so above."""
    _ignored.update(drop_link_values_not_taken(options, ranges))
    if _ignored:
        _link_note.info(ignored_link_message(_ignored, _link_values), icon=":material/link_off:")

st.markdown(
    """
A **Mixture-of-Experts** (MoE) layer replaces the one MLP of a Transformer layer by E smaller MLPs, the
*experts*, and a tiny linear **router** that scores every token against every expert. Each token goes
only to its **top k** experts, and its output is their results weighted by the router's softmax
(Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Mixtral: E = 8, k = 2). So the model has the
parameters of E MLPs but each token pays the FLOPs of only k: **total parameters** grow with E,
**active parameters** (what one token passes through) with k.
"""
)
sidebar_spec = MODEL_PRESETS[choices.model]
if sidebar_spec.is_moe:
    spec = sidebar_spec
else:
    st.info(f"The sidebar's {sidebar_spec.name} is a **dense** model: every token passes through its one "
            "MLP, it has no experts to spread. Pick an MoE preset to follow here (or choose one in the "
            "sidebar).",
            icon=":material/info:")
    _check_link({"ep_moe_model": MOE_PRESETS})
    spec = MODEL_PRESETS[st.selectbox("MoE model", MOE_PRESETS, key="ep_moe_model", bind="query-params")]
nums = moe_numbers(spec)
shared = f" plus {spec.shared_experts} always-on shared expert" if spec.shared_experts else ""
dense_first = f" (its first {spec.dense_layers} layers keep a dense MLP)" if spec.dense_layers else ""
st.markdown(
    f"**{spec.name}**: {spec.moe_layers} MoE layers{dense_first}, each with E = **{spec.experts}** routed "
    f"experts{shared}, top k = **{spec.top_k}**. One expert is a SwiGLU MLP of D = {spec.hidden:,} and "
    f"F = {spec.ffn:,}: {nums['per_expert'] / 1e6:,.0f} M parameters. All routed experts together hold "
    f"**{nums['experts_all_layers'] / 1e9:,.1f} B** of the model's **{nums['total'] / 1e9:,.1f} B** "
    f"parameters, but one token uses only **{nums['active'] / 1e9:,.1f} B** "
    f"({nums['active'] / nums['total']:.0%}): the compute of a {nums['active'] / 1e9:,.0f} B dense model "
    f"with the memory of a {nums['total'] / 1e9:,.0f} B one."
)
st.markdown(
    """
That memory is the problem expert parallel solves. Instead of copying every expert to every chip, the
**ep** chips of an expert-parallel group each hold **E/ep whole experts**; attention, norms and the router
stay data parallel (each chip reads its own tokens). A token whose expert lives elsewhere has to travel
there and back, in two **all-to-alls** per MoE layer:
"""
)
# Each step under its name, a line per matmul or move: beside the names the lines ran past the page's right
# edge, in a window 1,024 px wide too.
st.latex(r"""
\begin{array}{l}
\text{route:} \\
\qquad \text{In}[T, D] \cdot W_r[D, E] \rightarrow \text{top-}k \text{ experts per token} \\
\text{dispatch (all-to-all):} \\
\qquad X[T \cdot k, D] \text{ sorted by expert} \rightarrow X[T_{e}, D] \\
\qquad\qquad \text{for each local expert } e \in E_{ep} \\
\text{experts:} \\
\qquad X[T_e, D] \cdot W_{in}[D, 2F] \rightarrow H[T_e, F], \\
\qquad H[T_e, F] \cdot W_{out}[F, D] \rightarrow Y[T_e, D] \\
\text{combine (all-to-all):} \\
\qquad Y[T_e, D] \rightarrow Y[T \cdot k, D] \text{ back home}, \\
\qquad \text{Out}[t] = \textstyle\sum_{j \le k} g_{t,j}\, Y_{t,j}
\end{array}""")
st.markdown(
    """
Before the rows move, the ranks exchange a small all-to-all of **counts** (how many rows each rank sends to
each expert), so every rank knows how much it will receive: an uneven all-to-all needs its split sizes.
The backward pass runs both all-to-alls in reverse, so a training step moves each routed token copy
**four** times per MoE layer.
"""
)
ep_choices = [e for e in (1, 2, 4, 8, 16, 32, 64) if e <= spec.experts and spec.experts % e == 0]
fallback_ep = min(8, ep_choices[-1])
sidebar_ep = choices.mesh["ep"] if choices.mesh["ep"] in ep_choices[1:] else fallback_ep
_check_link({"ep_model_degree": ep_choices, "ep_tokens": TOKENS, "ep_experts": EXPERTS, "ep_top_k": TOP_KS,
             "ep_degree": SIM_EPS, "ep_capacity": CAPACITIES, "ep_micro_batch": MICRO_BATCHES},
            {"ep_skew": SKEW_RANGE})
follow_sidebar("ep_model_degree", sidebar_ep)
model_ep = st.select_slider(
    "Expert-parallel degree ep for this model", ep_choices, value=sidebar_ep, key="ep_model_degree",
    bind="query-params",
    help=f"Starts at the sidebar's ep (again whenever that changes) where that is one of these "
         f"({', '.join(map(str, ep_choices[1:]))}: more "
         f"than 1, at most 64 and dividing {spec.name}'s E = {spec.experts}); otherwise at ep = {fallback_ep}.")
if choices.mesh["ep"] > 1 and choices.mesh["ep"] not in ep_choices:
    st.caption(f"The sidebar's ep = {choices.mesh['ep']:,} cannot spread {spec.name}'s E = {spec.experts} experts "
               f"on this slider (ep must divide E and be at most 64), so it starts at ep = {fallback_ep} instead.")
st.plotly_chart(placement_figure(spec.experts, model_ep), key="ep_placement")
expert_gb = spec.experts // model_ep * nums["per_expert"] * spec.moe_layers * 2 / 1e9
st.caption(f"{spec.name} at ep = {model_ep}: each chip holds {count(spec.experts // model_ep, 'expert')} per MoE "
           f"layer, {expert_gb:,.1f} GB of expert weights in bf16 over all {spec.moe_layers} MoE layers "
           f"(against {chip.hbm_bytes / 1e9:.0f} GB of HBM on {chip.name}).")

st.header("Routing: who gets how many tokens")
st.markdown(
    """
A router is not told to be fair. If it likes a few experts, their chips get more rows than the others,
and the whole MoE layer waits for the busiest chip. Real systems bound the damage with a **capacity
factor** CF: each expert accepts at most
"""
)
st.latex(r"\text{capacity} = \left\lceil \mathrm{CF} \cdot \frac{T \cdot k}{E} \right\rceil")
st.markdown(
    """
token copies from each group of T tokens (GShard, sec. 3.2); the rest are **dropped**: that expert's
output for them is zero, and the token goes on through the residual connection. First choices claim
places before second choices, earlier tokens before later ones. Below, every rank routes its own T tokens
with the same router; the **skew** s makes expert e's probability proportional to 1/(e+1)^s (Zipf: s = 0 is
a perfectly balanced router). The experts are numbered by popularity, so the hottest ones sit together on
rank 0, the worst case for the ranks.
"""
)
c1, c2, c3 = st.columns(3)
sim_tokens = c1.select_slider("Tokens per rank T", TOKENS, value=512,
                              key="ep_tokens", bind="query-params")
sim_experts = c2.select_slider("Experts E", EXPERTS, value=8,
                               key="ep_experts", bind="query-params")
sim_k = c3.select_slider("Top k", TOP_KS, value=2, key="ep_top_k", bind="query-params")
c4, c5, c6 = st.columns(3)
sim_ep = c4.select_slider("Expert-parallel degree ep of the simulated layer", SIM_EPS, value=4,
                          key="ep_degree", bind="query-params")
sim_c = c5.select_slider("Capacity factor CF", CAPACITIES, value="1.25", key="ep_capacity", bind="query-params",
                         help="none: no limit, no token dropped")
sim_skew = c6.slider("Router skew s (Zipf exponent)", *SKEW_RANGE, 0.0, 0.1, key="ep_skew", bind="query-params")
cap_factor = None if sim_c == "none" else float(sim_c)
cached_routing = st.cache_data(simulate_routing, max_entries=32, show_spinner=False)
problem = ep_config_error(sim_experts, sim_k, sim_ep)
if sim_k > sim_experts:
    problem = f"top k = {sim_k} is more than the E = {sim_experts} experts; choose k <= E"
if problem:
    st.error(f"This routing cannot be placed: {problem}.", icon=":material/block:")
else:
    routing = cached_routing(sim_tokens, sim_experts, sim_k, sim_ep, cap_factor, sim_skew, seed=0)
    stats = routing.stats()
    cap_text = ("no capacity limit" if routing.capacity_per_group is None else
                f"capacity {routing.capacity_per_group} per expert per rank (the dashed line: x {sim_ep} ranks)")
    st.plotly_chart(load_figure(routing.tokens_per_expert, routing.dropped_per_expert, sim_ep,
                                routing.capacity_line,
                                f"{sim_ep} ranks x {sim_tokens} tokens x k = {sim_k}, E = {sim_experts}, "
                                f"s = {sim_skew:g}: {cap_text}"), key="ep_sim_load")
    total = sim_ep * sim_tokens * sim_k
    st.markdown(
        f"Of the **{total:,}** token copies (ep x T x k), **{routing.dropped:,}** were dropped "
        f"(**{stats['dropped_fraction']:.1%}**). The busiest expert got "
        f"**{stats['expert_max_over_mean']:.2f}x** the mean load; the busiest rank processes "
        f"**{stats['rank_max_over_mean']:.2f}x** the mean number of rows, and every rank waits for it. "
        "A larger CF drops fewer tokens but lets the busiest rank run longer (and reserve more buffer). "
        "Below CF = 1 the E experts together take fewer copies than the T x k that arrive (E x capacity < "
        "T x k), so at least 1 - CF of them (less what rounding the capacity up adds) are dropped by "
        "arithmetic alone, however balanced the router; at CF = 1 there is room for all, and the drops come "
        "from randomness: a random router never fills every expert exactly to its share."
    )
    st.plotly_chart(matrix_figure(routing.matrix, "The dispatch all-to-all: rows each rank sends to each "
                                                  "rank"), key="ep_sim_matrix")
    sent = routing.matrix.sum(1)
    local = routing.matrix.diagonal()
    st.markdown(
        f"Row r is what rank r's tokens need from the experts of each rank; the diagonal stays on the chip "
        f"(no link). Each rank keeps **{local.sum() / max(sent.sum(), 1):.0%}** of its rows at home "
        f"(balanced: 1/ep = {1 / sim_ep:.0%}); the rest, **{(sent.sum() - local.sum()) / sim_ep:,.0f}** rows "
        "per rank on average, cross the network in the dispatch, and come back in the combine "
        "(the transposed matrix)."
    )

st.header("What the all-to-alls cost on real chips")
st.markdown(
    """
With balanced routing each of a chip's T·k token copies lands on a uniformly chosen rank of the ep group,
so (ep−1)/ep of them leave the chip. Per MoE layer and micro-batch each chip sends
"""
)
# what it counts on a line of its own: beside the formula it ran past the page's right edge in a narrow window
st.latex(r"""\begin{array}{c} 4 \times T \cdot k \cdot D \cdot 2\,\text{bytes} \times \dfrac{ep-1}{ep} \\[0.3em]
(\text{dispatch} + \text{combine, forward} + \text{backward}) \end{array}""")
st.markdown(
    """
(GShard's dispatch and combine, the all-to-all cost of the scaling book's Part 12 on a switch:
(N−1)/N of the array through each chip's own port). Like tensor parallel's all-reduces, the bytes per chip do
not shrink as ep grows; unlike tensor parallel, the FLOPs per chip do not shrink either: each chip still runs
T·k rows through experts.
What ep buys is **memory** (E/ep experts per chip) and larger matmuls per expert. Whether the all-to-all
stays on the fast scale-up links decides its price:
"""
)
gpu = chip.kind == "gpu"
# one scale-up domain in words, as the meshes lesson says it: an 8-GPU node, a GB200 NVL72's NVLink domain (a rack)
unit = ("node" if domain <= 8 else "NVLink domain") if gpu else "slice"
fast_links = f"{chip.scaleup_link}'s" if gpu else "the scale-up links'"
micro_batch = st.select_slider("Micro-batch b (sequences per chip)", MICRO_BATCHES, value=1, key="ep_micro_batch",
                               bind="query-params")
tokens = micro_batch * spec.seq_len
rows = cost_rows(spec, chip, tokens, [1, 2, 4, 8, 16, 32, 64, 128, 256], choices.num_chips)
here = next(r for r in rows if r["ep"] == model_ep)
one = a2a_bytes(tokens, spec.top_k, spec.hidden, model_ep)
if model_ep == 1:
    st.markdown("With ep = 1 every chip holds every expert and nothing moves: pick ep > 1 above.")
else:
    st.markdown(
        f"{spec.name}, T = b·s = {tokens:,} tokens, k = {spec.top_k}, D = {spec.hidden:,}, "
        f"ep = **{model_ep}**: one all-to-all sends **{format_bytes(one['one'])}** per chip, the four of a "
        f"step **{format_bytes(here['bytes'])}** per MoE layer. On {chip.name} with the group on consecutive "
        f"chips ({here['topology']}) that takes **{format_seconds(here['a2a_s'])}** against "
        f"**{format_seconds(here['compute_s'])}** of expert compute (forward + backward): "
        f"**{here['a2a_s'] / here['compute_s']:.0%}** of it. With one chip per {unit} it would take "
        f"**{format_seconds(here['a2a_spread_s'])}**."
    )
st.plotly_chart(cost_figure(rows, model_ep, domain, f"{spec.name} on {chip.name}: one MoE layer, "
                                                      f"T = {tokens:,} tokens per chip", unit),
                key="ep_cost")
# short headers, the words in the caption: at 1,280 px the long ones cut the last column ("expert weights p...")
text_table([{"ep": r["ep"], "bytes sent": format_bytes(r["bytes"]),
               "all-to-all, consecutive": format_seconds(r["a2a_s"]),
               f"all-to-all, one per {unit}": format_seconds(r["a2a_spread_s"]),
               "expert compute": format_seconds(r["compute_s"]),
               "expert weights": f"{r['expert_weights_bytes'] / 1e9:,.1f} GB"} for r in rows])
st.caption(f"Per chip and MoE layer: the bytes its four all-to-alls send (dispatch and combine, forward and "
           f"backward), their time with the ep group on consecutive chips or spread one chip per {unit}, the "
           "experts' compute, and the expert weights it holds.")
inside = [r for r in rows if r["inside_domain"] and r["ep"] > 1]
outside = [r for r in rows if not r["inside_domain"]]
lines = []
if inside:
    best = inside[-1]
    lines.append(f"Inside one {domain:,}-chip {unit}, at ep = {best['ep']}, the all-to-alls take "
                 f"{best['a2a_s'] / best['compute_s']:.0%} of the experts' compute time.")
if outside:
    jump = outside[0]
    network = ("each GPU's own network card" if gpu else "the data-center network (DCN)")
    speeds = (f"at {chip.scaleout_bytes_per_s / 1e9:.0f} GB/s instead of {fast_links} "
              f"{chip.scaleup_bytes_per_s / 1e9:.0f} GB/s (spec line rates; the table counts the achievable "
              f"{chip.scaleout_bw(True) / 1e9:.0f} and {chip.scaleup_bw(True) / 1e9:.0f} GB/s)")
    spans = f"At ep = {jump['ep']} the group spans {count(jump['domains'], unit)}"
    if jump["rows_leaving_domain"] is not None:
        where = (f"{spans}: {jump['rows_leaving_domain']} of every {jump['ep']} rows leave the {unit} through "
                 f"{network} {speeds}")
    else:
        where = (f"{spans}, but {jump['ep']} is no multiple of the {domain:,}-chip {unit}, so the cost model puts "
                 f"the group on a flat network: every row that leaves a chip goes through {network} {speeds}")
    lines.append(f"{where}, and the all-to-alls take {jump['a2a_s'] / jump['compute_s']:.0%} of the compute "
                 "time.")
else:
    lines.append(f"Every ep on the chart fits inside {chip.name}'s {domain:,}-chip scale-up domain; only the "
                 f"dotted line, one chip per {unit}, pays the scale-out network.")
lines.append(
    f"The price of crossing {unit}s is why DeepSeek-V3 limits each token to experts on at most 4 nodes, "
    "dispatches in FP8, and overlaps the all-to-all of one micro-batch with the compute of another "
    "(DualPipe; arXiv 2412.19437 sec. 3.2). The alpha-beta model here assumes balanced routing and network "
    "cards free of other traffic.")
st.markdown(" ".join(lines))
if model_ep > 1:
    ep_links = group_links_chip(chip, model_ep, choices.num_chips)  # a TPU's: the job's slice
    bound = expert_parallel_bound(spec, ep_links, tokens, model_ep)
    st.plotly_chart(bound_figure(bound, f"The bound meter at ep = {model_ep}"),
                    key="ep_bound")
    link = (f"across {unit}s an all-to-all cannot reduce inside the {unit} first, so each GPU's own network card "
            "is the link" if gpu and model_ep > domain else f"here it runs over {bound.link}")
    st.markdown(verdict_text(bound) + " Both sides grow with the tokens and with k, so only a wider expert "
                f"or faster links help; {link}. (The scaling book's way of counting: peak FLOP/s, the "
                "links' bandwidth, latency left out; the table above uses achievable numbers.)")

if model_ep > 1:
    show_exercises([ep_expert_width(spec, ep_links, model_ep),
                    a2a_leaving_share(model_ep, tokens, spec.top_k, spec.hidden)])
else:
    st.info("At ep = 1 one chip holds every expert: no token leaves it, there is no all-to-all to hide, so no "
            "bound meter and no exercises here. Choose ep > 1 above to see them.", icon=":material/info:")

st.header("Run it for real")
st.markdown(
    """
Below, the live engine trains its small Transformer with an MoE MLP on **real processes of this machine**
(`engine/ep.py`): each rank holds E/ep experts, exchanges the counts, dispatches its rows with
`all_to_all_single` and uneven split sizes, runs its experts, combines the results back, and records how
many tokens every expert received and dropped. The run is checked against one process computing the whole
model, same routing and same drops.
"""
)
# two rows: five sliders in one had about 60 px each at 800 px, their labels wrapped and hard to drag
l1, l2, l3 = st.columns(3)
l4, l5, _ = st.columns(3)
world = l1.select_slider("Processes (ep)", [2, 4], value=2, key="ep_live_world")
live_experts = l2.select_slider("Experts", [2, 4, 6, 8], value=8, key="ep_live_experts")
live_k = l3.select_slider("Top k", [1, 2], value=2, key="ep_live_top_k")
live_c = l4.select_slider("Capacity factor", ["none", "0.5", "1.0", "1.25", "2.0"], value="1.0",
                          key="ep_live_capacity")
steps = l5.select_slider("Optimizer steps", LIVE_STEP_CHOICES, value=LIVE_STEPS, key="ep_live_steps")
argv = ["--strategy", "ep", "--world", str(world), "--experts", str(live_experts), "--top-k", str(live_k),
        "--steps", str(steps), "--check"] + ([] if live_c == "none" else ["--capacity-factor", live_c])
st.code(shell_lines(f"{COMMAND} " + " ".join(argv)), language="bash", wrap_lines=True)

if st.button("Run expert parallel on this machine", type="primary"):
    from engine.cli import config_from_args, run_parser
    from engine.config import ConfigError

    try:
        # exactly what `python -m engine run ...` builds and validates
        cfg = config_from_args(run_parser("python -m engine run").parse_args(argv))
        run_live("live_ep", [("Expert parallel", cfg)], hint="try 2 processes or fewer steps")
    except ConfigError as e:
        st.session_state.pop("live_ep", None)
        st.error(f"This run cannot start: {e}.", icon=":material/block:")

for live in show_live("live_ep"):
    cfg, summary, timeline = live.cfg, live.summary, live.timeline
    load = summary.stats["expert_load"]
    layer_name, layer = next(iter(load["layers"].items()))
    m = cfg.model
    sequences = cfg.world * cfg.steps * cfg.micro_batches * cfg.micro_batch_size
    cap = capacity(m.capacity_factor, m.seq_len, m.top_k, m.experts)
    # one under the other, on one scale: side by side, at 800 px each had 225 px for two panels, and their
    # titles and panel titles ran into each other
    measured = (layer["tokens_per_expert"], layer["dropped_per_expert"], load["ep"],
                None if cap is None else cap * sequences)
    sim = simulate_routing(cfg.steps * cfg.micro_batches * cfg.micro_batch_size * m.seq_len, m.experts,
                           m.top_k, load["ep"], m.capacity_factor, 0.0, seed=cfg.seed, group_tokens=m.seq_len)
    simulated = (sim.tokens_per_expert, sim.dropped_per_expert, load["ep"], sim.capacity_line)
    tops = tuple(map(max, zip(load_tops(*measured), load_tops(*simulated), strict=True)))
    st.plotly_chart(load_figure(*measured, f"Measured, layer {layer_name}: the engine's router", tops=tops),
                    key="ep_live_load")
    st.plotly_chart(load_figure(*simulated, "Simulated: a balanced random router, same T, E, k, CF", tops=tops),
                    key="ep_live_sim")
    st.caption(f"The engine counts capacity per sequence of {m.seq_len} tokens ({sequences} sequences in the "
               "run), so the dashed capacity line is the capacity per sequence times the sequences. Its router is a "
               "freshly initialised linear layer: close to balanced, but its preferences are real, not "
               "random draws.")
    text_table(live_load_rows(summary), columns_from="layer")
    st.markdown(live_a2a_text(a2a_bytes_by_name(timeline, 0, cfg.steps), summary, m.hidden, cfg.steps))
