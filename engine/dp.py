"""Data parallel, ZeRO stage 0 (Li et al. 2020, "PyTorch Distributed"): every rank holds whole parameters,
gradients and AdamW moments, and sums its gradients with the other ranks that saw other tokens.

    forward/backward:  In[B_dp, T, D] . W[D, F]           (W replicated over the data axes)
    gradients:         dW = AllReduce_{grad axes}(dW_local) / replicas

The grad axes are the mesh's data axes (dp, fsdp, cp, ep; an expert's weights skip ep: core/mesh.py), so
one all-reduce over one group does it whatever the mesh: dp=4 reduces over dp, dp=2,cp=2 over dp+cp.
`naive` all-reduces each parameter after backward; `bucketed` (DDP's gradient buckets) groups parameters
in reverse order into buckets of about `bucket_bytes`, each all-reduced asynchronously as soon as its last
gradient has been accumulated, so the communication overlaps the rest of backward. A bucket is one flat
buffer and its parameters' gradients are views of it (DDP's gradient_as_bucket_view): autograd accumulates
into the buffer in place, so nothing is copied in or out. With micro-batches, only the last one's backward
communicates (DDP's no_sync).
"""

from __future__ import annotations

import torch

from core.buckets import plan_buckets
from core.mesh import group_key
from engine.optim import adamw_
from engine.strategy import Strategy


class DataParallel(Strategy):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.params = dict(self.held_params(self.model))
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()}
        # The group each gradient is summed over (None: no other rank holds this parameter's replica).
        self.group = {n: group_key(axes) if (axes := self.grad_axes(n)) else None for n in self.params}
        self.bucketed = self.cfg.parallel.dp_comm == "bucketed"
        self.buckets: list[tuple[str, list[torch.nn.Parameter]]] = []
        self.flats: list[torch.Tensor] = []  # bucket k's gradients, one buffer
        self.pending: list[tuple[torch.Tensor, object]] = []
        if self.bucketed:
            self._make_buckets(self.cfg.parallel.bucket_bytes)
        in_buckets = {id(p) for _, bucket in self.buckets for p in bucket}
        self.unbucketed = [p for p in self.params.values() if id(p) not in in_buckets]  # divided one by one

    def _make_buckets(self, bucket_bytes: int) -> None:
        """The buckets of core.buckets.plan_buckets (reverse parameter order, one bucket list per reduction
        group, each group's first bucket at most FIRST_BUCKET_BYTES, as DDP's)."""
        plan = plan_buckets(((name, p.numel() * p.element_size(), self.group[name]) for name, p in self.params.items()),
                            bucket_bytes)
        self.buckets = [(group, [self.params[name] for name in names]) for group, names in plan]
        self.flats = [torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                      for _, bucket in self.buckets]
        self._ready = [0] * len(self.buckets)
        for k, (_, bucket) in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, k=k: self._grad_ready(k))

    def _grad_ready(self, k: int) -> None:
        if not self.last_micro_batch:
            return
        self._ready[k] += 1
        group, bucket = self.buckets[k]
        if self._ready[k] == len(bucket):
            handle = self.comm.all_reduce(self.flats[k], group, async_op=True, name=f"all_reduce bucket {k}")
            self.pending.append((self.flats[k], handle))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
        for (_, bucket), flat in zip(self.buckets, self.flats, strict=True):
            flat.zero_()  # 0 + g is g exactly: the first micro-batch's gradient lands unchanged
            offset = 0
            for p in bucket:
                p.grad = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
        self._ready = [0] * len(self.buckets)

    def finish_grads(self) -> None:
        """Sum over each gradient's group, then divide by the replicas of the loss: a bucket at once, as
        DDP does (one pass over its memory; elementwise the same division as per parameter)."""
        if self.bucketed:
            for _, handle in self.pending:
                handle.wait()
        else:
            for name, p in reversed(list(self.params.items())):
                if self.group[name] is not None:
                    self.comm.all_reduce(p.grad, self.group[name])
        if self.replicas > 1:
            # the divisions as one span, as planner.live predicts them ("finish grads"): untraced, their time had
            # counted as waiting in the measured run while the prediction drew it as compute
            with self.rec.compute("finish grads"):
                for flat, _ in self.pending:
                    flat.div_(self.replicas)
                for p in self.unbucketed:
                    p.grad.div_(self.replicas)
        self.pending = []

    def step(self, step: int) -> None:
        with self.rec.compute("optimizer step"):
            for n, p in self.params.items():
                adamw_(p, p.grad, self.exp_avg[n], self.exp_avg_sq[n], step, self.hyper)

    def sharded_state(self):
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
