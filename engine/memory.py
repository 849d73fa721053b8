"""Activation memory measured from the tensors autograd saves for backward.

`saved_tensors_hooks` sees every tensor the forward pass keeps for the backward pass; the bytes of
their distinct storages, minus storages that hold parameters (a matmul saves its weight, but the
weight is counted as a parameter), are the activation memory of one micro-batch. Its maximum over
micro-batches is the peak: by the end of a forward everything saved is alive at once, and backward
frees it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class ActivationMeter:
    def __init__(self, param_storages):
        self.param_ids = {s._cdata for s in param_storages}
        self.peak_bytes = 0

    @contextmanager
    def measure(self):
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage._cdata not in self.param_ids:
                seen[storage._cdata] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak_bytes = max(self.peak_bytes, sum(seen.values()))
