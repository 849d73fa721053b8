"""Mixed precision (dtype bfloat16, engine.model.mixed_precision): every layout against the single-process run
in the same precision, with bf16's own tolerances (engine/verify.py: BF16_TOLERANCES, and why), and what is
refused."""

import subprocess
import sys

import pytest
import torch

from engine.cli import argv_for, config_from_args, run_parser
from engine.config import ConfigError, ModelConfig, RunConfig, validate
from engine.launch import REPO_ROOT
from engine.model import build_model, mixed_precision
from engine.run import run


def _cfg(flags: str) -> RunConfig:
    return config_from_args(run_parser("x").parse_args([*flags.split(), "--dtype", "bfloat16"]))


def test_matmuls_compute_in_bf16_and_the_weights_stay_fp32():
    model = build_model(ModelConfig(), 0)
    tokens = torch.randint(0, 256, (2, 32))
    with mixed_precision("bfloat16", "cpu"):
        logits = model(tokens)
    assert logits.dtype == torch.bfloat16  # the head's matmul
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with mixed_precision("float32", "cpu"):
        assert model(tokens).dtype == torch.float32


CASES = ["--strategy dp --world 2", "--strategy fsdp --world 2", "--strategy tp --world 2 --sequence-parallel",
         "--strategy cp --world 2", "--mesh pp=2 --world 2 --micro-batches 2",
         "--arch mamba2 --strategy cp --world 4", "--arch hybrid --mesh cp=2,tp=2 --world 4",
         "--arch mamba2 --strategy tp --world 2"]  # a mixer's in_dt, in_b, in_c and D at up to 3.4 % of their norm


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", CASES)
def test_bf16_layouts_match_the_bf16_reference(pools, flags):
    cfg = _cfg(flags)
    summary, _ = run(cfg, traced=False, check=True, pool=pools(cfg.world))
    assert summary.check["passed"], summary.check["failures"]
    # a pipeline alone repeats the reference's arithmetic in bf16 too: compared bit for bit
    exact = cfg.mesh.world == cfg.mesh.degree("pp")
    assert summary.check["exact"] == exact
    assert summary.check["tolerances"]["grads"]["why"].startswith("bit for bit" if exact else "||a - b|| / ||b||")
    assert summary.predicted is None or summary.predicted.get("step_time_s") is None


def test_bf16_with_moe_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="routing tie"):
        validate(_cfg("--strategy ep --world 2"))


def test_the_command_line_carries_the_dtype():
    cfg = _cfg("--strategy tp --world 2")
    assert "--dtype" in argv_for(cfg)
    assert config_from_args(run_parser("x").parse_args(argv_for(cfg))) == cfg


def test_cli_refuses_bf16_moe_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--strategy", "ep", "--dtype", "bfloat16"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "routing tie" in out.stderr and "Traceback" not in out.stderr
