"""engine.verify's tolerances on hand-made states: where a rounding-decided Adam step is allowed, and how the
gradients of runs whose weights already differ are compared."""

import pytest
import torch

from engine.config import RunConfig
from engine.reference import StepState
from engine.verify import (
    ADAM_FLIP_LR,
    DIVERGED_REL,
    NEAR_ZERO_GRAD,
    PARAM_ATOL_LR,
    compare,
    flips,
    param_atol_by_element,
)

LR = RunConfig().lr


def _state(grads, params) -> StepState:
    g, p = torch.tensor(grads, dtype=torch.float32), torch.tensor(params, dtype=torch.float32)
    return StepState(loss=1.0, grads={"w": g}, params={"w": p}, exp_avg={"w": 0.1 * g}, exp_avg_sq={"w": 0.05 * g * g})


def _snapshot(state: StepState, **changed) -> dict:
    out = {q: {"w": getattr(state, q)["w"].clone()} for q in ("grads", "params", "exp_avg", "exp_avg_sq")}
    for q, t in changed.items():
        out[q]["w"] = torch.tensor(t, dtype=torch.float32)
    return out


def test_a_near_zero_gradient_may_flip_its_adam_step_and_no_other_may():
    grads = [1e-9, 0.5]  # the first below NEAR_ZERO_GRAD in both runs: rounding decides its step's sign
    assert grads[0] < NEAR_ZERO_GRAD
    ref = _state(grads, [1.0, 1.0])
    flipped = flips(ref.exp_avg_sq["w"], ref.exp_avg_sq["w"], 1)
    assert flipped.tolist() == [True, False]
    assert param_atol_by_element(LR, [flipped]).tolist() == pytest.approx([ADAM_FLIP_LR * LR, PARAM_ATOL_LR * LR])
    cfg = RunConfig(steps=1)
    ok = compare(cfg, [ref], [_snapshot(ref, params=[1.0 + 1.5 * LR, 1.0])], [1.0])
    assert ok["passed"], ok["failures"]
    moved = compare(cfg, [ref], [_snapshot(ref, params=[1.0, 1.0 + 0.5 * LR])], [1.0])
    assert not moved["passed"] and "params" in moved["failures"][0]


def test_a_gradient_leaked_into_a_weight_whose_true_gradient_is_zero_is_caught():
    # a reviewer's case: a sharding bug leaks 5e-6 (within the gradients' atol) into an element whose reference
    # gradient is 0, and Adam turns it into a full lr step; the run's own Adam scale is not near zero, so the
    # strict bound holds
    ref = _state([0.0, 0.5], [1.0, 1.0])
    leaked = [5e-6, 0.5]
    run = _snapshot(ref, grads=leaked, exp_avg=[0.1 * g for g in leaked], exp_avg_sq=[0.05 * g * g for g in leaked],
                    params=[1.0 - LR, 1.0])
    result = compare(RunConfig(steps=1), [ref], [run], [1.0])
    assert not result["passed"] and any("params" in f for f in result["failures"])


def test_after_a_rounding_decided_adam_step_a_gradient_may_differ_by_a_share_of_its_norm():
    # the first element's gradient is near zero in both runs (Adam's scale under NEAR_ZERO_GRAD): its step's sign
    # is rounding's, the runs' weights differ from then on, and the next step's gradients by their sensitivity
    grads = [1e-9, 0.05, 1.0, 0.75]
    ref = _state(grads, [1.0] * 4)
    assert flips(ref.exp_avg_sq["w"], ref.exp_avg_sq["w"], 1).any()
    off = [g + (2e-5 if i == 1 else 0.0) for i, g in enumerate(grads)]  # past 1e-5 + 1e-4 x 0.05, 1.6e-5 of the norm
    cfg = RunConfig(steps=2)
    moved = [1.0 + 1.5 * LR, 1.0, 1.0, 1.0]  # the flip moved that weight the other way
    flipped = _snapshot(ref, params=moved)
    later = compare(cfg, [ref, ref], [flipped, _snapshot(ref, grads=off, params=moved)],
                    [1.0, 1.0])
    assert later["passed"], later["failures"]
    first = compare(cfg, [ref, ref], [_snapshot(ref, grads=off), _snapshot(ref)], [1.0, 1.0])
    assert not first["passed"]  # the first step starts from the same weights: elementwise
    # the same rounding-level weights without a flip's move: the strict bounds stay
    assert not compare(cfg, [ref, ref], [_snapshot(ref), _snapshot(ref, grads=off)], [1.0, 1.0])["passed"]
    far = [g * (1 + 3 * DIVERGED_REL) for g in grads]
    assert not compare(cfg, [ref, ref], [flipped, _snapshot(ref, grads=far, params=moved)],
                       [1.0, 1.0])["passed"]


def test_without_a_rounding_decided_step_later_gradients_keep_the_first_steps_bounds():
    # a reviewer's case: every gradient 5e-4 too large from the second step passed the norm-only 1e-3 bound
    grads = [0.05, -0.25, 1.0, 0.75]
    ref = _state(grads, [1.0] * 4)
    assert not flips(ref.exp_avg_sq["w"], ref.exp_avg_sq["w"], 1).any()
    scaled = [g * (1 + 5e-4) for g in grads]
    result = compare(RunConfig(steps=2), [ref, ref], [_snapshot(ref), _snapshot(ref, grads=scaled)], [1.0, 1.0])
    assert not result["passed"] and "step 1 w: grads differs" in result["failures"][0], result["failures"]


def test_a_real_models_later_gradients_off_by_5e_4_fail():
    # a reviewer's case on the engine's own model: embedding rows of tokens absent from the batch have an Adam scale
    # of zero in both runs (no step at all), and a `flips` count had switched every run to the norm-only bound at
    # step 2, where every gradient 5e-4 too large passed
    from engine.reference import reference_run

    cfg = RunConfig(world=2, steps=2)
    ref = reference_run(cfg)
    run = [{q: {n: t.clone() for n, t in getattr(s, q).items()} for q in ("grads", "params", "exp_avg", "exp_avg_sq")}
           for s in ref]
    assert compare(cfg, ref, run, [s.loss for s in ref])["passed"]
    run[1]["grads"] = {n: t * (1 + 5e-4) for n, t in run[1]["grads"].items()}
    result = compare(cfg, ref, run, [s.loss for s in ref])
    assert not result["passed"] and all(f.startswith("step 1 ") for f in result["failures"])


def test_a_layout_that_repeats_the_references_arithmetic_is_compared_bit_for_bit():
    from engine.config import ParallelConfig
    from engine.reference import reproduces_reference

    pp = RunConfig(world=2, steps=1, parallel=ParallelConfig("pp", mesh=(("pp", 2),)))
    assert reproduces_reference(pp) and reproduces_reference(RunConfig(world=1, steps=1))
    assert not reproduces_reference(RunConfig(world=2)) and not reproduces_reference(RunConfig(world=1, device="cuda"))
    ref = _state([0.05, -0.25], [1.0, 1.0])
    same = compare(pp, [ref], [_snapshot(ref)], [1.0])
    assert same["passed"] and same["exact"] and same["tolerances"]["grads"]["rtol"] == 0
    # one float32 ulp on one weight, far inside the tolerances of a layout that does not repeat the arithmetic
    nudged = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    result = compare(pp, [ref], [_snapshot(ref, params=[nudged, 1.0])], [1.0])
    assert not result["passed"] and "bit for bit" in result["failures"][0]
    assert compare(RunConfig(steps=1), [ref], [_snapshot(ref, params=[nudged, 1.0])], [1.0])["passed"]
    assert not compare(pp, [ref], [_snapshot(ref)], [1.0 + 1e-12])["passed"]  # the loss too, in float64


def test_a_tensor_of_another_shape_fails_even_where_the_values_would_broadcast():
    ref = StepState(loss=1.0, grads={"w": torch.zeros(4, 8)}, params={"w": torch.ones(4, 8)},
                    exp_avg={"w": torch.zeros(4, 8)}, exp_avg_sq={"w": torch.zeros(4, 8)})
    run = {"grads": {"w": torch.zeros(1)}, "params": {"w": torch.ones(4, 8)}, "exp_avg": {"w": torch.zeros(8)},
           "exp_avg_sq": {"w": torch.zeros(4, 8)}}
    result = compare(RunConfig(steps=1), [ref], [run], [1.0])
    assert not result["passed"]
    assert result["failures"] == ["step 0 w: grads has shape [1], the reference's [4, 8]",
                                  "step 0 w: exp_avg has shape [8], the reference's [4, 8]"]


def test_bf16_gradients_of_dense_tensors_get_a_tighter_bound_than_mamba_2s():
    from engine.verify import bf16_grads_bound

    cfg = RunConfig(steps=1, dtype="bfloat16")
    grads = [0.05, -0.25, 1.0, 0.75]
    for name, off, passes in (("toy.mlp.w1", 0.04, False), ("toy.mlp.w1", 0.01, True),
                              ("toy.mixer.A_log", 0.05, True), ("toy.mixer.A_log", 0.12, False)):
        ref = StepState(loss=1.0, grads={name: torch.tensor(grads)}, params={name: torch.ones(4)},
                        exp_avg={name: torch.zeros(4)}, exp_avg_sq={name: torch.zeros(4)})
        run = {"grads": {name: torch.tensor([g * (1 + off) for g in grads])}, "params": {name: torch.ones(4)},
               "exp_avg": {name: torch.zeros(4)}, "exp_avg_sq": {name: torch.zeros(4)}}
        result = compare(cfg, [ref], [run], [1.0])
        assert result["passed"] == passes, (name, off, result["failures"])
    assert bf16_grads_bound("units.2.mixer.conv_x.weight") == 0.1 and bf16_grads_bound("units.2.attn.wq.weight") == 0.03


def test_a_replica_that_differs_from_its_stage_fails_the_check():
    from engine.verify import replica_failures

    same = {("params", "w"): "aa", ("grads", "w"): "bb"}
    other = {("params", "w"): "ab", ("grads", "w"): "bb"}
    # ranks 0 and 1 hold stage 0, rank 2 and 3 stage 1; one step
    reports = [(0, [same], [[]]), (0, [other], [[]]), (1, [other], [[]]), (1, [other], [["params wk"]])]
    failures = replica_failures(reports)
    assert failures == [
        "step 0 w: rank 1's gathered params differs from rank 0's, a replica of the same pipeline stage "
        "(replicas must agree bit for bit)",
        "step 0 params wk: the copies of this tensor on rank 3 differ (every copy must agree bit for bit)"]
    assert not compare(RunConfig(steps=1), [], [], [], failures)["passed"]
    # a replica that gathered fewer tensors than the one compared, or more
    fewer = replica_failures([(0, [same], [[]]), (0, [{("params", "w"): "aa"}], [[]])])
    assert fewer == ["step 0 w: rank 1 gathered no grads of it, rank 0 did, a replica of the same pipeline stage "
                     "(replicas must agree bit for bit)"]
    assert replica_failures([(0, [{("params", "w"): "aa"}], [[]]), (0, [same], [[]])])


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, mesh, rank, found", [
    (2, "dp=2", 1, "rank 1's gathered params differs from rank 0's"),
    (4, "dp=2,tp=2", 3, "rank 2's gathered params differs from rank 0's"),
    # tp = 4 > kv_heads = 2: ranks 0 and 1 hold copies of one KV head, kept once when the state is gathered
    (4, "tp=4", 1, "params units.1.attn.wk.weight: the copies of this tensor on rank"),
])
def test_a_rank_that_drifts_from_its_replicas_is_caught(pools, world, mesh, rank, found):
    """Only one rank per pipeline stage is compared with the reference: a replica stepping with 3x the learning
    rate had passed (a reviewer's case), as had one skipping the last step."""
    from engine.cli import config_from_args, run_parser

    cfg = config_from_args(run_parser("x").parse_args(["--mesh", mesh, "--world", str(world), "--steps", "1"]
                                                      + (["--kv-heads", "2"] if mesh == "tp=4" else [])))
    results = pools(world).run("tests.engine.pool_tasks:train_with_one_rank_off", {"cfg": cfg, "rank": rank},
                               timeout_s=120)
    check = results[0]["check"]
    assert not check["passed"]
    assert any(found in f for f in check["failures"]), check["failures"]


def test_a_gradient_below_every_absolute_floor_is_still_compared_in_norm():
    """Mamba-2's A_log gradients are all below the gradients' atol: at half their size they had passed."""
    grads = [4e-6, -7e-6, 2e-6]
    ref = _state(grads, [1.0, 1.0, 1.0])
    half = [g / 2 for g in grads]
    result = compare(RunConfig(steps=1), [ref], [_snapshot(ref, grads=half)], [1.0])
    assert not result["passed"] and "grads differs" in result["failures"][0]
    rounding = [g * (1 + 1e-6) for g in grads]
    assert compare(RunConfig(steps=1), [ref], [_snapshot(ref, grads=rounding)], [1.0])["passed"]


@pytest.mark.multiprocess
def test_bf16_weights_that_never_move_fail_the_check(pools):
    """bf16's elementwise params bound (2 lr a step) is more than one Adam step: weights that were never written
    back had passed after one step (a reviewer's case). The move since initialisation is compared too."""
    from engine.cli import config_from_args, run_parser

    cfg = config_from_args(run_parser("x").parse_args(["--strategy", "dp", "--world", "2", "--steps", "1",
                                                       "--dtype", "bfloat16"]))
    check = pools(2).run("tests.engine.pool_tasks:train_with_weights_never_written", {"cfg": cfg},
                         timeout_s=120)[0]["check"]
    assert not check["passed"]
    assert any("move since initialised" in f for f in check["failures"]), check["failures"]
