"""ZeRO-1 and ZeRO-2 (Rajbhandari et al. 2020, "ZeRO", section 5.1): data parallel whose optimizer
state (stage 1) and also gradients (stage 2) are split over the dp ranks. Parameters stay whole.

The dp ranks below are those of the mesh's shard axis (fsdp when the mesh has one, else dp); the other
data axes hold replicas of the shards, whose gradients are summed across them too (engine/flat.py).

    forward/backward as data parallel:  In[B_dp, T, D] . W[D, F]          (W replicated)
    stage 1:  dW[P_dp]     = ReduceScatter_dp(dW_local) / dp   the full local gradient buffer stays,
              update       W[P_dp] with Adam[P_dp]             but a rank only updates its own shard
    stage 2:  dW[P_dp]     = ReduceScatter_dp(dW_local) / dp   a rank keeps only its gradient shard
              update       W[P_dp] with Adam[P_dp]
    both:     W[P]         = AllGather_dp(W[P_dp])             the updated shards back to everyone

Per rank, in fp32 with AdamW (Psi parameters, paper eq. 1 with K = 8 bytes of moments and no fp16
copy): stage 1 holds 4 Psi + 4 Psi + 8 Psi / dp bytes, stage 2 holds 4 Psi + (4 + 8) Psi / dp.

Both stages send what plain data parallel sends (a reduce-scatter plus an all-gather is one
all-reduce, paper section 7.2). Gradient communication is issued per unit, asynchronously, from the
hook that fires once autograd has accumulated the unit's flat gradient, so it overlaps the backward
of earlier units. Stage 1 communicates once per step (on the last micro-batch, like DDP's no_sync);
stage 2 reduce-scatters every micro-batch so that no full gradient outlives its unit's backward, and
adds the shards up.
"""

from __future__ import annotations

from engine.flat import ShardedStrategy


class ZeRO(ShardedStrategy):
    def __init__(self, *args, stage: int, **kw):
        super().__init__(*args, **kw)
        self.stage = stage
        lo = self.shard_rank
        for u in self.flat:
            # Parameters stay whole, so a rank's master shard is simply its slice of them.
            u.shard = u.full.data[lo * u.shard_numel: (lo + 1) * u.shard_numel]
            self.when_grad_ready(u, lambda u=u: self._grad_ready(u))

    def _grad_ready(self, u) -> None:
        if self.stage == 1 and not self.last_micro_batch:
            return  # stage 1 keeps whole gradients, so micro-batches accumulate locally first
        self.reduce_scatter(u, "reduce_scatter grads")
        if self.stage == 2:
            u.full.grad = None

    def zero_grad(self) -> None:
        for u in self.flat:
            u.full.grad = None
            u.grad_shard = None

    def step(self, step: int) -> None:
        super().step(step)
        if self.shard_n > 1:
            for u in self.flat:
                self.comm.all_gather(u.full.data, u.shard.clone(), self.shard_axis, name="all_gather params")

    def _params_state(self, u):
        """This rank's whole weights, the ones it computes with: the step's all-gather wrote them. Gathering the
        updated shards instead had left that all-gather unchecked (a run that skipped it passed at one step);
        each rank's copy is a replica the check compares bit for bit (engine.verify, replicas)."""
        return u.split(u.full.data.detach())

    def memory_bytes(self):
        grads = [u.grad_shard for u in self.flat]
        if self.stage == 1:
            grads += [u.full.grad for u in self.flat]
        return {
            "params": self._size(u.full for u in self.flat),
            "grads": self._size(grads),
            "optimizer": self._size(t for u in self.flat for t in (u.exp_avg, u.exp_avg_sq)),
        }
