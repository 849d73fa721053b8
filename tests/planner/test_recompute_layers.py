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
    assert any("first 2 layers (only their inputs kept)" in line for line in est.explanation)
    assert est.layout.recompute_label == "full (2 layers)"  # one chunk: the model
    piped = estimate(_case(recompute_layers=1, pp=2, v=2))
    assert any("first 1 layer of each chunk" in line for line in piped.explanation)
    assert piped.layout.recompute_label == "full (1 layer a chunk)"


@pytest.mark.parametrize("training, words", [
    ({"recompute": "selective", "recompute_layers": 2}, "applies to recompute \"full\""),
    ({"recompute_layers": 0}, "integer >= 1"),
    ({"recompute_layers": 2.5}, "integer >= 1"),
    ({"recompute_layers": LAYERS + 1}, "must be 1 to the model's 8 layers"),
    ({"recompute_modules": ["core_attn"], "recompute": None, "recompute_layers": 2}, "makes it \"selective\""),
])
def test_bad_counts_name_the_field(training, words):
    with pytest.raises(SpecError) as err:
        parse_case(_case(**training))
    assert err.value.field == "training.recompute_layers" and words in str(err.value)


def test_the_python_api_takes_the_same_rules():
    from planner.presets import make_case

    case = make_case("Llama 3 8B", "8x H100 (one node)", recompute_layers=3)
    assert case.training.recompute == "full"  # implied, as in a case file
    with pytest.raises(SpecError, match="training.recompute_layers"):
        make_case("Llama 3 8B", "8x H100 (one node)", recompute_layers=0)


def test_a_layer_count_that_covers_every_chunk_is_every_layer():
    """pp 2, v 2: chunks of 2 layers; a count of 6 covers all of each, and says so."""
    est = estimate(_case(recompute_layers=6, pp=2, v=2))
    assert est.layout.recompute_layers is None and est.layout.recompute_label == "full"
    assert est.step_time_s == estimate(_case(pp=2, v=2)).step_time_s


def test_the_recomputation_buffer_fits_in_what_the_layers_after_it_freed():
    """The backward reaches a chunk's recomputed layers after its other layers have freed everything they kept;
    the buffer the recomputation needs (one layer's activations less its input) is charged only beyond that.
    The loss's logits are freed before any layer recomputes: the larger of the two sets the peak."""
    one = estimate(_case(recompute_layers=LAYERS - 1)).result
    lay, m = one.layout, one.case.model
    full = layer_activation_bytes(m, lay, False)
    kept = layer_activation_bytes(m, lay, False, recompute="none")
    none = estimate(_case(recompute="none")).result
    logits = none.memory.temporary_bytes  # the loss's logits: no recomputation buffer without recomputation
    assert one.memory.temporary_bytes == pytest.approx(max(logits, (kept - full) - kept))
    every = estimate(_case()).result
    assert kept - full != logits
    assert every.memory.temporary_bytes == pytest.approx(max(logits, kept - full))


def _model_block(name):
    from dataclasses import fields

    from planner.models import MODEL_PRESETS, SSM_PRESETS, ModelSpec
    m = {**MODEL_PRESETS, **SSM_PRESETS}[name]
    return {f.name: getattr(m, f.name) for f in fields(ModelSpec)
            if f.name != "name" and getattr(m, f.name) is not None}


def _mtp_case(recompute_layers):
    return {"name": "v3", "model": _model_block("DeepSeek-V3"),
            "training": {"global_batch": 512, "micro_batch": 1, "zero_stage": 1, "attention": "flash",
                         "recompute": "full", "recompute_layers": recompute_layers},
            "parallel": {"dp": 64, "tp": 1, "pp": 8, "cp": 1, "ep": 64, "pp_layout": "Et|(tt|)*30mL"},
            "cluster": {"chip": "h100", "num_chips": 512}}


def test_multi_token_prediction_is_not_recomputed_by_a_layer_count():
    """Megatron-Core skips block recomputation for its MTP block (multi_token_prediction.py: a TODO, it warns
    and runs without checkpointing): the last chunk, "mL", holds no layer to recompute and keeps its MTP
    module's activations whole."""
    from planner.memory import recompute_split
    from planner.stages import chunks_of

    res = estimate(_mtp_case(1)).result
    last = chunks_of(res.case.model, res.layout)[-1][-1]
    assert last.layers == 0 and last.mtp == 1
    again, rest = recompute_split(res.case.model, last, 1)
    assert again == () and sum(n for _, n in rest) == 1
    chunk = res.stages[-1].chunks[-1]
    assert chunk.parts["recompute"] == 0.0
    assert all(lc.recompute == "none" for lc, _ in chunk.layer_costs)


def _pattern_case(pattern, pp=4, recompute_layers=1):
    model = _model_block("Nemotron-H 8B")
    model["layers"], model["layer_pattern"] = len(pattern), pattern
    return {"name": "hybrid", "model": model,
            "training": {"global_batch": 64, "micro_batch": 1, "zero_stage": 1, "attention": "flash",
                         "recompute": "full", "recompute_layers": recompute_layers},
            "parallel": {"dp": 16 // pp // 2, "tp": 2, "pp": pp, "cp": 1, "pp_schedule": "1f1b"},
            "cluster": {"chip": "h100", "num_chips": 16}}


def test_a_pattern_recomputes_each_chunks_own_first_layers_kinds():
    """Stages with the same kinds in another order recompute different kinds: each is costed apart, and each
    chunk keeps what its own layers keep."""
    from planner import costs

    res = estimate(_pattern_case("M-M*" "M*-M" "*MM-" "M-M-")).result
    m, lay = res.case.model, res.layout
    for i, first in enumerate("MM*M"):
        lc = costs.layer_cost(m, lay, res.chip, "bf16", first, 8)
        assert res.stages[i].chunks[0].parts["recompute"] == pytest.approx(lc.recompute_s, rel=1e-12), i
    # memory, one stage holding one micro-batch: each layer at its own kind's bytes, the first two recomputed
    kept = {k: layer_activation_bytes(m, lay, k, recompute="none") for k in "M-*"}
    full = {k: layer_activation_bytes(m, lay, k) for k in "M-*"}
    for pattern in ("**MMMM--", "MMMM--**"):
        mem = estimate(_pattern_case(pattern, pp=1, recompute_layers=2)).memory
        want = sum(full[k] for k in pattern[:2]) + sum(kept[k] for k in pattern[2:])
        assert mem.activations_bytes == pytest.approx(want, rel=1e-12), pattern


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
