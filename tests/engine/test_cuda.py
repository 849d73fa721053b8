"""The `--device cuda` path: NCCL when each rank has a GPU; GPU compute with gloo staging through host
memory when there are fewer GPUs than ranks. Runs only where torch sees a CUDA device:

    .venv/bin/python -m pytest -q tests/engine/test_cuda.py
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_GPU = torch.cuda.is_available()


def _engine(*args):
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(HAS_GPU, reason="checks the message shown where there is no GPU")
def test_cuda_without_a_gpu_exits_2():
    out = _engine("run", "--device", "cuda")
    assert out.returncode == 2 and "no CUDA device" in out.stderr


@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_cuda_matches_the_cpu_reference(strategy, world, tmp_path):
    trace = tmp_path / "t.json"
    out = _engine("run", "--strategy", strategy, "--world", str(world), "--device", "cuda", "--check", "--json",
                  "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["check"]["passed"], reply["check"]["failures"]
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    if world > torch.cuda.device_count():  # gloo staging: the copies are recorded as communication
        assert {"d2h", "h2d"} <= names


# Every other strategy and two 2-D meshes on CUDA (each passed on one H200, torch 2.11, 2026-12-04, gloo staging:
# max abs diff 5e-6 to 3e-5 against the reference, the engine's own tolerances).
@pytest.mark.multiprocess
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("args", [
    ["--strategy", "tp", "--world", "2"],
    ["--strategy", "tp", "--world", "2", "--sequence-parallel"],
    ["--strategy", "pp", "--world", "2"],
    ["--strategy", "cp", "--world", "2"],
    ["--strategy", "ep", "--world", "2"],
    ["--strategy", "cp", "--world", "2", "--arch", "mamba2"],
    ["--strategy", "fsdp", "--world", "4"],
    ["--mesh", "dp=2,tp=2", "--world", "4"],
    ["--mesh", "pp=2,tp=2", "--world", "4"],
], ids=lambda a: " ".join(a))
def test_cuda_strategies_match_the_reference(args):
    out = _engine("run", *args, "--device", "cuda", "--check", "--json")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["check"]["passed"], reply["check"]["failures"]
