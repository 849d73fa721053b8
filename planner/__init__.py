"""Analytic planner: memory, FLOPs, a simulated step on real chips, and the auto-parallel search.

No torch here: pages import it everywhere. Entry points: `estimate`, `search` (planner.api), the
presets (planner.models, planner.presets) and `python -m planner`.
"""

from planner.api import Estimate, SearchReport, estimate, search
from planner.case import Case, Cluster, Layout, Parallel, Training, parse_case
from planner.models import DEFAULT_MODEL, MODEL_PRESETS, ModelSpec, SpecError

__all__ = ["Case", "Cluster", "DEFAULT_MODEL", "Estimate", "Layout", "MODEL_PRESETS", "ModelSpec", "Parallel",
           "SearchReport", "SpecError", "Training", "estimate", "parse_case", "search"]
