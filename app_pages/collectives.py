"""Lesson 2: Collectives: what all-gather, reduce-scatter, all-reduce and all-to-all move and cost."""

import streamlit as st

from app_pages.exercise_panel import show_exercises
from app_pages.live_panel import run_task
from app_pages.metric_row import metric, metric_row
from engine.predict import cached_calibration
from hardware.chips import CHIPS
from hardware.collectives import Hierarchy, Ring, Switch, group_topology
from ui.collectives import (
    CALIBRATION_COLUMN_HELP,
    COLLECTIVE_NAMES,
    COLLECTIVES,
    MAX_RING,
    MIN_RING,
    all_reduce_note,
    calibration_rows,
    cost_figure,
    crossover_bytes,
    machine_link,
    pow2_sizes,
    ring_figure,
    ring_formula_latex,
    sweep_figure,
    tree_level,
)
from ui.exercises import latency_crossover, ring_bytes
from ui.tables import format_bytes, format_seconds

POW2 = [2**i for i in range(0, 17)]  # 1 .. 65,536
GROUP_SIZES = [2**i for i in range(1, 13)]  # 2 .. 4,096
STRIDES = [2**i for i in range(0, 13)]  # 1 .. 4,096
BF16_BYTES = 2
LIVE_WORLDS = [2, 3, 4]
LIVE_MAX_SIZES = [2**k for k in range(16, 27, 2)]  # 64 KiB .. 64 MiB, every 4x
LIVE_MIN_BYTES = 1024
SWEEP_TIMEOUT_S = 60.0

choices = st.session_state["choices"]
chip = CHIPS[choices.chip]

st.title("Collectives")
st.markdown(
    """
Every strategy in this guide is a plan for which chip holds which piece of the model and the batch,
plus the communication that brings a piece to the chip that needs it. Four **collective operations**
do almost all of that moving. In the scaling book's notation a subscript names the mesh axis a
dimension is split over, and `{U_X}` marks an array that still has to be summed over axis X:

| Collective | Each chip before | Each chip after | Sharding | Used for |
|---|---|---|---|---|
| **All-gather** | one shard, V/N bytes | the whole array, V | `A[I_X, J] -> A[I, J]` | FSDP / ZeRO-3 gathers each layer's weights; tensor parallel gathers activations |
| **Reduce-scatter** | its own full-size partial result, V | one shard of the sum, V/N | `A[I, J]{U_X} -> A[I_X, J]` | ZeRO-2/3 and FSDP gradients; sequence-parallel layer outputs |
| **All-reduce** | its own full-size partial result, V | the whole sum, V | `A[I, J]{U_X} -> A[I, J]` | data-parallel gradients; tensor-parallel layer outputs |
| **All-to-all** | N chunks, one for each chip | N chunks, one from each chip | `A[I, J_X] -> A[I_X, J]` | Mixture-of-Experts token routing; Ulysses sequence parallel |

V is the size of the full array and N the number of chips in the group. (Ulysses sequence parallel,
DeepSpeed-Ulysses: an all-to-all turns sequence-sharded activations into head-sharded ones before
attention, so each chip attends over the whole sequence for its heads, and another turns them back.)
"""  # noqa: E501 (a markdown table: one row per line)
)

st.header("On a ring, step by step")
st.markdown(
    "NCCL on GPUs and the TPU runtime mostly run these operations as **rings** (NCCL also uses trees "
    "for all-reduce over many nodes): every chip sends to its neighbour while receiving from the other "
    "one, so every link works at every step. Pick an operation "
    "and a ring size, then press **Play** or drag the step slider. Colour marks which shard a block is "
    "(for all-to-all, which chip sent it); hover a block for what it holds."
)
left, right = st.columns([1, 3])
with left:
    collective = st.radio("Collective", COLLECTIVES, format_func=COLLECTIVE_NAMES.get, key="collective",
                          bind="query-params")
    ring_n = st.slider("Chips in the ring (N)", MIN_RING, MAX_RING, 4, key="ring_n", bind="query-params")
    notes = {
        "all_gather": (
            f"Each step every link carries exactly one shard, V/{ring_n}: no link idles, none carries two. "
            f"After {ring_n - 1} steps each chip has received the {ring_n - 1}/{ring_n} of the array it "
            "lacked, the least any algorithm can move, so for large arrays the time is close to V/W "
            "whatever N is."),
        "reduce_scatter": (
            "The mirror image of all-gather: the same links and bytes, plus an addition when a partial "
            "sum arrives (Σk: k chips summed in; faint = partial, black border = complete). Each chip ends "
            f"with 1/{ring_n} of the result and can free the rest: the saving behind ZeRO-2 and FSDP."),
        "all_reduce": (
            f"Reduce-scatter, then all-gather of the reduced shards: {2 * (ring_n - 1)} steps and twice the "
            "bytes of either half. So ZeRO-1 and ZeRO-2, which reduce-scatter the gradients and all-gather "
            "the updated weights, move exactly what data parallel's all-reduce moves; ZeRO-3 / FSDP gathers "
            "the weights once more for the backward pass, 1.5 times as much (Rajbhandari et al. 2020)."),
        "all_to_all": (
            "Chunks addressed further around the ring ride several links, so a ring all-to-all moves "
            f"(N-1)/2 = {(ring_n - 1) / 2:g} times a chip's data over every link. Through a switch "
            "(NVSwitch) each chunk goes straight to its receiver in one hop: Mixture-of-Experts layers keep "
            "expert parallelism inside one NVLink domain for this reason."),
    }
with right:
    # No mode bar: it would cover the step caption, and zooming a diagram teaches nothing.
    st.plotly_chart(ring_figure(collective, ring_n), key="ring", config={"displayModeBar": False})
# under the ring, the page's full width: in the controls' quarter it ran one or two words a line
st.info(notes[collective])

st.header("What it costs: the alpha-beta model")
st.markdown(
    "Each step of a ring costs a fixed **latency α** (launching the transfer, synchronising with the "
    "neighbour, crossing the switch: about a microsecond on NVLink) plus the time to push its bytes "
    "through a link, **bytes · β** with β = 1/W and W the link bandwidth in one direction. For an "
    "array of V bytes on N chips (for all-to-all, b bytes per chip):"
)
# one formula a line: two side by side ran past the page's right edge
st.latex(r"T_\text{all-gather} = T_\text{reduce-scatter} = (N-1)\,\alpha + \frac{N-1}{N}\,\frac{V}{W}")
st.latex(r"T_\text{all-reduce} = 2(N-1)\,\alpha + 2\,\frac{N-1}{N}\,\frac{V}{W}")
st.latex(r"T_\text{all-to-all}^\text{ring} = (N-1)\,\alpha + \frac{N-1}{2}\,\frac{b}{W}")
st.latex(r"T_\text{all-to-all}^\text{switch} = \alpha + \frac{N-1}{N}\,\frac{b}{W}")
st.caption("Thakur, Rabenseifner & Gropp 2005 (ring all-gather; all-reduce = reduce-scatter + all-gather); "
           "How to Scale Your Model, Parts 3 and 12. Links are full duplex; W is one direction.")
st.markdown(
    "Small messages are **latency-bound**: the α term dominates and the time barely depends on size. "
    "Large ones are **bandwidth-bound**: the time grows in proportion to V. The two terms are equal at "
    "the crossover:"
)
st.latex(r"(N-1)\,\alpha = \frac{N-1}{N}\,\frac{V^{*}}{W} \;\Longrightarrow\; V^{*} = N\,\alpha\,W")
st.markdown("Below V*, pack small messages together (what DDP's gradient buckets and FSDP's flat "
            "parameter groups do); above it only more bandwidth helps.")

st.subheader(f"On {chip.name}")
left, right = st.columns([1, 2])
with left:
    group = st.select_slider("Chips in the group (N)", GROUP_SIZES, value=8, key="group", bind="query-params")
    stride = st.select_slider(
        "Stride between members", STRIDES, value=1, key="stride", bind="query-params",
        help="How many global ranks apart consecutive members are. Ranks are numbered tp fastest, so a tp "
             "group has stride 1 and the dp group behind tp=8 has stride 8. A group that fits in one "
             "NVLink domain / TPU slice uses the fast links; a wider stride crosses nodes.")
    rows = st.select_slider("Array rows", POW2, value=1024, key="rows", bind="query-params",
                            help="e.g. tokens of a batch, or rows of a weight matrix")
    cols = st.select_slider("Array columns", POW2[6:], value=16384, key="cols", bind="query-params")
    # wrap: in this narrow column a one-line label was cut to "Achievable instea..."
    achievable = st.toggle("Achievable instead of spec", key="achievable", bind="query-params", wrap=True,
                           help="Real collectives reach a fraction of the link's peak bandwidth (the chip "
                                "table's link efficiency, from nccl-tests and the scaling book).")

nbytes = BF16_BYTES * rows * cols
topology = group_topology(chip, group, stride, achievable=achievable)
kind = "achievable" if achievable else "spec"
sizes = pow2_sizes(2**10, 2**34)
array = f"bf16[{rows}, {cols}]"
with right:
    title = f"{group} x {chip.name}, stride {stride} ({kind})"
    st.plotly_chart(cost_figure(topology, sizes, nbytes, title=title), key="cost")
    st.caption(f"Topology: {topology.describe()}. Stars: your array, {array} = {format_bytes(nbytes)}. "
               "Diamonds: each collective's crossover; the shading is the all-gather's (each collective has its own).")
note = all_reduce_note(topology, sizes[0])
if note:
    st.markdown(note)

times = {op: topology.cost_s(op, nbytes) for op in COLLECTIVES}
crossover = crossover_bytes(topology.all_gather_s)
trees = tree_level(topology) is not None
with metric_row():
    for op in COLLECTIVES:
        metric(COLLECTIVE_NAMES[op], format_seconds(times[op]),
               help="double binary trees, not the ring: see below" if op == "all_reduce" and trees else None)
    metric("Crossover V* (all-gather)", format_bytes(crossover) if crossover else "none")
if topology.fill_s and crossover and isinstance(topology, Ring | Switch):  # one level: the formula is exact
    st.caption(f"With the achievable links, the {format_seconds(topology.fill_s)} the pipeline takes to fill, once "
               "per collective, counts with the latency: (N − 1) α + fill = (N − 1)/N · V*/W, so V* = N (α + "
               f"fill / (N − 1)) W = {format_bytes(crossover)}, above the ideal links' N α W.")
bound = "bandwidth" if crossover is not None and nbytes > crossover else "latency"
st.markdown(
    f"**Worked example.** All-gather of {array} ({format_bytes(nbytes)}) over {group} {chip.name} chips, "
    f"stride {stride}: **{format_seconds(times['all_gather'])}**, {bound}-bound. All-reduce of the same "
    f"array: {format_seconds(times['all_reduce'])}{' (double binary trees)' if trees else ''}; all-to-all "
    f"of {format_bytes(nbytes)} per chip: {format_seconds(times['all_to_all'])}"
    f"{' (straight through the switch)' if isinstance(topology, Switch) else ''}."
)
if isinstance(topology, Ring | Switch):
    link = topology.link
    st.latex(ring_formula_latex("all_gather", group, link.latency_s, link.bytes_per_s, nbytes, topology.fill_s))
    if topology.fill_s:
        st.caption(f"fill: the {format_seconds(topology.fill_s)} the links' pipeline takes to fill, once per "
                   "collective, measured from NCCL's curves (the achievable links only).")
elif isinstance(topology, Hierarchy):
    inner_s = topology.inner.all_gather_s(nbytes)
    outer_s = topology.outer.all_gather_s(topology.outer_bytes(nbytes))
    d = topology.domain_size
    how = (f"across domains each of a domain's {d} network cards (one per chip) moves a 1/{d} share of the "
           f"array, V/{d} = {format_bytes(nbytes / d)}: NCCL runs one ring per card through every chip of the "
           f"group, so each card carries {group - 1}/{group} of that share"
           if topology.flat else
           f"across domains each chip only gathers 1/{d} of it, V/{d} = {format_bytes(nbytes / d)}")
    st.markdown(
        f"The group spans {group // d} domains of {d} chips. Inside each domain the chips gather the full "
        f"array over the fast links ({format_seconds(inner_s)}); {how}, over the slower network "
        f"({format_seconds(outer_s)}). "
        "The two levels run as one pipeline, so the slower sets the pace and both latencies add"
        + (f": a ring through every chip takes the domain's {d - 1} fast step{'s' if d > 2 else ''} in each of the "
           f"{group // d} domains it passes, {group - group // d} in all." if topology.flat else ".")
    )
else:
    st.markdown("On a TPU torus the group spans one or more ICI axes with links in both directions, so each "
                "axis works as a bidirectional ring (half the hops, twice the bandwidth of a one-way ring) "
                "and several axes gather at once.")

st.markdown("**Where the group sits.** The same collective on the same number of chips costs very "
            f"different amounts depending on whether the members share fast links ({chip.name}: "
            f"{chip.scaleup_domain} chips per {'TPU slice' if chip.kind == 'tpu' else chip.scaleup_link + ' domain'}):")
placements = {1: "consecutive ranks (stride 1)",
              chip.scaleup_domain: f"one chip per domain (stride {chip.scaleup_domain})"}
placements.setdefault(stride, f"your stride ({stride})")
rows_out, described = [], []
for s, label in placements.items():
    topo = group_topology(chip, group, s, achievable=achievable)
    rows_out.append({"Placement": label,
                     "All-gather": format_seconds(topo.all_gather_s(nbytes)),
                     "All-reduce": format_seconds(topo.all_reduce_s(nbytes))
                     + (" (trees)" if tree_level(topo) is not None else ""),
                     "All-to-all": format_seconds(topo.all_to_all_s(nbytes))})
    described.append(f"{label}: {topo.describe()}")
st.dataframe(rows_out, hide_index=True, width="stretch")
st.caption("; ".join(described) + ".")  # below the table, in full: a column had cut them off

show_exercises([ring_bytes(COLLECTIVE_NAMES[collective].lower(), ring_n, nbytes),
                latency_crossover(topology, crossover)])

st.header("Measure this machine")
st.markdown(
    "The same four collectives on real processes of the computer running ShardLab: N worker ranks "
    "talk through gloo over the loopback network, every operation runs at several message sizes, and "
    "a least-squares fit (each point's error relative to its time) gives this machine's α and β: the ring's "
    "model for all-gather, reduce-scatter and all-reduce, and for all-to-all gloo's pairwise exchange, "
    "(N − 1) α + (N − 1)/N · b / W, not the ring's (N − 1)/2. The first run starts the workers (a few "
    "seconds); later runs reuse them."
)
left, mid, right = st.columns(3)
live_world = left.radio("Ranks", LIVE_WORLDS, horizontal=True, key="live_world")
live_max = mid.select_slider("Largest message", LIVE_MAX_SIZES, value=4 * 2**20, format_func=format_bytes,
                             key="live_max")
repeats = right.slider("Repeats per size", 1, 10, 3, key="live_repeats",
                       help="Each point is the median over repeats of the slowest rank's time.")
live_sizes = pow2_sizes(LIVE_MIN_BYTES, live_max)[::2]
st.caption(f"Sizes {format_bytes(live_sizes[0])} to {format_bytes(live_sizes[-1])}, every 4x "
           f"({len(live_sizes)} sizes) x 4 collectives x {repeats} repeats on {live_world} ranks.")
task = None
if st.button("Run the sweep", type="primary"):
    from engine.sweep import run_collective_sweep
    from server.queue import Task

    def sweep(progress, stop, world=live_world, sizes=tuple(live_sizes), repeats=repeats):
        measurements = []
        for i, op in enumerate(COLLECTIVES):
            first = " (the first run also starts the worker processes)" if i == 0 else ""
            progress(i / len(COLLECTIVES), f"{COLLECTIVE_NAMES[op]} on {world} ranks{first}")
            measurements += run_collective_sweep(world, [op], list(sizes), repeats, SWEEP_TIMEOUT_S, stop=stop)
        return measurements

    task = Task(f"sweep:{live_world}:{live_sizes}:{repeats}", live_world, sweep)
# followed on every run of the page: a widget moved while the sweep waits or runs does not lose it
measured = run_task("Collective sweep", task, what="sweep", hint="try fewer sizes, fewer repeats or fewer ranks")
if measured is not None:
    st.session_state["this_machine_link"] = machine_link(measured, measured[0]["world"] if measured else live_world)

result = st.session_state.get("this_machine_link")
if result is not None:
    st.plotly_chart(sweep_figure(result), key="sweep")
    with metric_row():
        metric("α (latency per step)", format_seconds(result.alpha_s))
        metric("W = 1/β (bandwidth)", f"{result.bytes_per_s / 1e9:,.2f} GB/s" if result.bytes_per_s else "n/a")
        metric("Crossover V* = N α W", format_bytes(result.world * result.alpha_s * result.bytes_per_s)
               if result.bytes_per_s else "n/a")
    st.dataframe([{"Collective": COLLECTIVE_NAMES[op], "α": format_seconds(a),
                   "β (ns per byte)": round(b * 1e9, 4),
                   "W = 1/β (GB/s)": round(1 / b / 1e9, 3) if b > 0 else None}
                  for op, (a, b) in result.per_op.items()], hide_index=True, width="stretch")
    if result.bytes_per_s:
        nvlink = chip.scaleup_bytes_per_s
        st.markdown(
            f"Fitted at {result.world} ranks; the summary α and β are the medians over the four fits. "
            f"{chip.name}'s scale-up link ({nvlink / 1e9:,.0f} GB/s, "
            f"α ≈ {format_seconds(chip.scaleup_latency_s)}) "
            f"is **{nvlink / result.bytes_per_s:,.0f}x** this machine's bandwidth, with "
            f"**{result.alpha_s / chip.scaleup_latency_s:,.0f}x** less latency per step. Local processes "
            "share memory bandwidth and CPU cores, so points scatter.")

st.subheader("What the live lessons predict with")
calibration = cached_calibration()
if calibration is None:
    st.caption("This machine is not calibrated yet: the first live run of a lesson (or **Measure this "
               "machine** on the hardware page) measures it, in under a minute, and this table appears.")
else:
    st.markdown(
        "Every live run is shown beside the planner's prediction of it, made from one calibration of this "
        "machine. For communication it times each gloo operation the engine uses, at the engine's message "
        "sizes (1, 128 and 512 KiB), each after a few hundred microseconds of computing as in a training "
        "step, with every group of the world communicating at once: back to back (as the sweep above runs "
        "them) gloo's threads can stay awake; in one measurement on this kind of virtual machine, cores kept "
        "awake made blocking all-reduces 3.4x faster. The rows timed both ways show what it is here. Its α "
        "is per operation, not per ring step as in the sweep above:")
    widths = {"group": "small", "timed": 330}  # the timing's longest label in full, and β beside it at 1,280 px
    st.dataframe(calibration_rows(calibration), hide_index=True, width="stretch", column_config={
        name: st.column_config.Column(help=words, width=widths.get(name))
        for name, words in CALIBRATION_COLUMN_HELP.items()})
