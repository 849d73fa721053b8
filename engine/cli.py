"""`python -m engine run ...`: one live run from the command line.

    python -m engine run --strategy {dp,fsdp,tp,pp,cp,ep} [--zero-stage {0,1,2,3}] [--world N] [--steps N]
                         [--micro-batches N] [--device {cpu,cuda}] [--trace FILE.json] [--check] [--json]
                         [--predict]
                         [--mesh dp=N] [--dp-comm {naive,bucketed}] [--mlp {dense,moe}] [--seed N]
                         [--arch {transformer,mamba2,hybrid}] [--pattern MA..] [--ssm-cp {state,alltoall}] ...

Exit codes: 0 fine, 1 check failed, 2 bad input (message on stderr; also a result stdout cannot take, whatever
the run's outcome), 3 a rank failed or timed out, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM); the
workers are stopped either way. With --json, stdout holds exactly one JSON object whatever the
exit code: a run's summary, which carries "predicted", the planner's prediction of the same run on this
machine's calibration, or {"ok": false, "error": ...} for a run that was refused, failed or interrupted.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from dataclasses import replace

from core.schedules import SCHEDULE_NAMES
from core.stdout import EXIT_BAD_INPUT, write_result
from core.timeline import strict_json, unwritable_reason
from engine.config import (
    ARCHS,
    DTYPES,
    MAX_MODEL,
    MLPS,
    SSM_CP_VARIANTS,
    STRATEGIES,
    ZERO_STAGES,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    parse_mesh,
    strategy_for,
    validate,
)
from hardware.this_machine import busy_words, speed_words
from planner.live import step_spread_words

EXIT_OK, EXIT_CHECK_FAILED, EXIT_RANK_FAILED, EXIT_INTERRUPTED = 0, 1, 3, 130  # EXIT_BAD_INPUT: core.stdout


class _Parser(argparse.ArgumentParser):
    """Bad flags raise ConfigError (exit 2 with a message, and the JSON object under --json) instead of
    argparse's own exit."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see: {self.prog} -h)")


def run_parser(prog: str) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Train a small Transformer, Mamba-2 or hybrid model on N local processes.")
    p.add_argument("--strategy", choices=["dp", "fsdp", "cp", "ep", "tp", "pp"], default=None,
                   help="default: what --mesh needs (cp or ep when it has them), else dp")
    p.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=None,
                   help="ZeRO stage (default: 0 for dp, 3 for fsdp)")
    p.add_argument("--world", type=int, default=2, help="number of ranks (processes)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient accumulation steps per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per rank per micro-batch")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=RunConfig.dtype,
                   help="compute precision: bfloat16 is mixed precision (bf16 matmuls, fp32 weights, gradients "
                        "and Adam state), checked against a single-process run in the same precision")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (open in Perfetto)")
    p.add_argument("--check", action="store_true", help="compare with the single-process reference")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (it always carries the prediction, see --predict)")
    p.add_argument("--predict", action="store_true",
                   help="also print the planner's prediction of this run on this machine (calibrating "
                        "the machine first when it has not been: about 25 s for 2 ranks, 45 s more for 4)")
    p.add_argument("--mesh", help="named mesh axes, e.g. dp=4 (default: dp=world)")
    p.add_argument("--dp-comm", choices=["naive", "bucketed"], default="bucketed",
                   help="dp gradient sync: after backward, or bucketed and overlapped")
    p.add_argument("--mlp", choices=MLPS, default=None,
                   help="default: moe for ep (the strategy or a mesh axis), else dense")
    p.add_argument("--experts", type=int, default=ModelConfig.experts, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=ModelConfig.top_k, help="experts each token is routed to")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="MoE: an expert takes at most ceil(C * seq_len * top_k / experts) tokens per "
                        "sequence, the rest are dropped (default: no limit)")
    p.add_argument("--cp-variant", choices=["ring", "allgather"], default="ring",
                   help="cp: pass K/V around a ring (overlapped) or all-gather them at once")
    p.add_argument("--arch", choices=list(ARCHS), default=ModelConfig.arch,
                   help="layers: attention + MLP blocks, Mamba-2 blocks, or both (see --pattern)")
    p.add_argument("--pattern", default="",
                   help="hybrid: one letter per layer, A attention or M Mamba-2 (default: M and A alternating)")
    p.add_argument("--ssm-cp", choices=list(SSM_CP_VARIANTS), default=ParallelConfig.ssm_cp,
                   help="cp of a Mamba-2 layer: pass the scan's states rank to rank, or all-to-all to heads")
    p.add_argument("--ssm-state", type=int, default=ModelConfig.ssm_state, help="Mamba-2 state size N per head")
    p.add_argument("--ssm-head-dim", type=int, default=ModelConfig.ssm_head_dim, help="Mamba-2 head width P")
    p.add_argument("--ssm-groups", type=int, default=ModelConfig.ssm_groups,
                   help="Mamba-2 groups of heads sharing B and C")
    p.add_argument("--ssm-chunk", type=int, default=ModelConfig.ssm_chunk, help="Mamba-2 SSD chunk length")
    p.add_argument("--seq-len", type=int, default=ModelConfig.seq_len, help="tokens per sequence")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="tp: norms and residuals split along the sequence (all-gather / reduce-scatter)")
    p.add_argument("--hidden", type=int, default=ModelConfig.hidden, help="model width")
    p.add_argument("--vocab", type=int, default=ModelConfig.vocab, help="vocabulary size")
    p.add_argument("--heads", type=int, default=ModelConfig.heads, help="attention (query) heads")
    p.add_argument("--kv-heads", type=int, default=ModelConfig.kv_heads, help="grouped key/value heads")
    p.add_argument("--ffn", type=int, default=ModelConfig.ffn, help="SwiGLU hidden size")
    p.add_argument("--layers", type=int, default=None,
                   help=f"layers (default: {ModelConfig.layers}, or pp*virtual_stages when larger, or the "
                        f"length of --pattern)")
    p.add_argument("--schedule", choices=list(SCHEDULE_NAMES), default=ParallelConfig.schedule,
                   help="pipeline schedule, when the mesh has pp > 1")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per pipeline rank (interleaved-1f1b)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=RunConfig.timeout_s, help="wall-clock limit of the run")
    p.add_argument("--no-prefetch", action="store_true", help="fsdp: gather each unit only when needed")
    return p


def config_from_args(args, world: int | None = None) -> RunConfig:
    """Build and validate; raises ConfigError with a message that says what to change."""
    world = args.world if world is None else world
    mesh = parse_mesh(args.mesh) if args.mesh is not None else ()  # an empty --mesh is refused, not ignored
    strategy = args.strategy or strategy_for(mesh)
    parallel = ParallelConfig(strategy=strategy, zero_stage=args.zero_stage, dp_comm=args.dp_comm,
                              mesh=mesh, prefetch=not args.no_prefetch,
                              cp_variant=args.cp_variant, sequence_parallel=args.sequence_parallel,
                              ssm_cp=args.ssm_cp,
                              schedule=args.schedule, virtual_stages=args.virtual_stages)
    layers = args.layers
    if layers is None:
        layers = _default_layers(parallel, world, args.virtual_stages, args.pattern)
        most = MAX_MODEL["layers"]
        if layers > most:  # the layers were not given: name what made them so many
            raise ConfigError(f"--pattern has {layers:,} letters, one layer each, and the engine runs at most {most:,}"
                              if args.pattern else f"pp x --virtual-stages = {layers:,} layers, one per chunk, and "
                              f"the engine runs at most {most:,}: use a smaller --virtual-stages")
    mlp = args.mlp or default_mlp(strategy, mesh)
    model = replace(ModelConfig(), mlp=mlp, layers=layers, experts=args.experts, top_k=args.top_k,
                    capacity_factor=args.capacity_factor, seq_len=args.seq_len, heads=args.heads,
                    hidden=args.hidden, vocab=args.vocab,
                    kv_heads=args.kv_heads, ffn=args.ffn, arch=args.arch, pattern=args.pattern,
                    ssm_state=args.ssm_state, ssm_head_dim=args.ssm_head_dim, ssm_groups=args.ssm_groups,
                    ssm_chunk=args.ssm_chunk)
    cfg = validate(RunConfig(model=model, parallel=parallel, world=world, steps=args.steps,
                             micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                             seed=args.seed, device=args.device, dtype=args.dtype, timeout_s=args.timeout_s))
    unused = unused_flag(args, cfg)
    if unused:
        raise ConfigError(unused)
    return cfg


def unused_flag(args, cfg: RunConfig) -> str | None:
    """What to change about a flag given away from its default that this run would not use (a K/V variant with no
    cp axis, a Mamba-2 size for a Transformer), or None: run as if it were not given, it had been ignored without
    a word, where --schedule and --sequence-parallel without their axes are refused."""
    p, m, d = cfg.parallel, cfg.model, ModelConfig()
    cp, mamba = cfg.parallel.degree("cp", cfg.world) > 1, m.arch != "transformer"
    if args.cp_variant != ParallelConfig.cp_variant and not cp:
        return (f"--cp-variant {args.cp_variant} chooses how context parallelism moves K/V, and this mesh has no cp "
                "axis: add one (e.g. --mesh cp=2) or drop --cp-variant")
    if args.ssm_cp != ParallelConfig.ssm_cp and not (cp and mamba):
        return (f"--ssm-cp {args.ssm_cp} chooses how context parallelism splits a Mamba-2 layer, and this run has "
                + ("no Mamba-2 layer: use --arch mamba2 or hybrid" if not mamba else
                   "no cp axis: add one (e.g. --mesh cp=2)") + ", or drop --ssm-cp")
    if args.no_prefetch and p.stage != 3:
        return (f"--no-prefetch stops ZeRO-3 gathering the next unit's weights ahead, and this run keeps whole "
                f"weights (ZeRO stage {p.stage}): use --strategy fsdp (or an fsdp axis), or drop --no-prefetch")
    if args.dp_comm != ParallelConfig.dp_comm and p.stage != 0:  # (argv_for leaves these two out: _dp_comm_used)
        return (f"--dp-comm {args.dp_comm} chooses how plain data parallel (ZeRO stage 0) syncs gradients, and this "
                f"run is ZeRO stage {p.stage}: use --strategy dp, or drop --dp-comm")
    if args.dp_comm != ParallelConfig.dp_comm and not cfg.mesh.grad_axes():
        return (f"--dp-comm {args.dp_comm} chooses how data-parallel ranks sync gradients, and this mesh has none "
                "(no dp, fsdp, ep or cp axis): add one (e.g. --mesh dp=2) or drop --dp-comm")
    if m.mlp != "moe":
        for flag, value, default in (("--experts", m.experts, d.experts), ("--top-k", m.top_k, d.top_k)):
            if value != default:
                return f"{flag} {value} sizes an MoE layer, and this model's MLP is dense: add --mlp moe or drop {flag}"
    if not mamba:
        for flag, value, default in (("--ssm-state", m.ssm_state, d.ssm_state),
                                     ("--ssm-head-dim", m.ssm_head_dim, d.ssm_head_dim),
                                     ("--ssm-groups", m.ssm_groups, d.ssm_groups),
                                     ("--ssm-chunk", m.ssm_chunk, d.ssm_chunk)):
            if value != default:
                return (f"{flag} {value} sizes a Mamba-2 layer, and this model is a Transformer: use --arch mamba2 "
                        f"or hybrid, or drop {flag}")
    return None


def _dp_comm_used(cfg: RunConfig) -> bool:
    """Whether the run's --dp-comm does anything: plain data parallel (ZeRO stage 0, engine.dp) with an axis to sum
    gradients over (the mesh's grad_axes, the groups engine.dp's all-reduces run in)."""
    return cfg.parallel.stage == 0 and bool(cfg.mesh.grad_axes())


def default_mlp(strategy: str, mesh) -> str:
    """The MLP a run gets when --mlp is not given: MoE where experts are split (strategy ep, or an ep axis of more
    than one rank in the mesh), else dense."""
    return "moe" if strategy == "ep" or any(axis == "ep" and n > 1 for axis, n in mesh) else "dense"


def _default_layers(parallel: ParallelConfig, world: int, virtual_stages: int, pattern: str) -> int:
    """One layer per letter of a hybrid's pattern; else the smallest model every pipeline stage gets whole
    layers of: pp * v layers at least."""
    if pattern:
        return len(pattern)
    return max(ModelConfig.layers, RunConfig(parallel=parallel, world=world).pp * max(1, virtual_stages))


def argv_for(cfg: RunConfig) -> list[str]:
    """The `python -m engine run` arguments that build `cfg` again (config_from_args inverts it): the
    command line a page shows under a live run, so it can be reproduced in a terminal. A gradient sync with
    nothing to sync (the data-parallel lesson's naive DDP on one process) is left out, which `unused_flag` would
    refuse: the command runs the same step."""
    p, m, d = cfg.parallel, cfg.model, ModelConfig()
    if not _dp_comm_used(cfg):
        p = replace(p, dp_comm=ParallelConfig.dp_comm)
    argv = ["--strategy", p.strategy, "--world", str(cfg.world), "--steps", str(cfg.steps)]
    default_layers = _default_layers(p, cfg.world, p.virtual_stages, m.pattern)
    pairs = [
        ("--zero-stage", p.zero_stage, None), ("--mesh", ",".join(f"{a}={n}" for a, n in p.mesh) or None, None),
        ("--dp-comm", p.dp_comm, "bucketed"), ("--cp-variant", p.cp_variant, "ring"),
        ("--arch", m.arch, d.arch), ("--pattern", m.pattern, ""), ("--ssm-cp", p.ssm_cp, ParallelConfig.ssm_cp),
        ("--ssm-state", m.ssm_state, d.ssm_state), ("--ssm-head-dim", m.ssm_head_dim, d.ssm_head_dim),
        ("--ssm-groups", m.ssm_groups, d.ssm_groups), ("--ssm-chunk", m.ssm_chunk, d.ssm_chunk),
        ("--schedule", p.schedule, ParallelConfig.schedule), ("--virtual-stages", p.virtual_stages, 1),
        ("--micro-batches", cfg.micro_batches, 1), ("--micro-batch-size", cfg.micro_batch_size, 2),
        ("--mlp", m.mlp, default_mlp(p.strategy, p.mesh)), ("--experts", m.experts, d.experts),
        ("--top-k", m.top_k, d.top_k), ("--capacity-factor", m.capacity_factor, None),
        ("--seq-len", m.seq_len, d.seq_len), ("--hidden", m.hidden, d.hidden), ("--vocab", m.vocab, d.vocab),
        ("--heads", m.heads, d.heads), ("--kv-heads", m.kv_heads, d.kv_heads),
        ("--ffn", m.ffn, d.ffn), ("--layers", m.layers, default_layers), ("--seed", cfg.seed, 0),
        ("--device", cfg.device, "cpu"), ("--dtype", cfg.dtype, RunConfig.dtype),
        ("--timeout-s", cfg.timeout_s, RunConfig.timeout_s),
    ]
    for flag, value, default in pairs:
        if value != default and value is not None:
            argv += [flag, _number(value) if isinstance(value, float) else str(value)]
    argv += ["--sequence-parallel"] * p.sequence_parallel + ["--no-prefetch"] * (not p.prefetch)
    return argv


def _number(value: float) -> str:
    """A float as short as it reads ("1.25", "120") and exact: `:g` keeps six digits, and 1234567 s had come
    back as 1.23457e+06."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


COMMAND = ".venv/bin/python -m engine run"  # from the repository, with the Python ./run.sh installed torch into


def command_line(cfg: RunConfig, check: bool = True) -> str:
    """The shell command that repeats `cfg`, each argument quoted for the shell (a pattern typed on a page, or
    brought by a link, is one argument and never shell syntax)."""
    return " ".join([COMMAND, shlex.join([*argv_for(cfg), *(["--check"] if check else []), "--predict"])])


def _zero_words(summary) -> str | None:
    """Where the run's ZeRO stage shards (core.mesh: the fsdp axis, else dp), or None at stage 0. A mesh that
    does not split that axis shards nothing at any stage, and says so."""
    from core.mesh import Mesh

    if not summary.zero_stage:
        return None
    axis = Mesh(summary.mesh).shard_axis()
    if summary.mesh.get(axis, 1) > 1 or summary.world == 1:
        return f"ZeRO-{summary.zero_stage} shards over {axis}"
    return (f"ZeRO-{summary.zero_stage} shards over {axis}, which this mesh does not split: nothing is sharded "
            f"(add {axis}=2 to --mesh to shard)")


def _human(summary) -> str:
    # the mesh, not the strategy's name: a tp mesh had read "dp zero-0"
    mesh = ",".join(f"{axis}={degree}" for axis, degree in summary.mesh.items())
    lines = [f"{summary.world} ranks ({summary.device}), mesh {mesh} (rank order outermost first), "
             f"{summary.steps} steps x {summary.micro_batches} micro-batches",
             f"loss per step: {', '.join(f'{x:.5f}' for x in summary.loss)}",
             f"step time (mean after the first step, slowest rank): {summary.step_time_s * 1e3:.1f} ms"]
    if summary.mesh.get("pp", 1) > 1:
        parallel = summary.config["parallel"]
        lines.insert(1, f"pipeline schedule {parallel['schedule']}, {parallel['virtual_stages']} virtual stage(s) "
                        "per rank")
    if (zero := _zero_words(summary)) is not None:
        lines.insert(1, zero)
    for rank, (mem, sent) in enumerate(zip(summary.memory_bytes, summary.comm_bytes, strict=True)):
        parts = ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in mem.items())
        lines.append(f"rank {rank}: sent {sent / 1024:.0f} KiB; memory: {parts}")
    for layer, load in summary.stats.get("expert_load", {}).get("layers", {}).items():
        lines.append(f"expert load {layer}: tokens per expert {load['tokens_per_expert']} "
                     f"(max/mean {load['expert_max_over_mean']:.2f}), "
                     f"per ep rank {load['processed_per_ep_rank']} "
                     f"(max/mean {load['ep_rank_max_over_mean']:.2f}), "
                     f"dropped {load['dropped_fraction']:.1%}")
    pred = summary.predicted
    if pred is not None:
        # what the calibration said (measured now, could not be kept, ...): the JSON's "calibration"
        lines += [f"calibration: {message}" for message in pred.get("calibration", [])]
        lines.append(prediction_line(summary.step_time_s, pred))
        lines += [f"note on the prediction: {note}" for note in pred.get("notes", [])]
        if (busy := busy_words(pred.get("speed_factor", 1.0))) is not None:
            lines.append(f"warning: {busy}")
        if (spread := step_spread_words(summary.step_times_s, pred.get("step_time_s"))) is not None:
            lines.append(f"measured: {spread}")
    check = summary.check
    if check is not None:
        verdict = "PASSED" if check["passed"] else "FAILED"
        how = ("bit for bit, this layout repeating the reference's arithmetic" if check.get("exact") else
               f"max abs diff {check['max_abs_diff']:.3g}")
        lines.append(f"check against the single-process reference: {verdict} ({how}, over {check['steps']} steps)")
        lines += [f"  {f}" for f in check["failures"]]
    return "\n".join(lines)


def prediction_line(measured_s: float, pred: dict) -> str:
    if pred.get("step_time_s") is None:
        return f"no prediction: {pred.get('why', 'unavailable')}"
    error = (pred["step_time_s"] - measured_s) / measured_s
    parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(pred["breakdown_s"].items(), key=lambda kv: -kv[1]))
    speed = pred.get("speed_factor", 1.0)
    return (f"predicted step time (planner, this machine's calibration): {pred['step_time_s'] * 1e3:.1f} ms, "
            f"{error:+.0%} against measured ({parts} ms)"
            + (f"; {speed_words(speed)}" if speed != 1.0 else ""))


USAGE = (f"usage: python -m engine run [--strategy {{{','.join(STRATEGIES)}}}] [--mesh AXIS=N,...] [options]\n"
         "Runs real sharded training steps on local processes, optionally checked against a single process\n"
         "(--check), predicted by the planner (--predict) and traced (--trace). Every option: "
         "python -m engine run -h")


class Terminated(KeyboardInterrupt):
    """A SIGTERM, turned into the interrupt the run already cleans up after (its workers, its temporary folder)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_terminate(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second TERM must not break the cleanup it started
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        write_result(USAGE)
        return EXIT_OK
    if not argv or argv[0] != "run":
        unknown = f"unknown command '{argv[0]}': the engine's one command is run\n" if argv else ""
        print(unknown + USAGE, file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        args = run_parser("python -m engine run").parse_args(argv[1:])
    except ConfigError as e:
        # argparse takes --js for --json; "--json=1" is refused, yet asked for JSON
        as_json = any(len(flag) > 2 and "--json".startswith(flag) for flag in (a.split("=")[0] for a in argv))
        return _fail(argparse.Namespace(json=as_json), str(e), EXIT_BAD_INPUT)
    previous = signal.signal(signal.SIGTERM, _on_terminate)
    try:
        return _run(args)
    except Terminated as e:  # as an interrupt: cleaned up, said, one JSON object; the shell's 128 + signal
        return _fail(args, "terminated", 128 + e.signum)
    except KeyboardInterrupt:  # the pool's workers are stopped by its own cleanup (engine/launch.py)
        return _fail(args, "interrupted", EXIT_INTERRUPTED)
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_trace_path(path: str | None) -> None:
    """Refuse (ConfigError) a --trace path that cannot be written, before the run it would record."""
    reason = path is not None and unwritable_reason(path)
    if reason:
        raise ConfigError(f"--trace {reason}")


def _fail(args, message: str, code: int, **extra) -> int:
    """Say why on stderr (and, with --json, as the one JSON object on stdout); return the exit code."""
    print(f"error: {message}", file=sys.stderr)
    if args.json:
        write_result(strict_json({"ok": False, "error": message, **extra}))
    return code


def _run(args) -> int:
    try:
        cfg = config_from_args(args)
        check_trace_path(args.trace)
    except ConfigError as e:
        return _fail(args, str(e), EXIT_BAD_INPUT)

    if cfg.device == "cuda":
        import torch  # only here: a cpu run's parent process never imports torch

        if torch.cuda.device_count() == 0:
            return _fail(args, "--device cuda, but torch sees no CUDA device here; use --device cpu", EXIT_BAD_INPUT)

    from engine.launch import WorkerError
    from engine.run import run

    try:
        summary, timeline = run(cfg, traced=bool(args.trace), check=args.check, predict=args.json or args.predict)
    except ConfigError as e:  # engine.run's check that the run fits this machine, before any worker starts
        return _fail(args, str(e), EXIT_BAD_INPUT)
    except WorkerError as e:
        return _fail(args, str(e), EXIT_RANK_FAILED, check=None, world=cfg.world)
    trace_error = None
    if args.trace:
        try:
            timeline.write_chrome_trace(args.trace)
        except OSError as e:  # checked before the run; the disk may still fill or the folder go
            trace_error = f"cannot write the trace {args.trace}: {e.strerror}; choose another path for --trace"
            print(f"error: {trace_error}", file=sys.stderr)
    reply = summary.to_dict() | ({"trace_error": trace_error} if trace_error else {})
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the run is over: its result is the one answer, TERM or not
    write_result(strict_json(reply) if args.json else _human(summary))
    if args.trace and not trace_error and not args.json:
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if not summary.ok:  # a failed check is the run's answer, whether or not its trace could be written
        return EXIT_CHECK_FAILED
    return EXIT_BAD_INPUT if trace_error else EXIT_OK
