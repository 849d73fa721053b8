"""The search against brute force on small cases, and its answer for Llama 3 405B on 16,384 H100s."""

import itertools
import json
from pathlib import Path

import pytest

from hardware.chips import get_chip
from planner import layout_search
from planner.api import estimate
from planner.case import MAX_NUM_CHIPS, Layout, layout_tp_ok, parse_case, recipe
from planner.costs import cluster_chip
from planner.layout_search import divisors, micro_batch_sizes, search
from planner.memory import memory_per_chip
from planner.models import MODEL_PRESETS, SpecError
from planner.simulate import simulate, usable_hbm_bytes

CASES = Path(__file__).resolve().parents[2] / "planner" / "cases"


def _free_case(model: dict, chips: int, batch: int, chip: str = "a100-80gb", node: int = 8) -> dict:
    return {"name": "bf", "model": model,
            "training": {"global_batch": batch, "dtype": "bf16", "optimizer": "adam"},
            "parallel": {}, "cluster": {"chip": chip, "num_chips": chips, "chips_per_node": node}}


def _brute_force_best(case) -> float:
    """Every layout of the space with no dominance rule: all ZeRO stages, recompute levels, SP on/off,
    GPipe too; only divisibility, the TP-in-a-node rule and memory filter."""
    m, t, n = case.model, case.training, case.cluster.num_chips
    chip = cluster_chip(get_chip(case.cluster.chip), n, case.cluster.chips_per_node)  # as the planner wires it
    hbm = usable_hbm_bytes(chip)
    how = recipe(t, chip, m)
    best = float("inf")
    for tp, cp, pp in itertools.product(divisors(n), repeat=3):
        if n % (tp * cp * pp) or tp > case.cluster.chips_per_node or not layout_tp_ok(m, tp):
            continue
        dp = n // (tp * cp * pp)
        if m.seq_len % cp or pp > m.layers or t.global_batch % dp:
            continue
        eps = [e for e in divisors(dp) if m.experts % e == 0] if m.is_moe else [1]
        for ep, b in itertools.product(eps, micro_batch_sizes(t.global_batch // dp, pp)):
            mb = t.global_batch // (dp * b)
            scheds = [("1f1b", 1)]
            if pp > 1:
                scheds += [("gpipe", 1)] + [("zb-h1", 1)] * (mb >= pp)
                vs = [v for v in divisors(m.layers // pp) if v >= 2 and mb % pp == 0]
                scheds += [("interleaved-1f1b", v) for v in vs]
            variants = itertools.product(scheds, range(4), layout_search.recompute_order(m, chip), (False, True))
            for (sched, v), z, rc, sp in variants:
                if (sp and tp == 1) or (rc == "selective" and how["attention"] != "materialized"):
                    continue
                lay = Layout(dp, tp, pp, cp, ep, sched, v, b, z, rc, sp, **how)
                if memory_per_chip(m, lay, mb, t.optimizer, t.dtype).total_bytes > hbm:
                    continue
                best = min(best, simulate(case, lay, chip).step_time_s)
    return best


SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "mlp")
SMALL_DENSE = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 2816, "vocab": 32000,
               "seq_len": 2048, "mlp": "swiglu"}
SMALL_GPT = {"layers": 12, "hidden": 2048, "heads": 16, "kv_heads": 16, "ffn": 8192, "vocab": 50257,
             "seq_len": 1024, "mlp": "gelu"}
# long sequences on 16 GB chips: at dp 1, tp 2, cp 2 without ZeRO-3 only a recomputation fits
LONG_DENSE = {"layers": 8, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000,
              "seq_len": 16384, "mlp": "swiglu"}
SMALL_MOE = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn": 1024, "vocab": 32000,
             "seq_len": 1024, "mlp": "swiglu", "experts": 8, "top_k": 2}


@pytest.mark.parametrize("model, chips, batch, chip", [
    (SMALL_DENSE, 16, 32, "a100-80gb"),
    (SMALL_GPT, 8, 16, "h100"),
    (SMALL_MOE, 8, 16, "h100"),
    (LONG_DENSE, 4, 4, "tpu-v5e"),
])
def test_search_matches_brute_force(model, chips, batch, chip):
    case = parse_case(_free_case(model, chips, batch, chip))
    res = search(case)
    assert res.ranked, "something must fit"
    assert res.ranked[0].step_time_s == pytest.approx(_brute_force_best(case), rel=1e-12)


def test_divisors_by_their_prime_factors():
    for n in range(1, 2000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(10**15) == sorted(2**i * 5**j for i in range(16) for j in range(16))
    assert divisors(2 * 999_999_937) == [1, 2, 999_999_937, 2 * 999_999_937]  # a large prime factor
    assert divisors(360, up_to=10) == [1, 2, 3, 4, 5, 6, 8, 9, 10]


def test_a_huge_chip_count_is_searched_without_walking_its_divisors(monkeypatch):
    # a fuzzed case file with 10^15 chips kept the search walking divisors for minutes: each mesh degree's
    # candidates are the divisors under its own cap (tp: the node, cp: the sequence, pp: the layers)
    walked = []

    def counting(n, up_to=None):
        walked.append(min(n, up_to) if up_to else n)
        return divisors(n, up_to)

    monkeypatch.setattr(layout_search, "divisors", counting)
    case = json.loads((CASES / "llama3-405b-16k-h100.json").read_text())
    case["cluster"]["num_chips"] = MAX_NUM_CHIPS - 3  # a prime near the most a case may state
    case["cluster"]["chips_per_node"] = None  # (8 would not divide it: a message of its own)
    with pytest.raises(SpecError, match="no layout"):
        estimate(case)
    assert walked and max(walked) <= case["model"]["seq_len"]
    case["cluster"]["num_chips"] = 10**15  # a mistyped count is refused before any search
    with pytest.raises(SpecError, match="cluster.num_chips"):
        estimate(case)


def test_a_huge_prime_tpu_chip_count_is_answered_at_once():
    # a TPU job's slices were found by trying every count from 1 to num_chips: a prime near 10^12 ran for hours
    from planner.costs import tpu_slices

    chip = get_chip("tpu-v5p")
    assert tpu_slices(chip, 16_777_213) == 16_777_213  # prime: slices of one chip each
    assert tpu_slices(chip, 6144 * 4) == 4  # whole pods


def test_search_respects_fixed_fields():
    raw = _free_case(SMALL_DENSE, 16, 32)
    raw["parallel"] = {"tp": 2, "pp": 2}
    raw["training"]["micro_batch"] = 2
    res = search(parse_case(raw))
    assert all(r.layout.tp == 2 and r.layout.pp == 2 and r.layout.micro_batch == 2 for r in res.ranked)


def test_memory_pruning_drops_what_does_not_fit():
    # 70B on 8 GPUs without ZeRO-3 or PP cannot hold 16 bytes/param (1.1 TB)
    m = MODEL_PRESETS["Llama 3 70B"]
    model = {k: getattr(m, k) for k in SHAPE}
    res = search(parse_case(_free_case(model, 8, 8, "h100")))
    assert all(r.fits for r in res.ranked)
    assert all(r.layout.pp > 1 or r.layout.zero_stage == 3 for r in res.ranked)


def test_llama3_405b_on_16k_h100_returns_ranked_explained_layouts(capsys):
    from planner.__main__ import main
    assert main(["search", str(CASES / "llama3-405b-16k-h100.json"), "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_chips"] == 16384 and len(out["layouts"]) == 3
    best, second = out["layouts"][0], out["layouts"][1]
    assert best["layout"]["pp"] > 1 or best["layout"]["zero_stage"] == 3  # 405B cannot sit whole on 80 GB
    assert 0.2 < best["mfu"] < 0.7
    assert any(line.startswith("TP=") or line.startswith("No TP") for line in best["explanation"])
    assert "slower than the best" in second["explanation"][0]


@pytest.mark.parametrize("name", ["mixtral-256-h100.json", "llama3-8b-v5p-64.json"])
def test_example_cases_estimate(name, capsys):
    from planner.__main__ import main
    assert main(["estimate", str(CASES / name)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["chosen"]["parallel"]


@pytest.mark.parametrize("model, chips, batch, chip", [
    (SMALL_DENSE, 16, 32, "a100-80gb"),
    (SMALL_MOE, 8, 16, "h100"),
    (SMALL_GPT, 64, 64, "tpu-v5p"),
])
def test_branch_and_bound_top_k_equals_full_ranking(model, chips, batch, chip):
    case = parse_case(_free_case(model, chips, batch, chip, node=4 if chip.startswith("tpu") else 8))
    full = [r.step_time_s for r in search(case).ranked[:4]]
    bounded = [r.step_time_s for r in search(case, top=4).ranked]
    assert bounded == pytest.approx(full, rel=1e-12)


def test_lower_bound_never_exceeds_any_variant():
    from planner.layout_search import _fitting_variants, candidate_layouts, lower_bound_s
    case = parse_case(_free_case(SMALL_DENSE, 16, 32))
    chip = get_chip("a100-80gb")
    for lay in candidate_layouts(case, chip):
        for cand in _fitting_variants(case, lay, usable_hbm_bytes(chip), chip):
            assert lower_bound_s(case, lay, chip) <= simulate(case, cand, chip).step_time_s * (1 + 1e-12)


def test_on_a_tpu_the_search_tries_jax_dots_policy_between_none_and_full():
    # JAX's checkpoint_dots_with_no_batch_dims (MaxText's 'minimal'): where nothing lighter fits, it beats
    # recomputing the whole layer; GPUs keep Megatron's policies, MoE and Mamba models are not modelled with it
    fixed = _free_case(dict(LONG_DENSE, seq_len=20480), 4, 4, "tpu-v5e")  # no recomputation does not fit
    fixed["parallel"] = {"dp": 1, "tp": 2, "cp": 2, "pp": 1}
    fixed["training"]["zero_stage"] = 2
    ranked = search(parse_case(fixed)).ranked
    assert "none" not in {r.layout.recompute for r in ranked}
    assert ranked[0].layout.recompute == "dots"
    full = [r for r in ranked if r.layout.recompute == "full"]
    assert full and ranked[0].step_time_s < full[0].step_time_s
    assert "dots" not in layout_search.recompute_order(MODEL_PRESETS["Llama 3 8B"], get_chip("h100"))
    assert "dots" not in layout_search.recompute_order(MODEL_PRESETS["Mixtral 8x7B"], get_chip("tpu-v5p"))


@pytest.mark.parametrize("parallel", [{"virtual_stages": 2}, {"pp_schedule": "interleaved-1f1b"},
                                      {"pp_schedule": "zb-h1"}, {"pp_schedule": "gpipe"}])
def test_a_stated_schedule_asks_for_pipeline_stages(parallel):
    """A case that states a pipeline's schedule or model chunks but leaves pp null gets stages: one stage has no
    schedule, and the search had answered pp 1 with 1F1B, dropping the stated field (and estimating the case again
    with what it chose then failed)."""
    raw = _free_case(SMALL_DENSE, 8, 32)
    raw["parallel"] = dict(parallel)
    est = estimate(raw)
    lay = est.result.layout
    assert lay.pp > 1
    assert all(getattr(lay, k) == v for k, v in parallel.items())
    again = {**raw, "parallel": {**parallel, **est.chosen.get("parallel", {})},
             "training": {**raw["training"], **est.chosen.get("training", {})}}
    assert estimate(again).step_time_s == pytest.approx(est.step_time_s)


def test_a_stated_single_stage_runs_whatever_schedule_it_names():
    """pp 1 stated with a schedule: one stage runs every schedule as the same passes (not refused as a layout
    that does not divide)."""
    raw = _free_case(SMALL_DENSE, 8, 32)
    raw["parallel"] = {"pp": 1, "pp_schedule": "gpipe"}
    assert estimate(raw).result.layout.pp == 1
