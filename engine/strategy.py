"""What every strategy shares: running the model's units in order, with a compute span per unit for
forward and backward, and hooks where a strategy communicates.

Backward spans come from identity autograd functions placed around each unit: the one on a unit's
output runs when its gradient arrives (the unit's backward starts), the one on its input runs when the
unit's backward has produced the input gradient (it ends).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.comm import Comm
from engine.config import RunConfig
from engine.model import Transformer, loss_fn, unit_forward_flops
from engine.optim import AdamW, adamw_
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


class Strategy(ABC):
    """Subclasses implement the communication; `forward`/`backward` are the same for all of them."""

    def __init__(self, cfg: RunConfig, model: Transformer, comm: Comm, recorder: Recorder, hyper: AdamW):
        self.cfg, self.model, self.comm, self.rec, self.hyper = cfg, model, comm, recorder, hyper
        self.names = model.unit_names
        self.dp = comm.size("dp")
        self.dp_rank = comm.group_rank("dp")
        self.last_micro_batch = True
        self._bwd_start_s: dict[int, float] = {}
        self._flops: list[float] = []

    # -- hooks a strategy may override -----------------------------------------------------------------
    def unit_forward(self, i: int, x):
        return self.model.units[i](x)

    def before_forward(self, i: int) -> None:
        pass

    def after_forward(self, i: int) -> None:
        pass

    def before_backward(self, i: int) -> None:
        pass

    def loss(self, logits, targets):
        """The last unit's output -> the mean loss (tensor parallel: logits sharded over the vocabulary)."""
        return loss_fn(logits, targets)

    def unit_flops(self, i: int, tokens) -> float:
        """Forward FLOPs of unit `i` on this rank's `tokens`; a strategy that splits a unit's work
        (sequence chunks, heads) overrides it."""
        return unit_forward_flops(self.model.config, i, tokens.shape[0])

    def stats(self) -> dict:
        """Strategy-specific figures for the summary (e.g. expert load); called on every rank after the
        last step, so it may communicate (untraced)."""
        return {}

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
    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """params, grads, exp_avg, exp_avg_sq by parameter name, unsharded (for verification)."""

    @abstractmethod
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: params, grads, optimizer (AdamW moments), and any transient peaks."""

    @abstractmethod
    def param_storages(self) -> list:
        """Storages holding parameters, so activation accounting does not count saved weights."""

    # -- shared driver -------------------------------------------------------------------------------
    def forward(self, tokens, targets):
        x = tokens
        last = len(self.names) - 1
        self._flops = [self.unit_flops(i, tokens) for i in range(last + 1)]
        for i, name in enumerate(self.names):
            self.before_forward(i)
            with self.rec.compute(f"fwd {name}", flops=self._flops[i]):
                if i > 0:
                    x = _OnBackward.apply(x, lambda i=i: self._backward_done(i))
                x = self.unit_forward(i, x)
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


class WholeParamsStrategy(Strategy):
    """A rank that keeps its local parameters whole (not flat shards), each with its own AdamW moments in
    `self.params`, `self.exp_avg`, `self.exp_avg_sq`: the optimizer step, the state for verification and
    the memory count are the same whichever communication the subclass does with the gradients."""

    def step(self, step: int) -> None:
        with self.rec.compute("optimizer step"):
            for n, p in self.params.items():
                adamw_(p, p.grad, self.exp_avg[n], self.exp_avg_sq[n], step, self.hyper)

    def full_state(self):
        return {
            "params": {n: p.detach().clone() for n, p in self.params.items()},
            "grads": {n: p.grad.detach().clone() for n, p in self.params.items()},
            "exp_avg": {n: t.clone() for n, t in self.exp_avg.items()},
            "exp_avg_sq": {n: t.clone() for n, t in self.exp_avg_sq.items()},
        }

    def memory_bytes(self):
        def size(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "params": size(self.params.values()),
            "grads": size(p.grad for p in self.params.values() if p.grad is not None),
            "optimizer": size(self.exp_avg.values()) + size(self.exp_avg_sq.values()),
        }

    def param_storages(self):
        return [p.untyped_storage() for p in self.params.values()]
