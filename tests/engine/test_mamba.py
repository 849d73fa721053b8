"""The Mamba-2 block (engine/mamba.py) against the exact recurrence, and every strategy that runs it
(engine/tp.py by heads, engine/ssm_cp.py's two context-parallel variants, the sharders, the pipeline, N-D
meshes with attention layers beside it) against the single-process reference over 3 steps."""

import subprocess
import sys

import pytest
import torch

from engine.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    mamba_forward_flops,
    parse_mesh,
    strategy_for,
    unit_forward_flops,
    validate,
)
from engine.launch import REPO_ROOT
from engine.mamba import causal_conv, sequential_scan, slice_decay, ssd_scan, state_output
from engine.model import LanguageModel, build_model, param_count
from engine.run import run


def _inputs(b=2, t=24, h=4, p=3, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, p, generator=g, dtype=torch.float64)
    log_a = -torch.rand(b, t, h, generator=g, dtype=torch.float64)
    bm = torch.randn(b, t, h, n, generator=g, dtype=torch.float64)
    cm = torch.randn(b, t, h, n, generator=g, dtype=torch.float64)
    return x, log_a, bm, cm


@pytest.mark.parametrize("chunk", [1, 4, 6, 24])
def test_chunked_ssd_is_the_recurrence(chunk):
    # float64: the two orders of summation agree to rounding (1e-12), whatever the chunk length
    x, log_a, b, c = _inputs()
    y_seq, h_seq = sequential_scan(x, log_a, b, c)
    y, h = ssd_scan(x, log_a, b, c, chunk)
    torch.testing.assert_close(y, y_seq, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h_seq, rtol=0, atol=1e-12)


def test_a_slice_from_zero_plus_its_incoming_state_is_the_whole_scan():
    # What state passing relies on: the scan is linear in its initial state.
    x, log_a, b, c = _inputs()
    y_all, h_all = sequential_scan(x, log_a, b, c)
    first, second = slice(0, 12), slice(12, 24)
    y1, h1 = ssd_scan(x[:, first], log_a[:, first], b[:, first], c[:, first], 4)
    y2, own = ssd_scan(x[:, second], log_a[:, second], b[:, second], c[:, second], 4)
    y2 = y2 + state_output(log_a[:, second], c[:, second], h1)
    h2 = own + slice_decay(log_a[:, second])[..., None, None] * h1
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_all, rtol=0, atol=1e-12)
    torch.testing.assert_close(h2, h_all, rtol=0, atol=1e-12)
    y_h0, _ = sequential_scan(x[:, second], log_a[:, second], b[:, second], c[:, second], h0=h1)
    torch.testing.assert_close(y2, y_h0, rtol=0, atol=1e-12)


def test_the_conv_halo_carries_the_previous_slice():
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(2, 10, 3, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    whole = causal_conv(x, w, bias)
    parts = torch.cat([causal_conv(x[:, :6], w, bias), causal_conv(x[:, 6:], w, bias, halo=x[:, 3:6])], 1)
    # fp32 rounding only: conv1d's kernel blocks the sum differently for a 10- and a 4-long input
    torch.testing.assert_close(whole, parts, rtol=0, atol=1e-6)


def test_the_calibration_times_the_mixer_the_engine_runs():
    """The calibration's Mamba-2 mixer has the engine's weights where they set the scan's magnitudes (its
    decays, steps and conv), so it meets the same floats: one left at the constructor's values, with
    uninitialised conv weights, timed its backward 3-5x slower, on denormals the engine's never makes."""
    from engine.calibrate import _mamba_mixer
    from engine.mamba import Mamba2

    m = ModelConfig(arch="mamba2")
    assert not Mamba2(m).conv_x.weight.any()  # a plain mixer's conv starts at zero, not at leftover bytes
    engine_mixer = build_model(m, seed=0).units[1].mixer
    mixer = _mamba_mixer(m)
    for name in ("A_log", "dt_bias", "D"):
        assert torch.equal(getattr(mixer, name), getattr(engine_mixer, name)), name
    for conv in ("conv_x", "conv_b", "conv_c"):  # drawn as the engine draws them: std 1 / sqrt(width)
        w = getattr(mixer, conv).weight
        assert 0.3 < w.std().item() < 0.7 and not getattr(mixer, conv).bias.any()


def test_the_model_counts_its_parameters_and_flops():
    for m in (ModelConfig(arch="mamba2"), ModelConfig(arch="hybrid"), ModelConfig(arch="hybrid", layers=4,
                                                                                     pattern="MMAM")):
        assert m.params == param_count(m)
    m = ModelConfig(arch="mamba2")
    # Hand count of one block (hidden 64, inner 128, 8 heads of 16, 4 groups of state 16, conv 4):
    # norm 64 + in_proj 64*(128+128+64+64+8) + conv (128+128)*5 + 3*8 + gated norm 128 + out_proj 128*64
    assert m.mamba_params == 64 + 64 * 392 + 256 * 5 + 24 + 128 + 128 * 64
    # FLOPs per sequence of 32: projections 2*32*(64*392 + 128*64), conv 2*32*256*4,
    # SSD per token and head 2*8*16 + 2*8*16 + 4*16*16, chunk recurrence 4 chunks * 8 heads * 2*16*16
    ssd = 32 * 8 * (256 + 256 + 1024) + 4 * 8 * 512
    assert mamba_forward_flops(m, 1) == 2 * 32 * (64 * 392 + 128 * 64) + 2 * 32 * 256 * 4 + ssd
    assert unit_forward_flops(m, 1, 3) == mamba_forward_flops(m, 3)
    # The SSD's work grows linearly with the sequence; attention's scores quadratically.
    longer = ModelConfig(arch="mamba2", seq_len=64)
    assert mamba_forward_flops(longer, 1) == 2 * mamba_forward_flops(m, 1)
    attn, attn_long = ModelConfig(), ModelConfig(seq_len=64)
    assert unit_forward_flops(attn_long, 1, 1) > 2 * unit_forward_flops(attn, 1, 1)


def test_the_layers_follow_the_pattern():
    model = LanguageModel(ModelConfig(arch="hybrid", layers=4, pattern="MMAM"))
    kinds = ["mixer" if hasattr(u, "mixer") else "attn" for u in model.units[1:-1]]
    assert kinds == ["mixer", "mixer", "attn", "mixer"]
    assert build_model(ModelConfig(arch="mamba2"), 0).units[1].mixer.D.eq(1).all()


def _cfg(arch="mamba2", mesh=None, world=2, strategy=None, micro_batches=1, model=(), **parallel) -> RunConfig:
    axes = parse_mesh(mesh) if mesh else ()
    layers = 2 * (dict(axes).get("pp", 1))
    kw = dict(model)
    return validate(RunConfig(model=ModelConfig(arch=arch, layers=kw.pop("layers", layers), **kw),
                              parallel=ParallelConfig(strategy or strategy_for(axes), mesh=axes, **parallel),
                              world=world, micro_batches=micro_batches))


CASES = {
    "dp 2": dict(strategy="dp"),
    "zero-1 2": dict(strategy="dp", zero_stage=1),
    "fsdp 4": dict(strategy="fsdp", world=4),
    "dp 3 (uneven world)": dict(strategy="dp", world=3),
    "tp 2": dict(strategy="tp"),
    "tp 4": dict(strategy="tp", world=4),
    "tp 2 sp": dict(strategy="tp", sequence_parallel=True),
    # a reviewer's: seed 0 gives out_proj a gradient element within Adam's eps of zero, whose step rounding decides
    # (engine.verify: NEAR_ZERO_GRAD, DIVERGED_REL); it failed the check, a correct layout
    "tp 2, 2 ssm groups": dict(strategy="tp", model=dict(ssm_groups=2)),
    "cp 2 state": dict(strategy="cp"),
    "cp 4 state": dict(strategy="cp", world=4),
    "cp 3 state (seq 24)": dict(strategy="cp", world=3, model=dict(seq_len=24)),
    "cp 2 alltoall": dict(strategy="cp", ssm_cp="alltoall"),
    "cp 4 alltoall": dict(strategy="cp", world=4, ssm_cp="alltoall"),
    "pp 2": dict(mesh="pp=2", micro_batches=2),
    "cp=2,tp=2 state sp": dict(mesh="cp=2,tp=2", world=4, sequence_parallel=True),
    "cp=2,tp=2 alltoall": dict(mesh="cp=2,tp=2", world=4, ssm_cp="alltoall"),
    "dp=2,cp=2 zero 3": dict(mesh="dp=2,cp=2", world=4, zero_stage=3),
    "hybrid cp 2 state": dict(arch="hybrid", strategy="cp"),
    "hybrid cp 4 state": dict(arch="hybrid", strategy="cp", world=4, model=dict(ssm_chunk=4)),
    "hybrid cp 2 alltoall": dict(arch="hybrid", strategy="cp", ssm_cp="alltoall"),
    "hybrid tp 2 sp": dict(arch="hybrid", strategy="tp", sequence_parallel=True),
    "hybrid pp=2,cp=2 1f1b": dict(arch="hybrid", mesh="pp=2,cp=2", world=4, micro_batches=2),
    "hybrid moe ep=2,cp=2": dict(arch="hybrid", mesh="ep=2,cp=2", world=4, model=dict(mlp="moe")),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_every_strategy_runs_mamba_like_the_reference(pools, case):
    cfg = _cfg(**CASES[case])
    summary, _ = run(cfg, traced=False, check=True, pool=pools(cfg.world))
    assert summary.check["passed"], summary.check["failures"]


@pytest.mark.multiprocess
def test_state_passing_is_one_hop_per_slice_boundary_and_layer(pools):
    # cp = 4, 2 Mamba layers, one step: forward, rank r < 3 sends its end state to r + 1 once per layer;
    # backward, rank r > 0 sends the state's gradient to r - 1. A state is B x H x P x N fp32.
    cfg = _cfg(strategy="cp", world=4)
    summary, timeline = run(cfg, traced=True, pool=pools(4))
    m = cfg.model
    state_bytes = cfg.micro_batch_size * m.ssm_heads * m.ssm_head_dim * m.ssm_state * 4
    for rank in range(4):
        spans = [s for s in timeline.spans if s.rank == rank and s.lane == "comm"]
        sends = [s for s in spans if s.name.startswith("send state")]
        dsends = [s for s in spans if s.name.startswith("send dstate")]
        assert len(sends) == (m.layers * cfg.steps if rank < 3 else 0)
        assert len(dsends) == (m.layers * cfg.steps if rank > 0 else 0)
        assert all(s.bytes == state_bytes and s.group == "cp" for s in sends + dsends)
        # each exchange is a wait from its posting on (posting it can hold the rank too): the wait span
        # encloses the transfer's span, which starts when the batch is posted
        waits = [s for s in timeline.spans if s.rank == rank and s.lane == "idle" and "state" in s.name]
        for x in [s for s in spans if "state" in s.name]:
            assert any(w.start_s <= x.start_s and w.step == x.step and w.name.split()[1] in x.name
                       for w in waits), x


@pytest.mark.multiprocess
def test_the_all_to_all_variant_switches_twice_per_layer_each_way(pools):
    cfg = _cfg(strategy="cp", world=2, ssm_cp="alltoall")
    _, timeline = run(cfg, traced=True, pool=pools(2))
    names = [s.name for s in timeline.spans if s.rank == 0 and s.lane == "comm" and "all_to_all" in s.name]
    per_step = 4 * cfg.model.layers  # inputs and outputs, forward and backward
    assert len(names) == per_step * cfg.steps
    assert not any("state" in s.name for s in timeline.spans)


def _bad(world=2, **kw):
    model = ModelConfig(**{k: kw.pop(k) for k in list(kw) if k in ModelConfig.__dataclass_fields__})
    return RunConfig(model=model, parallel=ParallelConfig(**kw), world=world)


@pytest.mark.parametrize("cfg, says", [
    (_bad(arch="mamba2", ssm_groups=2, strategy="tp", world=4), "ssm_groups=2 is not divisible by tp=4"),
    (_bad(arch="mamba2", ssm_groups=3), "ssm_groups=3 does not divide the 8 Mamba-2 heads"),
    (_bad(arch="mamba2", ssm_head_dim=24), "is not divisible by ssm_head_dim=24"),
    (_bad(arch="mamba2", ssm_chunk=5), "ssm_chunk=5 does not divide seq_len=32"),
    (_bad(arch="mamba2", ssm_chunk=16, strategy="cp", world=4), "ssm_chunk=16 does not divide the 8 positions"),
    (_bad(arch="mamba2", ssm_groups=2, strategy="cp", world=4, ssm_cp="alltoall"),
     "choose ssm_groups as a multiple of 4, or --ssm-cp state"),
    (_bad(arch="mamba2", mlp="moe"), "a Mamba-2 stack has no MLP"),
    (_bad(arch="mamba2", strategy="ep", mlp="dense"), "expert parallel splits the experts"),
    (_bad(arch="hybrid", pattern="MAX"), "pattern='MAX' has 'X'"),
    (_bad(arch="transformer", pattern="MA"), "needs arch='hybrid'"),
    (_bad(arch="mamba2", seq_len=8, ssm_chunk=1, strategy="cp", world=4), "shorter than the conv's reach"),
    (_bad(arch="mamba2", strategy="pp", schedule="zb-h1", layers=2), "use --schedule 1f1b or interleaved-1f1b"),
])
def test_bad_inputs_say_what_to_change(cfg, says):
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert says in str(err.value)


@pytest.mark.parametrize("argv, says", [
    (["--arch", "mamba2", "--strategy", "tp", "--world", "4", "--ssm-groups", "2"], "ssm_groups=2"),
    (["--arch", "mamba2", "--ssm-chunk", "5"], "ssm_chunk=5 does not divide"),
])
def test_cli_bad_input_exits_2_with_a_message(argv, says):
    out = subprocess.run([sys.executable, "-m", "engine", "run", *argv], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr
