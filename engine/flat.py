"""Flat parameters: the common ground of ZeRO-1/2/3.

Each unit of the model (embed, each block, head) keeps its parameters in one flat fp32 buffer,
padded to a multiple of dp so it splits into dp equal shards (as FSDP's FlatParameter does):

    full[P]  = concat(unit params) + padding          P = dp * S
    shard[S] = full[rank * S : (rank + 1) * S]         this rank's slice: it owns its AdamW update

The unit runs with `torch.func.functional_call` on views of `full`, so autograd delivers the whole
unit's gradient into `full.grad` in one piece, ready for one reduce-scatter or all-reduce.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from engine.optim import adamw_
from engine.strategy import Strategy


class FlatUnit:
    def __init__(self, prefix: str, module: torch.nn.Module, dp: int, dp_rank: int):
        self.module = module
        params = list(module.named_parameters())
        self.local_names = [n for n, _ in params]
        self.names = [f"{prefix}.{n}" for n, _ in params]
        self.shapes = [p.shape for _, p in params]
        self.numels = [p.numel() for _, p in params]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // dp)  # ceil: the last shard carries the padding
        padded = self.shard_numel * dp
        full = torch.zeros(padded, dtype=params[0][1].dtype, device=params[0][1].device)
        with torch.no_grad():
            torch.cat([p.reshape(-1) for _, p in params], out=full[: self.numel])
        for _, p in params:  # the flat buffer is now the only copy
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.full = full.requires_grad_()
        lo = dp_rank * self.shard_numel
        self.shard = full.detach()[lo: lo + self.shard_numel].clone()
        self.grad_shard: torch.Tensor | None = None
        self.exp_avg = torch.zeros_like(self.shard)
        self.exp_avg_sq = torch.zeros_like(self.shard)
        self.full_bytes = padded * full.element_size()

    def views(self) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape, n in zip(self.local_names, self.shapes, self.numels, strict=True):
            out[name] = self.full[offset: offset + n].view(shape)
            offset += n
        return out

    def __call__(self, x):
        return functional_call(self.module, self.views(), (x,))

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A full-length flat tensor (params, grads or a moment) back into named tensors."""
        out, offset = {}, 0
        for name, shape, n in zip(self.names, self.shapes, self.numels, strict=True):
            out[name] = flat[offset: offset + n].view(shape).clone()
            offset += n
        return out

    # -- resharding: FSDP frees the full buffer between uses -----------------------------------------
    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free_full(self) -> None:
        """Release the full parameters' memory; autograd's saved views keep the (now empty) storage,
        which `alloc_full` refills in place before backward reads it (FSDP1's resize trick)."""
        self.full.untyped_storage().resize_(0)

    def alloc_full(self) -> None:
        self.full.untyped_storage().resize_(self.full_bytes)


class ShardedStrategy(Strategy):
    """Optimizer state and update on shards; verification gathers the shards back."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.units = [FlatUnit(f"units.{i}", unit, self.dp, self.dp_rank)
                      for i, unit in enumerate(self.model.units)]
        # (unit, reduce-scatter handle, its input kept alive until the op completes)
        self.pending: list[tuple[FlatUnit, object, torch.Tensor]] = []

    def unit_forward(self, i: int, x):
        return self.units[i](x)

    def finish_grads(self) -> None:
        """Wait for the gradient reduce-scatters, sum the micro-batches' parts, average over dp."""
        for u, handle, _ in self.pending:
            part = handle.wait()
            u.grad_shard = part if u.grad_shard is None else u.grad_shard.add_(part)
        self.pending = []
        for u in self.units:
            u.grad_shard.div_(self.dp)

    def step(self, step: int) -> None:
        with self.rec.compute("optimizer step"):
            for u in self.units:
                adamw_(u.shard, u.grad_shard, u.exp_avg, u.exp_avg_sq, step, self.hyper)

    def _gather(self, u: FlatUnit, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        full = torch.empty(u.shard_numel * self.dp, dtype=shard.dtype, device=shard.device)
        with self.comm.untraced():
            self.comm.all_gather(full, shard, "dp")
        return u.split(full)

    def full_state(self):
        state = {"params": {}, "grads": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for u in self.units:
            state["params"].update(self._gather(u, u.shard))
            state["grads"].update(self._gather(u, u.grad_shard))
            state["exp_avg"].update(self._gather(u, u.exp_avg))
            state["exp_avg_sq"].update(self._gather(u, u.exp_avg_sq))
        return state

    def param_storages(self):
        return [t.untyped_storage() for u in self.units for t in (u.full, u.shard)]

    @staticmethod
    def _size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
