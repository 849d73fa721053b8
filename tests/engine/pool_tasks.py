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
