"""Named mesh axes -> rank coordinates and process groups.

A mesh `(("dp", 2), ("tp", 2))` lays ranks out row-major, the last axis fastest (as
torch.distributed.DeviceMesh does): rank = coord_dp * 2 + coord_tp. The group of axis `a` for a rank
is every rank that differs from it only in coordinate `a`.

Rank order: `--mesh` axes are always sorted into config.CANONICAL_AXIS_ORDER, outermost first,

    pp, dp, fsdp, cp, ep, tp          (tp innermost: consecutive ranks)

whatever order the user writes them in. On real machines consecutive ranks share a node and its fast
links (NVLink inside a node, the network between nodes), so the innermost axis gets the fastest links.
Per step tp all-reduces activations several times per layer (Shoeybi et al. 2019), cp and ep exchange
K/V and tokens per layer, fsdp/dp move parameters or gradients once per step (overlapped with compute),
and pp sends one activation per micro-batch per stage boundary: from the chattiest axis inwards to the
quietest outwards, close to Megatron-LM's default rank order (tp-cp-ep-dp-pp, innermost first).
`pp=2,dp=2,tp=2` on 8 ranks: tp groups {0,1} {2,3} {4,5} {6,7}; dp groups {0,2} {1,3} {4,6} {5,7};
pp groups {0,4} {1,5} {2,6} {3,7}.

`group_ranks` is pure arithmetic (tested without processes). `build_groups` creates the groups of
every axis in one fixed order on every rank, as torch.distributed requires of `new_group`.
"""

from __future__ import annotations

import itertools
import math


class Mesh:
    def __init__(self, axes: tuple[tuple[str, int], ...]):
        self.axes = tuple(axes)
        self.names = [a for a, _ in self.axes]
        self.shape = [d for _, d in self.axes]
        self.world = math.prod(self.shape)

    def coords(self, rank: int) -> dict[str, int]:
        out, rest = {}, rank
        for name, degree in reversed(self.axes):
            out[name] = rest % degree
            rest //= degree
        return {n: out[n] for n in self.names}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, degree in self.axes:
            rank = rank * degree + coords[name]
        return rank

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along `axis`, each sorted by the axis coordinate, in a fixed order."""
        others = [n for n in self.names if n != axis]
        groups = []
        for fixed in itertools.product(*(range(dict(self.axes)[n]) for n in others)):
            base = dict(zip(others, fixed, strict=True))
            groups.append([self.rank_of({**base, axis: i}) for i in range(dict(self.axes)[axis])])
        return groups

    def build_groups(self, rank: int, timeout_s: float) -> dict[str, object]:
        """This rank's process group for every axis. An axis spanning the whole world reuses the
        default group (no new rendezvous); a degree-1 axis still gets a group so code stays uniform."""
        from engine import comm

        mine = {}
        for axis in self.names:
            groups = self.group_ranks(axis)
            if len(groups) == 1 and len(groups[0]) == self.world:
                mine[axis] = comm.world_group()
                continue
            for ranks in groups:
                g = comm.new_group(ranks, timeout_s)
                if rank in ranks:
                    mine[axis] = g
        if "dp" not in mine and "fsdp" not in mine:
            # Every strategy averages gradients over "dp": a mesh without a data-parallel axis (tp=4)
            # has dp = 1, a group of one rank each.
            for r in range(self.world):
                g = comm.new_group([r], timeout_s)
                if r == rank:
                    mine["dp"] = g
        return mine
