"""Memory per chip against the ZeRO paper's example and Korthikanti et al.'s activation formulas."""

from dataclasses import replace

import pytest

from planner.case import Layout
from planner.memory import (
    WEIGHT_BYTES,
    in_flight_chunks,
    korthikanti_bytes,
    layer_activation_bytes,
    memory_per_chip,
    stage_params,
    zero_bytes_per_param,
)
from planner.models import MODEL_PRESETS, ModelSpec

GB = 1e9


@pytest.mark.parametrize("stage, expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, expected_gb):
    # Rajbhandari et al. 2019 Figure 1: 7.5B parameters, N_d = 64, K = 12
    w, g, o = zero_bytes_per_param(stage, 64)
    assert 7.5e9 * (w + g + o) / GB == pytest.approx(expected_gb, abs=0.05)


# Korthikanti et al. 2022 analyse a GPT layer: ffn = 4h, MHA, dropout, materialised softmax.
GPT = ModelSpec("gpt-22b", 48, 6144, 64, 64, 4 * 6144, 51200, 2048, "gelu")
S, B, H, A = GPT.seq_len, 4, GPT.hidden, GPT.heads


def _lay(tp=1, sp=False, recompute="none"):
    return Layout(dp=1, tp=tp, pp=1, micro_batch=B, recompute=recompute, sequence_parallel=sp,
                  attention="materialized")


@pytest.mark.parametrize("lay, mode", [
    (_lay(), "none"),  # sbh(34 + 5as/h)
    (_lay(tp=8), "tp"),  # sbh(10 + 24/t + 5as/(ht))
    (_lay(tp=8, sp=True), "tp+sp"),  # sbh/t (34 + 5as/h)
    (_lay(tp=8, sp=True, recompute="selective"), "tp+sp+selective"),  # 34 sbh/t
    (_lay(tp=8, recompute="full"), "full"),  # 2sbh
])
def test_activation_bytes_reduce_to_korthikanti(lay, mode):
    expected = korthikanti_bytes(S, B, H, A, t=lay.tp, mode=mode)
    assert layer_activation_bytes(GPT, lay, False) == pytest.approx(expected, rel=1e-12)


def test_korthikanti_formula_numbers():
    # hand-worked: s=2048, b=4, h=6144, a=64 -> sbh = 50,331,648; 5as/h = 106.67
    assert korthikanti_bytes(S, B, H, A) == pytest.approx(50_331_648 * (34 + 5 * 64 * 2048 / 6144))


def test_in_flight_micro_batches():
    p, m = 8, 64
    one_f_one_b = Layout(dp=1, tp=1, pp=p, pp_schedule="1f1b")
    assert [in_flight_chunks(i, one_f_one_b, m) for i in range(p)] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert in_flight_chunks(0, one_f_one_b, 3) == 3  # never more than m
    v = 3
    inter = Layout(dp=1, tp=1, pp=p, pp_schedule="interleaved-1f1b", virtual_stages=v)
    # Korthikanti et al. 2022 sec. 4.2.3: first stage holds p (1 + (p-1)/(p v)) stage-sized micro-batches
    assert in_flight_chunks(0, inter, m) / v == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert in_flight_chunks(0, Layout(dp=1, tp=1, pp=p, pp_schedule="gpipe"), m) == m


def _held_peak(actions) -> int:
    """The most chunk-micro-batches a rank keeps activations for at once: forwards not yet back-propagated,
    and (ZB-H1) input gradients whose weight gradient still waits for them, counted whole."""
    from core.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD

    step = {FORWARD: 1, BACKWARD: -1, BACKWARD_WEIGHT: -1}  # a BI moves one from held to pending: no change
    now = peak = 0
    for a in actions:
        now += step.get(a.kind, 0) if a.kind != BACKWARD_INPUT else 0
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1", "gpipe"])
def test_in_flight_chunks_match_the_schedules_built_step_by_step(schedule):
    # every rank's peak in core.schedules' own orders: interleaved with m == p warms up as with more micro-batches
    # (Megatron-Core since core_r0.10.0), ZB-H1 never holds more than 1F1B's p (Qi et al. 2023 sec. 2.3)
    from core.schedules.build import make_schedule

    for p in (2, 3, 4, 8):
        for v in ((2, 3, 4) if schedule == "interleaved-1f1b" else (1,)):
            for m in (p, 2 * p, 3 * p) if schedule == "interleaved-1f1b" else (1, p - 1, p, 2 * p + 1):
                if m < 1:
                    continue
                built = make_schedule(schedule, p, m, v)
                lay = Layout(dp=1, tp=1, pp=p, pp_schedule=schedule, virtual_stages=v)
                assert [in_flight_chunks(r, lay, m) for r in range(p)] == \
                    [_held_peak(built.actions[r]) for r in range(p)], (p, v, m)


def test_memory_per_chip_splits_by_tp_and_pp():
    m = ModelSpec("gpt-175b", 96, 12288, 96, 96, 49152, 51200, 2048, "gelu")
    lay = Layout(dp=1, tp=8, pp=8, micro_batch=1, recompute="full", attention="materialized")
    mem = memory_per_chip(m, lay, 64)
    # 175B / 64 chips ~ 2.7B params per chip -> 2 + 4 (fp32 gradients, the Layout default) + 12 = 18 bytes
    # each ~ 49 GB of model state; 16 bytes (~44 GB) with half-precision gradients, the ZeRO paper's count
    assert (mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes) / GB == pytest.approx(49, rel=0.05)
    half = memory_per_chip(m, replace(lay, grad_reduce_in_fp32=False), 64)
    assert (half.params_bytes + half.grads_bytes + half.optimizer_bytes) / GB == pytest.approx(44, rel=0.05)
    # full recompute: first stage keeps 12 layers x 8 in-flight x 2sbh
    assert mem.activations_bytes == pytest.approx(12 * 8 * 2 * 2048 * 12288)
    zero3 = memory_per_chip(m, Layout(dp=8, tp=8, pp=1, micro_batch=1, zero_stage=3, recompute="full",
                                      attention="materialized"), 8)
    assert zero3.params_bytes == pytest.approx(2 * 175e9 / 64, rel=0.02)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    from planner.memory import stage_params
    mqa = ModelSpec("mqa", 1, 4096, 32, 1, 8192, 1000, 1024, "swiglu", tied_embeddings=True)
    dense, _ = stage_params(mqa, Layout(dp=1, tp=8, pp=1), 0)
    q_o = 2 * 4096 * 4096 / 8
    kv = 2 * 4096 * 128  # one kv head, whole on every rank
    mlp = 3 * 4096 * 8192 / 8
    norms = 2 * 4096
    embed = 1000 * 4096 / 8 + 4096  # tied embedding shard + final norm
    assert dense == pytest.approx(q_o + kv + mlp + norms + embed)


def test_fp8_keeps_each_gemm_input_in_one_byte():
    # Transformer Engine saves the fp8 cast of a GEMM's input for its weight gradient: a Llama layer keeps
    # the inputs of QKV and fc1 (2sbh) and of fc2 (sb f) in 1 byte, not 2; the attention output, which the
    # flash kernel's backward reads in bf16, gains the output projection's fp8 copy (sb q more)
    llama = ModelSpec("llama-8b", 32, 4096, 32, 8, 14336, 128256, 8192)
    lay = Layout(dp=1, tp=1, pp=1, micro_batch=1, attention="flash3")
    sb, q = 8192, 32 * 128
    saved = layer_activation_bytes(llama, lay, False) - layer_activation_bytes(llama, lay, False, dtype="fp8")
    assert saved == pytest.approx(sb * (2 * 4096 + 14336 - q))
    # with materialised scores the attention output is read by no kernel's backward: 1 byte
    mat = replace(lay, attention="materialized")
    assert layer_activation_bytes(llama, mat, False) - layer_activation_bytes(llama, mat, False, dtype="fp8") == \
        pytest.approx(sb * (2 * 4096 + 14336 + q))
    assert layer_activation_bytes(llama, lay, False, recompute="full", dtype="fp8") == 2 * sb * 4096
    m = memory_per_chip(llama, lay, 1)
    assert memory_per_chip(llama, lay, 1, dtype="fp8").activations_bytes == pytest.approx(
        m.activations_bytes - 32 * saved)


def test_a_fused_cross_entropy_keeps_the_bf16_logits_and_their_gradient_only():
    # fp32 path: fp32 logits and their gradient, 8 bytes per logit on the loss stage; fused (flash-attention's
    # kernels): the bf16 logits and their bf16 gradient, 4 bytes
    m = ModelSpec("mpt-1b", 24, 2048, 16, 16, 8192, 50368, 2048, "gelu")
    lay = Layout(dp=8, tp=2, pp=1, micro_batch=3, attention="flash")
    fp32, fused = (memory_per_chip(m, replace(lay, cross_entropy=ce), 1).temporary_bytes for ce in ("fp32", "fused"))
    assert fp32 - fused == pytest.approx(4 * 3 * 2048 * 50368 / 2)


def test_the_metrics_cross_entropies_set_the_peak_when_their_logits_outweigh_the_activations():
    # they run after the backward has freed the activations: bf16 logits, their fp32 copy and its log-softmax,
    # 10 bytes a logit; a small model with a large vocabulary and batch peaks there, a large one does not
    small = ModelSpec("125m-llama3-vocab", 12, 768, 12, 12, 3072, 128256, 2048, "gelu")
    lay = Layout(dp=8, tp=1, pp=1, micro_batch=32, attention="flash", cross_entropy="fused")
    before, after = (memory_per_chip(small, replace(lay, logit_metrics=k), 1) for k in (0, 2))
    logits = 32 * 2048 * 128256
    assert 10 * logits > before.activations_bytes + before.temporary_bytes
    assert after.total_bytes == pytest.approx(before.total_bytes - before.activations_bytes
                                              - before.temporary_bytes + 10 * logits)
    big = ModelSpec("mpt-7b", 32, 4096, 32, 32, 16384, 50368, 2048, "gelu")
    lay7 = replace(lay, micro_batch=6)
    assert memory_per_chip(big, replace(lay7, logit_metrics=2), 1) == memory_per_chip(big, lay7, 1)


def test_pipelined_zero3_gathers_no_copy_of_experts_it_shards_over_one_rank():
    # dp 8 with ep 8 leaves each expert a data-parallel group of one: its weights are whole already and take
    # their gradient in place (AutoModel passes them to FSDP as ignored_params); the dense weights, sharded
    # over 8, are gathered whole in bf16 and their gradients accumulated whole in fp32
    m = MODEL_PRESETS["Mixtral 8x7B"]
    lay = Layout(dp=8, tp=1, pp=2, ep=8, micro_batch=1, zero_stage=3, recompute="full", attention="flash")
    mem = memory_per_chip(m, lay, 16)
    dense, moe = stage_params(m, lay, mem.stage)
    w, g, _ = zero_bytes_per_param(3, 8, "adam", lay.grad_bytes)
    we, ge, _ = zero_bytes_per_param(3, 1, "adam", lay.grad_bytes)
    assert (we, ge) == (WEIGHT_BYTES, lay.grad_bytes)
    assert mem.params_bytes == pytest.approx(dense * (w + WEIGHT_BYTES) + moe * we)
    assert mem.grads_bytes == pytest.approx(dense * (g + 4) + moe * ge)


def test_a_zero3_layers_gather_holds_its_experts_tp_share():
    # per-layer ZeRO-3 gathers each layer's weights as the chip holds them: experts split over ep and tp
    m = MODEL_PRESETS["Mixtral 8x7B"]
    lay = Layout(dp=8, tp=2, pp=1, ep=4, micro_batch=1, zero_stage=3, recompute="full", attention="flash",
                 sequence_parallel=True, etp=2)
    one, two = (memory_per_chip(replace(m, experts=e), lay, 1).temporary_bytes for e in (8, 16))
    per_layer_experts = 8 * 3 * m.hidden * m.ffn / (4 * 2)  # 8 more experts' SwiGLU weights on a chip
    router = 8 * m.hidden  # and 8 more router columns, on every rank
    assert two - one == pytest.approx(WEIGHT_BYTES * 2 * (per_layer_experts + router), rel=1e-9)


def test_pipelined_fsdp_accumulates_its_unsharded_gradients_in_the_reduction_dtype():
    # staged ZeRO-3 keeps the stage's gradients whole until the last backward, in the dtype it reduces them
    # in (FSDP2's reduce_dtype): fp32 with grad_reduce_in_fp32, else the working bf16, 2 bytes less a parameter,
    # besides the reduced shard of 1 / dp of them it keeps for the optimizer
    m = MODEL_PRESETS["Llama 3 8B"]
    lay = Layout(dp=4, tp=1, pp=4, zero_stage=3, recompute="full")
    fp32, bf16 = (memory_per_chip(m, replace(lay, grad_reduce_in_fp32=f), 16, "adam", "bf16") for f in (True, False))
    dense, experts = stage_params(m, lay, 3)  # the most loaded stage: the head's (and the final norm's)
    assert fp32.grads_bytes - bf16.grads_bytes == pytest.approx(2 * (dense + experts) * (1 + 1 / 4), rel=1e-9)
