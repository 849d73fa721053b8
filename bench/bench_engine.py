"""Engine benchmark: prints ratios measured in one run at 4 ranks on the same model. Never pass/fail.

    .venv/bin/python bench/bench_engine.py [--world 4] [--steps 20] [--repeats 5] [--large]

--large: 4 layers of hidden 512 (about 100x the default model's FLOPs per step), where the strategies' own
costs show instead of the per-op overhead.

- our data parallel step / torch DDP step            (same model, batch, bucket size, AdamW)
- our ZeRO-3 step / torch FSDP2 (`fully_shard` per unit) step
- pool cold start (processes + imports + rendezvous) and warm-run latency
- tracing overhead: traced / untraced step time

Step times are the median over steps (after one warm-up step) of the slowest rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import ModelConfig, ParallelConfig, RunConfig  # noqa: E402

# About 100x the default model's step FLOPs (engine.config.step_flops), same vocabulary and sequence.
LARGE = ModelConfig(layers=4, hidden=512, heads=8, kv_heads=4, ffn=1024)
from engine.launch import Pool  # noqa: E402
from engine.run import run  # noqa: E402


def torch_rank(ctx, cfg: RunConfig, kind: str) -> list[float]:
    """Runs on every rank: the same training loop with torch's own DDP or FSDP2; step times in seconds."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from engine.model import build_model, global_batch, loss_fn

    model = build_model(cfg.model, cfg.seed)
    if kind == "ddp":
        model = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_bytes / 2**20)
    else:
        for unit in model.units:
            fully_shard(unit)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    times = []
    mbs = cfg.micro_batch_size
    for step in range(cfg.steps):
        tokens, targets = global_batch(cfg.model, cfg.seed, step, cfg.global_batch)
        rows = slice(ctx.rank * mbs, (ctx.rank + 1) * mbs)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(tokens[rows]), targets[rows]).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def noop(ctx) -> int:
    return ctx.rank


def slowest_median(per_rank: list[list[float]]) -> float:
    steps = len(per_rank[0])
    return statistics.median(max(r[s] for r in per_rank) for s in range(1, steps))


def ours(pool, cfg, traced=False) -> float:
    results = pool.run("engine.train:run_rank", {"cfg": cfg, "traced": traced}, timeout_s=600)
    return slowest_median([r["step_times_s"] for r in results])


def theirs(pool, cfg, kind) -> float:
    results = pool.run("bench.bench_engine:torch_rank", {"cfg": cfg, "kind": kind}, timeout_s=600)
    return slowest_median(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="back-to-back pairs per comparison")
    ap.add_argument("--large", action="store_true", help="4 layers, hidden 512 instead of the default model")
    args = ap.parse_args()
    n = args.world
    model = LARGE if args.large else ModelConfig()

    t0 = time.perf_counter()
    pool = Pool(n)
    pool.start()
    cold_start_s = time.perf_counter() - t0
    small = RunConfig(world=n, steps=3, parallel=ParallelConfig("fsdp"))
    t0 = time.perf_counter()
    first, _ = run(small, traced=False, pool=pool)
    first_run_s = time.perf_counter() - t0
    warm = []
    for _ in range(5):
        t0 = time.perf_counter()
        summary, _ = run(small, traced=False, pool=pool)
        warm.append((time.perf_counter() - t0, sum(summary.step_times_s)))
    warm_wall_s = statistics.median(w for w, _ in warm)
    warm_overhead_s = statistics.median(w - c for w, c in warm)
    t0 = time.perf_counter()
    pool.run("bench.bench_engine:noop")
    empty_task_s = time.perf_counter() - t0

    big_bucket = 25 * 2**20  # torch DDP's default bucket size
    dp_cfg = RunConfig(model=model, world=n, steps=args.steps,
                       parallel=ParallelConfig("dp", bucket_bytes=big_bucket), timeout_s=600)
    dp_small_cfg = RunConfig(model=model, world=n, steps=args.steps, parallel=ParallelConfig("dp"), timeout_s=600)
    fsdp_cfg = RunConfig(model=model, world=n, steps=args.steps, parallel=ParallelConfig("fsdp"), timeout_s=600)
    pairs = {  # label -> (ours, theirs or the untraced baseline)
        "our DP step / torch DDP  (25 MiB buckets)": (lambda: ours(pool, dp_cfg),
                                                      lambda: theirs(pool, dp_cfg, "ddp")),
        "our DP step / torch DDP  (16 KiB buckets)": (lambda: ours(pool, dp_small_cfg),
                                                      lambda: theirs(pool, dp_small_cfg, "ddp")),
        "our ZeRO-3 / torch FSDP2 fully_shard": (lambda: ours(pool, fsdp_cfg),
                                                 lambda: theirs(pool, fsdp_cfg, "fsdp2")),
        "tracing overhead ZeRO-3, traced / untraced": (lambda: ours(pool, fsdp_cfg, traced=True),
                                                       lambda: ours(pool, fsdp_cfg)),
        "tracing overhead DP, traced / untraced": (lambda: ours(pool, dp_cfg, traced=True),
                                                   lambda: ours(pool, dp_cfg)),
    }
    # Each pair runs back to back, `repeats` times: a noisy neighbour on a shared machine slows both
    # sides of a pair alike, so the median of the per-pair ratios is steadier than a ratio of medians.
    measured = {label: [(a(), b()) for _ in range(args.repeats)] for label, (a, b) in pairs.items()}
    pool.shutdown()

    print(f"engine benchmark, world {n}, {os.cpu_count()} cpu cores, model "
          f"{model.layers} layers hidden {model.hidden}, "
          f"{args.steps} steps (median of the slowest rank, warm-up step excluded), {args.repeats} pairs")
    for label, runs in measured.items():
        ratio = statistics.median(a / b for a, b in runs)
        a_ms, b_ms = (statistics.median(x[i] for x in runs) * 1e3 for i in (0, 1))
        print(f"  {label:45s} {a_ms:7.2f} ms / {b_ms:7.2f} ms = {ratio:.2f}x")
    print(f"  pool cold start {cold_start_s:.2f} s; first run on it {first_run_s:.2f} s")
    print(f"  warm 3-step ZeRO-3 run {warm_wall_s * 1e3:.0f} ms wall, of which "
          f"{warm_overhead_s * 1e3:.0f} ms "
          f"beyond the step times; an empty task round trip {empty_task_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
