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


def test_from_the_second_step_a_gradient_may_differ_by_a_share_of_its_norm():
    grads = [0.05, -0.25, 1.0, 0.75]
    ref = _state(grads, [1.0] * 4)
    off = [g + (2e-5 if i == 0 else 0.0) for i, g in enumerate(grads)]  # past 1e-5 + 1e-4 x 0.05, 1.6e-5 of the norm
    cfg = RunConfig(steps=2)
    later = compare(cfg, [ref, ref], [_snapshot(ref), _snapshot(ref, grads=off)], [1.0, 1.0])
    assert later["passed"], later["failures"]
    first = compare(cfg, [ref, ref], [_snapshot(ref, grads=off), _snapshot(ref)], [1.0, 1.0])
    assert not first["passed"]  # the first step starts from the same weights: elementwise only
    far = [g * (1 + 3 * DIVERGED_REL) for g in grads]
    assert not compare(cfg, [ref, ref], [_snapshot(ref), _snapshot(ref, grads=far)], [1.0, 1.0])["passed"]
