"""Measure collectives on the local ranks over a sweep of message sizes (hardware/this_machine.py fits alpha
and beta to them).

Byte convention (what `bytes` in a measurement means), matching the lesson's formulas:
- all_gather, reduce_scatter, all_reduce: the size of the *full* array (all shards together);
- all_to_all: the bytes each rank holds (and exchanges) before the exchange.

Ring cost model (Patarasuk & Yuan 2009; scaling-book "All About Rings"), n ranks, B bytes:
    all_gather, reduce_scatter:  T = (n-1) alpha + (n-1)/n B beta
    all_reduce:                  T = 2 (n-1) alpha + 2 (n-1)/n B beta       (reduce-scatter + all-gather)
    all_to_all (pairwise):       T = (n-1) alpha + (n-1)/n B beta           (n-1 rounds, each rank sends
                                                                            B/n to each other rank)
"""

from __future__ import annotations

import statistics
import time

from engine.config import MAX_WORLD, ConfigError

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def sweep_rank(ctx, ops: list[str], sizes_bytes: list[int], repeats: int) -> list[dict]:
    """Runs on every rank: for each op and size, one warm-up and `repeats` timed calls, each started
    right after a barrier. Returns this rank's durations; the pool's caller takes the slowest rank."""
    import torch

    from engine.comm import Comm
    from engine.recorder import Recorder

    comm = Comm(Recorder(ctx.rank, ctx.clock_offset_s, enabled=False), ctx.device)
    n = ctx.world
    out = []
    for op in ops:
        for size in sizes_bytes:
            numel = max(n, size // 4 // n * n)  # float32, divisible into n equal parts
            full = torch.randn(numel, device=ctx.device)
            shard = full[: numel // n].clone()
            if op == "all_gather":
                call = lambda: comm.all_gather(full, shard)  # noqa: E731
            elif op == "reduce_scatter":
                call = lambda: comm.reduce_scatter(shard, full)  # noqa: E731
            elif op == "all_reduce":
                call = lambda: comm.all_reduce(full)  # noqa: E731
            else:
                received = torch.empty_like(full)
                call = lambda: comm.all_to_all(received, full)  # noqa: E731
            call()
            times = []
            for _ in range(repeats):
                comm.barrier()
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            out.append({"op": op, "bytes": numel * 4, "times_s": times})
    return out


def run_collective_sweep(world: int, ops: list[str], sizes_bytes: list[int], repeats: int = 3,
                         timeout_s: float = 60, stop=None) -> list[dict]:
    """[{op, bytes, seconds (median over repeats of the slowest rank), world}] from the warm pool; setting the
    `stop` event ends it (launch.RunStopped)."""
    from engine import launch

    if not 2 <= world <= MAX_WORLD:
        raise ConfigError(f"world={world} must be between 2 and {MAX_WORLD} to measure a collective")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ConfigError(f"ops {unknown} are unknown; use any of {', '.join(OPS)}")
    if not sizes_bytes or min(sizes_bytes) < 1:
        raise ConfigError("sizes_bytes must be a non-empty list of positive byte counts")
    if repeats < 1:
        raise ConfigError(f"repeats={repeats} must be at least 1")
    task = {"ops": list(ops), "sizes_bytes": list(sizes_bytes), "repeats": repeats}
    results = launch.get_pool(world).run("engine.sweep:sweep_rank", task, timeout_s=timeout_s, stop=stop)
    measurements = []
    for i, first in enumerate(results[0]):
        slowest = [max(r[i]["times_s"][k] for r in results) for k in range(repeats)]
        measurements.append({"op": first["op"], "bytes": first["bytes"],
                             "seconds": statistics.median(slowest), "world": world})
    return measurements
