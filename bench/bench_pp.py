"""Pipeline benchmark: prints ratios measured in one run at 4 ranks on the same model. Never pass/fail.

    .venv/bin/python bench/bench_pp.py [--world 4] [--micro-batches 8] [--steps 6] [--repeats 3]

- our 1F1B step / torch.distributed.pipelining Schedule1F1B step: the same stages (engine/pipeline/stage.py),
  micro-batches, loss and AdamW, on gloo; torch's side sends with batch_isend_irecv and infers shapes
- measured bubble fraction per schedule against the formula ((p-1)/m, (p-1)/(v m), ZB-H1's
  (p-1)(t_F + t_BI - t_BW) / (m (t_F + t_B))): makespan of a step's F/B/BI/BW spans over all ranks
  minus the busiest rank's compute, over that compute (core/timeline.py)

Step times are the median over steps (after one warm-up step) of the slowest rank. The model is larger
than the tests' so that one stage's compute outweighs a point-to-point round trip.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.schedules import SCHEDULE_NAMES, formula_bubble_fraction  # noqa: E402
from core.timeline import measured_bubble_fraction  # noqa: E402
from engine.config import ModelConfig, ParallelConfig, RunConfig  # noqa: E402
from engine.launch import Pool  # noqa: E402
from engine.run import assemble  # noqa: E402


def torch_1f1b_rank(ctx, cfg: RunConfig) -> list[float]:
    """Runs on every rank: torch's Schedule1F1B over this rank's stage; step times in seconds."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from core.schedules import stage_units
    from engine.model import build_model, global_batch, loss_fn
    from engine.optim import adamw_
    from engine.reference import hyper

    p, rank = cfg.world, ctx.rank
    full = build_model(cfg.model, cfg.seed)
    module = nn.Sequential(*(full.units[u] for u in stage_units(cfg.model, p, rank)))
    params = list(module.parameters())
    moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in params]
    stage = PipelineStage(module, rank, p, ctx.device)
    # scale_grads=False: the loss of each micro-batch is divided by m below, as engine/pipeline/executor.py does.
    schedule = Schedule1F1B(stage, cfg.micro_batches, loss_fn=lambda y, t: loss_fn(y, t) / cfg.micro_batches,
                            scale_grads=False)
    times = []
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg.model, cfg.seed, step, cfg.global_batch)
        start = time.perf_counter()
        module.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(tokens)
        elif rank == p - 1:
            schedule.step(target=targets)
        else:
            schedule.step()
        for w, (m1, m2) in zip(params, moments, strict=True):
            adamw_(w, w.grad, m1, m2, step + 1, hyper(cfg))
        times.append(time.perf_counter() - start)
    return times


def slowest_median(per_rank: list[list[float]]) -> float:
    steps = len(per_rank[0])
    return statistics.median(max(r[s] for r in per_rank) for s in range(1, steps))


def ours(pool, cfg) -> float:
    results = pool.run("engine.train:run_rank", {"cfg": cfg, "traced": False}, timeout_s=600)
    return slowest_median([r["step_times_s"] for r in results])


def theirs(pool, cfg) -> float:
    return slowest_median(pool.run("bench.bench_pp:torch_1f1b_rank", {"cfg": cfg}, timeout_s=600))


def bubbles(pool, cfg) -> list[float]:
    summary, timeline = assemble(cfg, pool.run("engine.train:run_rank", {"cfg": cfg, "traced": True},
                                               timeout_s=600))
    return [measured_bubble_fraction(timeline, step) for step in range(1, cfg.steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="back-to-back pairs in the torch comparison")
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    p, m = args.world, args.micro_batches
    model = ModelConfig(layers=2 * p, hidden=args.hidden, heads=8, kv_heads=4, ffn=4 * args.hidden,
                        seq_len=64)

    def cfg(schedule: str) -> RunConfig:
        v = 2 if schedule == "interleaved-1f1b" else 1
        return RunConfig(model=model, world=p, steps=args.steps, micro_batches=m,
                         parallel=ParallelConfig("pp", schedule=schedule, virtual_stages=v))

    pool = Pool(p)
    pool.start()
    # Back to back, `repeats` times: a noisy neighbour slows both sides of a pair alike.
    pairs = [(ours(pool, cfg("1f1b")), theirs(pool, cfg("1f1b"))) for _ in range(args.repeats)]
    measured = {s: bubbles(pool, cfg(s)) for s in SCHEDULE_NAMES}
    pool.shutdown()

    print(f"pipeline benchmark, {p} ranks, {os.cpu_count()} cpu cores, {m} micro-batches, model "
          f"{model.layers} layers hidden {model.hidden} seq {model.seq_len}, {args.steps} steps "
          f"(median of the slowest rank, warm-up step excluded), {args.repeats} pairs")
    ratio = statistics.median(a / b for a, b in pairs)
    a_ms, b_ms = (statistics.median(x[i] for x in pairs) * 1e3 for i in (0, 1))
    print(f"  our 1F1B step / torch pipelining Schedule1F1B   {a_ms:8.1f} ms / {b_ms:8.1f} ms = {ratio:.2f}x")
    print("  bubble fraction: measured (median over steps, min-max) vs formula for equal op times")
    for schedule, values in measured.items():
        v = 2 if schedule == "interleaved-1f1b" else 1
        formula = formula_bubble_fraction(schedule, p, m, v)
        print(f"    {schedule:18s} v={v}  measured {statistics.median(values):.3f} "
              f"({min(values):.3f}-{max(values):.3f})  formula {formula:.3f}")


if __name__ == "__main__":
    main()
