"""Analytic planner: memory, FLOPs, a simulated step on real chips, and the auto-parallel search.

No torch here: pages import it everywhere. Entry points: `estimate` and `search` (planner.api), with
`assumptions` (what each recipe field the case leaves null is worth),
`make_case` with the model and cluster presets (planner.models, planner.presets), and the CLI
`python -m planner estimate|search CASE.json`.

Modules: models (shapes, presets), case (case files, validation), flops (parameters, FLOPs, MFU/HFU),
memory (ZeRO, activations, pipeline in-flight), costs (per-layer compute and collectives, efficiency
curves), simulate (pipeline step time, breakdown), timeline (predicted Timeline), layout_search
(enumeration, pruning, branch and bound), explain (words), api, presets, validation.
"""

from planner.api import (
    Assumption,
    Estimate,
    SearchReport,
    assumptions,
    compare_architectures,
    estimate,
    flops_per_token_by_seq,
    layer_comm_bytes,
    search,
    step_time_band_s,
)
from planner.case import Case, Cluster, Layout, Parallel, Training, parse_case
from planner.models import DEFAULT_MODEL, MODEL_PRESETS, SSM_PRESETS, ModelSpec, SpecError
from planner.presets import CLUSTER_PRESETS, DEFAULT_CLUSTER, make_case

__all__ = ["CLUSTER_PRESETS", "Assumption", "Case", "Cluster", "DEFAULT_CLUSTER", "DEFAULT_MODEL", "Estimate",
           "Layout", "MODEL_PRESETS", "ModelSpec", "Parallel", "SSM_PRESETS", "SearchReport", "SpecError", "Training",
           "assumptions", "compare_architectures", "estimate", "flops_per_token_by_seq", "layer_comm_bytes",
           "make_case", "parse_case", "search", "step_time_band_s"]
