"""A parallel block (PaLM's y = x + attn(ln(x)) + mlp(ln(x)), MaxText's default DecoderLayer): one norm for both
branches, one add into the residual, and what that leaves in memory."""

from dataclasses import replace

import pytest

from hardware import kernels
from hardware.chips import get_chip
from planner.case import Layout
from planner.costs import layer_cost
from planner.flops import layer_params, pre_norms
from planner.memory import layer_activation_bytes
from planner.models import ModelSpec


def test_a_parallel_block_keeps_one_norms_input_and_output():
    # PaLM's y = x + attn(ln(x)) + mlp(ln(x)) (MaxText's DecoderLayer): of the tensors replicated across TP,
    # a sequential Llama layer keeps x, ln1(x), x + o and ln2(x + o) (8sbh bytes), a parallel one x and ln(x)
    # (4sbh); the GPT recipe adds a dropout mask per block (2sbh), one over the parallel block's sum (sbh)
    sb, h = 8192, 4096
    lay = Layout(dp=1, tp=4, pp=1, micro_batch=1, attention="flash")
    for mlp, seq_minus_par in (("swiglu", 4 * sb * h), ("gelu", 5 * sb * h)):
        m = ModelSpec("m", 32, h, 32, 8, 14336, 128256, 8192, mlp)
        par = replace(m, parallel_block=True)
        assert layer_activation_bytes(m, lay, False) - layer_activation_bytes(par, lay, False) == \
            pytest.approx(seq_minus_par)
    # under fp8 QKV and the MLP each keep their own 1-byte cast of ln(x) (Transformer Engine casts each module's
    # input), as many bytes as the one bf16 ln(x): only fc2's input and the attention output change, as
    # test_fp8_keeps_each_gemm_input_in_one_byte counts them
    par = ModelSpec("m", 32, h, 32, 8, 14336, 128256, 8192, parallel_block=True)
    fp8 = layer_activation_bytes(par, lay, False) - layer_activation_bytes(par, lay, False, dtype="fp8")
    assert fp8 == pytest.approx(sb * (14336 - 32 * 128) / 4)
    llama = ModelSpec("llama", 32, h, 32, 8, 14336, 128256, 8192)
    assert pre_norms(llama, False) == 2 and pre_norms(replace(llama, parallel_block=True), False) == 1
    assert layer_params(llama, False).norms - layer_params(replace(llama, parallel_block=True), False).norms == h


@pytest.mark.parametrize("chip_name", ["h100", "tpu-v5p"])
def test_a_parallel_block_runs_one_norm_and_one_three_way_add(chip_name):
    # per token, forward: one norm fewer (read x, write y: 4h bytes; backward 6h) and one add of three
    # tensors (read 3, write 1: 8h) for two of two (12h); the backward's adds are as many
    chip = get_chip(chip_name)
    m = ModelSpec("m", 32, 4096, 32, 8, 14336, 128256, 8192)
    lay = Layout(dp=1, tp=1, pp=1, micro_batch=1, attention="flash")
    tokens, h = 8192, 4096
    seq, par = (dict(layer_cost(x, lay, chip, "bf16", False, 8).by_class)["memory-bound"]
                for x in (m, replace(m, parallel_block=True)))
    saved = (kernels.norm_s(chip, 4 * h * tokens) + kernels.norm_s(chip, 6 * h * tokens, backward=True)
             + kernels.pointwise_s(chip, 4 * h * tokens))
    assert seq - par == pytest.approx(saved, rel=1e-9)
    # run eager, x + a + m is two adds: only the norm is saved
    eager = replace(lay, fusion="eager")
    seq, par = (dict(layer_cost(x, eager, chip, "bf16", False, 8).by_class)["memory-bound"]
                for x in (m, replace(m, parallel_block=True)))
    assert seq - par == pytest.approx(kernels.eager_s(chip, (kernels.EAGER_BYTES["norm_fwd"]
                                                             + kernels.EAGER_BYTES["norm_bwd"]) * h * tokens), rel=1e-9)


def test_layer_style_says_what_surrounds_the_matmuls_not_the_mlp():
    # a GELU MLP in a Llama-style layer (MaxText's GPT-3-like models): RMSNorm without biases, rotary, no dropout
    from planner.case import parse_model
    from planner.flops import total_params
    from planner.models import SpecError

    gelu = ModelSpec("m", 32, 4096, 32, 32, 16384, 32000, 2048, "gelu")
    llama = replace(gelu, layer_style="llama")
    assert gelu.gpt_style and not llama.gpt_style and replace(llama, layer_style="gpt").gpt_style
    # per layer: the GPT style's LayerNorm biases (2 x 4096) and projection biases (q, k, v, o, up, down),
    # and the learned positions (2048 x 4096) once
    biases = 2 * 4096 + 3 * 4096 + 4096 + 16384 + 4096
    assert total_params(gelu) - total_params(llama) == 32 * biases + 2048 * 4096
    lay = Layout(dp=1, tp=1, pp=1, micro_batch=1, attention="flash")
    # the two dropout masks (1 byte each per element of the residual stream) leave the kept activations
    assert layer_activation_bytes(gelu, lay, False) - layer_activation_bytes(llama, lay, False) == 2 * 2048 * 4096
    assert parse_model({"layers": 2, "hidden": 64, "heads": 4, "vocab": 100, "seq_len": 16, "ffn": 256,
                        "mlp": "gelu", "layer_style": "llama"}).layer_style == "llama"
    for bad in ({"layer_style": "bert"}, {"layer_style": "gpt", "mlp": "swiglu"}):
        with pytest.raises(SpecError, match="model.layer_style"):
            parse_model({"layers": 2, "hidden": 64, "heads": 4, "vocab": 100, "seq_len": 16, "ffn": 256, **bad})


def test_a_gelu_without_a_bias_is_one_kernel_even_eager():
    # layer_style "llama" with a GELU MLP: no bias add before the activation, so eager PyTorch runs one GELU kernel
    # (4 bytes an element forward, 6 backward), not squared ReLU's two
    chip = get_chip("h100")
    lay = Layout(dp=1, tp=1, pp=1, micro_batch=1, attention="flash")
    gelu = ModelSpec("m", 32, 4096, 32, 8, 14336, 128256, 8192, "gelu", layer_style="llama")
    for fusion in ("fused", "eager"):
        lay_f = replace(lay, fusion=fusion)
        gap = (dict(layer_cost(replace(gelu, mlp="relu2"), lay_f, chip, "bf16", False, 8).by_class)["memory-bound"]
               - dict(layer_cost(gelu, lay_f, chip, "bf16", False, 8).by_class)["memory-bound"])
        extra = kernels.pointwise_s(chip, (4 + 6) * 14336 * 8192) if fusion == "eager" else 0.0
        assert gap == pytest.approx(extra, rel=1e-9)
