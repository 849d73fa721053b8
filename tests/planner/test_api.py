"""The pure-function API the pages use, and the no-torch rule."""

import subprocess
import sys

import pytest

import planner


def test_planner_never_imports_torch():
    code = ("import sys, planner; "
            "planner.estimate(planner.make_case('Llama 3 8B', '8x H100 (one node)')).timeline; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_estimate_from_objects_has_everything_a_page_needs():
    case = planner.make_case("Llama 3 70B", "1,024x H100 (128 nodes)",
                             parallel=planner.Parallel(tp=8, pp=4, cp=1))
    est = planner.estimate(case)
    assert est.layout.tp == 8 and est.layout.pp == 4
    assert est.chosen["parallel"]["dp"] == 32
    mem = est.memory.as_dict()
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    assert est.fits and "h100" in est.fits_on
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    assert 0 < est.mfu <= est.hfu < 1
    tl = est.timeline
    assert tl.source == "predicted" and len(tl.ranks) == 4
    assert tl.end_s == pytest.approx(est.step_time_s, rel=0.03)


def test_fixed_zero_and_recompute_are_respected():
    case = planner.make_case("Llama 3 8B", "8x H100 (one node)", zero_stage=1, recompute="full",
                             micro_batch=2)
    lay = planner.estimate(case).layout
    assert (lay.zero_stage, lay.recompute, lay.micro_batch) == (1, "full", 2)


def test_estimate_explains_itself():
    est = planner.estimate(planner.make_case("Mixtral 8x7B", "1,024x H100 (128 nodes)"))
    words = " ".join(est.explanation)
    assert f"EP={est.layout.ep}" in words and "MFU" in words
