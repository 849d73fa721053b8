"""Data parallel: every rank holds the whole model and a slice of the batch; gradients are summed.

    In[B_dp, T, D] . W[D, F]  ->  Out[B_dp, T, F]          (W replicated on every dp rank)
    dW = AllReduce_dp( sum over micro-batches of dW_local ) / dp

Two ways to synchronize the gradients:

* ``naive``: after the whole backward, one blocking all-reduce per parameter. Simple, and nothing
  overlaps: the ranks compute, then only communicate.
* ``bucketed`` (what torch DDP does, Li et al. 2020 "PyTorch Distributed", section 3.2.3): parameters
  are grouped into buckets of about `bucket_bytes` in reverse order (the order backward produces their
  gradients); a bucket's all-reduce is issued asynchronously as soon as its last gradient is
  accumulated, so communication of late layers overlaps backward of early ones.

Gradient accumulation: with several micro-batches, gradients add up locally and only the last
micro-batch's backward communicates (DDP's `no_sync`). The loss of each micro-batch is divided by the
number of micro-batches and the summed gradient by dp, so the result is the gradient of the mean loss
over the global batch, as in the reference.
"""

from __future__ import annotations

import torch

from engine.strategy import WholeParamsStrategy


class DataParallel(WholeParamsStrategy):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.params = dict(self.model.named_parameters())
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.bucketed = self.cfg.parallel.dp_comm == "bucketed" and self.dp > 1
        self.buckets: list[list[torch.nn.Parameter]] = []
        self.pending: list[tuple[list[torch.nn.Parameter], object]] = []
        if self.bucketed:
            self._make_buckets(self.cfg.parallel.bucket_bytes)

    def _make_buckets(self, bucket_bytes: int) -> None:
        bucket, size = [], 0
        for p in reversed(list(self.params.values())):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self._ready = [0] * len(self.buckets)
        for k, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, k=k: self._grad_ready(k))

    def _grad_ready(self, k: int) -> None:
        if not self.last_micro_batch:
            return
        self._ready[k] += 1
        if self._ready[k] == len(self.buckets[k]):
            bucket = self.buckets[k]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            handle = self.comm.all_reduce(flat, "dp", async_op=True, name=f"all_reduce bucket {k}")
            self.pending.append((bucket, handle))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
        self._ready = [0] * len(self.buckets)

    def finish_grads(self) -> None:
        if self.dp == 1:
            return
        if not self.bucketed:
            for p in reversed(list(self.params.values())):
                self.comm.all_reduce(p.grad, "dp")
                p.grad.div_(self.dp)
            return
        for bucket, handle in self.pending:
            flat = handle.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad)).div_(self.dp)
                offset += n
        self.pending = []
