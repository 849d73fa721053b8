"""Tensor and sequence parallel (engine/tp.py) against the single-process reference over 3 optimizer
steps at world 2 and 4, alone and inside data parallel / FSDP meshes; the bytes each rank sends against
`tp_comm_bytes`; sequence parallel moving the same bytes as plain TP with less activation memory; bad
inputs."""

import subprocess
import sys

import pytest
import torch

from engine.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, validate
from engine.launch import REPO_ROOT
from engine.reference import reference_run
from engine.run import assemble
from engine.tp import tp_comm_bytes
from hardware.collectives import ring_sent_bytes

LR = RunConfig.lr
# quantity -> (rtol, atol, why); measured values from this model at world 2 and 4
TOLERANCES = {
    "loss": (1e-6, 0.0, "vocab-parallel cross entropy adds per-slice max/sum-exp where F.cross_entropy takes "
                        "one log-softmax: fp32 rounding only (measured 9e-8 relative)"),
    "grads step 1": (1e-5, 2e-7, "same weights on both sides: a row-parallel all-reduce adds the tp partial "
                                 "products of a matmul in another order than one BLAS call (measured 3e-8)"),
    "grads": (1e-4, 1e-6, "from step 2 on the weights differ (see params), so the gradients do too "
                          "(measured 2.5e-7)"),
    "params": (0.0, 0.05 * LR, "Adam moves a weight by about lr whatever its gradient's size, so a "
                               "rounding-level difference on a near-zero gradient moves it by a fraction of "
                               "lr (measured 0.012 lr)"),
}

CASES = {  # name -> (world, ParallelConfig)
    "tp world 2": (2, ParallelConfig("tp")),
    "tp world 4 (kv heads replicated)": (4, ParallelConfig("tp")),
    "tp+sp world 2": (2, ParallelConfig("tp", sequence_parallel=True)),
    "tp+sp world 4": (4, ParallelConfig("tp", sequence_parallel=True)),
    "dp=2,tp=2": (4, ParallelConfig(mesh=(("dp", 2), ("tp", 2)))),
    "fsdp=2,tp=2": (4, ParallelConfig(mesh=(("fsdp", 2), ("tp", 2)))),
}


def _cfg(world, parallel, steps=3):
    # generous wall-clock limit: several helpers share two cores
    return RunConfig(parallel=parallel, world=world, steps=steps, timeout_s=240)


def _run(pool, cfg, traced=False, return_states=False, check=False):
    results = pool.run("engine.train:run_rank", {"cfg": cfg, "traced": traced, "check": check,
                                                 "return_states": return_states}, timeout_s=cfg.timeout_s)
    return results, *assemble(cfg, results)


def _close(quantity, a, b, where):
    rtol, atol, why = TOLERANCES[quantity]
    assert torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol), \
        f"{where}: {quantity} differs by {(a - b).abs().max().item():.3g} (allowed: {why})"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(pools, case):
    world, parallel = CASES[case]
    cfg = _cfg(world, parallel)
    results, summary, _ = _run(pools(world), cfg, return_states=True, check=True)
    assert summary.check["passed"], summary.check["failures"]  # the engine's own comparison
    reference = reference_run(cfg)
    for step, (ref, state) in enumerate(zip(reference, results[0]["states"], strict=True)):
        _close("loss", torch.tensor(summary.loss[step]), torch.tensor(ref.loss), f"step {step}")
        assert state["grads"].keys() == ref.grads.keys()  # shards gathered back to the full names
        for name, t in ref.grads.items():
            _close("grads step 1" if step == 0 else "grads", state["grads"][name], t, f"step {step} {name}")
            _close("params", state["params"][name], ref.params[name], f"step {step} {name}")


def _tp_local_numel(m: ModelConfig, tp: int) -> list[int]:
    """Parameters per unit on one tp rank: embed, blocks, head (KV heads replicated when tp > kv_heads)."""
    h, d = m.hidden, m.head_dim
    kv_local = max(1, m.kv_heads // tp)
    block = 2 * h + 2 * (m.heads // tp) * d * h + 2 * kv_local * d * h + 3 * h * m.ffn // tp
    return [m.vocab // tp * h, *[block] * m.layers, h + m.vocab // tp * h]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_follow_the_formula(pools, world):
    # Per micro-batch (A = b*s*h*4 bytes, ring all-reduce = 2 (n-1)/n A): 4 L all-reduces of A in the
    # blocks + 1 for the embedding (forward) + 1 for the output layer's input (backward) + the loss's
    # all-reduces of 3 b*s floats, + at world 4 (tp > kv_heads = 2) the replicated wk/wv gradients.
    # Sequence parallel swaps each all-reduce of A for an all-gather + a reduce-scatter (same bytes) and
    # adds the RMSNorm weight gradients' all-reduce, (2 L + 1) x h floats.
    tp_cfg, sp_cfg = (_cfg(world, ParallelConfig("tp", sequence_parallel=sp), steps=1)
                      for sp in (False, True))
    m = tp_cfg.model
    a = 2 * m.seq_len * m.hidden * 4
    expect = ((4 * m.layers + 2) * ring_sent_bytes("all_reduce", a, world)
              + ring_sent_bytes("all_reduce", 2 * m.seq_len * 4, world)
              + ring_sent_bytes("all_reduce", 4 * m.seq_len * 4, world)
              + (2 * m.layers * ring_sent_bytes("all_reduce", m.kv_heads * m.head_dim * m.hidden * 4, world)
                 if world > m.kv_heads else 0))
    assert sum(tp_comm_bytes(tp_cfg).values()) == expect
    norms = (2 * m.layers + 1) * ring_sent_bytes("all_reduce", m.hidden * 4, world)
    assert sum(tp_comm_bytes(sp_cfg).values()) == expect + norms

    _, tp, tp_timeline = _run(pools(world), tp_cfg, traced=True)
    _, sp, sp_timeline = _run(pools(world), sp_cfg, traced=True)
    assert tp.comm_bytes == [expect] * world
    assert sp.comm_bytes == [expect + norms] * world

    def activation_bytes(timeline, op=None):  # everything but the norm-weight gradients
        return sum(s.bytes for s in timeline.for_rank(0) if s.lane == "comm" and "norm" not in s.name
                   and (op is None or s.name.startswith(op)))

    assert activation_bytes(sp_timeline) == activation_bytes(tp_timeline)
    # the all-gathers and reduce-scatters on the tp group are exactly the all-reduces of A they replace
    assert activation_bytes(sp_timeline, "all_gather") == activation_bytes(sp_timeline, "reduce_scatter") \
        == (4 * m.layers + 2) * ring_sent_bytes("all_reduce", a, world) // 2
    assert all(s.group == "tp" for s in sp_timeline.spans if s.lane == "comm")
    # sequence parallel stores the norms' and residuals' activations for S/tp positions only
    for tp_mem, sp_mem in zip(tp.memory_bytes, sp.memory_bytes, strict=True):
        assert sp_mem["activations_peak"] < tp_mem["activations_peak"]
        assert sp_mem["params"] == tp_mem["params"] == 4 * sum(_tp_local_numel(m, world))


@pytest.mark.multiprocess
def test_meshes_add_dp_and_fsdp_traffic_on_tp_local_parameters(pools):
    # dp=2,tp=2: bucketed all-reduce over dp of the tp-local gradients (ring, n = 2: their bytes once).
    # fsdp=2,tp=2: per step, the tp-local flat units (padded to 2 shards) are gathered for forward, again
    # for backward except the head, and their gradients reduce-scattered: (n-1)/n of 4 bytes each.
    m = ModelConfig()
    units = _tp_local_numel(m, 2)
    tp_bytes = sum(tp_comm_bytes(_cfg(2, ParallelConfig("tp"))).values())
    _, dp, _ = _run(pools(4), _cfg(4, CASES["dp=2,tp=2"][1], steps=1))
    assert dp.comm_bytes == [tp_bytes + 4 * sum(units)] * 4
    padded = [-(-n // 2) * 2 for n in units]
    _, fsdp, _ = _run(pools(4), _cfg(4, CASES["fsdp=2,tp=2"][1], steps=1))
    assert fsdp.comm_bytes == [tp_bytes + 4 * (3 * sum(padded) - padded[-1]) // 2] * 4
    assert all(mem["params"] == 4 * sum(padded) // 2 for mem in fsdp.memory_bytes)


def _bad(world=4, **kw):
    model = ModelConfig(**{k: kw.pop(k) for k in list(kw) if k in ModelConfig.__dataclass_fields__})
    return RunConfig(model=model, parallel=ParallelConfig(**kw), world=world)


@pytest.mark.parametrize("cfg, says", [
    (_bad(hidden=96, heads=6, kv_heads=3, strategy="tp"),
     "heads=6 is not divisible by tp=4: each rank computes heads/tp attention heads; use tp in {1, 3, 6}"),
    (_bad(world=2, hidden=96, heads=12, kv_heads=3, strategy="tp"),
     "kv_heads=3 is not divisible by tp=2 (nor tp by kv_heads): use tp in {1, 3, 6, 12}"),
    (_bad(ffn=130, strategy="tp"), "ffn=130 is not divisible by tp=4"),
    (_bad(vocab=258, strategy="tp"), "vocab=258 is not divisible by tp=4"),
    (_bad(seq_len=30, strategy="tp", sequence_parallel=True), "seq_len=30 is not divisible by tp*cp=4"),
    (_bad(strategy="dp", sequence_parallel=True), "--sequence-parallel"),
    (_bad(strategy="tp", mesh=(("dp", 4),)), "--strategy tp needs a tp axis"),
])
def test_bad_inputs_say_what_to_change(cfg, says):
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert says in str(err.value)


def test_cli_bad_input_exits_2_with_a_message():
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--strategy", "tp", "--world", "4",
                          "--kv-heads", "4", "--heads", "4", "--ffn", "130"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "ffn=130 is not divisible by tp=4" in out.stderr and "Traceback" not in out.stderr
