"""Composed-mesh benchmark: a 3-D mesh at 8 ranks against the same model's 1-rank step on the same global
batch, at two model sizes. Prints ratios measured in one run; never pass/fail.

    .venv/bin/python bench/bench_meshes.py [--steps 6] [--repeats 3] [--mesh pp=2,dp=2,tp=2]

On a machine with fewer cores than ranks the 8 ranks share the cores, so the ratio mostly shows what the
layout costs beyond the arithmetic (its collectives, point-to-point waits and per-op overhead) rather than a
speed-up; at the larger size the arithmetic weighs more.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_engine import LARGE, slowest_median  # noqa: E402
from engine.config import ModelConfig, ParallelConfig, RunConfig, parse_mesh, strategy_for, validate  # noqa: E402
from engine.launch import Pool  # noqa: E402


def step_s(pool, cfg) -> float:
    results = pool.run("engine.train:run_rank", {"cfg": cfg, "traced": False}, timeout_s=900)
    return slowest_median([r["step_times_s"] for r in results])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="back-to-back pairs per size")
    ap.add_argument("--mesh", default="pp=2,dp=2,tp=2")
    args = ap.parse_args()
    axes = parse_mesh(args.mesh)
    world = 1
    for _, d in axes:
        world *= d
    pools = {1: Pool(1), world: Pool(world)}
    for pool in pools.values():
        pool.start()
    print(f"composed-mesh benchmark, {os.cpu_count()} cpu cores, mesh {args.mesh} ({world} ranks) against 1 rank "
          f"on the same global batch, {args.steps} steps (median of the slowest rank, warm-up excluded), "
          f"{args.repeats} pairs")
    for label, base in (("default", ModelConfig()), ("large", LARGE)):
        layers = max(base.layers, 2 * dict(axes).get("pp", 1))
        model = ModelConfig(**{**base.__dict__, "layers": layers})
        mesh_cfg = validate(RunConfig(model=model, world=world, steps=args.steps, micro_batches=2, timeout_s=900,
                                      parallel=ParallelConfig(strategy_for(axes), mesh=axes)))
        sequences = mesh_cfg.global_batch // mesh_cfg.micro_batches
        one_cfg = validate(RunConfig(model=model, world=1, steps=args.steps, micro_batches=2,
                                     micro_batch_size=sequences, timeout_s=900))
        pairs = [(step_s(pools[world], mesh_cfg), step_s(pools[1], one_cfg)) for _ in range(args.repeats)]
        ratio = statistics.median(a / b for a, b in pairs)
        a_ms, b_ms = (statistics.median(x[i] for x in pairs) * 1e3 for i in (0, 1))
        print(f"  {label:8s} model ({model.layers} layers, hidden {model.hidden}, {model.params / 1e6:.1f} M params, "
              f"global batch {mesh_cfg.global_batch}): {args.mesh} {a_ms:8.1f} ms / 1 rank {b_ms:8.1f} ms "
              f"= {ratio:.2f}x")
    for pool in pools.values():
        pool.shutdown()


if __name__ == "__main__":
    main()
