"""Pure checks, no processes: config validation messages, mesh arithmetic, the alpha-beta fit."""

import dataclasses

import pytest

from core.mesh import Mesh
from engine.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, parse_mesh, validate
from hardware.this_machine import fit_alpha_beta, ring_terms


def _cfg(**kw):
    model_kw = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(ModelConfig)}}
    par_kw = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(ParallelConfig)}}
    return RunConfig(model=ModelConfig(**model_kw), parallel=ParallelConfig(**par_kw), **kw)


def test_defaults_are_valid():
    cfg = validate(RunConfig())
    assert cfg.global_batch == cfg.world * cfg.micro_batches * cfg.micro_batch_size
    assert ParallelConfig(strategy="fsdp").stage == 3 and ParallelConfig().stage == 0


@pytest.mark.parametrize("kw, says", [
    ({"hidden": 96, "heads": 5}, "hidden=96 is not divisible by heads=5"),
    ({"heads": 4, "kv_heads": 3}, "kv_heads=3"),
    ({"world": 0}, "world=0 must be between 1 and 64"),
    ({"world": 65}, "world=65 must be between 1 and 64"),
    ({"steps": 0}, "steps=0"),
    ({"micro_batches": 0}, "micro_batches=0"),
    ({"strategy": "zz"}, "strategy='zz' is not available"),
    ({"mesh": (("fsdp", 2),), "zero_stage": 0}, "drop --zero-stage 0 or name the axis dp"),
    ({"strategy": "fsdp", "zero_stage": 0}, "use --strategy dp --zero-stage 0"),
    ({"world": 4, "mesh": (("dp", 2),)}, "has 2 ranks but world=4"),
    ({"world": 4, "mesh": (("dp", 2), ("zz", 2))}, "mesh axis 'zz' is unknown"),
    ({"mlp": "moe", "top_k": 5, "experts": 4}, "top_k=5"),
    ({"device": "tpu"}, "device='tpu'"),
])
def test_impossible_configs_say_what_to_change(kw, says):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(**kw))
    assert says in str(err.value)


def test_parse_mesh():
    assert parse_mesh("dp=2,tp=2") == (("dp", 2), ("tp", 2))
    cases = [("dp", "name=degree"), ("xx=2", "unknown"), ("dp=2,dp=2", "twice"), ("", "names no axis")]
    for bad, says in cases:
        with pytest.raises(ConfigError, match=says):
            parse_mesh(bad)


def test_mesh_coordinates_and_groups_row_major():
    mesh = Mesh((("dp", 2), ("tp", 2)))
    assert [mesh.coords(r) for r in range(4)] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1},
                                                  {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert mesh.group_ranks("tp") == [[0, 1], [2, 3]]
    assert mesh.group_ranks("dp") == [[0, 2], [1, 3]]
    assert all(mesh.rank_of(mesh.coords(r)) == r for r in range(4))


def test_alpha_beta_fit_recovers_the_model():
    alpha, beta = 30e-6, 1 / 5e9
    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        ms = []
        for world in (2, 4):
            for size in (1e3, 1e5, 1e7):
                a, b = ring_terms(op, world, size)
                ms.append({"op": op, "world": world, "bytes": size, "seconds": a * alpha + b * beta})
        fit = fit_alpha_beta(ms, op)
        assert fit == pytest.approx((alpha, beta), rel=1e-6)  # exact data: only float rounding


def test_one_slow_small_message_does_not_set_the_latency():
    # the collectives page's sweep at 2 ranks, 1 KiB to 4 MiB every 4x: 300 us per step and 0.5 GB/s, but the
    # 1 KiB point 12x slow (a woken core); fitted in absolute seconds alpha had come out at 921 us
    alpha, beta = 300e-6, 1 / 0.5e9
    ms = [{"op": "all_gather", "world": 2, "bytes": size, "seconds": alpha + size / 2 * beta}
          for size in (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22)]
    ms[0]["seconds"] *= 12
    fitted_alpha, fitted_beta = fit_alpha_beta(ms, "all_gather")
    assert fitted_alpha == pytest.approx(alpha, rel=0.1) and fitted_beta == pytest.approx(beta, rel=0.1)  # 309 us


def test_alpha_beta_fit_never_negative():
    ms = [{"op": "all_reduce", "world": 4, "bytes": b, "seconds": t} for b, t in ((1e3, 5e-3), (1e6, 1e-3))]
    alpha, beta = fit_alpha_beta(ms, "all_reduce")
    assert alpha >= 0 and beta >= 0
    with pytest.raises(ValueError, match="at least two"):
        fit_alpha_beta(ms[:1], "all_reduce")
