"""Selective recomputation by module (Megatron-Core's recompute_modules): what each module runs again,
what it stops keeping, its FLOPs, and the case-format checks."""

import pytest

from hardware import kernels
from hardware.chips import get_chip
from planner.case import Layout, parse_case
from planner.costs import layer_cost
from planner.flops import hardware_flops, model_flops
from planner.memory import layer_activation_bytes
from planner.models import MODEL_PRESETS, SpecError

DSV3 = MODEL_PRESETS["DeepSeek-V3"]
H100 = get_chip("h100")
T, TP = 4096, 2  # tokens of one micro-batch; tensor parallel with sequence parallelism


def _lay(*modules):
    return Layout(dp=64, tp=TP, pp=1, ep=64, sequence_parallel=True, attention="flash3",
                  recompute="selective" if modules else "none", recompute_modules=modules or ("core_attn",))


def _recompute_s(kind, *modules):
    return layer_cost(DSV3, _lay(*modules), H100, "bf16", kind, 8).recompute_s


def test_each_module_runs_its_own_forward_again():
    # (whole GEMMs: an MLA model runs no TP overlap in Megatron-Core, planner.case.default_tp_overlap)
    q_up = kernels.matmul_s(H100, "bf16", T, 1536, 128 * 192 / TP)  # q rank -> 128 heads of 128 + 64 rope
    kv_up = kernels.matmul_s(H100, "bf16", T, 512, 128 * 256 / TP)  # kv rank -> K and V of 128 heads of 128
    assert _recompute_s(True, "mla_up_proj") == pytest.approx(q_up + kv_up, rel=1e-12)
    # two RMSNorms, read x + write y in bf16 over the sequence-parallel shard
    norms = kernels.norm_s(H100, 2 * 4 * 7168 / TP * T)
    assert _recompute_s(True, "layernorm") == pytest.approx(norms, rel=1e-12)
    # SwiGLU reads gate and up, writes their product: 6 bytes per element of the 8 routed copies
    assert _recompute_s(True, "moe_act") == pytest.approx(kernels.pointwise_s(H100, 6 * 8 * 2048 / TP * T), rel=1e-12)
    # a dense layer's MLP: its three GEMMs and activation; the shared expert is the same in an MoE layer
    fc1 = kernels.matmul_s(H100, "bf16", T, 7168, 2 * 18432 / TP)
    fc2 = kernels.matmul_s(H100, "bf16", T, 18432 / TP, 7168)
    act = kernels.pointwise_s(H100, 6 * 18432 / TP * T)
    assert _recompute_s(False, "mlp") == pytest.approx(fc1 + fc2 + act, rel=1e-12)
    assert _recompute_s(True, "mlp") == 0.0  # "mlp" is the dense layers' module
    assert _recompute_s(True, "shared_experts") > 0.0
    both = _recompute_s(True, "mla_up_proj", "layernorm")
    assert both == pytest.approx(_recompute_s(True, "mla_up_proj") + _recompute_s(True, "layernorm"), rel=1e-12)


def test_each_module_stops_keeping_what_it_recomputes():
    sb, h = T, 7168

    def kept(kind, *modules):
        return layer_activation_bytes(DSV3, _lay(*modules), kind)

    # MLA's full-width Q, K, V (128 heads of 128 + 64 rope for Q and K, 128 for V) and the rope parts of Q and K
    qkv = 2 * sb * (128 * 128 + 2 * 128 * 128) + 2 * sb * 2 * 128 * 64
    assert kept(True) - kept(True, "mla_up_proj") == pytest.approx(qkv / TP)
    assert kept(True) - kept(True, "layernorm") == pytest.approx(2 * 2 * sb * h / TP)  # the QKV and MLP inputs
    assert kept(True) - kept(True, "moe_act") == pytest.approx(8 * 2 * sb * 2048 / TP)  # fc2's input, 8 copies
    # a dense layer keeps gate, up and fc2's input of its 18432-wide MLP
    assert kept(False) - kept(False, "mlp") == pytest.approx((4 + 2) * sb * 18432 / TP)


def test_recomputed_matmul_flops():
    tokens = 1000.0
    # MLA up-projections per token per layer: q 1536 x 128 x 192 and kv 512 x 128 x 256 weights, 2 FLOPs each,
    # over 61 layers and the MTP module's
    up = 2 * 62 * (1536 * 128 * 192 + 512 * 128 * 256)
    assert hardware_flops(DSV3, tokens, "selective", ("mla_up_proj",)) - model_flops(DSV3, tokens) == \
        pytest.approx(tokens * up, rel=1e-12)
    dense = 2 * 3 * 3 * 7168 * 18432  # the 3 dense layers' SwiGLU MLPs
    assert hardware_flops(DSV3, tokens, "selective", ("mlp",)) - model_flops(DSV3, tokens) == \
        pytest.approx(tokens * dense, rel=1e-12)
    assert hardware_flops(DSV3, tokens, "selective", ("layernorm", "moe_act")) == model_flops(DSV3, tokens)


def _case(**training):
    return {"name": "v3", "model": {k: getattr(DSV3, k) for k in (
                "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "experts", "top_k", "head_dim",
                "shared_experts", "dense_layers", "dense_ffn", "q_lora_rank", "kv_lora_rank", "rope_head_dim")},
            "training": {"global_batch": 512, "micro_batch": 1, "zero_stage": 1, **training},
            "parallel": {"dp": 16, "tp": 2, "pp": 8, "cp": 1, "ep": 16},
            "cluster": {"chip": "h100", "num_chips": 256}}


def test_stated_modules_make_recompute_selective_and_reach_the_layout():
    case = parse_case(_case(recompute_modules=["mla_up_proj", "mlp"]))
    assert case.training.recompute == "selective" and case.training.recompute_modules == ("mla_up_proj", "mlp")
    from planner.api import estimate
    assert estimate(case).layout.recompute_modules == ("mla_up_proj", "mlp")


@pytest.mark.parametrize("training, words", [
    ({"recompute_modules": ["moe"]}, "not modelled"),
    ({"recompute_modules": ["attention"]}, "unknown ['attention']"),
    ({"recompute_modules": []}, "non-empty list"),
    ({"recompute_modules": "core_attn"}, "non-empty list"),
    ({"recompute_modules": ["layernorm", "layernorm"]}, "twice"),
    ({"recompute_modules": ["layernorm"], "recompute": "full"}, "applies to recompute \"selective\""),
])
def test_bad_module_lists_name_the_field(training, words):
    with pytest.raises(SpecError) as err:
        parse_case(_case(**training))
    assert err.value.field == "training.recompute_modules" and words in str(err.value)


def test_a_module_the_model_does_not_have_is_refused():
    dense = _case(recompute_modules=["mla_up_proj"])
    for key in ("experts", "top_k", "shared_experts", "dense_layers", "dense_ffn", "q_lora_rank", "kv_lora_rank",
                "rope_head_dim"):
        dense["model"].pop(key)
    dense["parallel"]["ep"] = 1
    with pytest.raises(SpecError, match="needs an MLA model"):
        parse_case(dense)
    dense["training"]["recompute_modules"] = ["moe_act"]
    with pytest.raises(SpecError, match="needs routed experts"):
        parse_case(dense)
    assert parse_case({**dense, "training": {**dense["training"], "recompute_modules": ["mlp"]}})



def test_mla_gathers_its_latents_and_runs_its_down_projections_on_the_sequence_shard():
    """Megatron-Core's MLA under TP with sequence parallelism: the q and kv down projections are duplicated on
    every rank over its sequence shard, the up projections all-gather the latents (q rank, kv rank), not the
    hidden states, and the shared rotary key is gathered on its own, in full view; without SP only the up
    projections' input gradients are all-reduced."""
    from planner.costs import tp_collective_bytes

    lay = _lay()
    lc = layer_cost(DSV3, lay, H100, "bf16", True, 8)
    per_token = tp_collective_bytes(DSV3, lay) / 7168  # bytes per hidden unit of the micro-batch's tokens
    gathers = {c.name: c.nbytes for c in lc.fwd_comms if c.kind == "all_gather" and "fc" not in c.name}
    assert gathers == pytest.approx({"tp all-gather (q up)": 1536 * per_token,
                                     "tp all-gather (kv up)": 512 * per_token,
                                     "tp all-gather (rotary key)": 64 * per_token})
    rope = [c for c in lc.fwd_comms + lc.bwd_comms if "rotary key" in c.name]
    assert len(rope) == 2 and all(c.exposed_s == c.time_s for c in rope)
    plain = layer_cost(DSV3, Layout(dp=64, tp=TP, pp=1, ep=64, attention="flash3"), H100, "bf16", True, 8)
    attention_ars = {c.name: c.nbytes for c in plain.bwd_comms if c.kind == "all_reduce" and "experts" not in c.name
                     and "fc" not in c.name}
    assert attention_ars == pytest.approx({"tp all-reduce (q up grad)": 1536 * per_token,
                                           "tp all-reduce (kv up grad)": 512 * per_token})
    assert not [c for c in plain.fwd_comms if c.gemm in ("q up", "kv up")]
    # with SP each rank projects its T / TP tokens down; without it, all T
    from planner.costs import _gemms
    for sp, rows in ((True, T / TP), (False, T)):
        attn, _ = _gemms(DSV3, Layout(dp=64, tp=TP, pp=1, ep=64, sequence_parallel=sp), True, T)
        assert {g.name: g.m for g in attn if "down" in g.name} == {"q down": rows, "kv down": rows}


def test_mla_keeps_its_duplicated_down_projections_whole_on_every_tp_rank():
    """One layer's parameters on a chip (planner.flops.layer_params_on_chip, which memory, ZeRO-3's gathers and
    the pages' gradient bytes all use): MLA's down projections are not split by TP."""
    from planner.flops import layer_params, layer_params_on_chip, mla_down_params

    down = 7168 * (1536 + 512 + 64)
    assert mla_down_params(DSV3) == down
    lp = layer_params(DSV3, True)
    dense, experts = layer_params_on_chip(DSV3, True, 4, 8, 4)
    assert dense == pytest.approx((lp.attention - down + lp.mlp) / 4 + down + lp.router + lp.norms)
    assert experts == pytest.approx(lp.experts / 32)
    assert layer_params_on_chip(DSV3, True, 4, 8, 1) == (dense, pytest.approx(lp.experts / 8))  # whole experts
    assert mla_down_params(MODEL_PRESETS["Llama 3 8B"]) == 0


def test_the_recomputed_modules_run_their_tp_collectives_again():
    """Megatron-Core reruns a checkpointed module whole: MLA's up projections with their gathers of the latents
    (and the rotary key's), a dense MLP with its gather and reduce-scatter; the norms and the activations lie
    between collectives and rerun none."""
    def again(kind, *modules):
        return sorted(c.name for c in layer_cost(DSV3, _lay(*modules), H100, "bf16", kind, 8).recompute_comms)

    assert again(True, "mla_up_proj") == ["tp all-gather (kv up)", "tp all-gather (q up)",
                                          "tp all-gather (rotary key)"]
    assert again(False, "mlp") == ["tp all-gather (fc1)", "tp reduce-scatter (fc2)"]
    assert again(True, "mlp") == []  # "mlp" is the dense layers' module; an MoE layer's is shared_experts
    assert again(True, "shared_experts") == ["tp all-gather (fc1)", "tp reduce-scatter (fc2)"]
    assert again(True, "layernorm", "moe_act") == []


def test_mla_rotates_only_the_decoupled_query_parts_and_the_shared_key():
    # DeepSeek-V3: 128 query heads each with a 64-wide rotary part, one shared rotary key; the fused rotary
    # kernel reads and writes 2 + 2 bytes an element, so 64 more rotary dims cost 4 x 64 x (heads / t + 1)
    from dataclasses import replace

    from planner.costs import _elementwise

    ds = MODEL_PRESETS["DeepSeek-V3"]
    lay = Layout(dp=1, tp=2, pp=1, sequence_parallel=True, attention="flash")
    wide, narrow = (_elementwise(replace(ds, rope_head_dim=r), lay, False, 4096)["point_fwd"] for r in (128, 64))
    assert wide - narrow == pytest.approx(4 * 64 * (ds.heads / 2 + 1) * 4096, rel=1e-12)


def test_a_patterns_selective_mlp_recomputation_counts_only_its_mlp_layers():
    # a hybrid stack "M-*-": two of its four layers have an MLP, the Mamba and attention layers none
    from planner.models import ModelSpec

    m = ModelSpec("hybrid", 4, 256, 4, 4, 1024, 1000, 512, "swiglu", layer_pattern="M-*-", ssm_head_dim=64)
    tokens = 512
    extra = hardware_flops(m, tokens, "selective", ("mlp",)) - model_flops(m, tokens)
    assert extra == pytest.approx(2.0 * tokens * 2 * 3 * 256 * 1024, rel=1e-12)
