"""Tensor-parallel benchmark: prints ratios and byte counts measured in one run at 4 ranks. Never pass/fail.

    .venv/bin/python bench/bench_tp.py [--world 4] [--steps 10] [--repeats 3]

- our TP step / torch DTensor TP step: the same model (engine/model.py) and batch; torch's side is
  `parallelize_module` with ColwiseParallel (wq, wk, wv, w1, w3, and the output layer with
  `loss_parallel`), RowwiseParallel (wo, w2, and the vocabulary-parallel embedding) and torch's AdamW on
  the DTensor parameters, on gloo like ours
- our sequence-parallel step / our TP step, and their activation memory (engine/memory.py)
- bytes each rank sends per step against `engine.tp.tp_comm_bytes`, and the collectives per step on both
  sides (torch's counted with CommDebugMode)

Step times are the median over steps (after one warm-up step) of the slowest rank; each comparison runs
back to back `repeats` times and the median of the per-pair ratios is printed.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import ModelConfig, ParallelConfig, RunConfig  # noqa: E402
from engine.launch import Pool  # noqa: E402
from engine.tp import tp_comm_bytes  # noqa: E402

# kv_heads a multiple of 4: DTensor's ColwiseParallel splits wk/wv evenly and cannot replicate a KV head
MODEL = ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, ffn=1024, vocab=2048, seq_len=128)
MICRO_BATCH = 4


def dtensor_rank(ctx, cfg: RunConfig) -> dict:
    """Runs on every rank: torch's own tensor parallel on the same model and batch."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    from engine.model import build_model, global_batch

    m, n = cfg.model, cfg.world
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    model = build_model(m, cfg.seed)
    plan = {"units.0.tok": RowwiseParallel(input_layouts=Replicate()),
            f"units.{m.layers + 1}.out": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(1, m.layers + 1):
        plan |= {f"units.{i}.attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan |= {f"units.{i}.mlp.{w}": ColwiseParallel() for w in ("w1", "w3")}
        plan |= {f"units.{i}.attn.wo": RowwiseParallel(), f"units.{i}.mlp.w2": RowwiseParallel()}
        attn = model.units[i].attn
        attn.heads, attn.kv_heads = m.heads // n, m.kv_heads // n  # local heads, as torchtitan does
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    def step(tokens, targets) -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt.step()
        return loss.full_tensor().item()

    times, losses, counts = [], [], {}
    for s in range(cfg.steps):
        tokens, targets = global_batch(m, cfg.seed, s, cfg.global_batch)
        start = time.perf_counter()
        if s == 1:
            with CommDebugMode() as debug:
                losses.append(step(tokens, targets))
            counts = {str(op).split(".")[-1]: c for op, c in debug.get_comm_counts().items()}
        else:
            losses.append(step(tokens, targets))
        times.append(time.perf_counter() - start)
    return {"times": times, "losses": losses, "counts": counts}


def slowest_median(per_rank: list[list[float]]) -> float:
    steps = len(per_rank[0])
    return statistics.median(max(r[s] for r in per_rank) for s in range(1, steps))


def ours(pool, cfg, traced=False) -> tuple[float, list[dict]]:
    results = pool.run("engine.train:run_rank", {"cfg": cfg, "traced": traced}, timeout_s=600)
    return slowest_median([r["step_times_s"] for r in results]), results


def theirs(pool, cfg) -> tuple[float, list[dict]]:
    results = pool.run("bench.bench_tp:dtensor_rank", {"cfg": cfg}, timeout_s=600)
    return slowest_median([r["times"] for r in results]), results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="back-to-back pairs per comparison")
    args = ap.parse_args()
    n = args.world

    def cfg(sp: bool) -> RunConfig:
        return RunConfig(model=MODEL, parallel=ParallelConfig("tp", sequence_parallel=sp), world=n,
                         steps=args.steps, micro_batch_size=MICRO_BATCH, timeout_s=600)

    tp_cfg, sp_cfg = cfg(False), cfg(True)
    pool = Pool(n)
    pool.start()
    pairs = {"our TP step / torch DTensor TP step": (lambda: ours(pool, tp_cfg),
                                                     lambda: theirs(pool, tp_cfg)),
             "our TP+SP step / our TP step": (lambda: ours(pool, sp_cfg), lambda: ours(pool, tp_cfg))}
    measured = {label: [(a(), b()) for _ in range(args.repeats)] for label, (a, b) in pairs.items()}
    traced = {sp: ours(pool, cfg(sp), traced=True)[1] for sp in (False, True)}
    pool.shutdown()

    print(f"tensor-parallel benchmark, world {n}, {os.cpu_count()} cpu cores, model {MODEL.layers} layers "
          f"hidden {MODEL.hidden} heads {MODEL.heads}/{MODEL.kv_heads} ffn {MODEL.ffn} vocab {MODEL.vocab} "
          f"seq {MODEL.seq_len}, micro-batch {MICRO_BATCH}; {args.steps} steps (median of the slowest rank, "
          f"warm-up excluded), {args.repeats} pairs")
    for label, runs in measured.items():
        ratio = statistics.median(a[0] / b[0] for a, b in runs)
        a_ms, b_ms = (statistics.median(x[i][0] for x in runs) * 1e3 for i in (0, 1))
        print(f"  {label:40s} {a_ms:8.1f} ms / {b_ms:8.1f} ms = {ratio:.2f}x")

    ours_tp, torch_tp = measured["our TP step / torch DTensor TP step"][0]
    first_loss = (ours_tp[1][0]["losses"][0], torch_tp[1][0]["losses"][0])
    print(f"  first-step loss: ours {first_loss[0]:.6f}, DTensor {first_loss[1]:.6f} (same model and batch)")
    for sp, results in traced.items():
        label = "TP+SP" if sp else "TP"
        formula = sum(tp_comm_bytes(cfg(sp)).values())
        sent = results[0]["comm_bytes"] / args.steps
        ops = collections.Counter(s["name"].split()[0] for s in results[0]["spans"]
                                  if s["lane"] == "comm" and s["step"] == 1)
        act = results[0]["memory_bytes"]["activations_peak"]
        print(f"  {label:6s} bytes sent per step by rank 0: {sent:,.0f} measured / {formula:,} formula "
              f"= {sent / formula:.4f}; collectives per step {dict(ops)}; activations {act / 2**20:.2f} MiB")
    print(f"  torch DTensor collectives per step (CommDebugMode): {torch_tp[1][0]['counts']}")


if __name__ == "__main__":
    main()
