"""Expert parallel: the experts of every MoE layer are split across the ep group; tokens travel to their
experts and back with two all-to-alls (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2022).

    ep ranks read different sequences (data parallel for attention, norms, router, embed, head)
    experts:  W_e[D, F]  for e in [r*E/ep, (r+1)*E/ep) on ep rank r        (E_ep experts per rank)

    rank 0 tokens --route--> |e0 e0 e1 e2 e3 e3| --all_to_all--> rank 0: e0 e1   (rows from every rank)
    rank 1 tokens --route--> |e1 e2 e2 e3 e0 e1| --dispatch---> rank 1: e2 e3
                                  ^ sorted by expert, so each destination gets one contiguous block

One MoE layer on one rank, In[N, D] with N = local tokens:
  1. router, top-k, capacity (the reference model's own `route` and `capacity_keep`: same ties, same drops)
  2. sort the kept (token, choice) pairs by expert; count them per expert
  3. all_to_all of the per-expert counts: every rank learns how many rows it will receive from whom
  4. all_to_all_single of the rows with those split sizes (gloo cannot do an uneven list all-to-all)
  5. each local expert on its received rows
  6. the reverse all_to_all_single brings the outputs home; out[token] += weight * row
Backward runs 4 and 6 reversed (autograd functions below), so an MoE layer moves its rows four times per
step: bytes sent per rank per layer per step ~ 4 * N * top_k * kept * D * 4 bytes * (ep-1)/ep.

Gradients (the data-parallel sharder's, core/mesh.py): dense parameters are summed over every data axis
(ep included: every rank computed them on other tokens); an expert's gradient already holds every ep
rank's tokens (they came through the all-to-all), so it is summed over the data axes but ep. Both are
divided by the number of local mean losses averaged into the global one. With ZeRO/FSDP an MoE block's
experts get their own flat buffers (engine/flat.py).
"""

from __future__ import annotations

import re
from functools import partial

import torch

from engine.comm import all_to_all_rows
from engine.strategy import Plan

_EXPERT_PARAM = re.compile(r"units\.(\d+)\.mlp\.experts\.(\d+)\.(.+)")


class ExpertParallelPlan(Plan):
    """Keeps this ep rank's experts of every MoE layer (frees the others) and routes tokens to them with
    the all-to-alls."""

    def __init__(self, cfg, model, comm, count_group: str):
        self.cfg, self.comm = cfg, comm
        self.count_group = count_group  # the ranks holding these layers that routed different tokens
        m = cfg.model
        self.names = model.unit_names
        self.ep, self.ep_rank = comm.size("ep"), comm.group_rank("ep")
        self.experts_here = m.experts // self.ep
        self.first_expert = self.ep_rank * self.experts_here
        for name, p in model.named_parameters():
            match = _EXPERT_PARAM.fullmatch(name)
            if match is not None and not 0 <= int(match[2]) - self.first_expert < self.experts_here:
                # another rank's expert: free it, this rank never computes with it
                p.requires_grad_(False)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # Per MoE layer (by the full model's unit index), counts accumulated over the run: routed and
        # dropped (token, choice) pairs per expert (all experts, from this rank's tokens).
        self.load = {}
        self.kinds: list[str] = []
        for i, unit in enumerate(model.units):
            if hasattr(unit, "mlp") and hasattr(unit.mlp, "dispatch"):
                unit.mlp.dispatch = partial(self._dispatch, i, unit.mlp)
                self.load[model.global_units[i]] = {"routed": torch.zeros(m.experts, dtype=torch.int64),
                                                    "dropped": torch.zeros(m.experts, dtype=torch.int64)}
                self.kinds = [n for n, _ in unit.mlp.experts[0].named_parameters()]
        self.global_units = model.global_units

    def is_expert(self, name: str) -> bool:
        return _EXPERT_PARAM.fullmatch(name) is not None

    def _dispatch(self, i: int, moe, flat, weights, chosen, keep):
        """The MoE.dispatch hook: the same sum as the reference's loop over experts, via all-to-all."""
        n_exp, name, load = self.cfg.model.experts, self.names[i], self.load[self.global_units[i]]
        k = chosen.shape[1]
        token = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(k)
        expert, weight, kept = chosen.reshape(-1), weights.reshape(-1), keep.reshape(-1)
        load["routed"] += torch.bincount(expert, minlength=n_exp).cpu()
        load["dropped"] += torch.bincount(expert[~kept], minlength=n_exp).cpu()
        token, expert, weight = token[kept], expert[kept], weight[kept]
        order = expert.argsort(stable=True)  # by expert, then earlier tokens first: the reference's order
        token, expert, weight = token[order], expert[order], weight[order]

        counts = torch.bincount(expert, minlength=n_exp)
        recv_counts = torch.empty_like(counts)
        self.comm.all_to_all(recv_counts, counts, group="ep", name=f"all_to_all counts {name}")
        in_splits = counts.view(self.ep, self.experts_here).sum(1).tolist()
        recv_counts = recv_counts.view(self.ep, self.experts_here)  # [source rank, local expert]
        out_splits = recv_counts.sum(1).tolist()

        rows = all_to_all_rows(flat[token], self.comm, out_splits, in_splits, "ep", f"all_to_all dispatch {name}")
        local = torch.arange(self.experts_here, device=flat.device).repeat(self.ep)
        local = local.repeat_interleave(recv_counts.reshape(-1).to(flat.device))
        out_rows = torch.zeros_like(rows)
        for e in range(self.experts_here):
            # An expert with no rows still runs (on zero rows): its parameters get a (zero) gradient.
            idx = (local == e).nonzero(as_tuple=True)[0]
            # an expert computes in the run's compute precision; the rows it returns join the others' dtype
            out_rows = out_rows.index_add(0, idx, moe.experts[self.first_expert + e](rows[idx]).to(out_rows.dtype))
        back = all_to_all_rows(out_rows, self.comm, in_splits, out_splits, "ep", f"all_to_all combine {name}")
        return torch.zeros_like(flat).index_add(0, token, back * weight[:, None])

    def full_state(self, state: dict) -> dict:
        """Every ep rank's experts gathered (names of the full model; collective over ep, untraced)."""
        for i in self.load:
            for kind in self.kinds:
                mine = [f"units.{i}.mlp.experts.{self.first_expert + j}.{kind}"
                        for j in range(self.experts_here)]
                for quantity in state:
                    # This rank's experts of one parameter kind, stacked; the stacks of all ep ranks gathered.
                    shard = torch.stack([state[quantity][n] for n in mine])
                    full = shard.new_empty((self.ep * self.experts_here, *shard.shape[1:]))
                    with self.comm.untraced():
                        self.comm.all_gather(full, shard, "ep")
                    for e in range(full.shape[0]):
                        state[quantity][f"units.{i}.mlp.experts.{e}.{kind}"] = full[e].clone()
        return state

    def stats(self) -> dict:
        """Expert load over the whole run, summed over every rank's tokens (for the pages; tensor-parallel
        ranks that routed the same tokens counted once, pipeline stages per layer): per layer the
        (token, choice) pairs routed to each expert, those dropped by the capacity, the rows each ep rank
        processed, and max/mean of each (1.0 = perfectly balanced)."""
        m = self.cfg.model
        layers = {}
        for i, load in self.load.items():
            both = torch.cat([load["routed"], load["dropped"]]).to(self.comm.device)
            with self.comm.untraced():
                self.comm.all_reduce(both, self.count_group)
            routed, dropped = both[: m.experts].cpu(), both[m.experts:].cpu()
            name = f"L{i - 1}"
            processed = routed - dropped
            per_rank = processed.view(self.ep, self.experts_here).sum(1)
            layers[name] = {
                "tokens_per_expert": routed.tolist(),
                "dropped_per_expert": dropped.tolist(),
                "processed_per_expert": processed.tolist(),
                "processed_per_ep_rank": per_rank.tolist(),
                "expert_max_over_mean": _max_over_mean(routed),
                "ep_rank_max_over_mean": _max_over_mean(per_rank),
                "dropped_fraction": dropped.sum().item() / max(routed.sum().item(), 1),
            }
        return {"expert_load": {"experts": m.experts, "ep": self.ep, "top_k": m.top_k,
                                "capacity_factor": m.capacity_factor, "layers": layers}}


def _max_over_mean(counts: torch.Tensor) -> float:
    mean = counts.double().mean().item()
    return counts.max().item() / mean if mean > 0 else 0.0
