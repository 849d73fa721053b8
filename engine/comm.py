"""The only module that calls torch.distributed: process groups, collectives, point-to-point.

Every operation is recorded as a ``comm`` span (rank, op, group, bytes, issue time, completion time,
async or not). ``bytes`` is what this rank *sends* under the ring algorithm, the quantity the
alpha-beta cost model prices (Patarasuk & Yuan 2009; scaling-book "All About Rings"):

    all_gather, reduce_scatter   (n-1)/n * full_bytes
    all_reduce                   2 (n-1)/n * full_bytes       (= reduce_scatter + all_gather)
    all_to_all                   bytes this rank sends to the other ranks
    broadcast                    full_bytes from the root, 0 elsewhere
    send / recv                  the tensor's bytes / 0

Gaps of gloo measured on this machine (torch 2.13) and how they are handled here:
- no PREMUL_SUM: reductions are SUM, and callers divide afterwards;
- uneven list all_gather / all_to_all fail: `all_to_all` uses all_to_all_single with split sizes;
- reduce_scatter_tensor needs a flat input: inputs are flattened (views, no copy) before the call;
- the default timeout is 30 minutes: every group is created with the run's collective timeout.

When ranks compute on a GPU but talk through gloo (fewer GPUs than ranks), each tensor is staged
through host memory and the copies are recorded as ``d2h``/``h2d`` comm spans.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.recorder import Recorder
from hardware.collectives import ring_sent_bytes

# torch 2.13 renamed the single-tensor collectives (all_gather_into_tensor -> all_gather_single,
# reduce_scatter_tensor -> reduce_scatter_single) and deprecated the old names; a GPU machine's torch may
# be older (seen: 2.11 on an H200, where the new names do not exist).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init(backend: str, init_method: str | None, rank: int, world: int, timeout_s: float) -> None:
    """Join the default process group; `init_method=None` reads torchrun's environment variables."""
    kw = {"init_method": init_method} if init_method else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kw)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_together() -> None:
    """Barrier, then destroy: under torchrun a rank that tears down while its peer still finishes the last
    collective aborts the peer ("terminate called without an active exception", seen 1 run in 3)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def world_group():
    return dist.group.WORLD


def new_group(ranks: list[int], timeout_s: float):
    """Collective over the default group: every rank must call it, with the same lists, in the same order."""
    return dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))


def mesh_groups(mesh, rank: int, timeout_s: float, spans: list[tuple[str, ...]] = ()) -> dict[str, object]:
    """This rank's process group for every axis of `mesh` (a core.mesh.Mesh) and for every multi-axis
    span in `spans` (keyed "dp+cp"), created in one fixed order on every rank, as `new_group` requires. A
    group spanning the whole world reuses the default group (no new rendezvous)."""
    from core.mesh import group_key

    mine = {}
    for axes in [(a,) for a in mesh.names] + list(spans):
        groups = mesh.group_ranks(axes)
        key = group_key(axes)
        if len(groups) == 1 and len(groups[0]) == mesh.world:
            mine[key] = world_group()
            continue
        for ranks in groups:
            g = new_group(ranks, timeout_s)
            if rank in ranks:
                mine[key] = g
    return mine


def measure_clock_offset(device: torch.device, rounds: int = 5) -> float:
    """Seconds to add to this rank's perf_counter to read rank 0's clock.

    Ranks leave a barrier within a few tens of microseconds of each other, so the clock readings taken
    right after it differ by (clock difference + small jitter); the median over rounds drops outliers.
    """
    world = dist.get_world_size()
    offsets = []
    for _ in range(rounds):
        dist.barrier()
        # NCCL only moves device tensors; the copy happens after the clock was read.
        now = torch.tensor([time.perf_counter()], dtype=torch.float64).to(device)
        readings = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(readings, now)
        offsets.append(readings[0].item() - now.item())
    return statistics.median(offsets)


class Handle:
    """An issued operation. `wait()` blocks until it is complete and returns its output tensor."""

    def __init__(self, work, finish, span_args: dict | None, comm: Comm):
        self._work, self._finish, self._span_args, self._comm = work, finish, span_args, comm
        self._done_s: float | None = None
        self._waited = False
        if work is not None and span_args is not None and span_args["is_async"]:
            try:
                work.get_future().then(self._mark_done)
            except RuntimeError:
                pass  # a backend without futures: completion is read at wait() instead

    def _mark_done(self, fut):
        self._done_s = self._comm.recorder.now()
        return None

    def wait(self):
        if self._waited:
            return self._finish()
        self._waited = True
        if self._work is not None:
            self._work.wait()
        end = self._comm.recorder.now()
        if self._span_args is not None:
            args = dict(self._span_args)
            start = args.pop("start_s")
            self._comm.recorder.add("comm", args.pop("name"), start, min(self._done_s or end, end), **args)
        return self._finish()


class Comm:
    """Collectives over named groups ("world", mesh axes), each one traced."""

    def __init__(self, recorder: Recorder, device: torch.device, groups: dict | None = None):
        self.recorder = recorder
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.groups: dict[str, object] = {"world": dist.group.WORLD, **(groups or {})}
        backend = dist.get_backend()
        self.staged = device.type == "cuda" and backend == "gloo"
        self.tracing = True  # off for bookkeeping traffic: no span, not counted in sent_bytes
        self.sent_bytes = 0  # counted even when the recorder is off, for untraced runs

    def size(self, group: str) -> int:
        """Ranks in a group; an axis the mesh does not name has one (no collective is issued on it)."""
        return dist.get_world_size(self.groups[group]) if group in self.groups else 1

    def group_rank(self, group: str) -> int:
        return dist.get_rank(self.groups[group]) if group in self.groups else 0

    @contextmanager
    def untraced(self):
        """For bookkeeping traffic (verification gathers) that is not part of the training step."""
        before, self.tracing = self.tracing, False
        try:
            yield
        finally:
            self.tracing = before

    # -- staging through host memory when compute is on a GPU but the backend is gloo --------------

    def _to_wire(self, t: torch.Tensor, group: str) -> torch.Tensor:
        if not self.staged:
            return t
        start = self.recorder.now()
        host = t.detach().to("cpu")
        if self.tracing:
            self.recorder.add("comm", "d2h", start, self.recorder.now(), group=group)
        return host

    def _wire_buffer(self, out: torch.Tensor) -> torch.Tensor:
        """Where a staged collective writes its result: host memory, copied back in `_from_wire`."""
        return torch.empty_like(out, device="cpu") if self.staged else out

    def _from_wire(self, host: torch.Tensor, out: torch.Tensor, group: str) -> torch.Tensor:
        if host is out:
            return out
        start = self.recorder.now()
        out.copy_(host)
        if self.tracing:
            self.recorder.add("comm", "h2d", start, self.recorder.now(), group=group)
        return out

    def _issue(self, name: str, group: str, sent_bytes: int, async_op: bool, call, finish,
               start: float | None = None) -> Handle:
        start = self.recorder.now() if start is None else start
        work = call()
        if self.tracing:
            self.sent_bytes += int(sent_bytes)
        span = ({"name": name, "start_s": start, "bytes": int(sent_bytes), "group": group,
                 "is_async": async_op} if self.tracing else None)
        handle = Handle(work, finish, span, self)
        return handle if async_op else Done(handle.wait())

    # -- collectives ---------------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor, group: str = "world", async_op: bool = False,
                   name: str = "all_reduce", op: str = "sum"):
        """Sum `t` over the group in place (`op="max"`: the elementwise maximum)."""
        n, wire = self.size(group), self._to_wire(t, group)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self._issue(name, group, ring_sent_bytes("all_reduce", t.numel() * t.element_size(), n), async_op,
                           lambda: dist.all_reduce(wire, op=reduce_op, group=self.groups[group],
                                                   async_op=True),
                           lambda: self._from_wire(wire, t, group))

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group: str = "world", async_op: bool = False,
                   name: str = "all_gather"):
        """out[n * len(shard)] <- the shards of all ranks, in group-rank order."""
        n = self.size(group)
        wire_out = self._wire_buffer(out)
        wire_in = self._to_wire(shard, group)
        sent = ring_sent_bytes("all_gather", out.numel() * out.element_size(), n)
        return self._issue(name, group, sent, async_op,
                           lambda: all_gather_single(wire_out.view(-1), wire_in.reshape(-1),
                                                     group=self.groups[group], async_op=True),
                           lambda: self._from_wire(wire_out, out, group))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group: str = "world",
                       async_op: bool = False, name: str = "reduce_scatter"):
        """out <- this rank's 1/n slice of the sum of every rank's `full` (flattened: gloo needs it flat)."""
        n = self.size(group)
        wire_out = self._wire_buffer(out)
        wire_in = self._to_wire(full, group)
        return self._issue(name, group, ring_sent_bytes("reduce_scatter", full.numel() * full.element_size(), n),
                           async_op,
                           lambda: reduce_scatter_single(wire_out.view(-1), wire_in.reshape(-1),
                                                         group=self.groups[group], async_op=True),
                           lambda: self._from_wire(wire_out, out, group))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None, group: str = "world", async_op: bool = False,
                   name: str = "all_to_all"):
        """Rows of `inp` go to ranks by `in_splits`; uneven splits work (gloo's list form does not)."""
        n, me = self.size(group), self.group_rank(group)
        row_bytes = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        sent_rows = (sum(in_splits) - in_splits[me]) if in_splits else inp.shape[0] * (n - 1) // n
        wire_out = self._wire_buffer(out)
        wire_in = self._to_wire(inp, group)
        return self._issue(name, group, sent_rows * row_bytes, async_op,
                           lambda: dist.all_to_all_single(wire_out, wire_in, out_splits, in_splits,
                                                          group=self.groups[group], async_op=True),
                           lambda: self._from_wire(wire_out, out, group))

    def broadcast(self, t: torch.Tensor, src: int, group: str = "world", async_op: bool = False,
                  name: str = "broadcast"):
        """`src` is a global rank."""
        wire = self._to_wire(t, group)
        sent = t.numel() * t.element_size() if self.rank == src else 0
        return self._issue(name, group, sent, async_op,
                           lambda: dist.broadcast(wire, src, group=self.groups[group], async_op=True),
                           lambda: self._from_wire(wire, t, group))

    def send(self, t: torch.Tensor, dst: int, name: str = "send", async_op: bool = False,
             group: str = "world"):
        """`dst` is a global rank; the send is recorded on `group` (e.g. "pp"). The caller keeps `t` alive
        until the handle's wait() returns. Posting an asynchronous send holds the rank (gloo writes the
        message from the calling thread; on busy cores that write now and then waits a scheduler tick): a
        blocking span of its own, "post <name>", as the ring attention's "post kv L0"."""
        wire = self._to_wire(t, group)
        start = self.recorder.now()
        handle = self._issue(name, group, t.numel() * t.element_size(), async_op,
                             lambda: dist.isend(wire, dst, group=self.groups[group]), lambda: t, start)
        if async_op and self.tracing:
            self.recorder.add("comm", f"post {name}", start, self.recorder.now(), group=group)
        return handle

    def recv(self, t: torch.Tensor, src: int, name: str = "recv", async_op: bool = False,
             group: str = "world"):
        """`src` is a global rank. Between one pair of ranks in one group, messages match in send order."""
        wire = self._wire_buffer(t)
        return self._issue(name, group, 0, async_op,
                           lambda: dist.irecv(wire, src, group=self.groups[group]),
                           lambda: self._from_wire(wire, t, group))

    def p2p(self, ops: list[tuple[str, torch.Tensor, int, str]], group: str, tag: int = 0) -> list[Handle]:
        """Point-to-point operations issued as one batch, each `("send" | "recv", tensor, peer, name)` with
        `peer` a rank *within* `group`; each is async and becomes its own span. One batch, because NCCL
        deadlocks a ring of separately issued sends (each waits for a receive queued behind the peer's own
        send). Between one pair of ranks, messages match by `tag`, then in posting order (ring attention
        keeps K/V and dK/dV on two tags)."""
        pg = self.groups[group]
        issued, batch = [], []
        for kind, t, peer, name in ops:
            other = dist.get_global_rank(pg, peer)
            if kind == "send":
                wire = self._to_wire(t, group)
                batch.append(dist.P2POp(dist.isend, wire, other, group=pg, tag=tag))
                issued.append((name, t.numel() * t.element_size(), lambda t=t: t))
            else:
                wire = self._wire_buffer(t)
                batch.append(dist.P2POp(dist.irecv, wire, other, group=pg, tag=tag))
                issued.append((name, 0, lambda w=wire, t=t: self._from_wire(w, t, group)))
        start = self.recorder.now()  # posting the batch can block the rank: its spans start here
        works = dist.batch_isend_irecv(batch)
        # gloo returns one work per operation; a coalescing backend may return one for the whole batch.
        per_op = len(works) == len(batch)
        return [self._issue(name, group, sent, True, lambda k=k: works[k] if per_op else works[-1], finish, start)
                for k, (name, sent, finish) in enumerate(issued)]

    def barrier(self, group: str = "world") -> None:
        start = self.recorder.now()
        dist.barrier(group=self.groups[group])
        if self.tracing:
            self.recorder.add("comm", "barrier", start, self.recorder.now(), group=group)

    def gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, on every rank; untraced bookkeeping (results, losses)."""
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_to_root(self, obj) -> list | None:
        """Every rank's picklable `obj` on rank 0 (None elsewhere): large bookkeeping (gathered states)."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


class Done:
    """A completed synchronous operation, so callers can `.wait()` on any result alike."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by `in_splits`, rows from ranks by `out_splits`; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits, group, name):
        ctx.comm, ctx.splits, ctx.group, ctx.name = comm, (out_splits, in_splits), group, name
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group, name=name)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all(back, grad.contiguous(), in_splits, out_splits, group=ctx.group,
                            name=f"{ctx.name} bwd")
        return back, None, None, None, None, None


def all_to_all_rows(x, comm: Comm, out_splits: list[int], in_splits: list[int], group: str, name: str):
    """The differentiable all-to-all of x's rows (expert dispatch, Mamba's sequence-to-heads switch)."""
    return _AllToAll.apply(x, comm, out_splits, in_splits, group, name)
