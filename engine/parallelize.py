"""A rank's layout, built in one fixed order from the mesh (learned from torchtitan's `parallelize`):

    1. the model, once, the same on every rank (engine/model.py)
    2. tensor (+ sequence) parallel: split the matmuls, embedding and head     engine/tp.py
    3. the pipeline stage cut: keep this rank's chunks of units                 engine/pipeline/stage.py
    4. context parallel: this rank's positions, ring attention                  engine/cp.py
    5. expert parallel: this rank's experts, all-to-all dispatch                engine/ep.py
    6. one data-parallel sharder by ZeRO stage over the data axes                engine/dp.py (0),
                                                                                 zero.py (1, 2), fsdp.py (3)

Each step is skipped when its axis has degree 1; no step knows which others ran. What each axis means
for the batch and the gradients is core/mesh.py's convention.
"""

from __future__ import annotations

from core.mesh import Mesh
from engine.comm import Comm
from engine.config import RunConfig
from engine.dp import DataParallel
from engine.fsdp import FSDP
from engine.model import build_model
from engine.recorder import Recorder
from engine.reference import hyper
from engine.strategy import Strategy
from engine.zero import ZeRO


def group_spans(cfg: RunConfig, mesh: Mesh) -> list[tuple[str, ...]]:
    """The multi-axis process groups this run's gradient sync and statistics talk over."""
    return mesh.reduce_groups(cfg.parallel.stage, cfg.model.mlp == "moe", _sequence_sharded(cfg, mesh))


def _sequence_sharded(cfg: RunConfig, mesh: Mesh) -> tuple[str, ...]:
    """With sequence parallel, an MoE layer's tp ranks route different tokens: count them over tp too."""
    return ("tp",) if cfg.parallel.sequence_parallel and mesh.degree("tp") > 1 else ()


def parallelize(cfg: RunConfig, comm: Comm, rec: Recorder, mesh: Mesh, device,
                chunks: list[list[int]] | None = None) -> Strategy:
    """This rank's strategy; `chunks` (the full model's unit indices of each pipeline chunk) cuts a stage."""
    model = build_model(cfg.model, cfg.seed)
    plans = []
    if mesh.degree("tp") > 1:
        from engine.tp import TensorParallelPlan

        plans.append(TensorParallelPlan(model, comm, cfg.parallel.sequence_parallel, cp=mesh.degree("cp")))
    if chunks is not None:
        from engine.pipeline.stage import StageModel

        model = StageModel(model, chunks)
    model = model.to(device)
    if mesh.degree("cp") > 1:
        from engine.cp import ContextParallelPlan

        plans.append(ContextParallelPlan(cfg, model, comm, rec))
    if mesh.degree("ep") > 1:
        from core.mesh import group_key
        from engine.ep import ExpertParallelPlan

        count_axes = mesh.grad_axes(False, _sequence_sharded(cfg, mesh))
        plans.append(ExpertParallelPlan(cfg, model, comm, group_key(count_axes)))
    args = (cfg, model, comm, rec, hyper(cfg), mesh, plans)
    stage = cfg.parallel.stage
    if stage == 0:
        return DataParallel(*args)
    if stage in (1, 2):
        return ZeRO(*args, stage=stage)
    return FSDP(*args)
