"""Contention benchmark: how much other ranks' work slows a rank's compute, on this machine. Never pass/fail.

    .venv/bin/python bench/bench_contention.py [--world 4] [--seconds 0.8] [--repeats 2]

On a `--world`-rank pool (more ranks than cores is the case it is for), the first half of the ranks time the
engine's default Block (forward + backward, one thread each, as a live run computes) back to back while the
other half, in pairs, do one of:

- idle: asleep;
- messages: 16 KB round trips with no compute (each one gloo send and receive of each side);
- pipeline: a Block, then a round trip (a pipeline stage's pattern).

It prints the timing ranks' Block (median, mean, p90) under each, its mean over the idle one, and the cores'
worth the other half took from them (the timing ranks' cores under `idle` over theirs under the other mode,
less one, times their count, as processor sharing would have it), per message where they only exchanged.

What it is for: the live prediction (planner/live.py, planner.eventsim) counts a rank posting a message as a
core busy, and a rank blocked in a receive, and a message in flight, as none. On the 2-core machine this was
written on, 4 ranks, three runs of 2-3 rounds: the Block read 1.15 ms median, 1.16-1.19 mean idle; beside a
pair exchanging messages 1.53-1.97x that mean (median 1.18-1.24, p90 3.7-5.4 ms): the pair took 0.7-1.0 of a
core, 0.5-1.3 ms of CPU per message (its round trips ran 670-1,689 in the same time, run to run). Ranks
blocked in one long receive took nothing (1.16 ms beside them, torchrun, same machine). So a wait that ends
soon costs a core while it lasts and a long one does not. The rounds alternate the modes so that a slow spell
of the machine falls on all of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.launch import Pool  # noqa: E402

MODES = ("idle", "messages", "pipeline")
MESSAGE_BYTES = 16 * 1024


def contention_rank(ctx, mode: str, seconds: float) -> dict:
    """Runs on every rank. The first half time Blocks for `seconds`; the second half, in pairs (r, r + 1),
    do `mode` until the first of each pair says the time is up. Returns the Block times or the round trips."""
    import torch
    import torch.distributed as dist

    from engine.config import ModelConfig
    from engine.model import Block

    torch.manual_seed(0)
    m = ModelConfig()
    block, x = Block(m), torch.randn(2, m.seq_len, m.hidden, requires_grad=True)

    def step():
        block(x).sum().backward()

    for _ in range(10):
        step()
    half = ctx.world // 2
    dist.barrier()
    end = time.perf_counter() + seconds
    if ctx.rank < half:
        times = []
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        dist.barrier()
        return {"block_s": times}
    trips = 0
    if mode == "idle":
        time.sleep(seconds)
    else:
        first = (ctx.rank - half) % 2 == 0
        peer = ctx.rank + 1 if first else ctx.rank - 1
        msg = torch.zeros(MESSAGE_BYTES // 4)
        while True:
            if mode == "pipeline":
                step()
            if first:  # the first of the pair decides when to stop, and says so in the message
                msg[0] = 1.0 if time.perf_counter() >= end else 0.0
                dist.send(msg, peer)
                dist.recv(msg, peer)
            else:
                dist.recv(msg, peer)
                dist.send(msg, peer)
            trips += 1
            if msg[0] == 1.0:
                break
    dist.barrier()
    return {"trips": trips}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="ranks, an even number of 4 or more")
    ap.add_argument("--seconds", type=float, default=0.8, help="each mode's timing window")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the modes")
    args = ap.parse_args()
    if args.world < 4 or args.world % 2 or args.seconds <= 0 or args.repeats < 1:
        ap.error("--world takes an even number of 4 or more, --seconds a positive time, --repeats 1 or more")
    half = args.world // 2
    pool = Pool(args.world)
    blocks = {mode: [] for mode in MODES}
    trips = {mode: 0 for mode in MODES}
    try:
        for _ in range(args.repeats):
            for mode in MODES:
                results = pool.run("bench.bench_contention:contention_rank",
                                   {"mode": mode, "seconds": args.seconds}, timeout_s=60 + 4 * args.seconds)
                for r in results[:half]:
                    blocks[mode] += r["block_s"]
                # round trips of each pair, counted by its first rank
                trips[mode] += sum(r["trips"] for r in results[half::2])
    finally:
        pool.shutdown()
    idle = statistics.mean(blocks["idle"])
    print(f"{args.world} ranks on {os.cpu_count()} cores: {half} time the default Block while the other {half} do "
          f"each mode ({args.repeats} x {args.seconds:g} s)")
    print(f"{'mode':10s} {'median ms':>9} {'mean ms':>8} {'p90 ms':>7} {'mean / idle':>11} {'cores taken':>11}"
          f" {'round trips':>11} {'ms CPU / message':>16}")
    for mode in MODES:
        t = sorted(blocks[mode])
        mean = statistics.mean(t)
        taken = half * (1 - idle / mean)  # the timing ranks' cores' worth lost, as processor sharing has it
        per_message = ""
        if mode == "messages" and trips[mode]:
            per_message = f"{taken * args.seconds * args.repeats / (2 * trips[mode]) * 1e3:>16.3f}"
        print(f"{mode:10s} {statistics.median(t) * 1e3:>9.3f} {mean * 1e3:>8.3f} {t[int(0.9 * len(t))] * 1e3:>7.3f} "
              f"{mean / idle:>11.2f} {taken:>11.2f} {trips[mode]:>11} {per_message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
