"""What context and expert parallel share: parameters held whole on every rank that uses them, AdamW on
them, and gradients summed over the mesh axes whose ranks computed different parts of the loss.

    dW = AllReduce_{axes}( dW_local ) / replicas

Each rank's loss is the mean over its own tokens and every rank holds the same number of tokens, so the
mean of those means over the `replicas` ranks is the global mean loss; its gradient is the sum of the
local gradients divided by `replicas`. When the axes together span the whole world one all-reduce over
the world group does it; otherwise one all-reduce per axis (the mesh only builds per-axis groups).
"""

from __future__ import annotations

import math

import torch

from engine.strategy import WholeParamsStrategy


class ReplicatedStrategy(WholeParamsStrategy):
    """Subclasses call `hold` once per group of parameters (names, the axes their gradients are summed
    over, and the divisor)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.params: dict[str, torch.nn.Parameter] = {}
        self.exp_avg: dict[str, torch.Tensor] = {}
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        self.sync_sets: list[tuple[list[str], tuple[str, ...], int, str]] = []

    def hold(self, params: dict[str, torch.nn.Parameter], axes: tuple[str, ...], divisor: int,
             label: str) -> None:
        self.params.update(params)
        for n, p in params.items():
            self.exp_avg[n] = torch.zeros_like(p)
            self.exp_avg_sq[n] = torch.zeros_like(p)
        self.sync_sets.append((list(params), axes, divisor, label))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def _sum_over(self, flat: torch.Tensor, axes: tuple[str, ...], label: str) -> None:
        degrees = [self.comm.size(a) for a in axes]
        if math.prod(degrees) == self.comm.world and self.comm.world > 1:
            self.comm.all_reduce(flat, "world", name=f"all_reduce grads {label}")
            return
        for axis, degree in zip(axes, degrees, strict=True):
            if degree > 1:
                self.comm.all_reduce(flat, axis, name=f"all_reduce grads {label}")

    def finish_grads(self) -> None:
        for names, axes, divisor, label in self.sync_sets:
            grads = [self.params[n].grad for n in names]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._sum_over(flat, axes, label)
            flat.div_(divisor)
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
