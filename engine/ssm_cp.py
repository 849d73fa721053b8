"""Context parallel for a Mamba-2 layer (engine/mamba.py): two ways to scan a sequence whose positions are
split over the cp ranks.

The sequence is cut into slices: cp slices in order, one per rank, in a model of Mamba-2 layers only (its
work per position does not grow along the sequence, so nothing needs balancing); 2 cp slices when the
model has attention layers too, which need ring attention's zig-zag split (engine/ring_attention.py):
rank r holds slices r and 2 cp - 1 - r.

* ``state`` (state passing): the scan is linear in its state, so a slice's outputs are what it computes
  from a zero state plus what the state entering it adds (`mamba.state_output`). Every rank scans its
  slices from zero at once, in parallel; then the states pass rank to rank in sequence order, each rank
  adding its slice's own final state to the incoming one carried through the slice (`slice_decay`), and
  each rank corrects its outputs with the state that came in. A pipeline over the sequence: one
  point-to-point of B x H x P x N floats per slice boundary and layer, and a chain (rank r waits for
  r - 1), unlike ring attention's cp overlapped rounds: cp - 1 hops in order, 2 (cp - 1) with the
  zig-zag split (out to the last rank and back; core/mesh.cp_chain_hops). Backward passes the states'
  gradients the other way. The causal conv also reaches w - 1 positions back, into the previous slice:
  those inputs (the "halo") come from its holder first, all at once.

      forward, cp = 4:   r0 --h--> r1 --h--> r2 --h--> r3        backward: r3 --dh--> r2 --dh--> r1 --dh--> r0
      zig-zag, cp = 2:   r0 (slice 0) --h--> r1 (slices 1, 2) --h--> r0 (slice 3)

* ``alltoall`` (Megatron-Core's Mamba context parallel, the DeepSpeed-Ulysses switch): one all-to-all
  turns the scan's inputs from sequence shards of every head into the whole sequence of H/cp heads
  (and G/cp groups); each rank convolves and scans its heads over the whole sequence, with no chain;
  a second all-to-all turns the outputs back into sequence shards. Needs the heads and groups a rank
  holds (after tp) to divide by cp. Bytes one rank sends per layer forward: (cp-1)/cp of its inputs
  (x, B, C, dt) and of its outputs y; the same again backward.
"""

from __future__ import annotations

import torch

from core.mesh import cp_slice_owners
from engine.comm import all_to_all_rows
from engine.mamba import conv_scan, skip, slice_decay, state_output

_TAG_STATE, _TAG_DSTATE, _TAG_HALO, _TAG_DHALO = 3, 4, 5, 6  # ring attention uses 1 and 2


class Slices:
    """Which cp rank holds which slice of the sequence: `owner[g]` for every slice g, and this rank's own
    slices `mine`, in sequence order (the order its local positions are in)."""

    def __init__(self, n: int, rank: int, zigzag: bool):
        self.n, self.rank = n, rank
        self.owner = cp_slice_owners(n, zigzag)
        self.mine = [g for g, r in enumerate(self.owner) if r == rank]

    def before(self, g: int) -> int | None:
        """The rank holding slice g - 1, or None at the sequence's start."""
        return self.owner[g - 1] if g > 0 else None

    def after(self, g: int) -> int | None:
        return self.owner[g + 1] if g + 1 < len(self.owner) else None


def wait_for(handles, rec, name: str, start: float | None = None) -> None:
    """Block until `handles` complete; the time blocked (from `start` when given) is recorded as a wait (an
    "idle" span named `name`), so a layer's span around it says how much of it the rank computed and how
    much it waited for its peers (planner.live.per_step_by_kind reads a wait inside a compute span as
    waiting)."""
    start = rec.now() if start is None else start
    for h in handles:
        h.wait()
    rec.add("idle", name, start, rec.now())


def _blocking_p2p(comm, ops: list, tag: int, what: str, name: str) -> None:
    """Post `ops` (Comm.p2p) and block until they complete, the whole time a wait: posting a blocking
    state or halo exchange can hold the rank too (2-6 ms in one step of three on 2 cores: gloo's receive
    posting waits for its pair), and that is waiting for a peer, not the layer's compute."""
    start = comm.recorder.now()
    wait_for(comm.p2p(ops, "cp", tag), comm.recorder, f"wait {what} {name}", start)


class _PassStates(torch.autograd.Function):
    """(decay[S, B, H], own[S, B, H, P, N]) of this rank's S slices -> the state entering each, in[S, ...].
    Forward, in sequence order: in_g = end_{g-1}, end_g = decay_g in_g + own_g, received from or sent to
    the rank holding the neighbouring slice. Backward, in reverse: d end_g = d in_{g+1};
    d in_g (total) = d in_g (from the outputs) + decay_g d end_g, sent to the previous slice's holder."""

    @staticmethod
    def forward(ctx, decay, own, slices: Slices, comm, name: str):
        ctx.slices, ctx.comm, ctx.name = slices, comm, name
        entering, end = torch.zeros_like(own), None
        for j, g in enumerate(slices.mine):
            prev = slices.before(g)
            if prev is not None and prev != slices.rank:
                _blocking_p2p(comm, [("recv", entering[j], prev, f"recv state {name}")], _TAG_STATE, "state", name)
            elif prev is not None:
                entering[j] = end
            end = decay[j][..., None, None] * entering[j] + own[j]
            nxt = slices.after(g)
            if nxt is not None and nxt != slices.rank:
                _blocking_p2p(comm, [("send", end.contiguous(), nxt, f"send state {name}")], _TAG_STATE, "state", name)
        ctx.save_for_backward(decay, entering)
        return entering

    @staticmethod
    def backward(ctx, d_entering):
        decay, entering = ctx.saved_tensors
        slices, comm, name = ctx.slices, ctx.comm, ctx.name
        d_decay, d_own = torch.zeros_like(decay), torch.zeros_like(entering)
        later = None  # the total gradient of the state entering the slice after this one
        for j, g in reversed(list(enumerate(slices.mine))):
            nxt = slices.after(g)
            d_end = torch.zeros_like(entering[j])
            if nxt is not None and nxt != slices.rank:
                _blocking_p2p(comm, [("recv", d_end, nxt, f"recv dstate {name}")], _TAG_DSTATE, "dstate", name)
            elif nxt is not None:
                d_end = later
            d_own[j] = d_end
            d_decay[j] = (d_end * entering[j]).sum((-2, -1))
            later = d_entering[j] + decay[j][..., None, None] * d_end
            prev = slices.before(g)
            if prev is not None and prev != slices.rank:
                _blocking_p2p(comm, [("send", later.contiguous(), prev, f"send dstate {name}")], _TAG_DSTATE, "dstate",
                              name)
        return d_decay, d_own, None, None, None


class _Halo(torch.autograd.Function):
    """tails[S, B, w-1, C] (the last w-1 conv inputs of each own slice) -> halos[S, B, w-1, C] (those of the
    slice before each; zeros at the sequence's start). Every transfer is in one batch: no chain."""

    @staticmethod
    def forward(ctx, tails, slices: Slices, comm, name: str):
        ctx.slices, ctx.comm, ctx.name = slices, comm, name
        halos = torch.zeros_like(tails)
        ops, received = [], []
        for j, g in enumerate(slices.mine):
            prev, nxt = slices.before(g), slices.after(g)
            if prev == slices.rank:
                halos[j] = tails[j - 1]
            elif prev is not None:
                buf = torch.empty_like(tails[j])
                ops.append(("recv", buf, prev, f"recv conv halo {name}"))
                received.append((j, buf))
            if nxt is not None and nxt != slices.rank:
                ops.append(("send", tails[j].contiguous(), nxt, f"send conv halo {name}"))
        if ops:
            _blocking_p2p(comm, ops, _TAG_HALO, "conv halo", name)
        for j, buf in received:
            halos[j] = buf
        return halos

    @staticmethod
    def backward(ctx, d_halos):
        slices, comm, name = ctx.slices, ctx.comm, ctx.name
        d_tails = torch.zeros_like(d_halos)
        ops, received = [], []
        for j, g in enumerate(slices.mine):
            prev, nxt = slices.before(g), slices.after(g)
            if prev == slices.rank:
                d_tails[j - 1] += d_halos[j]
            elif prev is not None:
                ops.append(("send", d_halos[j].contiguous(), prev, f"send dhalo {name}"))
            if nxt is not None and nxt != slices.rank:
                buf = torch.empty_like(d_halos[j])
                ops.append(("recv", buf, nxt, f"recv dhalo {name}"))
                received.append((j, buf))
        if ops:
            _blocking_p2p(comm, ops, _TAG_DHALO, "dhalo", name)
        for j, buf in received:
            d_tails[j] += buf
        return d_tails, None, None, None


class StatePassing:
    """`Mamba2.mix` for a rank holding `slices` of the sequence (its local positions, in order)."""

    def __init__(self, mixer, slices: Slices, comm, rec, name: str):
        self.mixer, self.slices, self.comm, self.rec, self.name = mixer, slices, comm, rec, name

    def __call__(self, x, b, c, dt):
        mx, k = self.mixer, len(self.slices.mine)
        widths = [t.shape[-1] for t in (x, b, c)]
        xbc = torch.cat((x, b, c), dim=-1)
        pieces = xbc.chunk(k, dim=1)
        w = mx.conv_x.weight.shape[1]
        halos = _Halo.apply(torch.stack([p[:, p.shape[1] - (w - 1):] for p in pieces]), self.slices, self.comm,
                            self.name)
        scanned = []  # per own slice: (y from a zero state, dt A, C per head, x per head, own final state)
        with self.rec.compute(f"scan {self.name} own slices"):
            for j, (piece, dt_j) in enumerate(zip(pieces, dt.chunk(k, dim=1), strict=True)):
                scanned.append(conv_scan(*piece.split(widths, -1), dt_j, mx.convs(), mx.dt_bias, mx.A_log,
                                         mx.groups, mx.chunk, halos[j].split(widths, -1)))
        decays = torch.stack([slice_decay(log_a) for _, log_a, _, _, _ in scanned])
        owns = torch.stack([own for *_, own in scanned])
        entering = _PassStates.apply(decays, owns, self.slices, self.comm, self.name)
        with self.rec.compute(f"scan {self.name} correct with incoming state"):
            ys = [skip(y + state_output(log_a, c_h, h0), x_h, mx.D)
                  for (y, log_a, c_h, x_h, _), h0 in zip(scanned, entering, strict=True)]
        return torch.cat(ys, dim=1)


class AllToAll:
    """`Mamba2.mix` that switches from sequence shards to head shards and back (module docstring)."""

    def __init__(self, mixer, positions: torch.Tensor, all_positions: torch.Tensor, comm, rec, name: str):
        self.mixer, self.comm, self.rec, self.name = mixer, comm, rec, name
        self.n, self.rank = comm.size("cp"), comm.group_rank("cp")
        self.t_local = len(positions)
        # all_positions: every cp rank's positions in rank order; `order` sorts them into the sequence.
        self.order = torch.argsort(all_positions)
        self.unorder = torch.argsort(self.order)

    def _exchange(self, parts: torch.Tensor, what: str) -> torch.Tensor:
        rows = [parts.shape[0] // self.n] * self.n
        return all_to_all_rows(parts, self.comm, rows, rows, "cp", f"all_to_all {what} {self.name}")

    def __call__(self, x, b, c, dt):
        mx, n, r = self.mixer, self.n, self.rank
        heads, groups = mx.heads // n, mx.groups // n
        bs = x.shape[0]
        # Channels of each destination rank: its heads of x and dt, its groups of B and C.
        send = [t.reshape(bs, self.t_local, n, -1) for t in (x, b, c, dt)]
        widths = [s.shape[-1] for s in send]
        packed = torch.cat(send, dim=-1).permute(2, 0, 1, 3)  # [n dest, B, T_cp, channels of one dest]
        got = self._exchange(packed.reshape(n * bs, self.t_local, -1), "scan inputs")
        whole = got.reshape(n, bs, self.t_local, -1).permute(1, 0, 2, 3).reshape(bs, n * self.t_local, -1)
        whole = whole[:, self.order]  # the whole sequence, in order, of this rank's heads
        xw, bw, cw, dtw = whole.split(widths, dim=-1)
        p, gn = mx.head_dim, bw.shape[-1]
        with self.rec.compute(f"scan {self.name} whole sequence, {heads} heads"):
            mine = slice(r * heads * p, (r + 1) * heads * p)
            g_mine = slice(r * gn, (r + 1) * gn)
            h_mine = slice(r * heads, (r + 1) * heads)
            convs = [(w[part], bias[part]) for (w, bias), part in zip(mx.convs(), (mine, g_mine, g_mine), strict=True)]
            y, _, _, x_h, _ = conv_scan(xw, bw, cw, dtw, convs, mx.dt_bias[h_mine], mx.A_log[h_mine], groups, mx.chunk)
            y = skip(y, x_h, mx.D[h_mine])[:, self.unorder]  # back in rank order of positions
        back = y.reshape(bs, n, self.t_local, -1).permute(1, 0, 2, 3).reshape(n * bs, self.t_local, -1)
        got = self._exchange(back, "scan outputs").reshape(n, bs, self.t_local, -1)
        return got.permute(1, 2, 0, 3).reshape(bs, self.t_local, -1)  # heads in rank order
