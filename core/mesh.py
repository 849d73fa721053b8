"""The mesh convention, in one place: axis names, rank order, strides, which axes a group spans, and what
each axis means for the batch and the gradients. Torch-free: the engine, the planner, the sidebar and the
pages all read it.

Axes, outermost (slowest-changing rank coordinate) first, whatever order a user writes them in:

    pp, dp, fsdp, cp, ep, tp          (tp innermost: consecutive ranks)

A mesh lays ranks out row-major, the last axis fastest (as torch.distributed.DeviceMesh does):
`(("dp", 2), ("tp", 2))` puts rank = coord_dp * 2 + coord_tp. The group of axis `a` is every rank that
differs from this one only in coordinate `a`; a group over several axes (`("dp", "cp")`) is every rank
that differs only in those coordinates.

Why this order: on real machines consecutive ranks share a node and its fast links (NVLink inside a
node, the network between nodes), so the innermost axis gets the fastest links. Per step tp all-reduces
activations several times per layer (Shoeybi et al. 2019), ep and cp exchange tokens and K/V per layer,
fsdp/dp move parameters or gradients once per step (overlapped with compute), and pp sends one
activation per micro-batch per stage boundary: from the chattiest axis inwards to the quietest outwards,
close to Megatron-LM's default order (tp-cp-ep-dp-pp, innermost first).
`pp=2,dp=2,tp=2` on 8 ranks: tp groups {0,1} {2,3} {4,5} {6,7}; dp groups {0,2} {1,3} {4,6} {5,7};
pp groups {0,4} {1,5} {2,6} {3,7}.

What the axes mean (the one convention for expert parallel too):

    dp, fsdp, ep   ranks read different sequences of the batch (ep: its ranks are data parallel for every
                   dense layer and split the experts of each MoE layer among themselves)
    cp             ranks read different positions of the same sequences
    tp             ranks read the same tokens and split each layer's matmuls
    pp             ranks hold different layers

So the batch splits over dp x fsdp x ep (in mesh order), every rank's loss is the mean over its own tokens,
and the global mean loss is the mean over dp x fsdp x ep x cp ranks. A dense weight's gradient is summed
over those data axes; an expert's over all but ep (its gradient already holds the tokens of every ep rank,
which the all-to-all brought to it). In Megatron-LM's notation ("ep is carved out of the data-parallel
ranks") our dp x fsdp x ep is its data-parallel size and our ep its expert-parallel size.

ZeRO (stages 1-3) shards over one axis: fsdp when the mesh has one, else dp. Every other data axis keeps
replicas of those shards, whose gradients are then summed across it (HSDP: sharded over fsdp, replicated
over dp, as torch's FSDP2 and Zhao et al. 2023 section 3.2.2 do).
"""

from __future__ import annotations

import itertools
import math

AXES = ("pp", "dp", "fsdp", "cp", "ep", "tp")  # outermost first
BATCH_AXES = ("dp", "fsdp", "ep")  # ranks along these read different sequences
DATA_AXES = ("dp", "fsdp", "cp", "ep")  # ranks along these see different tokens


def canonical(axes) -> tuple[tuple[str, int], ...]:
    """Named degrees (pairs or a dict) in the mesh's order; unknown names raise ValueError."""
    pairs = list(axes.items()) if isinstance(axes, dict) else list(axes)
    for name, _ in pairs:
        if name not in AXES:
            raise ValueError(f"mesh axis {name!r} is unknown; use one of {', '.join(AXES)}")
    return tuple(sorted(pairs, key=lambda a: AXES.index(a[0])))


def label(axes) -> str:
    """`dp=2,tp=2`: the axes with degree > 1, in mesh order (`dp=1` for a single rank)."""
    shown = [(a, d) for a, d in canonical(axes) if d > 1]
    return ",".join(f"{a}={d}" for a, d in shown) or "dp=1"


class Mesh:
    def __init__(self, axes):
        self.axes = canonical(axes)
        self.names = [a for a, _ in self.axes]
        self.shape = [d for _, d in self.axes]
        self.world = math.prod(self.shape)
        self._degree = dict(self.axes)

    def degree(self, axis: str) -> int:
        """An axis the mesh does not name has degree 1."""
        return self._degree.get(axis, 1)

    def stride(self, axis: str) -> int:
        """How many ranks apart the members of an `axis` group are: the product of the inner axes."""
        return math.prod(self.degree(a) for a in AXES[AXES.index(axis) + 1:])

    def coords(self, rank: int) -> dict[str, int]:
        out, rest = {}, rank
        for name, degree in reversed(self.axes):
            out[name] = rest % degree
            rest //= degree
        return {n: out[n] for n in self.names}

    def coord(self, rank: int, axis: str) -> int:
        return self.coords(rank).get(axis, 0)

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, degree in self.axes:
            rank = rank * degree + coords.get(name, 0)
        return rank

    def group_ranks(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """All groups spanning `axes` (one name or several), each in mesh order, in a fixed order."""
        span = (axes,) if isinstance(axes, str) else tuple(axes)
        inside = [n for n in self.names if n in span]
        others = [n for n in self.names if n not in span]
        groups = []
        for fixed in itertools.product(*(range(self.degree(n)) for n in others)):
            base = dict(zip(others, fixed, strict=True))
            groups.append([self.rank_of({**base, **dict(zip(inside, c, strict=True))})
                           for c in itertools.product(*(range(self.degree(n)) for n in inside))])
        return groups

    def group_of(self, rank: int, axes: str | tuple[str, ...]) -> list[int]:
        """The group spanning `axes` that `rank` belongs to, in mesh order (computed from its coordinates:
        cheap on a mesh of any size)."""
        span = (axes,) if isinstance(axes, str) else tuple(axes)
        inside = [n for n in self.names if n in span]
        base = self.coords(rank)
        return [self.rank_of({**base, **dict(zip(inside, c, strict=True))})
                for c in itertools.product(*(range(self.degree(n)) for n in inside))]

    def group_count(self, axes: str | tuple[str, ...]) -> int:
        span = (axes,) if isinstance(axes, str) else tuple(axes)
        return self.world // math.prod(self.degree(a) for a in set(span))

    @classmethod
    def from_megatron(cls, dp: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> Mesh:
        """A layout in Megatron-LM's notation (the planner's case files: dp counts every data-parallel
        rank of the dense layers, ep among them) as this mesh: dp / ep replicas of ep expert ranks."""
        if dp % ep:
            raise ValueError(f"ep={ep} must divide dp={dp}: expert-parallel ranks are data-parallel ranks")
        return cls((("pp", pp), ("dp", dp // ep), ("cp", cp), ("ep", ep), ("tp", tp)))

    def group_stride(self, axes: tuple[str, ...]) -> int:
        """How far apart a multi-axis group's nearest members are: its innermost axis's stride."""
        strides = [self.stride(a) for a in axes if self.degree(a) > 1]
        return min(strides, default=1)

    def megatron_degrees(self) -> dict[str, int]:
        """The same layout in Megatron-LM's (and the planner's case files') notation, where ep is carved out
        of the data-parallel ranks: dp = our dp x fsdp x ep, and ep, tp, pp, cp as they are."""
        return {"dp": self.batch_shards, "tp": self.degree("tp"), "pp": self.degree("pp"),
                "cp": self.degree("cp"), "ep": self.degree("ep")}

    # -- what the axes mean for the batch and the gradients (module docstring) --------------------------
    @property
    def batch_shards(self) -> int:
        """How many parts the batch's sequences are split into."""
        return math.prod(self.degree(a) for a in BATCH_AXES)

    def batch_index(self, rank: int) -> int:
        """Which part of the batch's sequences `rank` reads: its coordinates over dp, fsdp, ep, row-major."""
        index = 0
        for axis in BATCH_AXES:
            index = index * self.degree(axis) + self.coord(rank, axis)
        return index

    @property
    def loss_replicas(self) -> int:
        """Local mean losses averaged into the global one: the ranks that see different tokens."""
        return math.prod(self.degree(a) for a in DATA_AXES)

    def grad_axes(self, expert: bool = False, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The axes (degree > 1, mesh order) a gradient is summed over: every data axis, but not ep for an
        expert's weights; `extra` adds axes a plan needs (tp for a weight that saw only this rank's
        sequence shard)."""
        wanted = {a for a in DATA_AXES if not (expert and a == "ep")} | set(extra)
        return tuple(a for a in self.names if a in wanted and self.degree(a) > 1)

    def shard_axis(self) -> str:
        """Where ZeRO shards: fsdp when the mesh has it, else dp (possibly of degree 1)."""
        return "fsdp" if self.degree("fsdp") > 1 else "dp"

    def shard_replica_axes(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """The axes a ZeRO shard's gradient is still summed over after its reduce-scatter: a gradient's axes
        (`grad_axes`) but the shard axis (HSDP's dp, cp, ep for the dense weights)."""
        return tuple(a for a in axes if a != self.shard_axis())

    def reduce_groups(self, stage: int, moe: bool, extra: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        """The multi-axis groups a run needs (single axes always exist), in a fixed order: every set of
        grad axes (at ZeRO stages 1-3 also without the shard axis, for the shards' replicas), and all
        data axes with `extra` (where expert loads are counted)."""
        sets = [self.grad_axes(False)]
        if moe:
            sets += [self.grad_axes(True), self.grad_axes(False, extra)]
        if stage > 0:
            sets += [self.shard_replica_axes(axes) for axes in sets]
        out = []
        for axes in sets:
            if len(axes) > 1 and axes not in out:
                out.append(axes)
        return out


def group_key(axes: tuple[str, ...]) -> str:
    """The name a multi-axis group goes by (`"dp+cp"`)."""
    return "+".join(axes)


def cp_slice_owners(cp: int, zigzag: bool) -> list[int]:
    """The cp rank holding each slice of a sequence, in sequence order: cp slices, one per rank in order, or
    2 cp zig-zagged, rank r holding slices r and 2 cp - 1 - r (one early, one late: the split that balances
    causal attention's work, Llama 3 / Megatron-LM). Context parallel's one convention for where positions
    live: ring attention, the Mamba-2 state chain and the planner all read it."""
    return [min(g, 2 * cp - 1 - g) for g in range(2 * cp)] if zigzag else list(range(cp))


def cp_chain_hops(cp: int, zigzag: bool) -> int:
    """Slice boundaries whose two sides live on different ranks: the sequential hops of a state passed along
    the sequence (cp - 1 in order; 2 (cp - 1) zig-zagged, out to the last rank and back)."""
    owner = cp_slice_owners(cp, zigzag)
    return sum(1 for a, b in zip(owner, owner[1:], strict=False) if a != b)


def cp_chain_sends(cp: int, zigzag: bool) -> int:
    """The most of those hops one rank sends: 1 in order; 2 zig-zagged beyond cp = 2 (a middle rank passes
    the state on from its early slice and again from its late one). What one chip sends, where
    `cp_chain_hops` is how long the chain waits."""
    owner = cp_slice_owners(cp, zigzag)
    sends = [0] * max(cp, 1)
    for a, b in zip(owner, owner[1:], strict=False):
        if a != b:
            sends[a] += 1
    return max(sends)

