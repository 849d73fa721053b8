"""Exercises whose answers recompute from the page's current settings: a question, the answer, and the
worked solution (the formula, the numbers substituted, the result). Each answer comes from the module that
owns the formula (planner.bounds, planner.memory, core.schedules), never a copy of it. No Streamlit here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hardware.chips import DTYPE_BYTES, Chip
from planner.bounds import data_parallel_bound, expert_parallel_bound, mlp_matrices, tensor_parallel_bound
from planner.memory import zero_bytes_per_param
from planner.models import ModelSpec
from ui.tables import format_bytes, format_bytes_per_s, format_flops, format_flops_per_s, format_seconds


@dataclass(frozen=True)
class Exercise:
    question: str
    answer: float | int | str  # what a test compares with the planner's own number
    worked: list[str]  # the worked solution, line by line (markdown)


def _numbers(achievable: bool) -> str:
    return "achievable" if achievable else "spec"


def ridge_point(chip: Chip, dtype: str = "bf16", achievable: bool = False) -> Exercise:
    """The ridge point in the page's number format and numbers (spec or achievable)."""
    c, w, e = chip.peak_flops_per_s(dtype, achievable), chip.hbm_bw(achievable), DTYPE_BYTES[dtype]
    return Exercise(
        f"Above what arithmetic intensity (FLOPs per byte of HBM traffic) is a {dtype} matmul on {chip.name} "
        f"compute-bound rather than memory-bound ({_numbers(achievable)} numbers)?",
        c / w,
        ["The ridge point is peak FLOP/s over HBM bandwidth: I* = C / W_HBM.",
         f"I* = {format_flops_per_s(c)} / {format_bytes_per_s(w)} = **{c / w:,.0f} FLOPs per byte**.",
         f"A matmul of an (M x K) by a (K x N) {dtype} matrix ({e:g} byte{'s' if e != 1 else ''} an element) does "
         f"2MKN FLOPs over {e:g}(MK + KN + MN) bytes: with M = K = N = n that is {2 / (3 * e):.3g} n FLOPs per "
         f"byte, so square matmuls need n > {3 * e * c / w / 2:,.0f}."])


def fsdp_batch(m: ModelSpec, chip: Chip, dp: int, stride: int) -> Exercise:
    b = data_parallel_bound(m, chip, 1.0, dp, stride, fsdp=True)
    return Exercise(
        f"With the sidebar's mesh (dp = {dp}) on {chip.name}, from how many tokens per chip per step is "
        f"FSDP of {m.name} compute-bound?",
        b.intensity,
        ["Per layer of P parameters, the forward's math takes 2·B·P / C seconds and the weight all-gather "
         "2P / W (2 bytes per bf16 weight at W bytes per second); they are equal at B = C / W, whatever P is.",
         f"The dp group uses {b.link}: W = {format_bytes_per_s(chip.peak_flops_per_s('bf16') / b.intensity)}, "
         f"C = {format_flops_per_s(chip.peak_flops_per_s('bf16'))}.",
         f"B > C / W = **{b.intensity:,.0f} tokens per chip** (the scaling book's rule; latency left out)."])


def smallest_fitting_zero_stage(m_params: float, name: str, chip: Chip, dp: int, shard: int = 1) -> Exercise:
    """`m_params`: the parameters each data-parallel rank holds, its 1/`shard` of the model under tp x pp."""
    rows = []
    answer: int | str = "none: even ZeRO-3 does not fit; raise dp"
    for stage in range(4):
        per = sum(zero_bytes_per_param(stage, dp)) * m_params
        rows.append(f"{'ZeRO-' + str(stage) if stage else 'DP'}: {per / 1e9:,.1f} GB")
        if per <= chip.hbm_bytes and not isinstance(answer, int):
            answer = stage
    of = f" (each chip's 1/{shard} shard of them, under tp x pp = {shard})" if shard > 1 else ""
    return Exercise(
        f"What is the smallest ZeRO stage at which {name}'s weights, gradients and Adam state{of} "
        f"(16 bytes per parameter in mixed precision) fit in {chip.name}'s {chip.hbm_bytes / 1e9:.0f} GB at "
        f"dp = {dp}?",
        answer,
        ["Per chip: ZeRO-1 shards the 12 bytes of Adam state, ZeRO-2 also the 2 of gradients, ZeRO-3 also "
         f"the 2 of weights, each over dp = {dp}.",
         ", ".join(rows) + " (activations come on top).",
         f"Answer: **{('ZeRO-' + str(answer) if answer else 'DP') if isinstance(answer, int) else answer}**."])


def largest_compute_bound_tp(m: ModelSpec, chip: Chip, tokens: float, job_chips: int = 1) -> Exercise:
    """`job_chips`: the sidebar's mesh, whose slice a TPU's TP group lies on (planner.costs.group_links_chip):
    there a group spanning more torus axes gets more links, so the rule's limit grows with Y."""
    from planner.costs import group_links_chip

    f, n = (m.dense_ffn_ if m.is_moe else m.ffn), mlp_matrices(m)
    # a degree the node (a TPU's slice) holds and the heads divide by (9.8 had been answered 9 on 8-GPU nodes,
    # 32 heads), and whose own links keep it compute-bound
    node = chip.scaleup_domain
    degrees = [y for y in range(1, min(node, m.heads) + 1) if m.heads % y == 0]
    bounds = {y: tensor_parallel_bound(m, group_links_chip(chip, y, job_chips), tokens, y) for y in degrees}
    largest = max([y for y, b in bounds.items() if b.compute_bound], default=1)
    b = bounds[largest]
    limit = n / 2 * f / b.intensity
    factor = "" if n == 2 else f"{n / 2:g} · "
    return Exercise(
        f"Up to how many chips can tensor parallel split {m.name}'s MLP on {chip.name} (inside one "
        f"{'node' if chip.kind == 'gpu' else 'slice'}) before its communication outgrows its math?",
        largest,
        [f"Per pass, the MLP's math is {2 * n}·B·D·F / (Y·C) ({n} matrices{', SwiGLU' if n == 3 else ''}); the "
         f"activations' all-gather and reduce-scatter 4·B·D / W. They are equal at Y = {factor}F / (C / W), "
         "whatever the batch.",
         f"At Y = {largest}: C / W = {b.intensity:,.0f} ({b.link}); F = {f:,}: Y < {factor}{f:,} / "
         f"{b.intensity:,.0f} = {limit:,.1f}."
         + (" On a TPU each degree's group gets the links of the torus axes it spans on the slice (more axes, "
            "more links; part of an axis, no wraparound), so C / W changes with Y."
            if chip.kind != "gpu" else ""),
         f"Answer: **{largest}**: the largest degree that stays under its own limit and divides the {m.heads} "
         "heads" + (f", on a slice of the sidebar's {job_chips:,} chips (or of Y, if more)." if chip.kind != "gpu"
                    else f" and fits the {node:,}-chip node.")])


def bubble_micro_batches(p: int, target: float = 0.10) -> Exercise:
    from core.schedules import formula_bubble_fraction

    m = 1
    while formula_bubble_fraction("1f1b", p, m) > target:
        m += 1
    return Exercise(
        f"With p = {p} stages, how many micro-batches keep the 1F1B bubble at or under {target:.0%} of the "
        "compute time?",
        m,
        ["1F1B's bubble over the ideal compute time is (p − 1) / m (Narayanan et al. 2021, eq. 1).",
         f"(p − 1) / m ≤ {target:g}  ⇒  m ≥ (p − 1) / {target:g} = {p - 1} / {target:g}.",
         f"Answer: **m = {m}** (the bubble is then {formula_bubble_fraction('1f1b', p, m):.1%}). Interleaving "
         "with v chunks divides it by v, at v times the point-to-point traffic."])


def ep_expert_width(m: ModelSpec, chip: Chip, ep: int) -> Exercise:
    b = expert_parallel_bound(m, chip, 1.0, ep)
    n = 3 if m.mlp == "swiglu" else 2
    limit = 2 / n * (ep - 1) / ep * b.intensity
    return Exercise(
        f"At ep = {ep} on {chip.name}, how wide must an expert be (F) for the all-to-alls to hide under its "
        "math?",
        limit,
        [f"Per token copy: expert math 2·{n}·D·F / C against dispatch + combine 2·2·D·(ep − 1)/ep / W.",
         f"The group uses {b.link}: C / W = {b.intensity:,.0f}.",
         f"F > (2 / {n}) · ({ep} − 1) / {ep} · {b.intensity:,.0f} = **{limit:,.0f}**; {m.name}'s experts have "
         f"F = {m.ffn:,}, so they are {'compute' if m.ffn > limit else 'communication'}-bound."])


def ring_hiding_shard(spec: ModelSpec, chip: Chip, cp: int, seq_len: int, row: dict) -> Exercise:
    """`row`: ui.context_parallel.overlap_row for these settings (the page's own numbers). The question counts
    the transfer's bytes alone, and says so: asked as "hides its K/V transfer", its answer (647 tokens on the
    default setup) had stood under a chart whose K/V line, latency and fill included, still lay above the
    attention at 1,024 tokens a shard. The last step brings the latency back, in the chart's numbers."""
    t = row["threshold_tokens"]
    shard = seq_len // cp
    latency_s = row["alpha_s"] + row["fill_s"]
    return Exercise(
        f"For {spec.name} on {chip.name} at cp = {cp}, counting the K/V transfer's bytes only (its bandwidth "
        "term; the latency comes after), what is the shortest sequence shard S/cp whose ring step hides that "
        f"transfer, and is S/cp = {shard:,} above it?",
        t,
        ["A step sends 2·B·(S/cp)·H_kv·d·e bytes and computes ½·4·B·(S/cp)²·H·d FLOPs: the bytes hide "
         "when S/cp ≥ (H_kv / H) · e · F / W.",
         f"H_kv / H = {spec.kv_heads} / {spec.heads}, e = 2 bytes, F = {row['attention_flops_per_s'] / 1e12:,.0f} "
         f"TFLOP/s (the attention kernel at this shard) and W = {row['link_bytes_per_s'] / 1e9:,.0f} GB/s (this "
         f"link, achievable): S/cp ≥ **{t:,.0f} tokens**.",
         f"S/cp = {shard:,} is {'above' if shard >= t else 'below'} it: by its bytes the ring is "
         f"{'hidden' if shard >= t else 'exposed'}. Each message also pays the link's latency and fill, "
         f"{format_seconds(latency_s)} whatever its size (the chart's K/V line): with them this step's transfer "
         f"takes {format_seconds(row['transfer_s'])} against {format_seconds(row['compute_s'])} of attention, "
         f"so the ring is {'hidden' if row['hidden'] else 'exposed'}. The latency moves the crossing to longer "
         "shards, where the chart's two lines meet."])


def compute_bound_tokens(chip: Chip, d: int, f: int, dtype: str = "bf16", achievable: bool = False) -> Exercise:
    """The hardware page's matmul In[B, D] . W[D, F] in its number format and numbers (hardware.roofline.
    matmul_cost): from how many tokens B is it compute-bound?"""
    ridge = chip.peak_flops_per_s(dtype, achievable) / chip.hbm_bw(achievable)
    e = DTYPE_BYTES[dtype]
    # intensity 2BDF / (e(BD + DF + BF)) >= I*  <=>  B (2DF - e I*(D + F)) >= e I* D F
    denominator = 2 * d * f - e * ridge * (d + f)
    least = e * ridge * d * f / denominator if denominator > 0 else None
    # the first whole token count past the bound, as the page's info box says it (rounding to the nearest had
    # answered 188 where 188.16 is needed: 188 tokens are still memory-bound)
    answer: float | str = float(math.ceil(least)) if least is not None else "never: the weights alone cost more"
    shown = (f"{least:,.1f}, so **{answer:,.0f} tokens**" if least is not None else f"**{answer}**")
    return Exercise(
        f"With D = {d:,} and F = {f:,} (the sliders), from how many tokens B is the {dtype} matmul "
        f"In[B, D] · W[D, F] on {chip.name} compute-bound ({_numbers(achievable)} numbers)?",
        answer,
        [f"Its arithmetic intensity is 2·B·D·F FLOPs over e·(B·D + D·F + B·F) bytes, e = {e:g} byte"
         f"{'s' if e != 1 else ''} an element of {dtype}, compute-bound once it reaches the ridge point "
         f"I* = {ridge:,.0f}.",
         "2·B·D·F ≥ e·I*·(B·D + D·F + B·F)  ⇒  B ≥ e·I*·D·F / (2·D·F − e·I*·(D + F)).",
         f"B ≥ {e:g} · {ridge:,.0f} · {d:,} · {f:,} / (2 · {d * f:,} − {e:g} · {ridge:,.0f} · {d + f:,}) = {shown} "
         f"(for D, F much larger than I*, B ≈ {e / 2:g} I*: the rule of thumb)."])


def ring_bytes(collective_name: str, n: int, nbytes: float) -> Exercise:
    """Bytes each chip sends in a ring collective of an array of `nbytes` over n chips (for an all-to-all,
    `nbytes` per chip, each chip's piece for the chip d steps on forwarded d times)."""
    if collective_name == "all-to-all":
        factor = (n - 1) / 2
        return Exercise(
            f"On a ring of N = {n} chips, each chip holds b = {format_bytes(nbytes)}, one piece of b / N for "
            "every chip. How many bytes does each chip send in a ring all-to-all?",
            factor * nbytes,
            ["The piece for the chip d steps on travels d links: each chip sends its own N − 1 pieces and "
             "forwards the others' that pass through it, Σ d · b / N for d = 1 … N − 1.",
             f"(N − 1) / 2 · b = {factor:g} · {nbytes:,.0f} = **{format_bytes(factor * nbytes)}**: unlike the "
             "other three, it grows with N, which is why an all-to-all wants a switch (each piece straight to "
             "its chip) or a torus."])
    factor = 2 * (n - 1) / n if collective_name == "all-reduce" else (n - 1) / n
    formula = "2 (N − 1) / N · V" if collective_name == "all-reduce" else "(N − 1) / N · V"
    return Exercise(
        f"On a ring of N = {n} chips, how many bytes does each chip send in an {collective_name} of the "
        f"{format_bytes(nbytes)} array?",
        factor * nbytes,
        [("An all-reduce is a reduce-scatter then an all-gather: each passes N − 1 shards of V / N per chip."
          if collective_name == "all-reduce" else
          "N − 1 steps, each passing one shard of V / N to the next chip."),
         f"{formula} = {factor:.3f} · {nbytes:,.0f} = **{format_bytes(factor * nbytes)}**, nearly "
         f"{'2V' if collective_name == 'all-reduce' else 'V'} whatever N: a larger ring sends hardly more bytes "
         "per chip, it only adds steps (each a latency)."])


def latency_crossover(topology, crossover: float | None) -> Exercise:
    """`crossover`: ui.collectives.crossover_bytes of the page's all-gather on its topology."""
    fill = topology.fill_s
    return Exercise(
        f"Over {topology.describe()}, from what array size is an all-gather bandwidth-bound rather than "
        "latency-bound?",
        crossover if crossover is not None else "always bandwidth-bound",
        ["The alpha-beta model: T(V) = α·steps " + ("+ fill " if fill else "") + "+ V·(N − 1)/N / W. The two "
         "terms are equal at the crossover" + (": the fill counts with the latency, once." if fill else "."),
         (f"V* = T(0) / slope = **{format_bytes(crossover)}**: below it adding bytes costs almost "
          "nothing, above it time grows with the bytes." if crossover is not None else
          "No latency term on this link: every size is bandwidth-bound.")])


def tp_bytes_per_layer(t: int, b: int, s: int, h: int, comm_bytes: float) -> Exercise:
    """`comm_bytes`: ui.tensor_parallel.scaling_rows' bytes per chip for this t (the page's own row)."""
    return Exercise(
        f"At t = {t}, b = {b}, s = {s:,}, h = {h:,}: how many bytes does each chip send per layer and "
        "micro-batch, forward and backward?",
        comm_bytes,
        ["Four collectives of the activation array V = b·s·h·2 bytes per layer (two all-reduces forward, two "
         "backward; or their all-gather + reduce-scatter halves with sequence parallel), each sending "
         "2(t − 1)/t · V per chip.",
         f"4 · 2·({t} − 1)/{t} · {b}·{s:,}·{h:,}·2 = **{format_bytes(comm_bytes)}**."])


def gpipe_bubble(p: int, m: int) -> Exercise:
    from core.schedules import formula_bubble_fraction

    f = formula_bubble_fraction("gpipe", p, m)
    return Exercise(
        f"With p = {p} stages and m = {m} micro-batches (the sliders), what share of the step do GPipe's "
        "stages sit idle?",
        f / (1 + f),
        ["Bubble time over ideal compute is (p − 1)/m, so the idle share of the step is (p − 1)/(m + p − 1).",
         f"({p} − 1)/({m} + {p} − 1) = **{f / (1 + f):.1%}** of the step. 1F1B idles as long; "
         + ("it holds fewer micro-batches' activations (p instead of m)." if m > p else
            f"with m ≤ p it holds as many as GPipe ({m}): 1F1B saves memory only when m > p.")])


def a2a_leaving_share(ep: int, tokens: int, top_k: int, hidden: int) -> Exercise:
    share = (ep - 1) / ep
    nbytes = tokens * top_k * hidden * 2 * share
    return Exercise(
        f"At ep = {ep}, with balanced routing, what share of a chip's {tokens:,} x {top_k} token copies leave "
        "it in the dispatch, and how many bytes is that (bf16, D = "
        f"{hidden:,})?",
        share,
        ["Each copy lands on a uniformly chosen rank of the group; 1/ep of them stay.",
         f"(ep − 1)/ep = **{share:.1%}**: {tokens:,} · {top_k} · {hidden:,} · 2 · {share:.3f} = "
         f"**{format_bytes(nbytes)}** per dispatch (the combine sends as much back)."])


def ring_kv_held(row: dict) -> Exercise:
    """`row`: ui.context_parallel.overlap_row (the page's own numbers)."""
    return Exercise(
        "How much K/V does a rank hold per layer with the ring, and with the all-gather variant?",
        row["allgather_kv_held_bytes"] / row["ring_kv_held_bytes"],
        ["The ring holds the block in use and the one arriving: 2 blocks; the all-gather holds all cp blocks.",
         f"Ring: **{format_bytes(row['ring_kv_held_bytes'])}**, all-gather: "
         f"**{format_bytes(row['allgather_kv_held_bytes'])}**, "
         f"{row['allgather_kv_held_bytes'] / row['ring_kv_held_bytes']:,.1f}x as much."])


def training_state_chips(m_params: float, name: str, chip: Chip) -> Exercise:
    state = 16 * m_params
    chips = math.ceil(state / chip.hbm_bytes)
    return Exercise(
        f"At least how many {chip.name} chips does {name}'s training state (bf16 weights and gradients, fp32 "
        "master weights and Adam moments) need before any activation?",
        chips,
        ["Mixed-precision Adam keeps 2 + 2 + 12 = 16 bytes per parameter; fully sharded (ZeRO-3) it spreads "
         "over the chips.",
         # in the chip table's units (GB, 10^9 bytes), the parameters in billions: no "8.03e+09", no "0.13 TB"
         f"16 bytes x {m_params / 1e9:,.3g} billion parameters = {state / 1e9:,.1f} GB over "
         f"{chip.hbm_bytes / 1e9:,.1f} GB per chip: "
         f"**{chips:,} chips**, before activations, buffers and fragmentation."])


def axes_leaving_the_domain(mesh, chip: Chip) -> Exercise:
    """Which axes of `mesh` (a core.mesh.Mesh) have groups that leave one scale-up domain."""
    from planner.costs import crosses_network

    domain = chip.scaleup_domain
    where = f"{chip.scaleup_link} domain" if chip.kind == "gpu" else "slice"
    axes = [a for a in reversed(mesh.names) if mesh.degree(a) > 1]
    leaving = [a for a in axes if crosses_network(mesh.degree(a), mesh.stride(a), chip, domain)]
    worked = [f"A group of n ranks whose members are s ranks apart spans n x s consecutive ranks; it stays in one "
              f"{where} of {domain:,} chips when n x s <= {domain:,} (ranks fill a {where} first)."]
    worked += [f"{a}: n = {mesh.degree(a)}, s = {mesh.stride(a)}: n x s = {mesh.degree(a) * mesh.stride(a):,} "
               f"{'>' if a in leaving else '<='} {domain:,}: {'leaves' if a in leaving else 'stays inside'}."
               for a in axes]
    answer = ", ".join(leaving) or "none"
    worked.append(f"So **{answer}** {'cross' if len(leaving) != 1 else 'crosses'} the network"
                  if leaving else "So **none**: every group stays inside one domain.")
    return Exercise(f"Which axes of this mesh have groups that leave one {where} of {chip.name}?", answer, worked)


def attention_crossover(m: ModelSpec) -> Exercise:
    """From what sequence length do a Transformer layer's attention scores cost more than its weights?"""
    from planner.flops import layer_attention_flops_per_token, layer_matmul_params

    kind = m.layer_kinds[0]
    weights = 2.0 * layer_matmul_params(m, kind)
    per_position = layer_attention_flops_per_token(m, 1)
    crossover = weights / per_position
    return Exercise(
        f"From what sequence length S do the attention scores (Q·Kᵀ and P·V) of one {m.name} layer cost more "
        "FLOPs per token than all its weight matmuls together?",
        crossover,
        [f"Weights: 2 FLOPs per weight per token, 2 x {layer_matmul_params(m, kind):,} = **{format_flops(weights)}** "
         "per token per layer, whatever S is.",
         f"Scores: each token meets S keys, 2·S·N·(2·d_head) = S x {per_position:,.0f} FLOPs per token per "
         "layer (the full S x S square).",
         f"Equal at S = {weights:,.0f} / {per_position:,.0f} = **{crossover:,.0f} tokens**"
         + (f" (6·D for a GPT layer with a 4D MLP: 6 x {m.hidden:,})" if m.mlp == "gelu" and m.ffn == 4 * m.hidden
            else "") + ". A Mamba-2 layer's scan costs the same per token at any S."])


def state_passing_chain(m: ModelSpec, cp: int) -> Exercise:
    """Hops and bytes of one Mamba-2 layer's state passing over cp ranks."""
    from planner.case import Layout
    from planner.costs import ssm_state_bytes

    one = ssm_state_bytes(m, Layout(dp=1, tp=1, pp=1, cp=cp, micro_batch=1))
    return Exercise(
        f"{m.name} is trained with context parallel cp = {cp} by state passing. In one layer's forward, for "
        "one sequence, how many transfers happen one after the other, and how many bytes is each?",
        f"{cp - 1} hops of {one:,.0f} bytes",
        [f"Rank r can pass its slice's final state on only after receiving rank r − 1's: the chain has "
         f"cp − 1 = **{cp - 1} hops** in sequence (the backward has as many, reversed).",
         f"Each hop carries one state per head: H x P x N = {m.ssm_heads} x {m.ssm_head_dim} x {m.ssm_state} "
         f"numbers in fp32 (the scan keeps its states in fp32): **{one:,.0f} bytes**, "
         f"{format_bytes(one)}, whatever S is.",
         "Compare ring attention: cp − 1 K/V blocks per layer that grow with S/cp, but each sent while the "
         "previous block's attention computes."])
