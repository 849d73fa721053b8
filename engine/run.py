"""Run one experiment on the warm pool and turn the ranks' results into one summary and one Timeline.

This is what the CLI and the pages call:

    summary, timeline = run(cfg, check=True)

The summary is a `RunSummary`; its `to_dict()` is the JSON object of `python -m engine run --json`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from core.timeline import Span, Timeline, bubble_spans
from engine.config import RunConfig, check_fits_machine, validate


@dataclass
class RunSummary:
    """What one live run measured, over all ranks (per-rank lists are in rank order)."""

    ok: bool  # the check passed, or no check was asked for
    check: dict | None  # engine.verify.compare's verdict (with --check)
    world: int
    strategy: str
    zero_stage: int
    mesh: dict[str, int]
    steps: int
    micro_batches: int
    device: str
    loss: list[float]  # per step, the global mean loss
    step_time_s: float  # mean over the steps after the first, slowest rank
    step_times_s: list[float]  # per step, slowest rank
    memory_bytes: list[dict[str, int]]  # per rank: params, grads, optimizer, activations_peak, ..., total
    comm_bytes: list[int]  # per rank, bytes sent over the run
    stats: dict  # plan-specific figures (expert load)
    config: dict  # the RunConfig, as a dict
    predicted: dict | None = None  # the planner's prediction of this run on this machine (engine/predict.py)

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.predicted is None:
            del out["predicted"]
        return out


def assemble(cfg: RunConfig, results: list[dict]) -> tuple[RunSummary, Timeline]:
    results = sorted(results, key=lambda r: r["rank"])
    timeline = Timeline([Span(**s) for r in results for s in r["spans"]], source="measured",
                        meta={"strategy": cfg.parallel.strategy, "zero_stage": cfg.parallel.stage,
                              "world": cfg.world, "steps": cfg.steps, "micro_batches": cfg.micro_batches})
    if cfg.pp > 1:
        # Idle "bubble" spans, as on the simulator's predicted pipeline timeline.
        timeline.extend(bubble_spans(timeline))
        timeline.meta.update(schedule=cfg.parallel.schedule, virtual_stages=cfg.parallel.virtual_stages)
    # A step takes as long as its slowest rank; the step time is the mean over the steps after the first
    # (its warm-up: allocations, caches): what a step costs on average, the occasional stall of ranks
    # sharing cores included, i.e. what throughput (tokens per second) is made of.
    slowest = [max(r["step_times_s"][s] for r in results) for s in range(cfg.steps)]
    check = results[0]["check"]
    losses = [sum(r["losses"][s] for r in results) / len(results) for s in range(cfg.steps)]
    summary = RunSummary(
        ok=check is None or check["passed"], check=check, world=cfg.world, strategy=cfg.parallel.strategy,
        zero_stage=cfg.parallel.stage, mesh=dict(cfg.parallel.axes(cfg.world)), steps=cfg.steps,
        micro_batches=cfg.micro_batches, device=cfg.device, loss=losses,
        step_time_s=statistics.mean(slowest[1:] or slowest), step_times_s=slowest,
        memory_bytes=[r["memory_bytes"] for r in results], comm_bytes=[r["comm_bytes"] for r in results],
        stats=results[0].get("stats") or {}, config=asdict(cfg))
    return summary, timeline


def run(cfg: RunConfig, traced: bool = True, check: bool = False, pool=None,
        predict: bool = False, progress=None, on_step=None, stop=None) -> tuple[RunSummary, Timeline]:
    """Validate, run on the shared pool for (world, device), assemble. Raises `ConfigError` for bad
    input and `launch.WorkerError` when a rank fails or the run times out.

    With `predict`, the summary also carries "predicted": the planner's prediction of this very run on
    this machine (engine/predict.py), calibrating the machine first if it has not been (engine/predict.py;
    `progress(fraction, message)` hears about it). `on_step(steps_done, loss)` hears each finished step;
    setting the `stop` event ends the run (`launch.RunStopped`)."""
    from engine import launch

    validate(cfg)
    check_fits_machine(cfg, check)
    prediction = None
    if predict:
        from engine.predict import predicted

        prediction = predicted(cfg, progress, stop)  # before the run: calibrating warms the run's pool
    pool = pool or launch.get_pool(cfg.world, cfg.device, cfg.collective_timeout_s)
    results = pool.run("engine.train:run_rank", {"cfg": cfg, "traced": traced, "check": check},
                       timeout_s=cfg.timeout_s, on_progress=on_step, stop=stop)
    summary, timeline = assemble(cfg, results)
    summary.predicted = prediction
    return summary, timeline
