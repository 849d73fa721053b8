"""What every layout shares: running the model's units in order, with a compute span per unit for
forward and backward, hooks where the sharder communicates, and the plans' hooks.

A rank's strategy is built in one fixed order (engine/parallelize.py): the model once; the plans applied
to it (tensor parallel, the pipeline stage cut, context parallel, expert parallel); then one data-parallel
sharder chosen by ZeRO stage (engine/dp.py stage 0, engine/zero.py stages 1-2, engine/fsdp.py stage 3).
No class exists per combination: the sharder asks the plans what it needs to know.

Backward spans come from identity autograd functions placed around each unit: the one on a unit's
output runs when its gradient arrives (the unit's backward starts), the one on its input runs when the
unit's backward has produced the input gradient (it ends).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.comm import Comm
from engine.config import RunConfig
from engine.model import loss_fn, mixed_precision, unit_forward_flops
from engine.optim import AdamW
from engine.recorder import Recorder


class _OnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


class Plan:
    """A model plan (tensor, context or expert parallel): it changes the model's modules in place when it
    is built, and the hooks below let the strategy drive the changed model. The defaults change nothing."""

    def local_tokens(self, tokens):
        """The part of a [B, T] batch of token ids (or targets) this rank computes on."""
        return tokens

    def loss(self, logits, targets):
        """The mean loss from the last unit's output, when the plan computes it its own way (else None)."""
        return None

    def unit_flops(self, i: int, flops: float, sequences: int) -> float:
        """Forward FLOPs of unit i (the full model's index) on this rank's part of `sequences` sequences,
        given what the plans applied after this one counted (they count first)."""
        return flops

    def is_expert(self, name: str) -> bool:
        """Whether a parameter belongs to one expert of an MoE layer (its gradient is not summed over ep)."""
        return False

    def full_state(self, state: dict) -> dict:
        """This rank's (plan-local) named tensors -> the full model's; may communicate (untraced)."""
        return state

    def copies_differing(self) -> list[str]:
        """The tensors whose copies on several ranks the last `full_state` kept one of and found differing
        (engine.verify, replicas)."""
        return []

    def stats(self) -> dict:
        return {}


class Strategy(ABC):
    """The one data-parallel sharder of a rank (subclasses: ZeRO stage 0, 1-2, 3) over a model that the
    `plans` have already changed. `forward`/`backward` are the same for every combination.

    Batch and gradients follow the mesh convention (core/mesh.py): this rank reads part `batch_index` of
    the batch's sequences; a parameter's gradient is summed over its `grad_axes` and divided by
    `replicas`, the number of local mean losses averaged into the global one."""

    def __init__(self, cfg: RunConfig, model, comm: Comm, recorder: Recorder, hyper: AdamW, mesh,
                 plans: list[Plan] = ()):
        self.cfg, self.model, self.comm, self.rec, self.hyper = cfg, model, comm, recorder, hyper
        self.mesh, self.plans = mesh, list(plans)
        self.names = model.unit_names
        self.batch_index = mesh.batch_index(comm.rank)
        self.replicas = mesh.loss_replicas
        self.shard_axis = mesh.shard_axis()
        self.shard_n, self.shard_rank = comm.size(self.shard_axis), comm.group_rank(self.shard_axis)
        self.last_micro_batch = True
        self._bwd_start_s: dict[int, float] = {}
        self._flops: list[float] = []

    def grad_axes(self, name: str) -> tuple[str, ...]:
        return self.mesh.grad_axes(expert=any(p.is_expert(name) for p in self.plans))

    def held_params(self, module) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters this rank computes with (expert parallel frees other ranks' experts)."""
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    # -- hooks a sharder may override -------------------------------------------------------------------
    def unit_forward(self, i: int, x):
        return self.model.units[i](x)

    def run_unit(self, i: int, x):
        """Unit i's forward in the run's compute precision (engine.model.mixed_precision)."""
        with mixed_precision(self.cfg.dtype, self.comm.device.type):
            return self.unit_forward(i, x)

    def before_forward(self, i: int) -> None:
        pass

    def after_forward(self, i: int) -> None:
        pass

    def before_backward(self, i: int) -> None:
        pass

    def weight_grads_ready(self, buffers: list) -> None:
        """ZB-H1's BW accumulated these flat buffers' gradients by hand (engine/pipeline/stage.py): do what their
        gradient hooks would have done. Whole parameters' hooks fire by themselves."""

    # -- what the plans decide ----------------------------------------------------------------------------
    def local_tokens(self, tokens):
        for p in self.plans:
            tokens = p.local_tokens(tokens)
        return tokens

    def loss(self, logits, targets):
        """The last unit's output -> the mean loss (tensor parallel: logits sharded over the vocabulary)."""
        logits = logits.float()  # the loss in fp32 whatever the compute precision (as loss_fn)
        for p in self.plans:
            out = p.loss(logits, targets)
            if out is not None:
                return out
        return loss_fn(logits, targets)

    def unit_flops(self, i: int, tokens) -> float:
        """Forward FLOPs of unit `i` on this rank's `tokens` (sequences before the plans' slicing)."""
        flops = unit_forward_flops(self.model.config, self.model.global_units[i], tokens.shape[0])
        for p in reversed(self.plans):  # cp and ep count tokens and pairs, then tp splits the matmuls
            flops = p.unit_flops(self.model.global_units[i], flops, tokens.shape[0])
        return flops

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """params, grads, exp_avg, exp_avg_sq by the full model's parameter names, unsharded (for
        verification): the sharder gathers over its shard axis, then each plan undoes its split, the last
        applied first. Collective: every rank calls it."""
        state = {q: {self.model.global_name(n): t for n, t in tensors.items()}
                 for q, tensors in self.sharded_state().items()}
        for p in reversed(self.plans):
            state = p.full_state(state)
        return state

    def copies_differing(self) -> list[str]:
        """What the plans' last `full_state` found differing among copies it kept one of (Plan.copies_differing)."""
        return [name for p in self.plans for name in p.copies_differing()]

    def stats(self) -> dict:
        """Plan-specific figures for the summary (e.g. expert load); called on every rank after the last
        step, so it may communicate (untraced)."""
        out = {}
        for p in self.plans:
            out.update(p.stats())
        return out

    # -- what each strategy must provide -----------------------------------------------------------------
    @abstractmethod
    def zero_grad(self) -> None:
        """Drop the previous step's gradients."""

    @abstractmethod
    def finish_grads(self) -> None:
        """After the last micro-batch's backward: wait for gradient communication, average over dp."""

    @abstractmethod
    def step(self, step: int) -> None:
        """The optimizer step (AdamW step number `step`, from 1), and whatever communication follows it."""

    @abstractmethod
    def sharded_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """params, grads, exp_avg, exp_avg_sq by this rank's parameter names, whole over the shard axis."""

    @abstractmethod
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: params, grads, optimizer (AdamW moments), and any transient peaks."""

    @abstractmethod
    def param_storages(self) -> list:
        """Storages holding parameters, so activation accounting does not count saved weights."""

    # -- shared driver -------------------------------------------------------------------------------
    def forward(self, tokens, targets):
        x = tokens = self.local_tokens(tokens)
        targets = self.local_tokens(targets)
        last = len(self.names) - 1
        self._flops = [self.unit_flops(i, tokens) for i in range(last + 1)]
        for i, name in enumerate(self.names):
            self.before_forward(i)
            with self.rec.compute(f"fwd {name}", flops=self._flops[i]):
                if i > 0:
                    x = _OnBackward.apply(x, lambda i=i: self._backward_done(i))
                x = self.run_unit(i, x)
                if i == last:
                    x = self.loss(x, targets)
                x = _OnBackward.apply(x, lambda i=i: self._backward_begins(i))
            self.after_forward(i)
        return x

    def backward(self, loss, last_micro_batch: bool) -> None:
        self.last_micro_batch = last_micro_batch
        loss.backward()
        self._backward_done(0)  # the embedding's input is integer tokens: no gradient marks its end

    def _backward_begins(self, i: int) -> None:
        self.before_backward(i)
        if self.rec.synchronize:
            self.rec.synchronize()
        self._bwd_start_s[i] = self.rec.now()

    def _backward_done(self, i: int) -> None:
        if self.rec.synchronize:
            self.rec.synchronize()
        self.rec.add("compute", f"bwd {self.names[i]}", self._bwd_start_s.pop(i), self.rec.now(),
                     flops=2 * self._flops[i])
