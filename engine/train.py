"""One rank's part of a run: build the model, apply the strategy, train, measure, and (with
`check`) gather the full state after every step for comparison with the reference.

`run_rank` is the task the worker pool (or torchrun) calls on every rank; its result is a plain dict.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from engine.comm import Comm
from engine.config import RunConfig
from engine.dp import DataParallel
from engine.fsdp import FSDP
from engine.memory import ActivationMeter
from engine.model import build_model, global_batch
from engine.recorder import Recorder
from engine.reference import hyper, reference_run
from engine.strategy import Strategy
from engine.verify import compare
from engine.zero import ZeRO


def make_strategy(cfg: RunConfig, model, comm: Comm, rec: Recorder) -> Strategy:
    args = (cfg, model, comm, rec, hyper(cfg))
    if cfg.parallel.strategy == "cp":
        from engine.cp import ContextParallel

        return ContextParallel(*args)
    if cfg.parallel.strategy == "ep":
        from engine.ep import ExpertParallel

        return ExpertParallel(*args)
    if cfg.parallel.degree("tp", cfg.world) > 1:
        from engine.tp import make_tensor_parallel

        return make_tensor_parallel(*args)
    stage = cfg.parallel.stage
    if stage == 0:
        return DataParallel(*args)
    if stage in (1, 2):
        return ZeRO(*args, stage=stage)
    return FSDP(*args)


def run_rank(ctx, cfg: RunConfig, traced: bool = True, check: bool = False,
             return_states: bool = False) -> dict:
    """Train `cfg.steps` steps. With `check`, rank 0's result carries the comparison with the reference;
    with `return_states`, rank 0's result carries the gathered state after every step (CPU tensors)."""
    if cfg.parallel.strategy == "pp" or cfg.pp > 1:
        from engine.pp import run_pipeline_rank

        return run_pipeline_rank(ctx, cfg, traced=traced, check=check, return_states=return_states)
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else None
    rec = Recorder(ctx.rank, ctx.clock_offset_s, enabled=traced, synchronize=sync)
    comm = Comm(rec, ctx.device, ctx.mesh_groups(cfg.parallel.axes(cfg.world)))
    model = build_model(cfg.model, cfg.seed).to(ctx.device)
    strategy = make_strategy(cfg, model, comm, rec)
    meter = ActivationMeter(strategy.param_storages())
    mb, mbs = cfg.micro_batches, cfg.micro_batch_size
    losses, step_times_s, snapshots = [], [], []
    for step in range(cfg.steps):
        rec.step = step
        tokens, targets = global_batch(cfg.model, cfg.seed, step, cfg.global_batch)
        start = time.perf_counter()
        strategy.zero_grad()
        step_loss = 0.0
        for m in range(mb):
            rec.micro_batch = m
            rows = slice((strategy.dp_rank * mb + m) * mbs, (strategy.dp_rank * mb + m + 1) * mbs)
            x, y = tokens[rows].to(ctx.device), targets[rows].to(ctx.device)
            with meter.measure():
                loss = strategy.forward(x, y)
            strategy.backward(loss / mb, last_micro_batch=m == mb - 1)
            step_loss += loss.item() / mb
        rec.micro_batch = None
        strategy.finish_grads()
        strategy.step(step + 1)
        if sync:
            sync()
        step_times_s.append(time.perf_counter() - start)
        losses.append(step_loss)
        ctx.step_done(step + 1, step_loss)
        if check or return_states:
            state = strategy.full_state()  # collective: every rank takes part, rank 0 keeps it
            if ctx.rank == 0:
                snapshots.append(_to_cpu(state))
    memory = dict(strategy.memory_bytes(), activations_peak=meter.peak_bytes)
    memory["total"] = sum(memory.values())
    result = {"rank": ctx.rank, "losses": losses, "step_times_s": step_times_s, "memory_bytes": memory,
              "comm_bytes": comm.sent_bytes, "stats": strategy.stats(),
              "spans": [asdict(s) for s in rec.take()], "check": None,
              "states": snapshots if return_states else None}
    if check:
        with comm.untraced():
            all_losses = comm.gather_objects(losses)
        if ctx.rank == 0:
            dp_losses = [sum(r[s] for r in all_losses) / len(all_losses) for s in range(cfg.steps)]
            result["check"] = compare(cfg, reference_run(cfg), snapshots, dp_losses)
    return result


def _to_cpu(state: dict) -> dict:
    return {k: {n: t.detach().cpu() for n, t in d.items()} for k, d in state.items()}
