"""Parameter and FLOP counts against published numbers and hand-worked formulas."""

import pytest

from planner.flops import active_params, hardware_flops, megatron_flops, model_flops, total_params
from planner.models import MODEL_PRESETS, ModelSpec, SpecError


@pytest.mark.parametrize("name, published, rel", [
    ("GPT-3 175B", 175e9, 0.01),  # Brown et al. 2020 Table 2.1 (174.6B by this count)
    ("Llama 3 8B", 8.03e9, 0.005),  # Meta model card: 8.03B
    ("Llama 3 70B", 70.6e9, 0.005),  # 70.55B in the released checkpoint
    ("Llama 3 405B", 405.8e9, 0.005),  # Dubey et al. 2024
    ("Llama 2 13B", 13.0e9, 0.01),
    ("Gemma 7B", 8.54e9, 0.01),  # Gemma report Table 2: 7.75B non-embedding + 0.79B embedding
    ("Mixtral 8x7B", 46.7e9, 0.005),  # Jiang et al. 2024: 46.7B total
    ("DeepSeek-V3", 671e9, 0.01),  # DeepSeek-V3 report: 671B total (without the MTP module)
])
def test_total_params_match_published(name, published, rel):
    assert total_params(MODEL_PRESETS[name]) == pytest.approx(published, rel=rel)


@pytest.mark.parametrize("name, published, rel", [
    ("Mixtral 8x7B", 12.9e9, 0.01),  # Jiang et al. 2024: 12.9B active per token
    ("DeepSeek-V3", 37e9, 0.02),  # 37B activated
])
def test_active_params_match_published(name, published, rel):
    assert active_params(MODEL_PRESETS[name]) == pytest.approx(published, rel=rel)


def test_hardware_flops_with_full_recompute_is_megatron_eq3():
    # GPT shapes (ffn = 4h, MHA): our per-op count must reproduce Narayanan et al. 2021 eq. 3 exactly
    m = ModelSpec("gpt", 96, 12288, 96, 96, 4 * 12288, 51200, 2048, "gelu")
    batch = 1536
    assert hardware_flops(m, batch * m.seq_len, "full") == pytest.approx(megatron_flops(m, batch), rel=1e-12)


def test_model_flops_is_six_n_d_plus_attention():
    m = MODEL_PRESETS["Llama 3 8B"]
    tokens = 1e6
    dense_6nd = 6 * (total_params(m) - m.vocab * m.hidden - 2 * m.hidden * m.layers - m.hidden) * tokens
    attn = 12 * m.layers * m.hidden * m.seq_len * tokens  # 12 L H Q T per token (PaLM App. B)
    assert model_flops(m, tokens) == pytest.approx(dense_6nd + attn, rel=1e-9)


def test_selective_recompute_adds_only_attention_scores():
    m = MODEL_PRESETS["GPT-3 175B"]
    t = 2048.0
    extra = hardware_flops(m, t, "selective") - model_flops(m, t)
    assert extra == pytest.approx(t * 4 * m.seq_len * m.hidden * m.layers)


def test_bad_model_names_the_field():
    with pytest.raises(SpecError, match="model.kv_heads"):
        ModelSpec("bad", 2, 64, 8, 3, 256, 100, 128)


def test_a_mistyped_layer_count_is_refused_at_once():
    # a fuzzed case file with 18,182,995,194 layers ran for minutes and 4 GB before this check
    with pytest.raises(SpecError, match="model.layers"):
        ModelSpec("huge", 18_182_995_194, 64, 8, 8, 256, 100, 128)
    ModelSpec("deep", 10_000, 64, 8, 8, 256, 100, 128)  # the limit itself is a model
