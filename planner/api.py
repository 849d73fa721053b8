"""The planner's pure-function API for pages and the CLI: `estimate` one case, `search` its layouts.

    est = estimate({"model": ..., "training": ..., "parallel": ..., "cluster": ...})
    est.step_time_s, est.mfu, est.memory.as_dict(), est.fits, est.breakdown, est.timeline

A case may be a `Case`, a dict shaped like a case file, or a path to one. Null fields are chosen by
the search (`est.chosen` says what was picked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

from core.timeline import Timeline
from hardware.chips import CHIPS
from planner import layout_search as _search
from planner.case import RECIPE_DEFAULTS, Case, load_case, parse_case
from planner.simulate import StepResult, usable_hbm_bytes

_CHOICE_FIELDS = {
    "parallel": ("dp", "tp", "pp", "cp", "ep", "pp_schedule", "virtual_stages"),
    "training": ("micro_batch", "recompute", "zero_stage", "sequence_parallel", *RECIPE_DEFAULTS),
}


def as_case(case_or_dict) -> Case:
    if isinstance(case_or_dict, Case):
        return case_or_dict
    if isinstance(case_or_dict, str):
        return load_case(case_or_dict)
    return parse_case(case_or_dict)


def chosen_fields(case: Case, res: StepResult) -> dict:
    """The values picked for the case's null fields, in the case file's block structure."""
    out: dict = {}
    for block, names in _CHOICE_FIELDS.items():
        given = case.parallel if block == "parallel" else case.training
        for name in names:
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


@dataclass(frozen=True)
class Ranked:
    result: StepResult
    explanation: list[str]

    def as_dict(self, rank: int) -> dict:
        r = self.result
        return {"rank": rank, "step_time_s": r.step_time_s, "mfu": r.mfu,
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


def search(case_or_dict, top: int = 5) -> SearchReport:
    """The `top` fastest layouts that fit, each with an explanation in words."""
    from planner.explain import explain
    case = as_case(case_or_dict)
    res = _search.search(case, top=top)
    best = res.ranked[0] if res.ranked else None
    ranked = [Ranked(r, explain(r, best)) for r in res.ranked[:top]]
    return SearchReport(case, ranked, res.evaluated, res.considered, res.elapsed_s)


def dumps(obj: dict) -> str:
    return json.dumps(obj, indent=1, sort_keys=False)
