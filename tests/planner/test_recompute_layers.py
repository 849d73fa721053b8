"""Full recomputation of only some layers per chunk (training.recompute_layers; Megatron-Core's recompute_method
"block" with recompute_num_layers): what they keep and rerun, the case-format checks, and the search choosing
the fewest that fit."""

import pytest

from planner.api import estimate
from planner.case import parse_case
from planner.memory import layer_activation_bytes
from planner.models import SpecError
from planner.timeline import predicted_timeline

LAYERS = 8


def _case(recompute="full", recompute_layers=None, chip="h100", pp=1, v=1, **training):
    case = {"name": "partial", "model": {"layers": LAYERS, "hidden": 2048, "heads": 16, "kv_heads": 16, "ffn": 8192,
                                         "vocab": 32000, "seq_len": 2048, "mlp": "gelu"},
            "training": {"global_batch": 64, "micro_batch": 1, "zero_stage": 1, "attention": "flash",
                         "recompute": recompute, "recompute_layers": recompute_layers, **training},
            "parallel": {"dp": 8 // pp, "tp": 1, "pp": pp, "cp": 1, "virtual_stages": v},
            "cluster": {"chip": chip, "num_chips": 8}}
    if v > 1:
        case["parallel"]["pp_schedule"] = "interleaved-1f1b"
    return case


def test_each_chunk_keeps_its_recomputed_layers_inputs_and_everything_of_the_others():
    """One stage, one micro-batch in flight: N layers at the full mode's bytes, the others at no recomputation's."""
    res = {n: estimate(_case(recompute_layers=n)).result for n in (None, 3)}
    lay = res[3].layout
    full = layer_activation_bytes(res[3].case.model, lay, False)
    kept = layer_activation_bytes(res[3].case.model, lay, False, recompute="none")
    assert full == 2 * 2048 * 2048  # the layer input only (Korthikanti et al. 2022 sec. 5)
    assert res[None].memory.activations_bytes == pytest.approx(LAYERS * full)
    assert res[3].memory.activations_bytes == pytest.approx(3 * full + (LAYERS - 3) * kept)


def test_only_the_recomputed_layers_run_their_forward_again():
    full, some, none = (estimate(_case(recompute=r, recompute_layers=n)).result
                        for r, n in (("full", None), ("full", 3), ("none", None)))
    assert some.breakdown["recompute"] == pytest.approx(3 / LAYERS * full.breakdown["recompute"], rel=1e-12)
    assert some.breakdown["compute"] == pytest.approx(full.breakdown["compute"], rel=1e-12)
    extra = full.hardware_flops - none.hardware_flops
    assert some.hardware_flops - none.hardware_flops == pytest.approx(3 / LAYERS * extra, rel=1e-12)
    # as many as the chunk holds is every layer
    whole = estimate(_case(recompute_layers=LAYERS)).result
    assert whole.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert whole.memory.total_bytes == pytest.approx(full.memory.total_bytes)


def test_the_count_is_per_chunk_under_interleaving():
    """pp 2 with 2 chunks a stage: 4 chunks of 2 layers; 1 recomputed in each is half the layers."""
    half = estimate(_case(recompute_layers=1, pp=2, v=2)).result
    full = estimate(_case(pp=2, v=2)).result
    assert half.breakdown["recompute"] == pytest.approx(full.breakdown["recompute"] / 2, rel=1e-12)
    spans = predicted_timeline(half).spans
    recomputed = {s.name.split()[-1] for s in spans if s.name.startswith("recompute")}
    assert recomputed == {"L0"}  # each chunk's first layer, none of its second


def test_stated_layers_make_recompute_full_and_reach_the_layout_and_the_words():
    case = parse_case(_case(recompute=None, recompute_layers=2))
    assert case.training.recompute == "full" and case.training.recompute_layers == 2
    est = estimate(case)
    assert est.layout.recompute_layers == 2
    assert any("first 2 layer(s) of each chunk" in line for line in est.explanation)


@pytest.mark.parametrize("training, words", [
    ({"recompute": "selective", "recompute_layers": 2}, "applies to recompute \"full\""),
    ({"recompute_layers": 0}, "integer >= 1"),
    ({"recompute_layers": 2.5}, "integer >= 1"),
    ({"recompute_layers": LAYERS + 1}, "more than the model's 8 layers"),
])
def test_bad_counts_name_the_field(training, words):
    with pytest.raises(SpecError) as err:
        parse_case(_case(**training))
    assert err.value.field == "training.recompute_layers" and words in str(err.value)


def _tight(chip="h100", recompute=None, **over):
    """A case whose activations do not fit without recomputation on one 80 GB chip: seq 16384, no TP."""
    case = _case(recompute=recompute, chip=chip, **over)
    case["model"]["seq_len"] = 16384
    case["model"]["layers"] = 24
    case["training"]["micro_batch"] = 4
    case["training"]["global_batch"] = 32
    return case


def test_the_search_recomputes_the_fewest_layers_that_fit_on_a_gpu():
    est = estimate(_tight())
    lay = est.layout
    assert lay.recompute == "full" and lay.recompute_layers is not None and 1 < lay.recompute_layers < 24
    assert est.chosen["training"]["recompute_layers"] == lay.recompute_layers
    assert est.fits
    one_fewer = estimate(_tight(recompute="full", recompute_layers=lay.recompute_layers - 1))
    assert not one_fewer.fits
    # stated full recomputation is every layer
    assert estimate(_tight(recompute="full")).layout.recompute_layers is None


def test_no_partial_recomputation_is_chosen_on_a_tpu():
    """MaxText's remat policy applies to every scanned layer alike: the search keeps whole modes there."""
    est = estimate(_tight(chip="tpu-v5p"))
    assert est.layout.recompute == "dots"  # the lightest whole mode that fits
    assert est.layout.recompute_layers is None and "recompute_layers" not in est.chosen.get("training", {})
