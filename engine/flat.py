"""Flat parameters: the common ground of ZeRO-1/2/3.

Each unit of the model (embed, each block, head) keeps its parameters in flat fp32 buffers, one per
gradient group (a dense block has one; an MoE block under expert parallel two, its experts' gradients
being summed over fewer axes, core/mesh.py), each padded to a multiple of the shard axis's size n so it
splits into n equal shards (as FSDP's FlatParameter does):

    full[P]  = concat(the group's params) + padding    P = n * S
    shard[S] = full[rank * S : (rank + 1) * S]           this rank's slice: it owns its AdamW update

The unit runs with `torch.func.functional_call` on views of its buffers, so autograd delivers the whole
group's gradient into `full.grad` in one piece, ready for one reduce-scatter over the shard axis; the
shard's gradient is then summed over the group's other data axes (HSDP's replicas, cp, ep) and divided by
the number of replicas of the loss.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from core.mesh import group_key
from engine.comm import Done
from engine.optim import adamw_
from engine.strategy import Strategy


class FlatUnit:
    """Some parameters of one module (`params`: (local name, parameter)) in one flat buffer."""

    def __init__(self, prefix: str, params: list, n: int, rank: int, replicate: str | None):
        self.local_names = [name for name, _ in params]
        self.names = [f"{prefix}.{name}" for name, _ in params]
        self.shapes = [p.shape for _, p in params]
        self.numels = [p.numel() for _, p in params]
        self.numel = sum(self.numels)
        self.replicate = replicate  # the group the shard's gradient is summed over after the reduce-scatter
        self.shard_numel = -(-self.numel // n)  # ceil: the last shard carries the padding
        padded = self.shard_numel * n
        full = torch.zeros(padded, dtype=params[0][1].dtype, device=params[0][1].device)
        with torch.no_grad():
            torch.cat([p.reshape(-1) for _, p in params], out=full[: self.numel])
        for _, p in params:  # the flat buffer is now the only copy
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.full = full.requires_grad_()
        lo = rank * self.shard_numel
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
    """Optimizer state and update on shards; verification gathers the shards back. `self.units[i]` is
    unit i's flat buffers (one per gradient group), `self.flat` all of them in order."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.units: list[list[FlatUnit]] = []
        for i, unit in enumerate(self.model.units):
            groups: dict[tuple[str, ...], list] = {}
            for name, p in self.held_params(unit):
                groups.setdefault(self.grad_axes(f"units.{i}.{name}"), []).append((name, p))
            parts = []
            for axes, params in groups.items():
                replicate = self.mesh.shard_replica_axes(axes)
                parts.append(FlatUnit(f"units.{i}", params, self.shard_n, self.shard_rank,
                                      group_key(replicate) if replicate else None))
            self.units.append(parts)
        self.flat = [u for parts in self.units for u in parts]
        self._on_grad: dict[int, object] = {}  # id(flat buffer) -> what its gradient hook does
        # (flat unit, reduce-scatter handle, its input kept alive until the op completes)
        self.pending: list[tuple[FlatUnit, object, torch.Tensor]] = []

    def when_grad_ready(self, u: FlatUnit, callback) -> None:
        """Run `callback()` once autograd has accumulated `u`'s gradient (or ZB-H1's BW has)."""
        self._on_grad[id(u.full)] = callback
        u.full.register_post_accumulate_grad_hook(lambda full: callback())

    def weight_grads_ready(self, buffers: list) -> None:
        for full in buffers:
            self._on_grad[id(full)]()

    def unit_forward(self, i: int, x):
        views = {}
        for u in self.units[i]:
            views.update(u.views())
        return functional_call(self.model.units[i], views, (x,))

    def reduce_scatter(self, u: FlatUnit, name: str) -> None:
        if self.shard_n == 1:  # a shard axis of one rank: the shard is the whole buffer
            self.pending.append((u, Done(u.full.grad.clone()), None))
            return
        out = torch.empty_like(u.shard)
        handle = self.comm.reduce_scatter(out, u.full.grad, self.shard_axis, async_op=True, name=name)
        self.pending.append((u, handle, u.full.grad))  # the input must live until the op completes

    def finish_grads(self) -> None:
        """Wait for the gradient reduce-scatters, sum the micro-batches' parts, sum over the replicas'
        axes, divide by the number of local losses."""
        parts = [(u, handle.wait()) for u, handle, _ in self.pending]
        self.pending = []
        # the sums and divisions as spans, as planner.live predicts them ("finish grads"): untraced, their time had
        # counted as waiting in the measured run. A shard summed over replicas is divided after that sum, as before.
        with self.rec.compute("finish grads"):
            for u, part in parts:
                u.grad_shard = part if u.grad_shard is None else u.grad_shard.add_(part)
            for u in self.flat:
                if u.replicate is None:
                    u.grad_shard.div_(self.replicas)
        replicated = [u for u in self.flat if u.replicate is not None]
        for u in replicated:
            self.comm.all_reduce(u.grad_shard, u.replicate, name="all_reduce grad shards")
        if replicated:
            with self.rec.compute("finish grads"):
                for u in replicated:
                    u.grad_shard.div_(self.replicas)

    def step(self, step: int) -> None:
        with self.rec.compute("optimizer step"):
            for u in self.flat:
                adamw_(u.shard, u.grad_shard, u.exp_avg, u.exp_avg_sq, step, self.hyper)

    def _gather(self, u: FlatUnit, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        full = torch.empty(u.shard_numel * self.shard_n, dtype=shard.dtype, device=shard.device)
        with self.comm.untraced():
            if self.shard_n > 1:
                self.comm.all_gather(full, shard, self.shard_axis)
            else:
                full.copy_(shard)
        return u.split(full)

    def sharded_state(self):
        state = {"params": {}, "grads": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for u in self.flat:
            state["params"].update(self._params_state(u))
            state["grads"].update(self._gather(u, u.grad_shard))
            state["exp_avg"].update(self._gather(u, u.exp_avg))
            state["exp_avg_sq"].update(self._gather(u, u.exp_avg_sq))
        return state

    def _params_state(self, u: FlatUnit) -> dict[str, torch.Tensor]:
        """Unit buffer `u`'s weights for the check: its updated shards gathered (a collective of the shard group)."""
        return self._gather(u, u.shard)

    def param_storages(self):
        return [t.untyped_storage() for u in self.flat for t in (u.full, u.shard)]

    @staticmethod
    def _size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
