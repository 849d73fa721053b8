"""Pipeline parallel: each rank holds some stages of the model and runs a schedule's actions on them.

    rank r of the pp group:  stages r, p + r, ... (one per chunk; engine/pipeline/stage.py)
    F  mb on stage s:   x[B_mb, T, D] = RECV act from stage s - 1 (or the tokens);  y = units(x)
                        SEND y to stage s + 1 (the last stage computes the loss instead)
    B  mb on stage s:   dy = RECV grad from stage s + 1 (or dL/dL = 1);  dx = backward(y, dy)
                        SEND dx to stage s - 1; weight gradients accumulate locally
    BI / BW (ZB-H1):    the same backward in two parts, dx now and dW later (pp_stage.WeightGradSplit)

The executor walks `core.schedules.make_schedule(...)`'s action list for its pp rank, unchanged: the
same data drives the schedule picture and this run. SEND is an isend whose tensor is kept until it has
completed (at the end of the step); RECV is a blocking irecv + wait whose tensor waits under its message
key until the compute that needs it. Per pair of ranks the RECVs come in the sender's SEND order, so
FIFO point-to-point matching pairs them without tags. Every action becomes a span: compute "F s1",
"B s1", "BI s1", "BW s1" and comm "send act s1" / "recv grad s2" on the "pp" group, each with its
micro-batch.

Loss scaling happens in ONE place, `_micro_batch_loss`: the last stage's loss of a micro-batch is
divided by the number of micro-batches before anything flows backward, exactly as the non-pipeline
driver (engine/train.py) scales `loss / micro_batches`. Backward of micro-batches runs in increasing
order on every stage and every schedule, so gradients accumulate in the same order as there: pipeline
and non-pipeline gradients agree bit for bit (tests/engine/test_pp.py checks it).

Meshes (core/mesh.py): pp is the outermost axis. The ranks that share a pp coordinate hold the same
stages; engine/parallelize.py cuts this rank's stage out of the (tensor-parallel) model and applies the
other plans and the data-parallel sharder to it as to a whole model, so the sharder handles the gradients
of exactly the parameters this rank holds. With cp a stage receives and sends only this rank's T/cp
zig-zag tokens. pp sends the fewest bytes of all axes (one activation per micro-batch per stage
boundary), so it goes on the slowest links; tp, the chattiest, stays innermost.
"""

from __future__ import annotations

import torch

from core.mesh import Mesh
from core.schedules import (
    ACTIVATION,
    BACKWARD,
    BACKWARD_INPUT,
    FORWARD,
    GRADIENT,
    RECV,
    SEND,
    Action,
    make_schedule,
    stage_units,
)
from engine.comm import Comm
from engine.config import RunConfig
from engine.memory import ActivationMeter
from engine.model import micro_batch_rows
from engine.parallelize import parallelize
from engine.pipeline.stage import WeightGradSplit
from engine.recorder import Recorder
from engine.strategy import _OnBackward


def _micro_batch_loss(loss: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """The one place micro-batch losses are scaled: their sum is the mean loss of the step."""
    return loss / micro_batches


class Pipeline:
    """One rank's part of every pipeline step: its stage model, the strategy over its dp group, and
    the schedule's actions for its pp rank."""

    def __init__(self, cfg: RunConfig, comm: Comm, rec: Recorder, mesh: Mesh, device: torch.device):
        self.cfg, self.comm, self.rec, self.device = cfg, comm, rec, device
        pp_rank = mesh.coord(comm.rank, "pp")
        self.m = cfg.micro_batches
        self.schedule = make_schedule(cfg.parallel.schedule, cfg.pp, self.m, cfg.parallel.virtual_stages)
        self.actions = self.schedule.actions[pp_rank]
        self.pp_peers = mesh.group_of(comm.rank, "pp")  # global rank of each pp coordinate
        self.num_stages = self.schedule.num_stages
        chunks = [stage_units(cfg.model, self.num_stages, self.schedule.stage_of(pp_rank, c))
                  for c in range(cfg.parallel.virtual_stages)]
        self.strategy = parallelize(cfg, comm, rec, mesh, device, chunks)
        self.model = self.strategy.model
        self.tp, self.cp = mesh.degree("tp"), mesh.degree("cp")
        self.split = WeightGradSplit(self.model) if self.schedule.split_backward else None
        self.param_storages = self.strategy.param_storages()
        self.activation_peak_bytes = 0

    def step(self, tokens, targets, step: int) -> float | None:
        """One optimizer step; returns the mean loss over micro-batches on the last stage, else None."""
        self.tokens, self.targets = tokens, targets
        self.messages: dict[tuple[str, int, int], torch.Tensor] = {}  # produced or received, not consumed
        self.stash: dict[tuple[int, int], tuple] = {}  # (mb, stage) -> (stage input, output, captured)
        self.weight_work: dict[tuple[int, int], list] = {}
        self.sends: list[tuple[object, torch.Tensor]] = []
        self.held_bytes: dict[tuple[int, int], int] = {}
        self.loss_sum = 0.0
        self.strategy.zero_grad()
        for action in self.actions:
            self.rec.micro_batch = action.micro_batch
            self.run_action(action)
        self.rec.micro_batch = None
        for handle, _tensor in self.sends:
            handle.wait()
        self.strategy.finish_grads()
        self.strategy.step(step + 1)
        return self.loss_sum if self.holds_last_stage else None

    @property
    def holds_last_stage(self) -> bool:
        return any(a.kind == FORWARD and a.stage == self.num_stages - 1 for a in self.actions)

    def run_action(self, a: Action) -> None:
        if a.kind == SEND:
            tensor = self.messages.pop(a.message)
            handle = self.comm.send(tensor, self.pp_peers[a.peer], name=f"send {a.tensor} s{a.stage}",
                                    async_op=True, group="pp")
            self.sends.append((handle, tensor))  # the tensor must live until the isend completes
        elif a.kind == RECV:
            buf = torch.empty(self._boundary_shape(), device=self.device)
            self.comm.recv(buf, self.pp_peers[a.peer], name=f"recv {a.tensor} s{a.stage}", group="pp")
            self.messages[a.message] = buf
        elif a.kind == FORWARD:
            with self.rec.compute(f"F s{a.stage}"):
                self._forward(a)
        elif a.kind == BACKWARD:
            with self.rec.compute(f"B s{a.stage}"):
                self._backward(a)
        elif a.kind == BACKWARD_INPUT:
            with self.rec.compute(f"BI s{a.stage}"):
                self._backward_input(a)
        else:
            with self.rec.compute(f"BW s{a.stage}"):
                self.strategy.last_micro_batch = a.micro_batch == self.m - 1
                buffers = self.split.backward_weight(self.weight_work.pop((a.micro_batch, a.stage)))
                self.strategy.weight_grads_ready(buffers)
            # BI kept the whole graph (retain_graph) for BW, so the activations are freed only now.
            self.held_bytes.pop((a.micro_batch, a.stage))

    def _boundary_shape(self) -> tuple[int, ...]:
        """X[B_mb, T, D] between stages; X[B_mb, T_tp, D] with sequence parallel (engine/tp.py) and
        X[B_mb, T_cp, D] with context parallel (engine/cp.py)."""
        m = self.cfg.model
        tokens = m.seq_len // self.tp if self.cfg.parallel.sequence_parallel else m.seq_len
        return (self.cfg.micro_batch_size, tokens // self.cp, m.hidden)

    def _rows(self, mb: int) -> slice:
        return micro_batch_rows(self.strategy.batch_index, mb, self.m, self.cfg.micro_batch_size)

    def _forward(self, a: Action) -> None:
        mb, stage = a.micro_batch, a.stage
        if stage == 0:
            x = self.strategy.local_tokens(self.tokens[self._rows(mb)].to(self.device))
            stage_input = None  # integer tokens: no gradient to send back
        else:
            stage_input = self.messages.pop((ACTIVATION, mb, stage - 1)).detach().requires_grad_()
            x = stage_input
        meter = ActivationMeter(self.param_storages)
        captured: list = []
        with meter.measure():
            if self.split is not None:
                with self.split.record() as captured:
                    y = self._run_units(a.chunk, x)
            else:
                y = self._run_units(a.chunk, x)
            if stage == self.num_stages - 1:
                targets = self.strategy.local_tokens(self.targets[self._rows(mb)].to(self.device))
                loss = self.strategy.loss(y, targets)
                self.loss_sum += loss.item() / self.m
                y = _micro_batch_loss(loss, self.m)
        self.held_bytes[(mb, stage)] = meter.peak_bytes
        self.activation_peak_bytes = max(self.activation_peak_bytes, sum(self.held_bytes.values()))
        self.stash[(mb, stage)] = (stage_input, y, captured)
        if stage < self.num_stages - 1:
            self.messages[(ACTIVATION, mb, stage)] = y.detach()

    def _run_units(self, chunk: int, x):
        s = self.strategy
        for i in self.model.chunk_units[chunk]:
            s.before_forward(i)
            x = s.run_unit(i, x)
            # FSDP re-gathers unit i's parameters when its output gradient arrives.
            x = _OnBackward.apply(x, lambda i=i: s.before_backward(i))
            s.after_forward(i)
        return x

    def _output_grad(self, a: Action):
        if a.stage == self.num_stages - 1:
            return None  # the scaled loss is a scalar: autograd starts from 1
        return self.messages.pop((GRADIENT, a.micro_batch, a.stage + 1))

    def _backward(self, a: Action) -> None:
        stage_input, y, _ = self.stash.pop((a.micro_batch, a.stage))
        grad = self._output_grad(a)
        self.strategy.last_micro_batch = a.micro_batch == self.m - 1
        torch.autograd.backward(y, grad)
        self.held_bytes.pop((a.micro_batch, a.stage))
        if a.stage > 0:
            self.messages[(GRADIENT, a.micro_batch, a.stage)] = stage_input.grad

    def _backward_input(self, a: Action) -> None:
        stage_input, y, captured = self.stash.pop((a.micro_batch, a.stage))
        input_grad, work = self.split.backward_input(y, self._output_grad(a), stage_input, captured)
        self.weight_work[(a.micro_batch, a.stage)] = work
        if a.stage > 0:
            self.messages[(GRADIENT, a.micro_batch, a.stage)] = input_grad
