"""The Lab's pure builders: the run configuration from the page's choices, the table of a session's runs,
two runs side by side, the export of all results, and the commands that run the same experiment elsewhere.
No Streamlit here."""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict

import plotly.graph_objects as go

from core.mesh import AXES
from core.schedules import SCHEDULE_NAMES
from core.timeline import strict_json
from engine.config import (
    ARCHS,
    DEVICES,
    DTYPES,
    MLPS,
    SSM_CP_VARIANTS,
    ZERO_STAGES,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    step_flops,
    strategy_for,
)
from ui.live import LiveRun, prediction_error, representative_step
from ui.state import link_value
from ui.timeline import shared_kinds, step_timeline, timeline_figure

SCHEDULES = ("1f1b", *(s for s in SCHEDULE_NAMES if s != "1f1b"))  # the engine's, its default first

# The Lab's controls, each bound to the link's query parameter of its key, so that a shared link opens the same
# experiment. Whole numbers: (lowest, highest, step) of their boxes (the Steps box's highest is the server's
# SHARDLAB_MAX_STEPS where the page can read it: lab_numbers); choices: their options, written in the link
# as the page labels them (LAB_LABELS; Streamlit's bound selectboxes and radios read and write the label).
LAB_NUMBERS = {"lab_ssm_state": (1, 128, 1), "lab_ssm_groups": (1, 64, 1), "lab_ssm_chunk": (1, 256, 1),
               "lab_layers": (1, 32, 1), "lab_hidden": (8, 1024, 8), "lab_heads": (1, 32, 1),
               "lab_kv_heads": (1, 32, 1), "lab_ffn": (8, 4096, 8), "lab_vocab": (16, 32000, 1),
               "lab_seq": (4, 1024, 1), "lab_experts": (1, 16, 1), "lab_top_k": (1, 16, 1),
               **{f"lab_{axis}": (1, 8, 1) for axis in ("pp", "dp", "fsdp", "cp", "ep", "tp")},
               "lab_virtual": (1, 4, 1), "lab_mb": (1, 16, 1), "lab_mbs": (1, 16, 1), "lab_steps": (1, 20, 1)}
# The Lab's starting points ("Start from"): each loads every model field
LAB_PRESETS = {"tiny (2 layers, width 64)": ModelConfig(),
               "small (4 layers, width 128)": ModelConfig(layers=4, hidden=128, heads=8, kv_heads=4, ffn=256),
               "MoE (2 layers, 4 experts, top-2)": ModelConfig(mlp="moe"),
               "Mamba-2 (2 layers, width 64)": ModelConfig(arch="mamba2"),
               "hybrid (4 layers: Mamba-2, attention, Mamba-2, attention)": ModelConfig(arch="hybrid", layers=4)}
LAB_CHOICES = {"lab_preset": tuple(LAB_PRESETS), "lab_arch": ARCHS, "lab_mlp": MLPS, "lab_zero": ZERO_STAGES,
               "lab_schedule": SCHEDULES,
               "lab_dtype": DTYPES, "lab_ssm_cp": SSM_CP_VARIANTS, "lab_device": DEVICES}
LAB_LABELS = {"lab_dtype": {"float32": "fp32", "bfloat16": "bf16 mixed precision"},
              "lab_ssm_cp": {"state": "state passing (rank to rank)", "alltoall": "all-to-all to heads"}}
# Each control's title on the page, and the engine's command-line flag it sets: the engine's messages name flags
# (shared with `python -m engine run`), and the Lab says them in its own controls' words (`lab_words`). Short
# enough for a quarter of a 1,024-px window on one line (the pattern's help says it is the hybrid's).
LAB_TITLES = {"lab_arch": "Architecture", "lab_pattern": "Layer pattern", "lab_ssm_state": "SSM state N",
              "lab_ssm_groups": "SSM groups", "lab_ssm_chunk": "SSD chunk", "lab_layers": "Layers",
              "lab_hidden": "Hidden size", "lab_heads": "Attention heads", "lab_kv_heads": "KV heads",
              "lab_ffn": "MLP width", "lab_vocab": "Vocabulary", "lab_seq": "Sequence length", "lab_mlp": "MLP",
              "lab_experts": "Experts", "lab_top_k": "Top-k", "lab_zero": "ZeRO stage",
              "lab_schedule": "Pipeline schedule", "lab_virtual": "Virtual stages",
              "lab_sp": "Sequence parallel (with tp)", "lab_ssm_cp": "A Mamba-2 layer under cp",
              "lab_mb": "Micro-batches", "lab_mbs": "Sequences per micro-batch", "lab_steps": "Steps",
              "lab_dtype": "Number format", "lab_device": "Device"}
LAB_FLAGS = {"--arch": "lab_arch", "--pattern": "lab_pattern", "--ssm-state": "lab_ssm_state",
             "--ssm-groups": "lab_ssm_groups", "--ssm-chunk": "lab_ssm_chunk", "--layers": "lab_layers",
             "--hidden": "lab_hidden", "--heads": "lab_heads", "--kv-heads": "lab_kv_heads", "--ffn": "lab_ffn",
             "--vocab": "lab_vocab", "--seq-len": "lab_seq", "--mlp": "lab_mlp", "--experts": "lab_experts",
             "--top-k": "lab_top_k", "--zero-stage": "lab_zero", "--schedule": "lab_schedule",
             "--virtual-stages": "lab_virtual", "--sequence-parallel": "lab_sp", "--ssm-cp": "lab_ssm_cp",
             "--micro-batches": "lab_mb", "--micro-batch-size": "lab_mbs", "--steps": "lab_steps",
             "--dtype": "lab_dtype", "--device": "lab_device"}
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def lab_words(message: str) -> str:
    """An engine message as the Lab says it: each command-line flag it names ("use --mlp moe", "--micro-batches
    2 or 4") as the title of the Lab's control that sets it ("use MLP moe", "Micro-batches 2 or 4"), in bold;
    a flag no control of the Lab sets stays as it is."""
    return _FLAG.sub(lambda f: f"**{LAB_TITLES[LAB_FLAGS[f.group()]]}**" if f.group() in LAB_FLAGS else f.group(),
                     message)


LAB_SWITCHES = ("lab_sp",)  # toggles: "true" or "false" in the link
LAB_TEXTS = ("lab_pattern",)  # any text: the engine's check says what it makes of it
LAB_PARAMS = frozenset({*LAB_NUMBERS, *LAB_CHOICES, *LAB_SWITCHES, *LAB_TEXTS})


def bound_number(text: str) -> int | None:
    """A whole-number box's value in a link as Streamlit reads it for a box bound to the link (a float, then cut
    to an int: "2.5" is 2, "1e3" 1000, "٣" 3), or None where it takes none: the link check must agree with it,
    for Streamlit sets the box from the link as the page first loads, whatever the check said."""
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) else None


def lab_numbers(max_steps: int | None = None) -> dict[str, tuple[int, int, int]]:
    """LAB_NUMBERS with the Steps box going up to `max_steps`, the server's SHARDLAB_MAX_STEPS (None: the
    default's 20): a teacher's raised limit had done nothing in the Lab, whose box stopped at 20."""
    if max_steps is None:
        return LAB_NUMBERS
    low, _, step = LAB_NUMBERS["lab_steps"]
    return {**LAB_NUMBERS, "lab_steps": (low, max_steps, step)}


def lab_label(key: str, option) -> str:
    """How the Lab shows `option` of the control `key`, and how a link writes it."""
    return LAB_LABELS.get(key, {}).get(option, str(option))


def lab_link_problems(params: Mapping[str, str | list[str]], devices: Sequence[str],
                      numbers: Mapping[str, tuple[int, int, int]] = LAB_NUMBERS) -> dict[str, str]:
    """The Lab's parameters in a link that its controls cannot take, each with what it should be: a whole number
    in the box's range (`numbers`: the page's, lab_numbers), one of the options (`devices`: the ones this server
    has), true or false. Of a repeated key (a list, as `st.query_params.get_all` gives it) a control reads the last
    value, and so does this check (`repeated_link_message` says the others are left)."""
    bad = {}
    for key, given in params.items():
        text = str(given[-1] if isinstance(given, list) and given else given)
        if key in numbers:
            low, high, _ = numbers[key]
            number = bound_number(text)
            if number is None or not low <= number <= high:
                bad[key] = f"a whole number from {low} to {high}"
        elif key in LAB_CHOICES:  # as Streamlit's bound selectbox reads it: the label exactly
            options = [o for o in LAB_CHOICES[key] if key != "lab_device" or o in devices]
            if text not in [lab_label(key, o) for o in options]:
                gpu_less = key == "lab_device" and "cuda" not in devices
                bad[key] = "one of " + ", ".join(lab_label(key, o) for o in options) + (
                    ": this server has no GPU" if gpu_less else "")
        elif key in LAB_TEXTS and len(text) > LAB_NUMBERS["lab_layers"][1]:  # the box would cut it, unsaid
            bad[key] = f"at most {LAB_NUMBERS['lab_layers'][1]} letters, one per layer"
        elif key in LAB_SWITCHES and text.lower() not in ("true", "false"):  # as Streamlit reads a toggle
            bad[key] = "true or false"
    # a repeated key's message quotes all its values: what it takes is one of them (a text is cut, not dropped)
    repeated = {k for k, v in params.items() if isinstance(v, list) and len(v) > 1} - set(LAB_TEXTS)
    return {k: "one value, " + what if k in repeated else what for k, what in bad.items()}


def repeated_link_message(params: Mapping[str, list[str]]) -> str:
    """What the Lab says of a link that repeats its keys (`params`: key -> every value the link gives it, as
    `st.query_params.get_all` reads them): each control takes one value, and Streamlit's bound boxes, choices and
    switches all take the last, without a word (`?lab_layers=2&lab_layers=4` opened with 4 layers). Empty when no
    key repeats."""
    repeated = {k: v for k, v in params.items() if len(v) > 1}
    if not repeated:
        return ""
    return ("The link gives " + "; ".join(f"{k} {len(v)} values ({link_value(', '.join(v))})"
                                          for k, v in repeated.items())
            + ". Each control takes one: the last is used (" + ", ".join(f"{k}={link_value(v[-1])}"
                                                                        for k, v in repeated.items()) + ").")


def lab_config(model: ModelConfig, mesh: dict[str, int], zero_stage: int, schedule: str, virtual_stages: int,
               micro_batches: int, micro_batch_size: int, steps: int, device: str,
               dtype: str = "float32") -> RunConfig:
    """The run the page describes: the mesh's axes of degree > 1, the ZeRO stage over its data axes (an
    fsdp axis shards at least the optimizer state: stage 0 there becomes 3), the label from the mesh
    (engine.config.strategy_for)."""
    axes = tuple((a, mesh[a]) for a in AXES if mesh.get(a, 1) > 1) or (("dp", 1),)
    world = 1
    for _, d in axes:
        world *= d
    strategy = strategy_for(axes)
    stage = 3 if dict(axes).get("fsdp", 1) > 1 and zero_stage == 0 else zero_stage
    piped = dict(axes).get("pp", 1) > 1  # without a pp axis the schedule and chunks are the engine's defaults
    parallel = ParallelConfig(strategy=strategy, mesh=axes, zero_stage=stage,
                              schedule=schedule if piped else ParallelConfig.schedule,
                              virtual_stages=virtual_stages if piped else 1)
    return RunConfig(model=model, parallel=parallel, world=world, steps=steps, micro_batches=micro_batches,
                     micro_batch_size=micro_batch_size, device=device, dtype=dtype)


def mesh_label(cfg: RunConfig) -> str:
    return " x ".join(f"{a}={d}" for a, d in cfg.parallel.axes(cfg.world) if d > 1) or "1 process"


def run_rows(runs: list[LiveRun], matmul_flops_per_s: float | None) -> list[dict]:
    """One row per run of this session: what a practitioner compares. MFU is against this machine's
    calibrated fp32 matmul rate per process (one core each), so 100 % is every rank doing nothing but
    matmuls at the speed the calibration measured."""
    rows = []
    for run in runs:
        s, cfg = run.summary, run.cfg
        tokens = cfg.global_batch * cfg.model.seq_len
        # against the calibrated fp32 matmul rate: a bf16 run has no rate of its own to compare with
        mfu = (step_flops(cfg) / (s.step_time_s * cfg.world * matmul_flops_per_s)
               if matmul_flops_per_s and cfg.device == "cpu" and cfg.dtype == "float32" else None)
        err = prediction_error(run)
        # what a run is and how it went first: at 800 px the grid shows four or five columns, and "error" had
        # been the last of twelve, out of view even at 1,280 px
        rows.append({
            "run": run.label, "mesh": mesh_label(cfg),
            "step (ms)": round(s.step_time_s * 1e3, 2),
            # text, two decimals as the step's ("21" had stood beside "4.98"): a column of numbers and "n/a"
            "predicted (ms)": f"{run.prediction['step_time_s'] * 1e3:.2f}" if err is not None else "n/a",
            "error": f"{err:+.0%}" if err is not None else "n/a",
            "check": "passed" if s.check and s.check["passed"] else "FAILED" if s.check else "not run",
            "model": cfg.model.arch, "dtype": cfg.dtype, "procs": cfg.world, "steps": cfg.steps,
            "tokens/s": round(tokens / s.step_time_s),
            "MFU": f"{mfu:.1%}" if mfu is not None else "n/a",
            "peak MiB / rank": round(max(m["total"] for m in s.memory_bytes) / 2**20, 2),
        })
    return rows


def compare_figures(a: LiveRun, b: LiveRun) -> tuple[go.Figure, go.Figure]:
    """Each run's representative step (the one nearest its mean step time) on one shared time axis."""
    steps = [representative_step(r.summary) for r in (a, b)]
    timelines = [step_timeline(r.timeline, s) for r, s in zip((a, b), steps, strict=True)]
    x_max = max(max(t.duration_s for t in timelines),
                *(r.summary.step_times_s[s] for r, s in zip((a, b), steps, strict=True))) * 1e3
    # the same legend on both (ui.timeline.shared_kinds), so their time axes line up to the pixel; each keeps
    # its own rows (two layouts' ranks and lanes differ)
    kinds = shared_kinds(*timelines)
    return tuple(timeline_figure(t, x_max_ms=x_max, kinds=kinds, title=f"{r.label}: {mesh_label(r.cfg)}, step {s} "
                                 f"({r.summary.step_times_s[s] * 1e3:.1f} ms)")
                 for r, t, s in zip((a, b), timelines, steps, strict=True))


def results_json(runs: list[LiveRun], commands: list[str]) -> str:
    """Every run of the session: its configuration, the command line that reproduces it (the page passes
    engine.cli.command_line's), the measured summary (the prediction included)."""
    return strict_json([{"label": r.label, "command": c, "config": asdict(r.cfg), "summary": r.summary.to_dict()}
                        for r, c in zip(runs, commands, strict=True)], default=str, indent=1)


def torchrun_command(cfg: RunConfig, argv: list[str], nodes: int = 2) -> str:
    """The same experiment over `nodes` machines (each runs this with its NODE rank; HOST0 is node 0), from
    the run's `python -m engine run` arguments (engine.cli.argv_for)."""
    if cfg.world % nodes:
        nodes = 1
    argv = list(argv)
    i = argv.index("--world")  # torchrun sets the world size
    del argv[i:i + 2]
    return (f"torchrun --nnodes {nodes} --nproc-per-node {cfg.world // nodes} --node-rank $NODE "
            f"--master-addr $HOST0 --master-port 29500 \\\n    -m engine.worker {shlex.join(argv)} --check "
            "--out result.json")
