"""ZeRO-3 / FSDP (Rajbhandari et al. 2020, section 5.3; Zhao et al. 2023, "PyTorch FSDP"): parameters,
gradients and optimizer state are all split over the dp ranks; a unit's parameters exist whole only
while that unit computes.

    W[P_dp]                                  each rank stores 1/dp of every unit
    forward unit i:   W_i[P] = AllGather_dp(W_i[P_dp]);  In[B_dp, T, D] . W_i[D, F];  free W_i[P]
    backward unit i:  W_i[P] = AllGather_dp(W_i[P_dp]);  dW_i[P] from the local batch;  free W_i[P]
                      dW_i[P_dp] = ReduceScatter_dp(dW_i[P]) / dp
    step:             update W[P_dp] with Adam[P_dp]     (no communication)

Per rank in fp32 with AdamW: (4 + 4 + 8) Psi / dp bytes, plus at most two gathered units at a time. The dp
ranks are those of the mesh's shard axis (fsdp, else dp); with both dp and fsdp axes (HSDP) each shard is
replicated over dp and its gradient all-reduced there after the reduce-scatter (engine/flat.py).

Overlap: while unit i computes, the all-gather of the next unit (i+1 in forward, i-1 in backward) is
already in flight (FSDP's forward/backward prefetch), and each unit's reduce-scatter runs asynchronously
while backward moves on. The last unit (the head) is not freed after forward, because its backward
follows at once (FSDP2 does the same for the root module).
"""

from __future__ import annotations

from engine.flat import ShardedStrategy


class FSDP(ShardedStrategy):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.prefetch = self.cfg.parallel.prefetch
        self.last = len(self.units) - 1
        self.gathers: dict[int, object] = {}
        self.gathered_bytes = 0
        self.gathered_peak_bytes = 0
        self._ready = [0] * len(self.units)
        for i, parts in enumerate(self.units):
            for u in parts:
                u.free_full()
                self.when_grad_ready(u, lambda i=i: self._grad_ready(i))

    def _unshard(self, i: int) -> None:
        parts = self.units[i]
        if i in self.gathers or parts[0].gathered:
            return
        handles = []
        for u in parts:
            u.alloc_full()
            self.gathered_bytes += u.full_bytes
            if self.shard_n == 1:
                u.full.data.copy_(u.shard)
                continue
            # Write through .data: autograd's saved views of `full` must not see a version bump.
            handles.append(self.comm.all_gather(u.full.data, u.shard, self.shard_axis, async_op=True,
                                                name=f"all_gather {self.names[i]}"))
        self.gathered_peak_bytes = max(self.gathered_peak_bytes, self.gathered_bytes)
        self.gathers[i] = handles

    def _wait(self, i: int) -> None:
        for handle in self.gathers.pop(i, []):
            handle.wait()

    def _reshard(self, i: int) -> None:
        for u in self.units[i]:
            u.free_full()
            self.gathered_bytes -= u.full_bytes

    def before_forward(self, i: int) -> None:
        self._unshard(i)
        if self.prefetch and i < self.last:
            self._unshard(i + 1)
        self._wait(i)

    def after_forward(self, i: int) -> None:
        if i != self.last:
            self._reshard(i)

    def before_backward(self, i: int) -> None:
        self._unshard(i)
        if self.prefetch and i > 0:
            self._unshard(i - 1)
        self._wait(i)

    def _grad_ready(self, i: int) -> None:
        """A flat buffer's gradient is complete; once all of unit i's are, the unit reshards."""
        self._ready[i] += 1
        if self._ready[i] < len(self.units[i]):
            return
        self._ready[i] = 0
        for u in self.units[i]:
            self.reduce_scatter(u, f"reduce_scatter {self.names[i]}")
            u.full.grad = None
        self._reshard(i)

    def zero_grad(self) -> None:
        self._ready = [0] * len(self.units)
        for u in self.flat:
            u.grad_shard = None

    def memory_bytes(self):
        return {
            "params": self._size(u.shard for u in self.flat),
            "grads": self._size(u.grad_shard for u in self.flat),
            "optimizer": self._size(t for u in self.flat for t in (u.exp_avg, u.exp_avg_sq)),
            "gathered_params_peak": self.gathered_peak_bytes,
        }
