"""Tasks the pool tests send to workers: `function(ctx, **kwargs)` run on every rank."""

import os
import time


def whoami(ctx):
    return {"rank": ctx.rank, "pid": os.getpid(), "world": ctx.world}


def all_reduce_ranks(ctx):
    import torch

    from engine.comm import Comm
    from engine.recorder import Recorder

    comm = Comm(Recorder(ctx.rank, ctx.clock_offset_s), ctx.device)
    t = torch.tensor([float(ctx.rank)])
    comm.all_reduce(t)
    return t.item()


def raise_on(ctx, rank):
    if ctx.rank == rank:
        raise ValueError(f"injected failure on rank {rank}")
    return all_reduce_ranks(ctx)


def hang_on(ctx, rank):
    if ctx.rank == rank:
        time.sleep(3600)
    return all_reduce_ranks(ctx)


def exit_on(ctx, rank):
    if ctx.rank == rank:
        os._exit(3)  # dies without a Python traceback, as a segfault or an OOM kill would
    return all_reduce_ranks(ctx)


def comm_gaps(ctx):
    """The gloo gaps comm.py papers over: uneven all_to_all, 2-D reduce_scatter input, spans recorded."""
    import torch

    from engine.comm import Comm
    from engine.recorder import Recorder

    comm = Comm(Recorder(ctx.rank, ctx.clock_offset_s), ctx.device)
    # rank r sends r + 1 rows to every rank; rows carry (sender, index) so the receiver can check them
    in_splits = [ctx.rank + 1] * ctx.world
    rows = torch.tensor([[ctx.rank, i] for i in range(sum(in_splits))], dtype=torch.float32)
    out_splits = [src + 1 for src in range(ctx.world)]
    received = torch.empty(sum(out_splits), 2)
    comm.all_to_all(received, rows, out_splits, in_splits)
    full = torch.arange(ctx.world * 6, dtype=torch.float32).view(ctx.world * 2, 3)  # 2-D: gloo wants flat
    shard = torch.empty(6)
    comm.reduce_scatter(shard, full)
    handle = comm.all_reduce(torch.ones(4), async_op=True)
    total = handle.wait()
    return {"received": received.tolist(), "shard": shard.tolist(), "total": total.tolist(),
            "spans": [(s.name, s.bytes, s.is_async) for s in comm.recorder.take()]}


def train_with_one_rank_off(ctx, cfg, rank, lr_scale=3.0):
    """engine.train.run_rank with --check, where `rank` alone steps with `lr_scale` times the learning rate: a
    replica that drifts from the others (the reference is compared with one rank of each stage only)."""
    from dataclasses import replace

    import engine.dp as dp
    import engine.flat as flat
    from engine.train import run_rank

    original = dp.adamw_, flat.adamw_

    def drifting(param, grad, exp_avg, exp_avg_sq, step, hyper):
        original[0](param, grad, exp_avg, exp_avg_sq, step, replace(hyper, lr=hyper.lr * lr_scale))

    if ctx.rank == rank:
        dp.adamw_ = flat.adamw_ = drifting
    try:
        return run_rank(ctx, cfg, traced=False, check=True)
    finally:
        dp.adamw_, flat.adamw_ = original


def train_with_weights_never_written(ctx, cfg):
    """engine.train.run_rank with --check, where Adam's moments move and the weights never do (every rank)."""
    import engine.dp as dp
    import engine.flat as flat
    from engine.train import run_rank

    original = dp.adamw_, flat.adamw_

    def stale(param, grad, exp_avg, exp_avg_sq, step, hyper):
        original[0](param.clone(), grad, exp_avg, exp_avg_sq, step, hyper)

    dp.adamw_ = flat.adamw_ = stale
    try:
        return run_rank(ctx, cfg, traced=False, check=True)
    finally:
        dp.adamw_, flat.adamw_ = original


def collector_state(ctx):
    """Whether the cyclic garbage collector runs by itself during a task, and how many objects it leaves out."""
    import gc

    return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}


def page_faults_of_ring_blocks(ctx, rows=256, times=20):
    """Minor page faults over the last half of `times` forward ring-attention blocks of `rows` x `rows` (4
    heads, head dim 16, 2 sequences: engine/cp.py's step at a 512-token sequence over cp = 2): with malloc
    keeping freed memory (engine.worker.keep_freed_memory) the later ones fault in nothing; left to glibc's
    default, the few MiB each frees go back to the system and the next faults them in again, page by page."""
    import resource

    import torch

    from engine.ring_attention import block_forward, expand_kv, merge

    q, kv = torch.randn(2, 4, rows, 16), torch.randn(2, 2, 2, rows, 16)
    out, lse = torch.randn(2, 4, rows, 16), torch.randn(2, 4, rows)
    faults = 0
    for i in range(times):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        merge(out, lse, *block_forward(q, expand_kv(kv[0], 4), expand_kv(kv[1], 4), None, 0.25))
        if i >= times // 2:
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return {"kept": ctx.keeps_freed_memory, "faults": faults}
