"""Live-prediction benchmark: the planner's prediction of each default live run beside its measurement.

    .venv/bin/python bench/bench_live_prediction.py [--worlds 2 4] [--steps 10] [--repeats 3] [--cached] [--more]
                                                    [--larger] [--calibrations N]

For dp, fsdp (ZeRO-3), tp + sp, pp 1F1B, cp and ep at each world (with --more, then in a second table the
runs the targets do not name: the other pipeline schedules, other syncs and variants, Mamba, 2-D meshes; with
--larger, a table of runs of models wider and longer than the default, as the Lab's boxes allow):
calibrates this machine first, predicts the run (planner/live.py) from it at the machine's speed of the
moment (the calibration's reference Block timed again right before: `speed` is how much slower it ran,
engine/predict.at_speed_now, as every live run's prediction does), then runs it `--repeats` times on the
warm pool and prints predicted and measured step time, the error and the kind of work that differs most.
The repeats go round the table's runs (all once, then all again), so that a run's repeats are spread over
the table's minutes rather than caught together in one slow spell of the machine; each is predicted at
the speed of its moment, and the prediction printed is the mean of the repeats' (weighted by steps).
The measured step time is the engine's (engine/run.py: the mean over the steps after the first, slowest
rank), here over every step after the first of every repeat; the median over the same steps is printed
beside it with its own error (processes sharing a few cores stall now and then, so the two differ), then
the fastest and slowest of those steps and how many of them were faster than the prediction.
No thresholds: the table is the result.

The calibration is measured afresh unless --cached: a shared machine drifts, and its runs with it. On
the 2-core machine this was built on, the engine's default step at world 1 took 4.6 ms and an hour later
7.6 ms; a calibration 15 minutes old predicted the default runs 32 % off on average (50 % at worst),
one measured right before them 12 % (30 % at worst). Measuring takes about 70 s on 2 cores.

A calibration is itself a measurement, with its own noise. With --calibrations N the machine is calibrated N
times in a row before the runs; the tables are predicted from the last one (the closest to the runs) and
each run is also predicted from every other at the same speed of the moment, its errors' range printed
beside it ("calibrations") and each calibration's mean and max under the table. A change to the live model
is judged on several calibrations, never on one: on 2 cores here eight calibrations taken within half an
hour predicted the same measured runs 11-35 % of their step apart (4-rank pipelines the widest), and one
change that had looked better against one calibration was worse against most of the eight.

Under each table the same runs are also priced without the speed check, at the calibration's own speed: the
check scales compute by a Block timed right before the run, and on a fresh pool here it has read 1.52x slower
before a run whose compute ran at the calibration's speed, and 0.71-0.84x before runs whose compute ran 1.1-1.7x
slower than that (2-rank 1F1B, its passes timed against their prediction).

A line beside it prices the same runs with each gloo operation's CPU share scaled by the speed check too
(hardware.this_machine.CommFit.at_speed). Four benchmarks judged that as the prediction: it took the named runs
from 11.3 to 9.6 % mean |error| where the check read 0.55-0.97x, 10.1 to 9.7 at 0.92-1.21x, but 13.0 to 16.8 at
1.02-1.30x and 8.5 to 16.2 at 1.42-2.00x, so communication stays as calibrated and the line keeps the question open.

Two more lines judge a change: the runs' signed mean error (a bias: below 0 they were predicted too fast;
the named runs read -15.5 % before the speed check timed every rank, +2.6 and +0.2 after) and, with
several calibrations, how wide each run's range over them is on average (the calibrations' own noise:
16.5 points before the module timings were anchored to the reference Block, 7.2-8.8 in four benches after
and 17.6 in a fifth).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import launch  # noqa: E402
from engine.cli import config_from_args, run_parser  # noqa: E402
from engine.predict import at_speed_now, ensure_calibration  # noqa: E402
from engine.run import run  # noqa: E402
from hardware.this_machine import summary_lines  # noqa: E402
from planner.live import compare, predict  # noqa: E402

WARM_STEPS = 3  # an untimed run of this many steps right before each timed repeat

# The default live runs: the CLI's defaults for each strategy (the pages' defaults are the same model).
DEFAULT_RUNS = {
    "dp": "--strategy dp",
    "fsdp (ZeRO-3)": "--strategy fsdp",
    "tp + sp": "--strategy tp --sequence-parallel",
    "pp 1F1B": "--strategy pp --schedule 1f1b --micro-batches 4",
    "cp": "--strategy cp",
    "ep": "--strategy ep",
}

# Runs the targets do not name, checked the same way (--more): (flags, the worlds it runs at; None: every one).
MORE_RUNS = {
    "pp GPipe": ("--strategy pp --schedule gpipe --micro-batches 4", None),
    "pp ZB-H1": ("--strategy pp --schedule zb-h1 --micro-batches 4", None),
    "pp interleaved": ("--strategy pp --schedule interleaved-1f1b --virtual-stages 2 --micro-batches 4", None),
    "dp naive sync": ("--strategy dp --dp-comm naive", None),
    "ZeRO-1": ("--strategy dp --zero-stage 1", None),
    "tp (no sp)": ("--strategy tp", None),
    "cp all-gather": ("--strategy cp --cp-variant allgather", None),
    "Mamba-2 cp": ("--arch mamba2 --strategy cp", None),
    "hybrid tp": ("--arch hybrid --strategy tp", None),
    "dp2 x tp2": ("--mesh dp=2,tp=2 --sequence-parallel", (4,)),
    "pp2 x dp2": ("--mesh pp=2,dp=2 --micro-batches 4", (4,)),
    "fsdp2 x tp2": ("--mesh fsdp=2,tp=2", (4,)),
    "cp2 x dp2": ("--mesh cp=2,dp=2", (4,)),
}

# Models larger than the default (--larger), as the Lab's boxes allow (ui/lab.py LAB_NUMBERS): the calibration
# times the modules at small shapes and longer sequences, and these ask how far its fits carry
LARGER_RUNS = {
    "dp width 256": ("--strategy dp --hidden 256 --ffn 1024", (2,)),
    "dp seq 256": ("--strategy dp --seq-len 256", (2,)),
    "dp 4 seqs": ("--strategy dp --micro-batch-size 4", (2,)),
    "fsdp 8 layers": ("--strategy fsdp --layers 8", (2,)),
    "tp width 256": ("--strategy tp --hidden 256 --ffn 1024 --sequence-parallel", (2, 4)),
    "cp seq 512": ("--strategy cp --seq-len 512", (2,)),
    "ep 8 top-2": ("--strategy ep --experts 8 --top-k 2", (2,)),
    "small, ep": ("--strategy ep --layers 4 --hidden 128 --heads 8 --kv-heads 4 --ffn 256", (2,)),
    "pp gpipe 8 layers": ("--strategy pp --schedule gpipe --micro-batches 8 --layers 8", (4,)),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cached", action="store_true",
                    help="predict from the cached calibration when it is sound instead of measuring it again")
    ap.add_argument("--remeasure", action="store_true", help="measure the calibration again (the default)")
    ap.add_argument("--more", action="store_true", help="then the runs the targets do not name (MORE_RUNS)")
    ap.add_argument("--larger", action="store_true", help="then runs of larger models (LARGER_RUNS)")
    ap.add_argument("--calibrations", type=int, default=1, metavar="N",
                    help="calibrate N times and print the range of each run's error over them (module docstring)")
    args = ap.parse_args(argv)
    if args.calibrations < 1 or (args.calibrations > 1 and args.cached):
        ap.error("--calibrations takes a whole number of 1 or more, and more than 1 measures each of them: "
                 "leave out --cached")

    cals = []
    for i in range(args.calibrations):
        t0 = time.perf_counter()
        cal, messages = ensure_calibration(args.worlds, remeasure=args.remeasure or not args.cached or i > 0)
        which = f" {i + 1} of {args.calibrations}" if args.calibrations > 1 else ""
        print(f"calibration{which} ({time.perf_counter() - t0:.1f} s): {'; '.join(messages) or 'from the cache'}")
        cals.append(cal)
    print("\n".join(f"  {line}" for line in summary_lines(cals[-1])))
    named = {name: (flags, None) for name, flags in DEFAULT_RUNS.items()}
    for title, runs in ([("the default runs", named)] + ([("runs not named", MORE_RUNS)] if args.more else [])
                        + ([("larger models", LARGER_RUNS)] if args.larger else [])):
        _table(title, runs, cals, args)
    launch.shutdown_all()
    return 0


def _table(title: str, runs: dict, cals: list, args) -> None:
    cal = cals[-1]  # the closest to the runs: the table's prediction
    cases = []
    for world in args.worlds:
        for name, (flags, worlds) in runs.items():
            if worlds is None or world in worlds:
                cases.append((world, name, config_from_args(run_parser("bench").parse_args(
                    flags.split() + ["--world", str(world), "--steps", str(args.steps)]))))
    if not cases:
        print(f"{title}: none runs at worlds {args.worlds}")
        return
    # The repeats go round the cases (every case once, then every case again, ...) so that a case's
    # measurements are minutes apart: this machine has slow spells of seconds (processes sharing its cores
    # stall), and back-to-back repeats put a whole case in one. Each repeat is predicted at the speed of
    # the moment (the reference Block timed again right before it).
    keys = [(world, name) for world, name, _ in cases]
    predicted, measured, speeds, others, comm_scaled = ({key: [] for key in keys} for _ in range(5))
    # each run at the calibration's own speed, without the speed check: whether scaling by it helps
    unscaled = {(world, name): predict(cfg, cal).step_time_s for world, name, cfg in cases}
    timelines = {}
    for repeat in range(args.repeats):
        print(f"{title}: repeat {repeat + 1} of {args.repeats}", file=sys.stderr, flush=True)
        for world, name, cfg in cases:
            now, speed = at_speed_now(cal, world)  # the machine's speed drifts: its reference Block timed again
            pred = predict(cfg, now)
            # warm the pool, its gloo threads and the ranks' caches, cold after the other cases' runs
            run(cfg if repeat == 0 else dataclasses.replace(cfg, steps=WARM_STEPS), traced=False)
            summary, timelines[(world, name)] = run(cfg)
            steps = summary.step_times_s[1:]
            # every calibration at the same speed of the moment (the reference Block's time then, in seconds),
            # predicted after the run so as not to widen the gap between the speed check and the run
            alts = [predict(cfg, dataclasses.replace(c.at_speed(cal.reference_s * speed)[0],
                                                     rank_pace=now.rank_pace)).step_time_s for c in cals]
            # and each gloo operation's CPU share at the check's speed too (CommFit.at_speed, not the prediction's)
            cpu_share = {key: f.at_speed(speed) for key, f in now.comm.items()}
            comm_scaled[(world, name)].append((predict(cfg, dataclasses.replace(now, comm=cpu_share)).step_time_s,
                                               len(steps)))
            predicted[(world, name)].append((pred, len(steps)))
            others[(world, name)].append([(p, len(steps)) for p in alts])
            measured[(world, name)] += steps
            speeds[(world, name)].append(speed)
    print(f"{'world':>5}  {'run':14s} {'speed':>5} {'predicted ms':>12} {'measured ms':>11} {'error':>7} "
          f"{'median ms':>9} {'error':>7} {'steps ms':>11} {'faster':>6}"
          + (f" {'calibrations':>14}" if len(cals) > 1 else "") + "   differs most")
    errors, median_errors, inside, unscaled_errors, signed, widths = [], [], 0, [], [], []
    comm_scaled_errors = []  # signed
    by_calibration = [[] for _ in cals]  # each calibration's |error| per run
    for world, name, _ in cases:
        preds, steps = predicted[(world, name)], measured[(world, name)]
        # the prediction of the whole measurement: each repeat's, weighted by its measured steps
        step_s = sum(p.step_time_s * n for p, n in preds) / sum(n for _, n in preds)
        mean, median = statistics.mean(steps), statistics.median(steps)
        error, median_error = (step_s - mean) / mean, (step_s - median) / median
        errors.append(abs(error))
        signed.append(error)
        median_errors.append(abs(median_error))
        unscaled_errors.append(abs(unscaled[(world, name)] - mean) / mean)
        pairs = comm_scaled[(world, name)]
        comm_scaled_errors.append((sum(p * n for p, n in pairs) / sum(n for _, n in pairs) - mean) / mean)
        faster = sum(t < step_s for t in steps)  # where the prediction falls among the measured steps
        inside += 0 < faster < len(steps)
        worst = compare(preds[-1][0].timeline, timelines[(world, name)], top=1)
        spread = ""
        if len(cals) > 1:  # each calibration's prediction of the whole measurement, weighted as above
            each = [sum(rep[i][0] * rep[i][1] for rep in others[(world, name)])
                    / sum(rep[i][1] for rep in others[(world, name)]) for i in range(len(cals))]
            errs = [(p - mean) / mean for p in each]
            for i, e in enumerate(errs):
                by_calibration[i].append(abs(e))
            spread = f" {min(errs):>+6.0%}..{max(errs):<+6.0%}"
            widths.append(max(errs) - min(errs))
        print(f"{world:>5}  {name:14s} {statistics.mean(speeds[(world, name)]):>5.2f} {step_s * 1e3:>12.2f} "
              f"{mean * 1e3:>11.2f} {error:>+7.1%} {median * 1e3:>9.2f} {median_error:>+7.1%} "
              f"{min(steps) * 1e3:>5.1f}-{max(steps) * 1e3:<5.1f} {faster:>3}/{len(steps):<2}{spread}   "
              f"{worst[0]['text'] if worst else '-'}", flush=True)
    print(f"{title}, step time (the engine's, a mean): mean |error| {statistics.mean(errors):.1%}, "
          f"max {max(errors):.1%}; median step: mean |error| {statistics.mean(median_errors):.1%}, "
          f"max {max(median_errors):.1%}; {len(errors)} runs, {inside} predicted within their measured steps' "
          "range")
    print(f"  without the speed check (each run at the calibration's own speed): mean |error| "
          f"{statistics.mean(unscaled_errors):.1%}, max {max(unscaled_errors):.1%}")
    print(f"  with each gloo operation's CPU share at the check's speed too: mean |error| "
          f"{statistics.mean(map(abs, comm_scaled_errors)):.1%}, max {max(map(abs, comm_scaled_errors)):.1%}, "
          f"signed {statistics.mean(comm_scaled_errors):+.1%}")
    print(f"  signed mean error {statistics.mean(signed):+.1%} (below 0: predicted too fast)"
          + (f"; each run's range over the calibrations {statistics.mean(widths) * 100:.1f} points wide on "
             "average" if widths else ""))
    for i, errs in enumerate(by_calibration if len(cals) > 1 else []):
        print(f"  calibration {i + 1} of {len(cals)}{' (the table)' if i == len(cals) - 1 else ''}: "
              f"mean |error| {statistics.mean(errs):.1%}, max {max(errs):.1%}")


if __name__ == "__main__":
    sys.exit(main())
