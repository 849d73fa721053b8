"""Auto-parallel search: every layout of the case's free fields, pruned, ranked by simulated step time.

The space: every factorisation num_chips = dp * tp * pp * cp, every ep dividing the expert count and
the ranks it is carved from (dp, core/mesh.py; tp x cp x dp where the experts fold the tp ranks,
Parallel.etp), every micro-batch size dividing the per-replica batch (1 with pipeline stages, as current
frameworks run them: `micro_batch_sizes`), every pipeline schedule and
number of virtual stages, ZeRO stage 0-3, recomputation none / selective / full, sequence parallel
on or off. Fields the case fixes are held; null fields are searched.

Pruning, each rule exact within the simulator's model (so the search is complete for its space):
* divisibility: tp must divide heads, hidden and ffn (and divide or be a multiple of kv_heads); cp
  must divide the sequence; dp * micro_batch must divide the global batch; pp * v <= layers; the
  interleaved schedule needs m divisible by pp (Megatron-LM's requirement).
* memory: a layout whose peak bytes per chip exceed the usable HBM is dropped.
* dominance: (a) every ZeRO stage is simulated: sharding shortens the optimizer update and splits the
  gradient sync into a reduce-scatter and an all-gather that hide differently, ZeRO-2 reduce-scatters
  every micro-batch and ZeRO-3 gathers every layer, so no stage always wins; (b) recomputation only
  adds time, so for each ZeRO stage only the lightest level that fits is simulated (`recompute_order`:
  none, Megatron's selective, on a TPU JAX's "dots", full); on a GPU, full recomputation covers only the
  fewest layers per chunk that fit (Megatron-Core's recompute_num_layers), and where a lighter mode fits
  but not none, that fewest-layers variant is simulated beside it, since either may cost less; (c) SP with
  tp > 1 moves the same bytes as plain TP and keeps and moves less through HBM, so SP on dominates;
  (d) GPipe has 1F1B's bubble and more memory, so 1F1B dominates; (e) TP stays inside one scale-up
  domain (NVLink node; TPU: the chip's scale-up domain) unless the case fixes it.
* Mamba-2 layers: tp must divide ssm_groups (and the SSM heads); with cp > 1 both CP variants are
  simulated (`training.ssm_cp`), the all-to-all one only where tp * cp divides the heads and groups.
  tests/planner/test_search.py checks (b)-(d) against brute force on small cases.

Ranking: by the step run pass by pass (planner.passes, what `estimate` reports and the timeline draws).
Every candidate is first costed with the closed-form pipeline time (planner.simulate.pipeline_time_s), fast
enough for thousands of layouts; those whose closed form could still enter the top run pass by pass (where
stages hold chunks of different sizes the two differ: by ~11 % for DeepSeek-V3's 61 layers on 16 stages of
3 chunks). A full ranking, with no `top`, stays closed-form.

How others search (for contrast): Alpa (Zheng et al. 2022) splits the problem into an inter-operator
dynamic program over pipeline stages and an intra-operator ILP over per-op shardings, which is
needed when every operator may shard differently; Galvatron (Miao et al. 2022) runs a dynamic program
over layers choosing per-layer hybrid strategies under a memory budget. Here every layer shares one
Megatron-style layout (the space practitioners use for homogeneous Transformers), which is small
enough to enumerate outright: no relaxation or heuristic is needed, hence completeness.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from hardware.chips import Chip
from hardware.kernels import FLASH_KERNELS
from planner import costs
from planner.case import (
    DEFAULT_RECOMPUTE_MODULES,
    PIPELINE_ENGINE_MAX_ZERO,
    SSM_CP,
    Case,
    Layout,
    dots_modelled,
    layout_tp_ok,
    recipe,
    ssm_alltoall_ok,
    zero_stage_runs,
)
from planner.costs import divisors
from planner.flops import mtp_kind, output_heads
from planner.memory import layer_kind_counts, memory_per_chip, stage_groups
from planner.models import ModelSpec, SpecError
from planner.simulate import StepResult, pipeline_p2p_s, simulate, usable_hbm_bytes
from planner.stages import chunks_of

ZERO_ORDER = (0, 1, 2, 3)
# The largest micro-batch (sequences per chip) the search tries when the case leaves it free. Published
# runs use 1 to 16 (planner/data); with a giant global batch (1e15 sequences, found by the fuzz test) the
# divisors of the per-replica batch alone took the search a minute.
MAX_MICRO_BATCH = 64
RECOMPUTE_ORDER = ("none", "selective", "full")


def recompute_order(m: ModelSpec, chip: Chip) -> tuple[str, ...]:
    """The recomputation policies the search tries, lightest first: on a TPU also JAX's "dots" (MaxText's
    remat_policy 'minimal', the matmul outputs kept; planner.case.RECOMPUTE), which the planner models for
    dense models, between the attention core alone and the whole layer."""
    if chip.kind == "tpu" and dots_modelled(m):
        return ("none", "selective", "dots", "full")
    return RECOMPUTE_ORDER


@dataclass(frozen=True)
class SearchResult:
    ranked: list[StepResult]  # fastest first
    evaluated: int  # layouts simulated
    considered: int  # layouts that passed divisibility (before bounds, memory and dominance pruning)
    elapsed_s: float


def _mesh_shapes(case: Case, chip: Chip) -> Iterator[tuple[int, int, int, int]]:
    m, p, n = case.model, case.parallel, case.cluster.num_chips
    # tp stays inside the scale-up domain: a GPU node (the case's chips_per_node), a TPU's slice (its ICI
    # torus; a TPU case's chips_per_node is the chips of one host, which ICI does not stop at)
    tp_cap = chip.scaleup_domain if chip.kind == "tpu" else case.cluster.chips_per_node or chip.scaleup_domain
    # each degree's candidates are the divisors below its own cap (tp: the scale-up domain; cp: the sequence;
    # pp: the layers), found without walking to sqrt(num_chips), which may be huge
    for tp in [p.tp] if p.tp else divisors(n, up_to=tp_cap):
        if not p.tp and not layout_tp_ok(m, tp):
            continue
        for cp in [p.cp] if p.cp else divisors(math.gcd(n // tp if n % tp == 0 else 1, m.seq_len)):
            if n % (tp * cp) or m.seq_len % cp:
                continue
            rest = n // (tp * cp)
            for pp in [p.pp] if p.pp else divisors(rest, up_to=m.layers):
                if rest % pp or pp > m.layers:
                    continue
                dp = rest // pp
                if p.dp and p.dp != dp:
                    continue
                if case.training.global_batch % dp:
                    continue
                yield dp, tp, pp, cp


# The most passes (forwards and backwards over every rank's model chunks) of one step's pipeline the planner
# runs pass by pass (planner.passes): 2^17 take it about a second; a 32M-token batch through pp 16 at dp 1 is
# 1.4M passes per candidate schedule, a minute of search. Layouts past it are left out (`no_layout_error` says so).
MAX_PIPELINE_PASSES = 2 ** 17


def _pipeline_passes(sched: str, pp: int, v: int, micro_batches: int, runs: int) -> int:
    """The passes planner.passes.plan builds for a step (at most: the gaps between runs are staged ZeRO-3's):
    a forward and a backward of each micro-batch through each model chunk, ZB-H1's backward in two."""
    return (3 if sched == "zb-h1" else 2) * pp * v * micro_batches * runs + (runs - 1) * pp


def _schedules(case: Case, pp: int, micro_batches: int, capped: bool = True) -> Iterator[tuple[str, int]]:
    """The (schedule, virtual stages) a layout of `pp` stages may run `micro_batches` per run with; `capped`:
    only those within MAX_PIPELINE_PASSES."""
    runs = case.training.schedule_runs or 1
    for sched, v in _all_schedules(case, pp, micro_batches):
        if not capped or pp == 1 or _pipeline_passes(sched, pp, v, micro_batches, runs) <= MAX_PIPELINE_PASSES:
            yield sched, v


def _all_schedules(case: Case, pp: int, micro_batches: int) -> Iterator[tuple[str, int]]:
    p, layers = case.parallel, case.model.layers
    if pp == 1:
        # one stage: every schedule is the same sequence of passes; a case that states a pipeline's schedule
        # (other than plain 1F1B) or its model chunks asks for stages
        if p.pp is not None or (p.pp_schedule in (None, "1f1b") and p.virtual_stages in (None, 1)):
            yield "1f1b", 1
        return
    # DeepSpeed's pipeline engine (pp_p2p "sequential") runs 1F1B only
    free = ["1f1b"] if case.training.pp_p2p == "sequential" else ["1f1b", "interleaved-1f1b", "zb-h1"]
    schedules = [p.pp_schedule] if p.pp_schedule else free
    for sched in schedules:
        if sched in ("1f1b", "gpipe", "zb-h1"):
            # the search leaves out ZB-H1 with fewer micro-batches than stages (it runs, with little to defer)
            if p.virtual_stages in (None, 1) and not (sched == "zb-h1" and micro_batches < pp and not p.pp_schedule):
                yield sched, 1
            continue
        if micro_batches % pp:
            continue
        # chunks of equal size within a stage: v divides the layers per stage
        vs = [p.virtual_stages] if p.virtual_stages else [v for v in divisors(layers // pp) if v >= 2]
        for v in vs:
            if pp * v <= layers:
                yield sched, v


def micro_batch_sizes(per_replica: int, pp: int) -> list[int]:
    """The micro-batch sizes a null `training.micro_batch` may take: 1 under pipeline parallelism, as
    current frameworks run pipelines (NeMo's pretraining recipes set micro_batch_size=1 with pp > 1, e.g.
    llama3_70b at tp 4, pp 4, vp 5, and every H100 tensor-parallel overlap config they ship is for
    micro-batch 1; Megatron-LM's example GPT-3 175B script: --micro-batch-size 1): the most micro-batches
    shrink the bubble. Without pipeline stages, every divisor of the replica's batch (the fastest that
    fits wins, as a run without gradient accumulation takes its whole local batch at once)."""
    return [1] if pp > 1 else divisors(per_replica, up_to=MAX_MICRO_BATCH)


def candidate_layouts(case: Case, chip: Chip, capped: bool = True) -> Iterator[Layout]:
    """Every layout that passes divisibility, with ZeRO and recompute left at their lightest values;
    `search` walks those two dimensions itself (dominance rules in the module docstring). `capped`: pipelines
    within MAX_PIPELINE_PASSES only."""
    m, t, p = case.model, case.training, case.parallel
    how = recipe(t, chip, case.model)
    for dp, tp, pp, cp in _mesh_shapes(case, chip):
        etp = tp if p.etp == "tp" else p.etp or 1  # Parallel.etp: null is 1 (the experts fold the tp ranks)
        if etp not in (1, tp):
            continue
        # the ranks ep is carved from: the dense layers' cp x dp ones, or with folded experts tp x cp x dp
        pool = dp * tp * cp if etp < tp else dp * cp
        eps = [p.ep] if p.ep else ([e for e in divisors(pool) if m.experts % e == 0] if m.is_moe else [1])
        for ep in eps:
            if pool % ep or (m.is_moe and m.experts % ep) or (not m.is_moe and ep > 1):
                continue
            runs = t.schedule_runs or 1
            if (t.global_batch // dp) % runs:
                continue
            per_run = t.global_batch // dp // runs  # sequences one run of the schedule takes per replica
            for b in [t.micro_batch] if t.micro_batch else micro_batch_sizes(per_run, pp):
                if per_run % b:
                    continue
                for sched, v in _schedules(case, pp, per_run // b, capped):
                    sps = [t.sequence_parallel] if t.sequence_parallel is not None else [tp > 1]
                    for sp, ssm_cp in itertools.product(sps, _ssm_cp_variants(case, tp, cp)):
                        if m.is_moe and tp > 1 and not sp:
                            continue  # Megatron-Core refuses MoE under tp without sequence parallelism
                        lay = Layout(dp, tp, pp, cp, ep, sched, v, b, 0, "none", bool(sp and tp > 1),
                                     **how, ssm_cp=ssm_cp, schedule_runs=runs, pp_layout=p.pp_layout,
                                     recompute_modules=t.recompute_modules or DEFAULT_RECOMPUTE_MODULES,
                                     recompute_layers=t.recompute_layers, etp=etp)
                        if t.recompute_layers and t.recompute_layers >= _most_layers(m, lay):
                            lay = replace(lay, recompute_layers=None)  # every layer of every chunk
                        yield lay


def _ssm_cp_variants(case: Case, tp: int, cp: int) -> list[str]:
    """How Mamba-2 layers run CP on this mesh: both variants where they differ and apply."""
    m, fixed = case.model, case.training.ssm_cp
    if not m.has_ssm or cp == 1:
        return [fixed or "state"]
    options = [fixed] if fixed else list(SSM_CP)
    return [o for o in options if o != "alltoall" or ssm_alltoall_ok(m, tp, cp)]


def _fitting_variants(case: Case, lay: Layout, hbm: float, chip: Chip) -> Iterator[Layout]:
    """For each ZeRO stage, the lightest recomputation that fits (dominance rule (a), (b)), and, on a GPU
    with the recomputation free, full recomputation of the fewest layers per chunk that fits
    (`_fewest_recomputed`) wherever a lighter mode than full fits only by recomputing something."""
    t = case.training
    recomputes = [t.recompute] if t.recompute else [r for r in recompute_order(case.model, chip)
                                                     if not (r == "selective" and lay.attention in FLASH_KERNELS)]
    zeros = [t.zero_stage] if t.zero_stage is not None else list(ZERO_ORDER)
    if lay.dp * lay.cp == 1 and t.zero_stage is None:
        zeros = [0]  # nothing to shard over
    zeros = [z for z in zeros if zero_stage_runs(t, lay.pp, z)]  # DeepSpeed's pipelines: ZeRO-1 at most
    m_batches = t.global_batch // (lay.dp * lay.micro_batch)

    def fits(cand: Layout) -> bool:
        return memory_per_chip(case.model, cand, m_batches, t.optimizer, t.dtype).total_bytes <= hbm

    some_layers = t.recompute is None and t.recompute_layers is None and chip.kind == "gpu"
    for z in zeros:
        for rc in recomputes:
            cand = replace(lay, zero_stage=z, recompute=rc)
            if not fits(cand):
                continue
            if some_layers and rc != "none":
                fewer = _fewest_recomputed(case.model, replace(cand, recompute="full"), fits)
                if rc == "full":
                    cand = fewer  # it recomputes no more than every layer
                elif fewer is not None and fewer.recompute_layers is not None:
                    yield fewer  # it may cost less than the lighter mode on every layer
            yield cand
            break


def _most_layers(m: ModelSpec, lay: Layout) -> int:
    """The most transformer layers one chunk of `lay` holds: a recompute_layers count this large covers every
    layer of every chunk."""
    return max(c.layers for stage in chunks_of(m, lay) for c in stage)


def _fewest_recomputed(m: ModelSpec, lay: Layout, fits) -> Layout | None:
    """`lay` (full recomputation) with the fewest layers per chunk recomputed whose memory `fits`
    (Megatron-Core's recompute_num_layers, block method); None (every layer) when only all of them fit,
    and None too when even all do not. Memory falls as more layers are recomputed, so the smallest
    count is found by bisection."""
    if not fits(lay):
        return None
    most = _most_layers(m, lay)
    low, high = 1, most  # `high` layers fit (every layer: `lay` itself)
    while low < high:
        mid = (low + high) // 2
        if fits(replace(lay, recompute_layers=mid)):
            high = mid
        else:
            low = mid + 1
    return replace(lay, recompute_layers=None if high == most else high)


def lower_bound_s(case: Case, lay: Layout, chip: Chip) -> float:
    """A step time no variant of `lay` (any ZeRO stage, any recomputation) can beat.

    Every variant runs each layer's forward and backward compute and its TP / CP / EP collectives
    (recomputation and ZeRO-3 only add to them), the loss chunk's logits (once per output head), the MTP
    modules, and each chunk's pipeline sends; so stage s takes at least S_s = sum of its layers' c_kind
    (+ the logits and MTP modules where it holds them) + 2 v * p2p per
    micro-batch, c_kind the per-layer cost of each kind it holds (a DeepSeek-V3 stage of MoE layers costs
    what MoE layers cost, not what its dense first layers do). Stage s cannot start before a forward has
    passed every stage before it, nor finish before its last backward has passed back through them, so
    T >= m * S_s + the smallest chunk of each stage before s, for every s (the closed form's fill, the
    other stages' whole S / v, is no floor: a heavy first stage's warm-up forwards hide the others' fill).
    """
    m, t = case.model, case.training
    node = case.cluster.chips_per_node or chip.scaleup_domain
    base = replace(lay, zero_stage=0, recompute="none")
    cost = {}
    for kind in m.kinds:
        lc = costs.layer_cost(m, base, chip, t.dtype, kind, node)
        cost[kind] = (lc.fwd_compute_s + lc.bwd_compute_s + lc.tp_fwd_s + lc.tp_bwd_s + lc.cp_fwd_s
                      + lc.cp_bwd_s + lc.ep_fwd_s + lc.ep_bwd_s)
    logits = output_heads(m) * sum(costs.logits_cost(m, base, chip, t.dtype))
    mtp = cost[mtp_kind(m)] + sum(costs.mtp_extra_cost(m, base, chip, t.dtype)) if m.mtp_layers else 0.0
    p2p = pipeline_p2p_s(m, lay, chip, node)
    plan = chunks_of(m, lay)
    groups = stage_groups(m, lay)
    by_group = {}
    for i in sorted(set(groups)):  # stages of one group cost the same
        chunks = [sum(cost[k] * n for k, n in layer_kind_counts(m, c.first, c.layers))
                  + c.mtp * mtp + (logits if c.loss else 0.0) + 2 * p2p for c in plan[i]]
        by_group[i] = (sum(chunks), min(chunks))
    micro_batches = t.global_batch // (lay.dp * lay.micro_batch)
    # ZB-H1 fills with F + B - 2W, which this bound does not split out: count no fill for it; each run of
    # the schedule fills and drains
    bound, before = 0.0, 0.0
    for g in groups:
        stage, smallest = by_group[g]
        bound = max(bound, micro_batches * stage + (0.0 if lay.pp_schedule == "zb-h1" else lay.schedule_runs * before))
        before += smallest
    return bound


# How far below the closed form a pass-by-pass step can come out: the closed form charges every other stage's
# whole fill and drain, which a heavier stage's warm-up partly hides (Llama 3 70B on 64 stages of v5p, 16 of
# them two layers: 4.5 % below; Llama 3.1 405B on 8 stages of 2 chunks: 1.9 %). A layout whose closed-form
# step is this much above the top-th pass-by-pass step is taken not to enter the ranking. A split a run states
# (pp_layout) can put one stage far heavier than the rest (17 layers of 32 on the first of 4: 19 % below),
# and such a variant can then be missed; branch and bound's own bound (`lower_bound_s`) holds pass by pass.
CLOSED_FORM_SLACK = 0.05
# How far above the closed form a pass-by-pass step can come out (DeepSeek-V3's 61 layers on 16 stages of 3
# chunks: 11 %): branch and bound keeps every layout whose floor is within this of the top-th closed form.
CLOSED_FORM_ABOVE = 0.15


def rank_key(res: StepResult) -> tuple:
    """Fastest first; a tie (the same step time, e.g. context-parallel degrees whose K/V ring hides
    completely under attention) goes to the layout with less memory per chip, then to the one with fewer
    chips in its model-parallel groups (tp x pp x cp), the simpler to run."""
    lay = res.layout
    return res.step_time_s, res.memory.total_bytes, lay.tp * lay.pp * lay.cp


def search(case: Case, top: int | None = None) -> SearchResult:
    """Rank every fitting layout of `case`'s free fields by simulated step time (fastest first): with
    `top`, the `top` best run pass by pass (planner.passes); without, every fitting layout by the closed
    form (the module docstring's "Ranking").

    With `top`, branch and bound: layouts are simulated closed-form in order of `lower_bound_s`, until the
    bound passes the top-th closed-form step by CLOSED_FORM_ABOVE; then they run pass by pass, best closed form
    first, until a closed-form step less CLOSED_FORM_SLACK is not below the top-th pass-by-pass one.
    """
    cl = case.cluster
    chip = costs.case_chip(cl)
    if case.training.dtype == "fp16" and chip.kind == "tpu":
        raise SpecError("training.dtype", f"{chip.name} has no fp16 matrix unit; use bf16")
    if case.training.dtype == "fp8" and chip.fp8_flops_per_s is None:
        raise SpecError("training.dtype", f"{chip.name} has no fp8 matrix unit; use bf16")
    hbm = usable_hbm_bytes(chip)
    start = time.perf_counter()
    layouts = list(candidate_layouts(case, chip))
    if top:
        bounded = sorted(((lower_bound_s(case, lay, chip), i) for i, lay in enumerate(layouts)))
        order = [(b, layouts[i]) for b, i in bounded]
    else:
        order = [(0.0, lay) for lay in layouts]
    results: list[StepResult] = []
    kth = []  # the `top` best closed-form step times so far, ascending
    for bound, lay in order:
        # a layout whose bound (a floor pass by pass too) is this far above the top-th closed-form step cannot
        # enter the pass-by-pass top
        if top and len(kth) >= top and bound >= kth[-1] * (1 + CLOSED_FORM_ABOVE):
            break
        for cand in _fitting_variants(case, lay, hbm, chip):
            res = simulate(case, cand, chip, exact=False)
            results.append(res)
            if top:
                bisect.insort(kth, res.step_time_s)
                del kth[top:]
    if not top:  # a full ranking stays closed-form: pass by pass, thousands of pipelined layouts take minutes
        ranked = sorted(results, key=rank_key)
    else:  # pass by pass, best closed form first, until the closed form (less the slack) cannot enter the top
        ranked, best = [], []
        for res in sorted(results, key=rank_key):
            if len(best) >= top and res.step_time_s * (1 - CLOSED_FORM_SLACK) >= best[-1]:
                break
            # one stage: no schedule to run, the closed form is the step
            ranked.append(res if res.layout.pp == 1 else simulate(case, res.layout, chip, res.memory))
            bisect.insort(best, ranked[-1].step_time_s)
            del best[top:]
        ranked = sorted(ranked, key=rank_key)[:top]
    elapsed = time.perf_counter() - start
    return SearchResult(ranked, len(results), len(layouts), elapsed)


def choose(case: Case) -> StepResult:
    """The fastest layout that fits for the case's null fields (the estimate when everything is fixed).

    When nothing fits, the layout needing the least memory per chip is simulated and returned with
    fits = False, so the caller still sees its step time and how far over the memory it is.
    """
    res = search(case, top=1)
    if res.ranked:
        return res.ranked[0]
    return leanest(case)


def leanest(case: Case) -> StepResult:
    """The layout needing the least memory per chip, simulated (fits False where nothing fits)."""
    cl, t = case.cluster, case.training
    chip = costs.case_chip(cl)
    best, best_bytes = None, float("inf")
    for lay in candidate_layouts(case, chip):
        zero = t.zero_stage if t.zero_stage is not None else (3 if lay.dp * lay.cp > 1 else 0)
        if not zero_stage_runs(t, lay.pp, zero):
            if t.zero_stage is not None:
                continue  # a stage the case fixed, which this layout's pipeline cannot run
            zero = PIPELINE_ENGINE_MAX_ZERO
        cand = replace(lay, zero_stage=zero, recompute=t.recompute or "full")
        need = memory_per_chip(case.model, cand, t.global_batch // (lay.dp * lay.micro_batch),
                               t.optimizer, t.dtype).total_bytes
        if need < best_bytes:
            best, best_bytes = cand, need
    if best is None:
        raise no_layout_error(case, chip)
    return simulate(case, best, chip)


# the stated fields that can leave no layout, in the order a message names them (the batch's split first)
_BLOCKING = (("training", "micro_batch"), ("training", "schedule_runs"), ("parallel", "virtual_stages"),
             ("parallel", "pp_schedule"), ("parallel", "ep"), ("parallel", "etp"), ("parallel", "pp"),
             ("parallel", "cp"), ("parallel", "tp"), ("parallel", "dp"), ("training", "sequence_parallel"),
             ("training", "ssm_cp"))


def no_layout_error(case: Case, chip: Chip) -> SpecError:
    """Why no layout divides evenly: the first stated field (`_BLOCKING`) without which one would, named with
    its value; else the cluster's size."""
    cl = case.cluster
    where = f"{case.model.name} on {cl.num_chips} x {cl.chip}"
    fewest = min((_pipeline_passes(lay.pp_schedule, lay.pp, lay.virtual_stages, case.training.global_batch
                                   // lay.dp // lay.micro_batch // lay.schedule_runs, lay.schedule_runs)
                  for lay in itertools.islice(candidate_layouts(case, chip, capped=False), 10_000)), default=0)
    if fewest > MAX_PIPELINE_PASSES:  # layouts divide, but only as pipelines too long to run pass by pass
        return SpecError("training.global_batch", f"its {case.training.global_batch:,} sequences make every pipeline "
                         f"layout of {where} that divides evenly run {fewest:,} passes or more a step, more than "
                         f"the {MAX_PIPELINE_PASSES:,} the planner simulates: fewer micro-batches per pipeline (a "
                         "smaller global batch, a larger micro_batch, more dp) or no pipeline stages")
    for block, name in _BLOCKING:
        value = getattr(case.training if block == "training" else case.parallel, name)
        if value is None:
            continue
        if block == "training":
            relaxed = replace(case, training=replace(case.training, **{name: None}))
        else:
            relaxed = replace(case, parallel=replace(case.parallel, **{name: None}))
        try:
            if next(candidate_layouts(relaxed, chip), None) is not None:
                hint = (" (ep's ranks are carved from the data-parallel ones, dp x cp, and from tp's too when the "
                        "experts fold them, etp 1)") if name == "ep" else ""
                return SpecError(f"{block}.{name}", f"{value!r} leaves no layout of {where} that divides evenly (the "
                                 f"global batch of {case.training.global_batch:,} into data-parallel replicas, "
                                 "micro-batches and pipeline runs; heads, hidden, ffn, layers, experts and sequence "
                                 f"against the mesh){hint}: change it, or set it to null for the planner to choose")
        except SpecError:
            continue
    return SpecError("parallel", f"no layout of {where} divides evenly (heads, hidden, ffn, layers, sequence and "
                     "batch against the mesh); free more fields (null) or change the chip count")
