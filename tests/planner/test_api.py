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


def test_the_closing_sentence_gives_model_tflops_and_the_executed_rate_apart():
    # the figure beside MFU is the page's metric (model FLOPs); recomputation's repeated FLOPs are named apart
    plain = planner.estimate(planner.make_case("Llama 3 8B", "8x H100 (one node)", recompute="none"))
    assert plain.explanation[-1] == (f"MFU {100 * plain.mfu:.1f}%, {plain.model_tflops_per_chip:.0f} model TFLOP/s "
                                     "per chip.")
    full = planner.estimate(planner.make_case("Llama 3 8B", "8x H100 (one node)", recompute="full"))
    assert full.tflops_per_chip > full.model_tflops_per_chip + 1
    assert full.explanation[-1].endswith(f"({full.tflops_per_chip:.0f} executed, recomputation included).")


def test_compute_by_class_is_one_chips_step_class_by_class():
    from planner.api import compute_by_class
    from planner.case import Cluster, Parallel
    from planner.models import SpecError

    def one_chip(global_batch, **training):
        return planner.make_case("Llama 3 8B", Cluster("h100", 1), global_batch=global_batch, micro_batch=1,
                                 recompute="none", zero_stage=0, parallel=Parallel(dp=1, tp=1, pp=1, cp=1, ep=1),
                                 **training)

    classes, est = compute_by_class(one_chip(2)), planner.estimate(one_chip(2))
    # one chip, no communication: the classes are the whole step
    assert sum(classes.values()) == pytest.approx(est.step_time_s, rel=1e-9)
    assert classes["gemm"] > classes["attention"] > 0 and classes["ssm scan"] == 0
    # two micro-batches: every class of the passes twice one micro-batch's, the optimizer once
    half = compute_by_class(one_chip(1))
    for cls in ("gemm", "attention", "memory-bound"):
        assert classes[cls] == pytest.approx(2 * half[cls])
    assert classes["optimizer"] == pytest.approx(half["optimizer"], rel=1e-12)  # the same update (float sums)
    # gradient accumulation without its fusion: an elementwise pass, memory-bound, and still the whole step
    unfused = one_chip(4, grad_accum_fusion=False)
    split, est = compute_by_class(unfused), planner.estimate(unfused)
    assert sum(split.values()) == pytest.approx(est.step_time_s, rel=1e-9)
    assert split["memory-bound"] > compute_by_class(one_chip(4))["memory-bound"]
    assert split["gemm"] == pytest.approx(compute_by_class(one_chip(4))["gemm"])
    with pytest.raises(SpecError, match="one chip"):
        compute_by_class(planner.make_case("Llama 3 70B", "1,024x H100 (128 nodes)", parallel=Parallel(tp=8, pp=4)))


def test_compute_by_class_has_the_scan_of_mamba():
    from planner.api import compute_by_class
    from planner.case import Cluster, Parallel

    mamba = compute_by_class(planner.make_case("Mamba-2 2.7B", Cluster("h100", 1), global_batch=1, micro_batch=1,
                                               parallel=Parallel(dp=1, tp=1, pp=1, cp=1, ep=1)))
    assert mamba["ssm scan"] > 0 and mamba["attention"] == 0


def test_the_explanation_names_narrow_heads_and_sliding_windows():
    import json

    from planner.validation import HELDOUT_RUNS, load_published_runs

    run = next(r for r in load_published_runs(HELDOUT_RUNS) if r["name"].startswith("nemo2602-gptoss"))
    words = " ".join(planner.estimate(run).explanation)
    # gpt-oss: heads 64 wide (cuDNN at 82 % of its head-dim-128 rate on H100), 18 of 36 layers windowed at 128
    assert "Attention heads are 64 wide" in words and "82%" in words
    assert "18 of the 36 attention layers attend within a sliding window of 128 tokens" in words
    assert "only that band" in words
    scored = json.loads(json.dumps(run))
    scored["training"]["attention"] = "materialized"
    words = " ".join(planner.estimate(scored).explanation)
    assert "the window saves nothing here" in words and "64 wide" not in words  # no flash kernel, no head-dim rate
