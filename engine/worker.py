"""The worker process: one rank. Started as `python -m engine.worker`, never by re-running a page script.

Two ways to start it:

* **Pool mode** (what `engine.launch.Pool` does): the parent passes a listener address and key in the
  environment; the worker joins the process group once, then runs task after task
  (`"module:function"`, called as `function(ctx, **kwargs)`) until told to exit. Process groups and
  imports stay warm between runs.

* **torchrun mode**, across one or several machines: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT; the worker runs one training run and rank 0 writes the result JSON:

      # on each of 2 machines (node ranks 0 and 1), 2 ranks per machine:
      torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE --master-addr $HOST0 --master-port 29500 \\
          -m engine.worker --strategy fsdp --zero-stage 3 --steps 3 --check --out result.json

  The flags are those of `python -m engine run`; the world size comes from torchrun.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Context:
    """What a task needs to know about the rank it runs on."""

    rank: int
    world: int
    local_rank: int
    device: object  # torch.device
    backend: str
    collective_timeout_s: float
    clock_offset_s: float = 0.0
    keeps_freed_memory: bool = False  # this rank's malloc keeps what torch frees (`keep_freed_memory`)
    _mesh_groups: dict = field(default_factory=dict)
    # Pool mode: tells the pool after each training step (engine.launch.Pool.run's on_progress); under
    # torchrun nobody listens.
    reporter: object = None

    def step_done(self, steps_done: int, loss: float | None) -> None:
        if self.reporter is not None:
            self.reporter(steps_done, loss)

    def mesh_groups(self, mesh, spans: list[tuple[str, ...]] = ()) -> dict:
        """Process groups of a mesh (core.mesh.Mesh) and of its multi-axis `spans`, created once per
        worker and reused by later runs."""
        key = (mesh.axes, tuple(spans))
        if key not in self._mesh_groups:
            from engine import comm

            self._mesh_groups[key] = comm.mesh_groups(mesh, self.rank, self.collective_timeout_s, spans)
        return self._mesh_groups[key]


def start_rank(rank: int, world: int, local_rank: int, local_world: int, device: str, init_method: str | None,
               collective_timeout_s: float) -> Context:
    """Pick device and backend, join the default group, align clocks with rank 0."""
    import torch

    from engine import comm

    backend = "gloo"
    dev = torch.device("cpu")
    if device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise RuntimeError("--device cuda was asked for but this machine has no CUDA device")
        dev = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(dev)
        # NCCL needs one GPU per rank; with fewer GPUs than ranks, gloo carries the traffic through host
        # memory and comm.Comm records the copies.
        backend = "nccl" if gpus >= local_world else "gloo"
    torch.set_num_threads(1)  # ranks share the machine's cores; one thread each avoids oversubscription
    kept = keep_freed_memory()
    comm.init(backend, init_method, rank, world, collective_timeout_s)
    ctx = Context(rank, world, local_rank, dev, backend, collective_timeout_s, keeps_freed_memory=kept)
    ctx.clock_offset_s = comm.measure_clock_offset(dev if backend == "nccl" else torch.device("cpu"))
    return ctx


# glibc's malloc: blocks up to this size come from the heap, not from a mapping of their own (32 MiB, its
# largest: DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), and the heap's free top is returned to the system only past
# MALLOC_TRIM_BYTES
MALLOC_MMAP_MAX_BYTES = 32 * 2**20
MALLOC_TRIM_BYTES = 2**30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Have this process's malloc keep the memory torch frees for its next tensors, as PyTorch's CPU
    performance guides have it do by preloading jemalloc or tcmalloc: glibc's default gives a freed block of
    a few MiB back to the system, and the next tensor of that size is faulted in again, page by page, each
    page zeroed. A 256 x 256 ring-attention block (engine/cp.py) took 300-1,140 minor page faults a call
    that way and 1.35-2.82 ms, from one batch of calls to the next; with the memory kept, none and 1.22-1.31
    ms. The rank's memory then stays at its peak, which is what a step needs again anyway. False where the C
    library has no mallopt (not glibc): its allocator is left as it is."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mapped = mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_MAX_BYTES)
    return bool(mapped) and bool(mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES))


def _exit_when_orphaned(parent_pid: int) -> None:
    """A worker whose parent died (killed server, Ctrl-C) exits by itself within half a second.

    Polling instead of prctl(PR_SET_PDEATHSIG): that signal fires when the *thread* that started the
    worker ends, and a Streamlit page runs in a short-lived thread.
    """
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a task runs, as training frameworks run it (Megatron-LM's
    --manual-gc, torchtitan's GarbageCollection with gc_freq): the objects alive when the task starts are
    frozen out of every collection (gc.freeze), and the training loop collects between steps (engine/train.py),
    outside the step it times. Left to its thresholds, the collector now and then
    walks every object torch has made, in the middle of a step: on this machine a full collection in a rank
    took 58-80 ms, against a 15-20 ms step of the 2-rank ZB-H1 pipeline, which then took 96 ms, and at any
    moment of any run. Re-entrant: inside a paused block it does nothing."""
    if not gc.isenabled():
        yield
        return
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def call(target: str, ctx: Context, kwargs: dict):
    module, _, name = target.partition(":")
    with collector_paused():
        return getattr(importlib.import_module(module), name)(ctx, **kwargs)


def _send(conn, msg) -> None:
    # Plain pickle, not multiprocessing's ForkingPickler: torch registers reducers there that pass tensor
    # storages as file descriptors through a side channel the parent cannot authenticate.
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def pool_main() -> None:
    from multiprocessing.connection import Client

    env = os.environ
    rank, world = int(env["SHARDLAB_RANK"]), int(env["SHARDLAB_WORLD"])
    threading.Thread(target=_exit_when_orphaned, args=(int(env["SHARDLAB_PARENT_PID"]),), daemon=True).start()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the pool asks "where are you?" on a timeout
    host, port = env["SHARDLAB_POOL_ADDR"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(env["SHARDLAB_POOL_KEY"]))
    # Import torch before saying hello and join the process group only when the pool says go: on a busy
    # machine the ranks' imports finish seconds apart, and the rendezvous waits only the collective timeout.
    import torch.distributed  # noqa: F401

    _send(conn, ("hello", rank, os.getpid(), threading.main_thread().ident))
    try:
        if pickle.loads(conn.recv_bytes())[0] != "go":
            return
    except (EOFError, OSError):
        return
    try:
        ctx = start_rank(rank, world, rank, world, env["SHARDLAB_DEVICE"], env["SHARDLAB_INIT"],
                         float(env["SHARDLAB_COLLECTIVE_TIMEOUT_S"]))
    except BaseException:
        _send(conn, ("error", None, traceback.format_exc()))
        return
    _send(conn, ("ready", ctx.clock_offset_s))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if msg[0] == "exit":
            from engine import comm

            comm.destroy()
            return
        if msg[0] == "ping":  # the pool checks its workers can answer before it sends a task
            _send(conn, ("pong",))
            continue
        _, task_id, target, kwargs = msg
        ctx.reporter = lambda steps_done, loss, task_id=task_id: _send(conn, ("progress", task_id, steps_done, loss))
        try:
            result = call(target, ctx, kwargs)
        except BaseException:
            _send(conn, ("error", task_id, traceback.format_exc()))
            continue
        _send(conn, ("ok", task_id, result))


def torchrun_main(argv: list[str]) -> int:
    """One run under torchrun; rank 0 writes the same JSON object `python -m engine run --json` prints."""
    from core.timeline import unwritable_reason, write_json
    from engine import cli
    from engine.config import ConfigError

    parser = cli.run_parser("python -m engine.worker")
    parser.add_argument("--out", required=True, help="where rank 0 writes the result JSON")
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    try:
        args = parser.parse_args(argv)
        cfg = cli.config_from_args(args, world=world)
        cli.check_trace_path(args.trace)  # (not the memory check: torchrun's ranks may be on other machines)
        # only rank 0 writes it, maybe on node 0 only; the result is the file, so /dev/stdout is a place for it
        if rank == 0 and (reason := unwritable_reason(args.out, result_on_stdout=False)):
            raise ConfigError(f"--out {reason}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ctx = start_rank(rank, world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world)),
                     cfg.device, None, cfg.collective_timeout_s)
    from engine import comm
    from engine.recorder import Recorder
    from engine.run import assemble
    from engine.train import run_rank

    with collector_paused():
        result = run_rank(ctx, cfg, traced=bool(args.trace), check=args.check)
    everything = comm.Comm(Recorder(rank), ctx.device).gather_objects(result)
    comm.leave_together()
    if rank != 0:
        return 0
    summary, timeline = assemble(cfg, everything)
    # the same object as `python -m engine run --json`, whose prediction is of this machine's calibration
    summary.predicted = {"step_time_s": None, "breakdown_s": {},
                         "why": "under torchrun the ranks may run on other machines than the one calibrated; "
                                "python -m engine run --json predicts a run on this machine"}
    try:  # the result first: a trace that cannot be written loses nothing else
        write_json(args.out, summary.to_dict(), indent=1)
    except OSError as e:  # checked before the run; the disk may still fill or the folder go
        print(f"error: cannot write the result {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    if args.trace:
        try:
            timeline.write_chrome_trace(args.trace)
        except OSError as e:
            print(f"error: cannot write the trace {args.trace}: {e.strerror}", file=sys.stderr)
            return 2
    return 0 if summary.ok else 1


if __name__ == "__main__":
    if "SHARDLAB_POOL_ADDR" in os.environ:
        pool_main()
    else:
        code = torchrun_main(sys.argv[1:])
        # Leave without running C++ static destructors: torch's store/gloo threads can still be joinable
        # at interpreter teardown and abort the rank after its work is done and written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
