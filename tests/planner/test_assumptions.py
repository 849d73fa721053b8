"""What the unstated recipe is worth (planner.api.assumptions): each recipe field a case leaves null, each other
value it can take, simulated one at a time on the estimate's own layout."""

import json

import pytest

from hardware.chips import get_chip
from planner.__main__ import main
from planner.api import assumptions, estimate, step_time_band_s
from planner.case import RECIPE_CHOICES, recipe_choices
from planner.validation import HELDOUT_RUNS, attention_stated_only, load_published_runs, validate

HELD = {r["name"]: r for r in load_published_runs(HELDOUT_RUNS)}
# Megatron's weak-scaling GPT 16B on 192 H100s (tp 4, dp 48): as the unseen runs are written, every recipe
# field but the attention kernel null
UNSTATED = attention_stated_only(HELD["megatron-h100-weak-gpt16b"])


def _stated(case: dict, est, **training) -> dict:
    """The case with the estimate's chosen layout written in and `training` stated: what `assumptions` simulates."""
    out = json.loads(json.dumps(case))
    for block in ("parallel", "training"):
        out[block].update(est.chosen.get(block, {}))
    out["training"].update(training)
    return out


def test_each_null_recipe_field_gets_its_other_values_and_nothing_stated_does():
    est = estimate(UNSTATED)
    found = assumptions(UNSTATED, est)
    assert found
    null = {k for k, v in UNSTATED["training"].items() if v is None} | set(est.chosen["training"])
    for a in found:
        name = a.field.removeprefix("training.")
        assert name in RECIPE_CHOICES and name in null and name != "attention"  # attention is stated
        assert a.assumed == est.chosen["training"][name] and a.alternative != a.assumed
        assert a.base_step_time_s == est.step_time_s
        assert a.change == pytest.approx(a.step_time_s / est.step_time_s - 1)
    assert [abs(a.change) for a in found] == sorted((abs(a.change) for a in found), reverse=True)
    # every value of every field the planner took is tried (this layout runs them all)
    tried = {(a.field, a.alternative) for a in found}
    chip = get_chip("h100")
    for name, value in est.chosen["training"].items():
        for other in recipe_choices(name, chip):
            if other != value and name in RECIPE_CHOICES:
                assert (f"training.{name}", other) in tried


def test_an_alternative_is_the_estimate_of_the_case_that_states_it():
    """One definition: the alternative's step is the planner's estimate of the same case with the layout and that
    field stated."""
    est = estimate(UNSTATED)
    found = {(a.field, a.alternative): a for a in assumptions(UNSTATED, est)}
    for name, value in (("grad_reduce_overlap", False), ("fusion", "eager"), ("tp_comm_overlap", False)):
        alt = found[(f"training.{name}", value)]
        assert alt.step_time_s == pytest.approx(estimate(_stated(UNSTATED, est, **{name: value})).step_time_s,
                                                rel=1e-12)


def test_turning_an_overlap_off_never_makes_the_step_faster():
    # hiding communication under compute can only shorten a step: its exposed sync shows again without it
    found = assumptions(UNSTATED)
    overlaps = [a for a in found if a.field.endswith("_overlap") and a.alternative is False]
    assert {a.field for a in overlaps} >= {"training.grad_reduce_overlap", "training.tp_comm_overlap"}
    assert all(a.change >= 0 for a in overlaps)


def test_a_stated_field_is_not_an_assumption():
    case = json.loads(json.dumps(UNSTATED))
    case["training"]["fusion"] = "eager"
    case["training"]["grad_reduce_overlap"] = False
    fields = {a.field for a in assumptions(case)}
    assert "training.fusion" not in fields and "training.grad_reduce_overlap" not in fields
    assert "training.tp_comm_overlap" in fields


def test_a_tpu_is_offered_xla_values_only():
    chip = get_chip("tpu-v5p")
    assert recipe_choices("fsdp_impl", chip) == ("in-place",)
    assert recipe_choices("ep_dispatch", chip) == ("all_to_all",)
    assert "flash-triton" not in recipe_choices("attention", chip)
    assert "flash3" not in recipe_choices("attention", get_chip("a100-80gb"))  # no FA3-class kernel on Ampere
    assert set(recipe_choices("attention", get_chip("h100"))) == {"flash", "flash3", "flash-triton", "materialized"}
    found = assumptions(attention_stated_only(HELD["maxtext-v5p-128b-256chips"]))
    assert found and not [a for a in found if a.field == "training.fsdp_impl"]  # in-place is the only one


def test_the_band_holds_the_estimate_and_the_alternatives_that_fit():
    est = estimate(UNSTATED)
    found = assumptions(UNSTATED, est)
    lo, hi = step_time_band_s(est, found)
    fitting = [a.step_time_s for a in found if a.fits]
    assert lo == min([est.step_time_s, *fitting]) and hi == max([est.step_time_s, *fitting])
    assert lo < est.step_time_s < hi  # fused kernels and overlaps are assumed: some values are slower, some faster


def test_validation_rows_carry_the_band_and_whether_the_published_step_is_inside():
    runs = [attention_stated_only(HELD[n]) for n in ("megatron-h100-weak-gpt32b", "mtnlg-530b-a100-3360")]
    inside, outside = validate(runs, bands=True)
    assert inside.band_s[0] <= inside.published_s <= inside.band_s[1] and inside.within_band
    # MT-NLG (DeepSpeed, 2021) ran slower than any single unstated field explains
    assert outside.published_s > outside.band_s[1] and not outside.within_band
    assert validate(runs[:1])[0].band_s is None  # only on request: it simulates each alternative


def test_the_cli_estimate_carries_the_assumptions_and_the_band(tmp_path, capsys):
    path = tmp_path / "case.json"
    path.write_text(json.dumps(UNSTATED))
    assert main(["estimate", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    lo, hi = out["step_time_band_s"]
    assert lo <= out["step_time_s"] <= hi
    assert out["assumptions"] and all(set(a) == {"field", "assumed", "alternative", "step_time_s", "change", "fits"}
                                      for a in out["assumptions"])
    assert {a["field"] for a in out["assumptions"]} >= {"training.fusion", "training.grad_reduce_overlap"}


def test_what_a_chip_cannot_run_is_refused_where_stated_and_never_offered():
    # one rule (planner.case.recipe_refusal) for the case's checks and the values tried: a reviewer found a TPU case
    # stating PyTorch's FSDP accepted while the table offered only XLA's in-place, and DeepEP offered on MI300X
    from planner.models import SpecError

    assert recipe_choices("ep_dispatch", get_chip("mi300x")) == ("all_to_all",)
    case = json.loads(json.dumps(HELD["maxtext-v5p-128b-256chips"]))
    case["training"]["fsdp_impl"] = "fsdp2"
    with pytest.raises(SpecError, match="training.fsdp_impl"):
        estimate(case)


def test_a_model_without_attention_layers_has_no_attention_kernel_to_assume():
    # a reviewer's: a pure Mamba-2 model was offered three attention kernels, each "+0.0 %"
    from planner.case import Cluster
    from planner.models import SSM_PRESETS
    from planner.presets import make_case

    name = next(k for k, m in SSM_PRESETS.items() if not m.attention_layers)
    est = estimate(make_case(name, Cluster("h100", 8), 64))
    assert "attention" not in est.chosen["training"]
    assert not [a for a in assumptions(est.result.case, est) if a.field == "training.attention"]
