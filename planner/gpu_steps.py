"""Real GPUs' training steps beside the planner's prediction of the same step, kernel class by kernel class.

bench/bench_gpu_step.py runs one GPU's eager PyTorch training step of a Llama- or GPT-style model, traces its
kernels and sums them by class (planner.costs.KERNEL_CLASSES); the recordings live in hardware/data
(`h200-step-*.json`: one H200, PyTorch 2.11, 2026-12-04). Here each recording becomes the planner's case for
the same step (one chip, the same layers, widths, tokens and attention kernel) and is compared class by class.
Test data, like the published runs: no constant is chosen on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner.api import compute_by_class, estimate
from planner.models import MODEL_PRESETS

RECORDED = sorted((Path(__file__).resolve().parents[1] / "hardware" / "data").glob("*-step-*.json"))
# the bench's SDPA backends as the planner's attention kernels: PyTorch's FlashAttention-2, cuDNN's fused attention
PLANNER_KERNEL = {"flash": "flash", "cudnn": "flash3"}
# the widths bench_gpu_step.py runs by default (Llama 3 8B's, from its preset)
LLAMA3_8B_WIDTHS = {k: getattr(MODEL_PRESETS["Llama 3 8B"], k) for k in ("hidden", "heads", "kv_heads", "ffn", "vocab",
                                                                         "mlp")}


def step_case(record: dict, backend: str, chip: str = "h200", fusion: str = "eager") -> dict:
    """The planner's case for one recorded step: one chip, one micro-batch, no recomputation or sharding.
    The bench's model runs its norms as fused kernels and its rotary embedding as elementwise ops; fusion
    "eager" charges the planner's Llama recipe both eager, "fused" both fused (its GPT recipe has no rotary). It
    runs no dropout (bench_gpu_step.py's Block): "dropout" false."""
    widths = record.get("model", LLAMA3_8B_WIDTHS)
    return {"name": f"{record['device']} one-GPU step",
            "model": {"layers": record["layers"], "seq_len": record["seq"], "experts": 0, "top_k": 0, **widths},
            "training": {"global_batch": record["micro_batch"], "micro_batch": record["micro_batch"],
                         "recompute": "none", "dtype": "bf16", "optimizer": "adam", "zero_stage": 0,
                         "sequence_parallel": False, "attention": PLANNER_KERNEL[backend], "fusion": fusion,
                         "dropout": False},
            "parallel": {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1},
            "cluster": {"chip": chip, "num_chips": 1, "chips_per_node": 8}}


@dataclass(frozen=True)
class StepComparison:
    label: str  # the model, its layers and tokens, e.g. "GPT 2048-wide ×24, 4×4096 tokens"
    backend: str  # the SDPA backend the step ran ("flash" or "cudnn")
    measured_s: float  # median step time
    idle_share: float  # of the traced span, the GPU between kernels
    measured: dict[str, float]  # traced kernel seconds per step by class
    predicted_s: float
    predicted: dict[str, float]  # planner.api.compute_by_class

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def _label(record: dict) -> str:
    w = record.get("model", LLAMA3_8B_WIDTHS)
    family = "GPT" if w["mlp"] == "gelu" else "Llama"
    kind = "Llama 3 8B-wide" if w == LLAMA3_8B_WIDTHS else f"{family} {w['hidden']}-wide"
    return f"{kind} ×{record['layers']}, {record['micro_batch']}×{record['seq']} tokens"


def comparisons(paths=RECORDED, chip: str = "h200", fusion: str = "eager") -> list[StepComparison]:
    """Every recorded step (each SDPA backend) beside its prediction."""
    out = []
    for path in paths:
        record = json.loads(Path(path).read_text())
        for backend, run in record["backends"].items():
            if "error" in run:
                continue
            trace = run["trace"]
            case = step_case(record, backend, chip, fusion)
            est = estimate(case)
            out.append(StepComparison(_label(record), backend, run["median_step_s"],
                                      1 - trace["busy_s"] / trace["span_s"], trace["classes"],
                                      est.step_time_s, compute_by_class(case, est.result)))
    return out
