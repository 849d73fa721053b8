"""The bound meter: is a strategy's communication hidden under its math, per layer, and the rule behind it.

The scaling book's rules ([SB] Part 5, "How to Parallelize a Transformer for Training"), with peak bf16
FLOP/s C and the bandwidth W the strategy's collectives use, latency left out:

* data parallel (one all-reduce of the gradients, under the backward) and FSDP / ZeRO-3 (all-gather the
  weights under each pass, reduce-scatter the gradients under the backward): per layer of P parameters
  and B tokens per chip, math 4 B P / C per pass against communication 4 P / W (DP, backward) or 2 P / W
  per collective (FSDP): **compute-bound while B > C / W**. On TPU v5p over one ICI axis:
  4.59e14 / 1.8e11 = 2,550 tokens per chip ([SB]: "2550").
* tensor parallel over Y chips (activations all-gathered and reduce-scattered around each MLP): math
  4 B D F / (Y C) against communication 4 B D / W per pass: **compute-bound while Y < F / (C / W)**, F
  the MLP width ([SB]: "Y < F / 2550" on v5p), independent of the batch.

* expert parallel over ep chips (each token's k copies dispatched to their experts and combined back,
  all-to-all, (ep - 1) / ep of them leaving the chip): per token copy the expert's forward math
  2 n D F / C (n = 3 matrices for SwiGLU, 2 for GELU) against dispatch + combine 2 x 2 D (ep - 1) / ep / W:
  **compute-bound while F > (2 / n) (ep - 1) / ep x C / W**, F the expert's width, independent of the
  batch and of k (derived the same way; an all-to-all cannot reduce inside the node first, so across
  nodes each GPU's own network card carries the rows that leave the node, (ep - d) / ep of them for d
  members in a node, the rest staying on its NVLink: W as hardware.collectives costs the all-to-all).

W, as [SB] uses it: a TPU group on a wrapped torus axis gets two links in each direction, over M axes M times
that, read from the job's slice by the collective model (`torus_bandwidth`: a line along part of an axis
gets one, a group across slices the DCN); a GPU
group inside its NVLink node gets the GPU's NVLink bandwidth (H100: 989e12 / 450e9 = 2,200); a group
that crosses nodes, reducing inside the node first, gets the node's network egress (8 x 50 GB/s = 400 GB/s
per H100 node: 2,475).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hardware.chips import Chip
from hardware.collectives import Hierarchy, Torus, group_topology, mesh_share
from planner.flops import layer_params
from planner.models import ModelSpec


@dataclass(frozen=True)
class Bound:
    strategy: str  # "dp", "fsdp" or "tp"
    math_s: float  # one layer's math that can hide the communication (per pass, or the backward for dp)
    comm_s: float  # the communication it has to hide
    intensity: float  # C / W of the group's links: the threshold of the rule
    link: str  # which links, in words
    rule: str  # the rule with its numbers

    @property
    def compute_bound(self) -> bool:
        return self.math_s >= self.comm_s

    @property
    def verdict(self) -> str:
        if self.compute_bound:
            return "compute-bound: the communication can hide under the math"
        return "communication-bound: the communication takes longer than the math it could hide under"


def group_bandwidth(chip: Chip, n: int, stride: int, chips_per_node: int | None = None,
                    hierarchical: bool = True) -> tuple[float, str]:
    """(W in bytes/s, the links in words) for a group of n chips `stride` apart, as [SB] counts it;
    `hierarchical`: the collective reduces inside a node before crossing the network (not an all-to-all)."""
    if chip.kind != "gpu":
        return torus_bandwidth(chip, n, stride, all_to_all=not hierarchical)
    node = chips_per_node or chip.scaleup_domain
    if n * stride <= node:
        share = mesh_share(chip, n, node)  # a mesh-linked node (MI300X): a pair shares one of seven links
        links = "" if share == 1 else f" ({share * (node - 1):g} of its {node - 1} links)"
        return chip.scaleup_bytes_per_s * share, f"{chip.scaleup_link} inside a node of {node}{links}"
    # reducing inside the node first, the group's members in one node share their NICs: all of them only when
    # the group is consecutive (tp inside the node leaves one member per node, with one NIC: 50 GB/s, not 400)
    per_node = max(1, min(n, node // stride))
    if hierarchical and per_node > 1:
        return (chip.scaleout_bytes_per_s * per_node,
                f"the network between nodes ({per_node} of the group's NICs per node)")
    if not hierarchical:
        # an all-to-all cannot reduce inside the node first, but its rows for the node's own members stay on the
        # node's links: W as the collective model costs it (the meter had sent every row that leaves the chip
        # through the NIC, 35 ms at DeepSeek-V3's ep = 16 on H100 where the page's own table, at achievable
        # links, said 21)
        topo = group_topology(chip, n, stride, scaleup_domain=node)
        leave = (f"{n - topo.domain_size} of every {n} rows leave the node" if isinstance(topo, Hierarchy) else
                 "every row leaves the node")
        return _slope_bandwidth(topo, n, all_to_all=True), f"the network between nodes (each GPU's own NIC; {leave})"
    return chip.scaleout_bytes_per_s, "the network between nodes (each GPU's own NIC)"


def torus_bandwidth(chip: Chip, n: int, stride: int, all_to_all: bool = False) -> tuple[float, str]:
    """(W, the links in words) of a TPU group on `chip`'s slice (`chip.torus_shape`: pass the job's slice,
    planner.costs.cluster_chip), read from the collective model (hardware.collectives.group_topology, peak
    links as [SB] counts them): the bytes per second its all-gather (or all-to-all) moves per chip,
    (n - 1) / n V over the time V adds, latency left out. On a wrapped axis that is two links each way, [SB]'s
    W; over M axes M times that ([SB]'s M_X: "850" for FSDP over a 16 x 16 x 16 slice's three); a line along
    part of an axis has one link at its ends; a group across slices shares the DCN. (The meter had given every
    group one wrapped axis.)"""
    n = max(n, 2)  # a group of one sends nothing: the smallest group's links, for the rule's C / W
    topo = group_topology(chip, n, stride)
    w = _slope_bandwidth(topo, n, all_to_all)
    if isinstance(topo, Hierarchy):
        slices = topo.n // topo.domain_size
        if isinstance(topo.inner, Torus):
            return w, f"{_torus_words(topo.inner)} in each of {slices} slices, the DCN between them"
        return w, f"the DCN between {slices} slices"
    return w, _torus_words(topo) if isinstance(topo, Torus) else "the DCN between slices"


def _torus_words(topo: Torus) -> str:
    axes = [a for a in topo.axes if a.size > 1]
    sizes = " x ".join(f"{a.size}" for a in axes)
    if all(a.wraparound for a in axes):
        links = "wrapped: two links each way" if len(axes) == 1 else "each wrapped: two links each way on each"
    elif not any(a.wraparound for a in axes):
        links = "no wraparound: one link at a line's ends"
    else:
        links = "; ".join(f"{a.size} {'wrapped' if a.wraparound else 'without wraparound'}" for a in axes)
    return f"{len(axes)} ICI ax{'is' if len(axes) == 1 else 'es'} of {sizes} chips ({links})"


_PROBE_BYTES = 1e9  # the message sizes the slope of a collective's time is read between (any two sizes do)


def _slope_bandwidth(topo, n: int, all_to_all: bool) -> float:
    """The bytes per second a group's all-gather (or all-to-all) moves per chip in the collective model, (n - 1) /
    n V over the time V adds (latency and pipeline fill left out, as [SB]'s rules leave them)."""
    cost = topo.all_to_all_s if all_to_all else topo.all_gather_s
    return (n - 1) / n * _PROBE_BYTES / (cost(2 * _PROBE_BYTES) - cost(_PROBE_BYTES))


def _c_over_w(c: float, w: float) -> str:
    """C / W in the units the chips table quotes them in: 989 TFLOP/s / 450 GB/s."""
    def sig(x: float) -> str:
        return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"
    return f"{sig(c / 1e12)} TFLOP/s / {sig(w / 1e9)} GB/s"


def data_parallel_bound(m: ModelSpec, chip: Chip, tokens_per_chip: float, dp: int, stride: int = 1,
                        fsdp: bool = False, chips_per_node: int | None = None) -> Bound:
    """DP or FSDP over `dp` chips `stride` apart with `tokens_per_chip` tokens each per step, per dense
    layer of P parameters (an MoE layer moves all its experts but computes only k of them: worse)."""
    p = layer_params(m, False)
    params = p.attention + p.mlp
    c = chip.peak_flops_per_s("bf16")
    w, link = group_bandwidth(chip, dp, stride, chips_per_node)
    if fsdp:  # per pass: the forward's 2 B P FLOPs against one all-gather of the bf16 weights (2P bytes)
        math_s, comm_s = 2 * tokens_per_chip * params / c, 2 * params / w
    else:  # the backward's 4 B P FLOPs against the all-reduce of the bf16 gradients (2 x 2P bytes)
        math_s, comm_s = 4 * tokens_per_chip * params / c, 4 * params / w
    alpha = c / w
    name = "FSDP" if fsdp else "Data parallel"
    rule = (f"{name} on {chip.name} over {link} is compute-bound while tokens per chip > C / W = "
            f"{_c_over_w(c, w)} = {alpha:,.0f}; here {tokens_per_chip:,.0f}")
    return Bound("fsdp" if fsdp else "dp", math_s, comm_s, alpha, link, rule)


def mlp_matrices(m: ModelSpec) -> int:
    """The MLP's weight matrices: a SwiGLU MLP's gate, up and down, else two."""
    return 3 if m.mlp == "swiglu" else 2


def tensor_parallel_bound(m: ModelSpec, chip: Chip, tokens_per_chip: float, tp: int,
                          chips_per_node: int | None = None) -> Bound:
    """TP over `tp` consecutive chips: each MLP's activations gathered in and reduced out. The scaling book's
    rule, Y < F / (C / W), is for an MLP of two matrices; a SwiGLU MLP's third (its gate reads the same gathered
    input) adds half the math and nothing to send: Y < 1.5 x F / (C / W), as `expert_parallel_bound` counts
    its n matrices (the meter had counted two for Llama, and called its TP communication-bound at 6.5)."""
    c = chip.peak_flops_per_s("bf16")
    w, link = group_bandwidth(chip, tp, 1, chips_per_node)
    f, d = (m.dense_ffn_ if m.is_moe else m.ffn), m.hidden
    n = mlp_matrices(m)
    math_s = 2 * n * tokens_per_chip * d * f / (tp * c)
    comm_s = 4 * tokens_per_chip * d / w
    alpha = c / w
    limit = n / 2 * f / alpha
    factor = "" if n == 2 else f"{n / 2:g} x "
    rule = (f"Tensor parallel on {chip.name} over {link} is compute-bound while Y < {factor}F / (C / W) = "
            f"{factor}{f:,} / {alpha:,.0f} = {limit:,.1f}" + (" (a SwiGLU MLP's three matrices)" if n == 3 else "")
            + f"; here Y = {tp}")
    return Bound("tp", math_s, comm_s, alpha, link, rule)


def expert_parallel_bound(m: ModelSpec, chip: Chip, tokens_per_chip: float, ep: int, stride: int = 1,
                          chips_per_node: int | None = None) -> Bound:
    """EP over `ep` chips `stride` apart: one MoE layer's forward expert math against its dispatch and
    combine all-to-alls."""
    c = chip.peak_flops_per_s("bf16")
    w, link = group_bandwidth(chip, ep, stride, chips_per_node, hierarchical=False)
    n = mlp_matrices(m)
    copies = tokens_per_chip * max(1, m.top_k)
    math_s = 2 * n * copies * m.hidden * m.ffn / c
    comm_s = 2 * 2 * copies * m.hidden * (ep - 1) / ep / w
    alpha = c / w
    limit = 2 / n * (ep - 1) / ep * alpha
    rule = (f"Expert parallel on {chip.name} over {link} is compute-bound while the expert width F > "
            f"(2 / {n}) x (ep - 1) / ep x C / W = {limit:,.0f}; here F = {m.ffn:,}")
    return Bound("ep", math_s, comm_s, alpha, link, rule)


def divisors(n: int) -> list[int]:
    """The divisors of n in order, in sqrt(n) steps (a loop to n had hung the meshes page at 2^32 chips)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class TradeoffRow:
    """One way to split N chips into X-way FSDP x Y-way tensor parallel, per layer's forward pass."""

    fsdp: int  # X
    tp: int  # Y
    fsdp_s: float  # all-gathering the n matrices' bf16 weights: 2 n D F / (Y W_X)
    tp_s: float  # gathering and reduce-scattering the activations: 4 B D / (X W_Y)
    math_s: float  # 2 n B D F / (N C)

    @property
    def comm_s(self) -> float:
        return self.fsdp_s + self.tp_s


@dataclass(frozen=True)
class FsdpTpTradeoff:
    rows: tuple[TradeoffRow, ...]  # every X dividing N (Y = N / X dividing the MLP width)
    best: TradeoffRow  # the least communication
    x_opt: float | None  # the continuous optimum, where [SB]'s closed form is used (else None)
    min_tokens_per_chip: float  # below this batch per chip even the best mix is communication-bound
    rule: str
    matrices: int  # the MLP's weight matrices counted (`mlp_matrices`)


def fsdp_tp_tradeoff(m: ModelSpec, chip: Chip, batch_tokens: float, n: int,
                     chips_per_node: int | None = None) -> FsdpTpTradeoff:
    """[SB] Part 5, "Combining FSDP and tensor parallelism", per layer's forward pass (the MLP's matmuls; the
    most communication per FLOP), B the batch in tokens over the N = X Y chips, n the MLP's matrices:

        T_fsdp = 2 n D F / (Y W_X)   FSDP moves bf16 weights: less as Y grows
        T_tp   = 4 B D / (X W_Y)     tensor parallel moves activations: less as X grows
        T_math = 2 n B D F / (N C)

    W_X and W_Y are the links each split's groups get (`group_bandwidth`: tp innermost, so the FSDP group's
    members are Y apart). On a TPU they count the torus axes the group spans ([SB]'s W M_X and W M_Y), read
    from `chip`'s slice: pass the job's (planner.costs.cluster_chip). The sum is least at X_opt = sqrt((2 / n)
    B N W_X / (F W_Y)) ([SB]'s quadratic, minimised) and stays under the math for some X while B / N > (8 / n)
    alpha_X alpha_Y / F, alpha = C / W: on a 4 x 4 x 4 TPU v5p slice with [SB]'s two-matrix MLP (n = 2), the
    16-way FSDP group spans two wrapped axes and the 4-way TP group one, 2 x 1275 x 2550 / F ([SB]: "around
    396" for F = 32,768). A SwiGLU MLP's third matrix (n = 3) adds weights to gather and math, not activations
    (its gate reads the same gathered input): X_opt falls by sqrt(2/3), the floor by 2/3."""
    c = chip.peak_flops_per_s("bf16")
    d, f = m.hidden, (m.dense_ffn_ if m.is_moe else m.ffn)
    n_mat = mlp_matrices(m)
    rows, w_xs, w_ys = [], set(), set()
    for x in divisors(n):
        y = n // x
        if f % y:
            continue
        w_x, _ = group_bandwidth(chip, x, y, chips_per_node)
        w_y, _ = group_bandwidth(chip, y, 1, chips_per_node)
        w_xs.update([w_x] if x > 1 else [])
        w_ys.update([w_y] if y > 1 else [])
        rows.append(TradeoffRow(x, y, 2 * n_mat * d * f / (y * w_x) if x > 1 else 0.0,
                                4 * batch_tokens * d / (x * w_y) if y > 1 else 0.0,
                                2 * n_mat * batch_tokens * d * f / (n * c)))
    best = min(rows, key=lambda r: r.comm_s)
    per_chip = batch_tokens / n
    verdict = "compute-bound" if best.comm_s <= best.math_s else "communication-bound"
    # [SB]'s closed form where every split has the same links, and on a TPU, as [SB] uses it there: with the
    # best split's axes (its M_X, M_Y), which the splits near the optimum share
    if chip.kind != "gpu" or (len(w_xs) <= 1 and len(w_ys) <= 1):
        w_x, _ = group_bandwidth(chip, max(best.fsdp, 2), best.tp, chips_per_node)
        w_y, _ = group_bandwidth(chip, max(best.tp, 2), 1, chips_per_node)
        x_opt = math.sqrt(2 / n_mat * batch_tokens * n * w_x / (f * w_y))
        floor = 8 / n_mat * (c / w_x) * (c / w_y) / f
        rule = (f"Mixed FSDP + tensor parallel of {m.name} on {n:,} {chip.name} stays compute-bound while tokens "
                f"per chip > (8 / {n_mat} MLP matrices) alpha_X alpha_Y / F = {floor:,.0f} (F = {f:,}; alpha_X = "
                f"{c / w_x:,.0f}, alpha_Y = {c / w_y:,.0f}); "
                f"here {per_chip:,.0f}. The least communication is at X = {best.fsdp:,} FSDP x Y = {best.tp:,} TP "
                f"(X_opt = {x_opt:,.1f}" + (f", beyond the {n:,} chips: pure FSDP moves least" if x_opt >= n else "")
                + f"): {verdict}.")
    else:
        # across GPU nodes a group's links change with the split (a node's NICs are shared by its members of
        # the group, `group_bandwidth`): no closed form; each split is compute-bound from its own batch, its
        # weights' time over what the math beats the activations by, and the floor is the least of them
        def threshold(r: TradeoffRow) -> float:
            margin = (r.math_s - r.tp_s) / batch_tokens
            return r.fsdp_s / margin if margin > 0 else math.inf

        x_opt = None
        floor = min(threshold(r) for r in rows) / n
        rule = (f"Mixed FSDP + tensor parallel of {m.name} on {n:,} {chip.name} stays compute-bound while tokens "
                f"per chip > {floor:,.0f} (F = {f:,}, {n_mat} MLP matrices; the lowest of the splits' own thresholds, "
                f"for across nodes the links a group gets change with the split, so the scaling book's closed form "
                f"does not hold); "
                f"here {per_chip:,.0f}. The least communication is at X = {best.fsdp:,} FSDP x Y = {best.tp:,} TP: "
                f"{verdict}.")
    return FsdpTpTradeoff(tuple(rows), best, x_opt, floor, rule, n_mat)


def cross_pod_bound(m: ModelSpec, chip: Chip, tokens_per_pod: float) -> Bound:
    """[SB] Part 5, "Scaling between pods": pure data parallel between pods (TPU) or NVLink nodes (GPU) over
    the data-centre network, everything else inside: per pod and layer, the backward's math 4 B_pod P / C_pod
    against the gradient all-reduce 4 P / W_pod: compute-bound while the batch per pod > C_pod / W_pod, which
    is one chip's C over its own network bandwidth, whatever the pod's size (v5p: 4.59e14 / 6.25e9 =
    73,440 tokens per pod; [SB] rounds to "about 76,000")."""
    p = layer_params(m, False)
    params = p.attention + p.mlp
    c, w = chip.peak_flops_per_s("bf16"), chip.scaleout_bytes_per_s
    alpha = c / w
    pod = "pod" if chip.kind != "gpu" else f"{chip.scaleup_link} node"
    rule = (f"Data parallel between {pod}s of {chip.name} over the data-centre network is compute-bound while "
            f"tokens per {pod} > C / W_network = {_c_over_w(c, w)} = {alpha:,.0f}; here {tokens_per_pod:,.0f}")
    return Bound("dp", 4 * tokens_per_pod * params / c, 4 * params / w, alpha, f"the network between {pod}s", rule)
