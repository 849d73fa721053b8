"""Parameter and FLOP counts against published numbers and hand-worked formulas."""

from dataclasses import replace

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


def test_a_recomputation_that_drops_dead_code_skips_the_matmuls_feeding_the_residual():
    # PaLM 540B (Chowdhery et al. 2022 Table 1 / Appendix B): d 18432, 48 query heads of 256, one KV head,
    # SwiGLU d_ff 4d. Per token: q 18432 x 12288, k and v 18432 x 256 each, o 12288 x 18432, gate, up, down
    # 18432 x 73728 each: 4,539.3 M weights, of which o (226.5 M) and down (1,358.95 M) feed only the residual,
    # leaving 2,953.8 / 4,539.3 = 65.07 % of the layer matmuls to run again (the paper counts 75 % for its own
    # rematerialisation policy)
    m = ModelSpec("palm", 118, 18432, 48, 1, 4 * 18432, 256000, 2048, "swiglu", head_dim=256, tied_embeddings=True,
                  parallel_block=True)
    tokens = 2048.0
    full = hardware_flops(m, tokens, "full") - model_flops(m, tokens)
    dropped = hardware_flops(m, tokens, "full", skips_residual_outputs=True) - model_flops(m, tokens)
    per_layer = 2 * tokens * (12288 * 18432 + 73728 * 18432)
    assert full - dropped == pytest.approx(m.layers * per_layer, rel=1e-12)
    layer_matmuls = 2 * tokens * m.layers * (2 * 18432 * 12288 + 2 * 18432 * 256 + 3 * 18432 * 73728)
    assert 1 - m.layers * per_layer / layer_matmuls == pytest.approx(0.6507, abs=1e-4)
    # nothing changes for the other policies
    assert hardware_flops(m, tokens, "selective", skips_residual_outputs=True) == hardware_flops(m, tokens, "selective")
    # as a sequential block (x + o feeds the MLP's norm) only the down projection is left out
    seq = replace(m, parallel_block=False)
    dropped_seq = hardware_flops(seq, tokens, "full", skips_residual_outputs=True) - model_flops(seq, tokens)
    assert full - dropped_seq == pytest.approx(m.layers * 2 * tokens * 73728 * 18432, rel=1e-12)


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
