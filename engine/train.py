"""The one rank loop of every run: set up the mesh's groups and this rank's layout, train, measure, and
(with `check`) gather the full state after every step for comparison with the reference.

`run_rank` is the task the worker pool (or torchrun) calls on every rank; its result is a plain dict. A
run with pp > 1 steps through a pipeline schedule (engine/pipeline/executor.py), any other through `Sequential`; both
give the same loop a `step(tokens, targets, step) -> loss or None`, their `strategy` and their activation
peak.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict

import torch

from core.mesh import Mesh
from engine.comm import Comm
from engine.config import RunConfig
from engine.memory import ActivationMeter
from engine.model import global_batch, micro_batch_rows
from engine.parallelize import group_spans, parallelize
from engine.recorder import Recorder
from engine.reference import reference_run
from engine.verify import compare, replica_failures, state_digest

FULL_COLLECTION_STEPS = 50  # torchtitan's default gc_freq


class Sequential:
    """Every unit on this rank, micro-batch after micro-batch: forward, backward, then one optimizer step."""

    def __init__(self, cfg: RunConfig, comm: Comm, rec: Recorder, mesh: Mesh, device):
        self.cfg, self.rec, self.device = cfg, rec, device
        self.strategy = parallelize(cfg, comm, rec, mesh, device)
        self.meter = ActivationMeter(self.strategy.param_storages())

    @property
    def activation_peak_bytes(self) -> int:
        return self.meter.peak_bytes

    def step(self, tokens, targets, step: int) -> float:
        s, mb = self.strategy, self.cfg.micro_batches
        s.zero_grad()
        step_loss = 0.0
        for m in range(mb):
            self.rec.micro_batch = m
            rows = micro_batch_rows(s.batch_index, m, mb, self.cfg.micro_batch_size)
            x, y = tokens[rows].to(self.device), targets[rows].to(self.device)
            with self.meter.measure():
                loss = s.forward(x, y)
            s.backward(loss / mb, last_micro_batch=m == mb - 1)
            step_loss += loss.item() / mb
        self.rec.micro_batch = None
        s.finish_grads()
        s.step(step + 1)
        return step_loss


def run_rank(ctx, cfg: RunConfig, traced: bool = True, check: bool = False,
             return_states: bool = False) -> dict:
    """Train `cfg.steps` steps. With `check`, rank 0's result carries the comparison with the reference;
    with `return_states`, rank 0's result carries the gathered state after every step (CPU tensors)."""
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else None
    rec = Recorder(ctx.rank, ctx.clock_offset_s, enabled=traced, synchronize=sync)
    mesh = Mesh(cfg.parallel.axes(cfg.world))
    comm = Comm(rec, ctx.device, ctx.mesh_groups(mesh, group_spans(cfg, mesh)))
    if mesh.degree("pp") > 1:
        from engine.pipeline.executor import Pipeline

        runner = Pipeline(cfg, comm, rec, mesh, ctx.device)
    else:
        runner = Sequential(cfg, comm, rec, mesh, ctx.device)
    # After full_state every rank of a pipeline stage holds that stage's whole state: one rank per stage
    # sends it to rank 0.
    keeps_state = all(c == 0 for axis, c in mesh.coords(ctx.rank).items() if axis != "pp")
    losses, step_times_s, snapshots, digests, differing = [], [], [], [], []
    for step in range(cfg.steps):
        rec.step = step
        tokens, targets = global_batch(cfg.model, cfg.seed, step, cfg.global_batch)
        # Every rank starts the step together, so a step's timeline shows the step's own waits, not the
        # previous step's skew (a pipeline's last stage finishes its optimizer step later than the first).
        with comm.untraced():
            comm.barrier()
        start = time.perf_counter()
        loss = runner.step(tokens, targets, step)
        if sync:
            sync()
        step_times_s.append(time.perf_counter() - start)
        losses.append(loss)
        ctx.step_done(step + 1, loss)  # None on pipeline ranks without the last stage
        # the step's garbage collected here, between the steps, with the collector paused while the task runs
        # (engine.worker.collector_paused; where it is not paused this is one collection early): the young
        # generations after every step (0.2 ms here), every generation now and then, so cycles that outlive
        # a step are freed in a long run too (the objects of before the task are frozen out of it: 0.1 ms
        # over the default model's, 54 ms with torch's unfrozen)
        gc.collect(2 if (step + 1) % FULL_COLLECTION_STEPS == 0 else 1)
        if check or return_states:
            state = runner.strategy.full_state()  # collective over this rank's stage
            if keeps_state:
                snapshots.append(_to_cpu(state))
            if check:  # every copy of the stage's state must agree (engine.verify, replicas)
                digests.append(state_digest(state))
                differing.append(runner.strategy.copies_differing())
    with comm.untraced():
        everyone = comm.gather_objects(losses)
        states = comm.gather_to_root(snapshots if keeps_state else None) if (check or return_states) else None
        copies = comm.gather_to_root((mesh.coords(ctx.rank).get("pp", 0), digests, differing)) if check else None
    # Every rank's loss is the mean over its own tokens, and every rank holding the last stage holds as
    # many: the global loss is the mean over those ranks.
    last = [ls for ls in everyone if ls[0] is not None]
    step_losses = [sum(ls[s] for ls in last) / len(last) for s in range(cfg.steps)]
    memory = dict(runner.strategy.memory_bytes(), activations_peak=runner.activation_peak_bytes)
    memory["total"] = sum(memory.values())
    result = {"rank": ctx.rank, "losses": step_losses, "step_times_s": step_times_s, "memory_bytes": memory,
              "comm_bytes": comm.sent_bytes, "stats": runner.strategy.stats(),
              "spans": [asdict(s) for s in rec.take()], "check": None, "states": None}
    if states is not None:
        merged = [_merge([snaps[s] for snaps in states if snaps is not None]) for s in range(cfg.steps)]
        if return_states:
            result["states"] = merged
        if check:
            result["check"] = compare(cfg, reference_run(cfg), merged, step_losses, replica_failures(copies))
    return result


def _to_cpu(state: dict) -> dict:
    return {k: {n: t.detach().cpu() for n, t in d.items()} for k, d in state.items()}


def _merge(states: list[dict]) -> dict:
    """Union of the stages' named tensors."""
    out: dict[str, dict] = {}
    for state in states:
        for quantity, tensors in state.items():
            out.setdefault(quantity, {}).update(tensors)
    return out
