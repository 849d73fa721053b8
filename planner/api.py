"""The planner's pure-function API for pages and the CLI: `estimate` one case, `search` its layouts.

    est = estimate({"model": ..., "training": ..., "parallel": ..., "cluster": ...})
    est.step_time_s, est.mfu, est.memory.as_dict(), est.fits, est.breakdown, est.timeline

A case may be a `Case`, a dict shaped like a case file, or a path to one. Null fields are chosen by
the search (`est.chosen` says what was picked, less the fields that do nothing for the layout picked: a
pipeline schedule without pipeline stages, say; `chosen_fields`).

For comparing architectures (Transformer, Mamba-2, hybrids): `compare_architectures` (the best layout
of each model on one cluster), `flops_per_token_by_seq` (forward FLOPs per token as the sequence
grows) and `layer_comm_bytes` (what each strategy moves for one layer). They call the functions the
estimate uses (planner.flops, planner.costs), so their numbers are the estimate's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property

from core.timeline import Timeline
from hardware.chips import CHIPS, get_chip
from hardware.collectives import ring_sent_bytes
from planner import costs
from planner import layout_search as _search
from planner.case import (
    RECIPE_CHOICES,
    RECIPE_DEFAULTS,
    Case,
    Cluster,
    Layout,
    check_fixed,
    load_case,
    parse_case,
    recipe_choices,
    ssm_alltoall_ok,
    ssm_tp_ok,
    transformer_tp_ok,
)
from planner.flops import (
    attention_flops_per_token,
    layer_params_on_chip,
    matmul_flops_per_token,
    ssm_flops_per_token,
    total_params,
)
from planner.models import MAMBA, ModelSpec, SpecError
from planner.simulate import StepResult, usable_hbm_bytes

_CHOICE_FIELDS = {
    "parallel": ("dp", "tp", "pp", "cp", "ep", "etp", "pp_schedule", "virtual_stages"),
    "training": ("micro_batch", "schedule_runs", "recompute", "recompute_layers", "zero_stage", "sequence_parallel",
                 *RECIPE_DEFAULTS, "ssm_cp"),
}


def as_case(case_or_dict) -> Case:
    if isinstance(case_or_dict, Case):
        return case_or_dict
    if isinstance(case_or_dict, str):
        return load_case(case_or_dict)
    return parse_case(case_or_dict)


def chosen_fields(case: Case, res: StepResult) -> dict:
    """The values picked for the case's null fields, in the case file's block structure, less those that do
    nothing for this model and layout (each rule below says why): what the CLI prints as "chosen" and the pages
    list as chosen by the planner. `assumptions` writes them back into the case: one left out stays null there,
    and is picked the same way again."""
    out: dict = {}
    for block, names in _CHOICE_FIELDS.items():
        given = case.parallel if block == "parallel" else case.training
        for name in names:
            if name == "fp8_casts" and case.training.dtype != "fp8":
                continue  # only fp8 GEMMs cast their operands
            if name == "ssm_cp" and not case.model.has_ssm:
                continue  # only Mamba-2 layers have the choice
            if name == "attention" and not case.model.attention_layers:
                continue  # a model of Mamba-2 layers alone runs no attention kernel
            if name in ("schedule_runs", "pp_p2p", "pp_schedule", "virtual_stages") and res.layout.pp == 1:
                continue  # without pipeline stages the runs are the same micro-batches, nothing is sent, and every
                # schedule is the same sequence of passes (layout_search._all_schedules)
            if name == "sequence_parallel" and res.layout.tp == 1:
                continue  # one tensor-parallel rank holds the whole sequence already
            if name == "recompute_layers" and res.layout.recompute_layers is None:
                continue  # every layer of a chunk, or a mode other than full: `recompute` says it
            if name == "etp" and not (case.model.is_moe and res.layout.tp > 1):
                continue  # only routed experts under tensor parallelism have the choice
            if name in ("ep", "ep_dispatch", "ep_comm_overlap") and not case.model.is_moe:
                continue  # a dense model has no experts to place or tokens to route
            if name in ("ep_dispatch", "ep_comm_overlap") and res.layout.ep == 1:
                continue  # every expert on every rank: no tokens leave it
            if name in ("grad_reduce_overlap", "param_gather_overlap", "zero_stage") and \
                    res.layout.dp * res.layout.cp == 1 and res.layout.expert_dp == 1:
                continue  # one data-parallel rank: no gradients to sum, no weights to gather, nothing to shard
            # (grad_reduce_in_fp32 stays: it sets the bytes a gradient is kept in, on one rank too)
            if name in ("tp_comm_overlap", "tp_grad_allreduce_overlap") and res.layout.tp == 1:
                continue  # one tensor-parallel rank has no tp collectives to overlap
            if name == "grad_accum_cast" and not res.layout.fp32_accumulation_pass:
                continue  # only a separate accumulation pass into an fp32 buffer casts the gradient first
            if name in ("fsdp_impl", "fsdp_backward_prefetch") and not res.layout.layer_zero3:
                continue  # only ZeRO-3's per-layer gathers and reductions copy and prefetch (costs._zero3_comms)
            if getattr(given, name) is None:
                out.setdefault(block, {})[name] = getattr(res.layout, name)
    return out


@dataclass(frozen=True)
class Estimate:
    result: StepResult
    chosen: dict = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        return self.result.step_time_s

    @property
    def mfu(self) -> float:
        return self.result.mfu

    @property
    def mfu_causal(self) -> float:
        return self.result.mfu_causal

    @property
    def hfu(self) -> float:
        return self.result.hfu

    @property
    def tflops_per_chip(self) -> float:
        return self.result.tflops_per_chip

    @property
    def model_tflops_per_chip(self) -> float:
        return self.result.model_tflops_per_chip

    @property
    def memory(self):
        return self.result.memory

    @property
    def fits(self) -> bool:
        return self.result.fits

    @property
    def breakdown(self) -> dict:
        return dict(self.result.breakdown)

    @property
    def layout(self):
        return self.result.layout

    @property
    def fits_on(self) -> list[str]:
        """Chips of the table on which this layout's peak memory per chip fits."""
        need = self.memory.total_bytes
        return [k for k, c in CHIPS.items() if c.kind in ("gpu", "tpu") and need <= usable_hbm_bytes(c)]

    @property
    def explanation(self) -> list[str]:
        """Why this layout costs what it does, in words (planner.explain)."""
        from planner.explain import explain
        return explain(self.result)

    @cached_property
    def timeline(self) -> Timeline:
        from planner.timeline import predicted_timeline
        return predicted_timeline(self.result)

    def as_dict(self) -> dict:
        r = self.result
        out = {
            "name": r.case.name,
            "chip": r.chip.key,
            "num_chips": r.num_chips,
            "step_time_s": r.step_time_s,
            "mfu": r.mfu,
            "mfu_causal": r.mfu_causal,
            "hfu": r.hfu,
            "tflops_per_chip": r.tflops_per_chip,
            "model_tflops_per_chip": r.model_tflops_per_chip,
            "tokens_per_s": r.case.training.global_batch * r.case.model.seq_len / r.step_time_s,
            "memory_bytes_per_chip": r.memory.as_dict(),
            "hbm_bytes": r.chip.hbm_bytes,
            "fits": r.fits,
            "fits_on": self.fits_on,
            "chosen": self.chosen,
            "layout": r.layout.as_dict(),
            "micro_batches": r.micro_batches,
            "breakdown_s": r.breakdown,
            "pipeline_s": r.pipeline_s,
            "model_flops_per_step": r.model_flops,
            "hardware_flops_per_step": r.hardware_flops,
            "explanation": self.explanation,
        }
        return out


def estimate(case_or_dict) -> Estimate:
    """Simulate the case; null fields take the values of the fastest layout that fits."""
    case = as_case(case_or_dict)
    res = _search.choose(case)
    return Estimate(res, chosen_fields(case, res))


def leanest(case_or_dict) -> Estimate:
    """The layout of the case's null fields needing the least memory per chip, simulated (fits False where none
    fits): whether any layout of these chips fits at all, and on which chips the leanest would (`fits_on`), which
    is what a page can advise when the layout it shows does not fit."""
    case = as_case(case_or_dict)
    res = _search.leanest(case)
    return Estimate(res, chosen_fields(case, res))


@dataclass(frozen=True)
class Assumption:
    """A recipe field the case left null: the value the planner took for it (`assumed`), another value it can
    take, and the step the same layout takes with that one instead."""

    field: str  # "training.<name>"
    assumed: object
    alternative: object
    step_time_s: float
    fits: bool  # the same layout still fits in memory with the alternative
    base_step_time_s: float  # the estimate's step, with every assumed value

    @property
    def change(self) -> float:
        """The alternative's step over the estimate's, less one (+0.2: 20 % slower)."""
        return self.step_time_s / self.base_step_time_s - 1

    def as_dict(self) -> dict:
        return {"field": self.field, "assumed": self.assumed, "alternative": self.alternative,
                "step_time_s": self.step_time_s, "change": self.change, "fits": self.fits}


def assumptions(case_or_dict, est: Estimate | None = None) -> list[Assumption]:
    """What each unstated recipe field is worth: for every recipe field the case leaves null (RECIPE_DEFAULTS,
    what a current framework does), each other value it can take on the chip (planner.case.recipe_choices),
    simulated one at a time on the estimate's own layout (mesh, micro-batch, ZeRO stage, recomputation), largest
    change first. A value the layout cannot run (e.g. DeepSpeed's sequential sends under an interleaved
    schedule) is left out. `est`: the case's estimate where the caller has it."""
    case = as_case(case_or_dict)
    est = est or estimate(case)
    picked = est.chosen.get("training", {})
    layout = {k: v for k, v in picked.items() if k not in RECIPE_CHOICES}
    fixed = replace(case, parallel=replace(case.parallel, **est.chosen.get("parallel", {})),
                    training=replace(case.training, **layout))
    chip = costs.case_chip(case.cluster)
    out = []
    for name, assumed in picked.items():
        for value in recipe_choices(name, chip):
            if value == assumed:
                continue
            alt = replace(fixed, training=replace(fixed.training, **{name: value}))
            try:
                check_fixed(alt)
                res = _search.choose(alt)
            except SpecError:
                continue
            out.append(Assumption(f"training.{name}", assumed, value, res.step_time_s, res.fits, est.step_time_s))
    return sorted(out, key=lambda a: -abs(a.change))


def step_time_band_s(est: Estimate, found: list[Assumption]) -> tuple[float, float]:
    """The fastest and the slowest step among the estimate and its one-field alternatives (`assumptions`) that
    fit (all of them where the estimate's own layout does not): how far the unstated recipe alone can move the
    prediction."""
    steps = [est.step_time_s] + [a.step_time_s for a in found if a.fits or not est.fits]
    return min(steps), max(steps)


@dataclass(frozen=True)
class Ranked:
    result: StepResult
    explanation: list[str]

    def as_dict(self, rank: int) -> dict:
        r = self.result
        return {"rank": rank, "step_time_s": r.step_time_s, "mfu": r.mfu, "mfu_causal": r.mfu_causal,
                "tflops_per_chip": r.tflops_per_chip,
                "memory_bytes_per_chip": r.memory.total_bytes, "layout": r.layout.as_dict(),
                "micro_batches": r.micro_batches, "breakdown_s": r.breakdown, "explanation": self.explanation}


@dataclass(frozen=True)
class SearchReport:
    case: Case
    ranked: list[Ranked]
    evaluated: int
    considered: int
    elapsed_s: float

    def as_dict(self) -> dict:
        cluster = self.case.cluster
        return {"name": self.case.name, "chip": cluster.chip, "num_chips": cluster.num_chips,
                "considered": self.considered, "evaluated": self.evaluated, "elapsed_s": self.elapsed_s,
                "layouts": [r.as_dict(i + 1) for i, r in enumerate(self.ranked)]}


def compute_by_class(case_or_dict, result: StepResult | None = None) -> dict[str, float]:
    """Seconds a one-chip case's step computes by kernel class (planner.costs.KERNEL_CLASSES), as a trace of one
    GPU's kernels sums them (bench/bench_gpu_step.py, planner.gpu_steps): each micro-batch's layers and output
    layer by class (LayerCost.by_class, logits_by_class); the rest of the step's compute (the embedding, and
    the gradient accumulation a run without its fusion does) memory-bound; the optimizer; recomputation, if
    any, its own entry. `result`: the case's simulated step where the caller has it (`estimate(...).result`)."""
    from planner.memory import layer_kind_counts

    case = as_case(case_or_dict)
    m, tr = case.model, case.training
    if case.cluster.num_chips != 1 or m.mtp_layers:
        raise SpecError("cluster.num_chips", "the kernel classes are summed for a step on one chip (of a model "
                                             "without multi-token prediction): set num_chips to 1")
    res = result or _search.choose(case)
    lay = res.layout
    node = case.cluster.chips_per_node or res.chip.scaleup_domain
    out = dict.fromkeys(costs.KERNEL_CLASSES, 0.0)
    for kind, n in layer_kind_counts(m, 0, m.layers):
        for cls, seconds in costs.layer_cost(m, lay, res.chip, tr.dtype, kind, node).by_class:
            out[cls] += res.micro_batches * n * seconds
    for cls, (fwd_s, bwd_s) in costs.logits_by_class(m, lay, res.chip, tr.dtype).items():
        out[cls] += res.micro_batches * (fwd_s + bwd_s)
    out["memory-bound"] += res.breakdown["compute"] - sum(out.values())
    out["optimizer"] = res.breakdown["optimizer"]
    if res.breakdown["recompute"]:
        out["recompute"] = res.breakdown["recompute"]
    return out


def search(case_or_dict, top: int = 5) -> SearchReport:
    """The `top` fastest layouts that fit, each with an explanation in words."""
    from planner.explain import explain
    case = as_case(case_or_dict)
    res = _search.search(case, top=top)
    best = res.ranked[0] if res.ranked else None
    ranked = [Ranked(r, explain(r, best)) for r in res.ranked[:top]]
    return SearchReport(case, ranked, res.evaluated, res.considered, res.elapsed_s)


def no_fit_error(case: Case, report: SearchReport) -> SpecError:
    """What to change when a search ranks nothing: the field that leaves no layout dividing evenly, or, where
    layouts divide but none fits, the least memory one needs."""
    if not report.considered:
        return _search.no_layout_error(case, costs.case_chip(case.cluster))
    least = _search.leanest(case)  # the search itself ranked nothing
    lay = least.layout
    shape = (f"dp {lay.dp}, tp {lay.tp}, pp {lay.pp}, cp {lay.cp}" + (f", ep {lay.ep}" if lay.ep > 1 else "")
             + f", ZeRO-{lay.zero_stage}, recompute {lay.recompute_label}")
    return SpecError("cluster.num_chips", f"none of the {report.considered:,} layouts fits: the leanest ({shape}) "
                     f"needs {least.memory.total_bytes / 1e9:,.1f} GB per chip of the "
                     f"{usable_hbm_bytes(least.chip) / 1e9:,.1f} GB a {least.chip.name} can use; add chips, or free "
                     "fixed fields (null)")


def dumps(obj: dict) -> str:
    return json.dumps(obj, indent=1, sort_keys=False)


def compare_architectures(models: list[ModelSpec | str], cluster: Cluster | str, global_batch: int | None = None,
                          top: int = 1, **training) -> list[dict]:
    """The best layouts of each model on the same cluster, fastest first within each model:
    [{"model", "params", "ranked": [SearchReport layout dicts (rank, step_time_s, mfu, layout, ...)],
      "tokens_per_s"}] in the order given; `global_batch` and `training` as `make_case` takes them."""
    from planner.presets import make_case
    out = []
    for model in models:
        case = make_case(model, cluster, global_batch, **training)
        report = search(case, top=top)
        best = report.ranked[0].result if report.ranked else None
        out.append({"model": case.model.name, "params": total_params(case.model),
                    "ranked": report.as_dict()["layouts"],
                    "tokens_per_s": (case.training.global_batch * case.model.seq_len / best.step_time_s
                                     if best else 0.0)})
    return out


def flops_per_token_by_seq(spec: ModelSpec, seq_lens: list[int]) -> list[dict]:
    """Forward FLOPs per token at each sequence length: [{"seq_len", "matmul", "attention", "ssm",
    "total"}]. Attention's scores grow with S (quadratic per sequence); the SSD scan does not (linear)."""
    rows = []
    for s in seq_lens:
        row = {"seq_len": s, "matmul": matmul_flops_per_token(spec), "attention": attention_flops_per_token(spec, s),
               "ssm": ssm_flops_per_token(spec, s)}
        row["total"] = row["matmul"] + row["attention"] + row["ssm"]
        rows.append(row)
    return rows


def layer_comm_bytes(spec: ModelSpec, kind=None, *, tp: int = 1, cp: int = 1, dp: int = 1, micro_batch: int = 1,
                     sequence_parallel: bool = False, chip: str = "h100", chips_per_node: int = 8) -> dict:
    """What each strategy moves for one layer of `kind` on one chip, one micro-batch (the estimate's own
    CommOps, planner.costs). `kind`: a pattern character ("M", "*", "-"), False / True for a dense / MoE
    Transformer layer, None for the model's first Mamba layer or else its first layer. Returns
    {strategy: {"ops_fwd", "ops_bwd", "bytes_fwd", "bytes_bwd", "time_s"}} for "tp", "cp_ring",
    "cp_state", "cp_alltoall" (those that apply) and "dp" (once per step: the layer's gradient
    all-reduce over dp x cp), bytes being what the busiest chip sends (`CommOp.sent_bytes`: a ring all-reduce
    sends 2 (n - 1) / n of its buffer, an all-to-all (n - 1) / n, one rank of a state chain its one or two
    hops, not the chain's all), ops counting a ring's steps and a chain's hops one after the other."""
    if kind is None:
        kind = MAMBA if spec.has_ssm else spec.layer_kinds[0]
    if kind is True and tp > 1 and not sequence_parallel:
        raise SpecError("training.sequence_parallel", "an MoE layer under tp > 1 needs sequence parallelism "
                                                      "(Megatron-Core refuses to train without it)")
    if kind == MAMBA and not ssm_tp_ok(spec, tp):
        raise SpecError("parallel.tp", f"{tp} must divide model.ssm_groups={spec.ssm_groups} and the "
                        f"{spec.ssm_heads} SSM heads (Dao & Gu 2024 sec. 8.1)")
    if kind != MAMBA and not transformer_tp_ok(spec, tp):
        raise SpecError("parallel.tp", f"{tp} must divide the {spec.heads} attention heads, the hidden size "
                        f"{spec.hidden:,} and the MLP width {spec.ffn:,}")
    hw = costs.cluster_chip(get_chip(chip), tp * cp * dp, chips_per_node)
    base = Layout(dp=dp, tp=tp, pp=1, cp=cp, micro_batch=micro_batch, sequence_parallel=sequence_parallel and tp > 1,
                  etp=tp)  # an MoE layer's experts split by tp, as the lessons' TP draws them
    variants = {"": base}
    if kind == MAMBA and cp > 1:
        variants = {"state": base}
        if ssm_alltoall_ok(spec, tp, cp):
            variants["alltoall"] = Layout(**{**base.as_dict(), "ssm_cp": "alltoall"})
    out: dict = {}
    for variant, lay in variants.items():
        lc = costs.layer_cost(spec, lay, hw, "bf16", kind, chips_per_node)
        for direction, ops in (("fwd", lc.fwd_comms), ("bwd", lc.bwd_comms)):
            for c in ops:
                name = "cp_" + (variant or "ring") if c.group == "cp" else c.group
                if c.group == "tp" and variant == "alltoall":
                    continue  # counted with the first variant
                row = out.setdefault(name, {"ops_fwd": 0, "ops_bwd": 0, "bytes_fwd": 0.0, "bytes_bwd": 0.0,
                                            "time_s": 0.0})
                row[f"ops_{direction}"] += c.count
                row[f"bytes_{direction}"] += c.sent_bytes({"tp": tp, "cp": cp}[c.group])
                row["time_s"] += c.time_s
    if dp * cp > 1:  # summed over every data-parallel rank of the dense layers, dp x cp
        nbytes = sum(layer_params_on_chip(spec, kind, tp, 1, lay.etp)) * lay.grad_bytes  # the layer's share here
        topo = costs.data_topology(hw, lay, chips_per_node)
        out["dp"] = {"ops_fwd": 0, "ops_bwd": 1, "bytes_fwd": 0.0,
                     "bytes_bwd": ring_sent_bytes("all_reduce", nbytes, dp * cp),
                     "time_s": costs.comm_s(topo, "all_reduce", nbytes)}
    return out
