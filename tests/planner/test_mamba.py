"""Mamba-2 (SSD) and hybrid stacks: hand counts, SSD's linear cost, what each strategy moves, bad specs,
and the search's best layouts for a Transformer, Mamba-2 and a hybrid on the same cluster."""

import pytest

from hardware.chips import get_chip
from planner.api import compare_architectures, estimate, flops_per_token_by_seq, layer_comm_bytes, search
from planner.case import Cluster, Layout, parse_case
from planner.costs import layer_cost
from planner.flops import (
    forward_flops,
    layer_forward_flops_per_token,
    matmul_flops_per_token,
    ssm_flops_per_token,
    total_params,
)
from planner.memory import mamba_activation_terms
from planner.models import MODEL_PRESETS, SSM_PRESETS, ModelSpec, SpecError
from planner.presets import make_case

MAMBA2 = SSM_PRESETS["Mamba-2 2.7B"]
NEMOTRON = SSM_PRESETS["Nemotron-H 8B"]
GPT3_27 = MODEL_PRESETS["GPT-3 2.7B"]
H100 = get_chip("h100")
SMALL = ModelSpec("small", 2, 64, 0, 0, 0, 100, 128, layer_pattern="MM", ssm_state=16, ssm_head_dim=16,
                  ssm_expand=2, ssm_groups=2, ssm_conv=4, ssm_chunk=32)


def test_mamba2_27b_parameters_by_hand():
    # d = 2560, e = 2d = 5120, H = e / 64 = 80, G = 1, N = 128, conv 4
    in_proj = 2560 * (2 * 5120 + 2 * 1 * 128 + 80)  # z, x, B, C, dt: 27,074,560
    conv = (5120 + 2 * 128) * (4 + 1)  # depthwise weights + bias over xBC: 26,880
    per_head = 3 * 80  # dt_bias, A_log, D
    gated_norm = 5120
    out_proj = 5120 * 2560  # 13,107,200
    pre_norm = 2560
    layer = in_proj + conv + per_head + gated_norm + out_proj + pre_norm  # 40,216,560
    embedding = 50288 * 2560  # tied with the output (mamba_ssm tie_embeddings=True)
    assert total_params(MAMBA2) == 64 * layer + embedding + 2560  # + final norm = 2,702,599,680
    assert total_params(MAMBA2) == pytest.approx(2.7e9, rel=0.01)  # "Mamba-2 2.7B"
    assert total_params(GPT3_27) == pytest.approx(total_params(MAMBA2), rel=0.03)  # the side-by-side pair


def test_nemotron_h_8b_is_8b_and_a_sum_over_its_pattern():
    assert total_params(NEMOTRON) == pytest.approx(8.1e9, rel=0.01)
    per_layer = {k: layer_forward_flops_per_token(NEMOTRON, k) for k in "M*-"}
    by_pattern = sum(per_layer[c] for c in NEMOTRON.layer_pattern) + 2 * NEMOTRON.vocab * NEMOTRON.hidden
    assert forward_flops(NEMOTRON, 1.0) == pytest.approx(by_pattern, rel=1e-12)


def test_small_mamba_flops_per_token_by_hand():
    # d 64, e 128, H = 128/16 = 8, G 2, N 16, P 16, Q 32, conv 4, vocab 100
    proj = 2 * (64 * (2 * 128 + 2 * 2 * 16 + 8) + 128 * 64)  # in_proj + out_proj: 58,368
    intra = 2 * 32 * (16 * 2 + 16 * 8)  # C.B^T per group + scores . x per head: 10,240
    states_and_output = 4 * 16 * 16 * 8  # B^T.x and C.h: 8,192
    recurrence = 2 * 16 * 16 * 8 / 32  # 128
    conv = 2 * 4 * (128 + 2 * 2 * 16)  # 1,536
    layer = proj + intra + states_and_output + recurrence + conv
    assert forward_flops(SMALL, 1.0) == pytest.approx(2 * layer + 2 * 100 * 64, rel=1e-12)


def test_ssd_is_linear_in_the_sequence_and_attention_quadratic():
    def per_sequence(m, s, fn):
        return fn(m, s) * s

    from planner.flops import attention_flops_per_token
    for s in (2048, 4096, 8192):
        assert per_sequence(MAMBA2, 2 * s, ssm_flops_per_token) == pytest.approx(
            2 * per_sequence(MAMBA2, s, ssm_flops_per_token), rel=1e-12)
        assert per_sequence(GPT3_27, 2 * s, attention_flops_per_token) == pytest.approx(
            4 * per_sequence(GPT3_27, s, attention_flops_per_token), rel=1e-12)
    rows = flops_per_token_by_seq(MAMBA2, [2048, 65536])
    assert rows[0]["total"] == rows[1]["total"] and rows[0]["attention"] == 0
    assert rows[0]["matmul"] == matmul_flops_per_token(MAMBA2)


def _ops(ops, kind):
    return [c for c in ops if c.kind == kind]


def test_tp_one_all_reduce_per_mamba_layer_each_way():
    lay = Layout(dp=1, tp=8, pp=1, micro_batch=1)
    mamba = layer_cost(NEMOTRON, lay, H100, "bf16", "M", 8)
    assert [len(_ops(mamba.fwd_comms, "all_reduce")), len(_ops(mamba.bwd_comms, "all_reduce"))] == [1, 1]
    llama = layer_cost(MODEL_PRESETS["Llama 3 8B"], lay, H100, "bf16", False, 8)
    assert [len(_ops(llama.fwd_comms, "all_reduce")), len(_ops(llama.bwd_comms, "all_reduce"))] == [2, 2]
    sp = layer_cost(NEMOTRON, Layout(dp=1, tp=8, pp=1, sequence_parallel=True), H100, "bf16", "M", 8)
    assert sorted(c.kind for c in sp.fwd_comms) == ["all_gather", "reduce_scatter"]


def test_cp_state_passing_is_a_chain_of_state_hops():
    tp, cp, b = 2, 4, 2
    lay = Layout(dp=1, tp=tp, pp=1, cp=cp, micro_batch=b, ssm_cp="state")
    lc = layer_cost(NEMOTRON, lay, H100, "bf16", "M", 8)
    chain = next(c for c in lc.fwd_comms if c.name == "cp ssm state chain")
    h, p, n = NEMOTRON.ssm_heads, NEMOTRON.ssm_head_dim, NEMOTRON.ssm_state
    # a hybrid's slices are zig-zagged for its attention layers: the chain goes out to the last rank and
    # back, 2 (cp - 1) hops (engine/ssm_cp.py runs it so)
    assert chain.count == 2 * (cp - 1) and chain.nbytes == b * h / tp * p * n * 4  # fp32 states, per sequence
    assert chain.exposed_s == chain.time_s  # each rank waits for the previous state
    back = next(c for c in lc.bwd_comms if c.name == "cp ssm state-gradient chain")
    assert back.count == 2 * (cp - 1) and back.nbytes == chain.nbytes
    halo = next(c for c in lc.fwd_comms if c.name == "cp conv halo")
    assert halo.nbytes == b * (NEMOTRON.ssm_conv - 1) * (NEMOTRON.ssm_inner + 2 * 8 * n) / tp * 2
    moved = layer_comm_bytes(NEMOTRON, "M", tp=tp, cp=cp, micro_batch=b)
    # what one chip sends is not the chain's all: a middle rank of the zig-zag passes two states on, and two
    # halos (engine/ssm_cp.py; cp = 4: ranks send 1, 2, 2, 1 states), at any cp
    assert moved["cp_state"]["ops_fwd"] == 2 * (cp - 1) + 1  # the chain's hops one after the other, the halo
    assert moved["cp_state"]["bytes_fwd"] == 2 * chain.nbytes + 2 * halo.nbytes
    assert layer_comm_bytes(NEMOTRON, "M", tp=tp, cp=16, micro_batch=b)["cp_state"]["bytes_fwd"] == pytest.approx(
        moved["cp_state"]["bytes_fwd"])
    # a model of Mamba-2 layers only keeps its slices in order: cp - 1 hops
    pure = layer_cost(MAMBA2, Layout(dp=1, tp=1, pp=1, cp=cp, micro_batch=b, ssm_cp="state"), H100, "bf16", "M", 8)
    pure_chain = next(c for c in pure.fwd_comms if c.name == "cp ssm state chain")
    assert pure_chain.count == cp - 1 and pure_chain.sent_bytes(cp) == pure_chain.nbytes  # one state per rank


def test_cp_all_to_all_moves_xbc_dt_in_and_y_out_twice_each_way():
    tp, cp, b = 2, 4, 1
    moved = layer_comm_bytes(NEMOTRON, "M", tp=tp, cp=cp, micro_batch=b)["cp_alltoall"]
    tokens = b * NEMOTRON.seq_len / cp
    e, g, n, h = NEMOTRON.ssm_inner, 8, NEMOTRON.ssm_state, NEMOTRON.ssm_heads
    into, out = tokens * (e + 2 * g * n + h) / tp * 2, tokens * e / tp * 2
    assert moved["ops_fwd"] == moved["ops_bwd"] == 2
    # each rank keeps its own 1/cp of the buffer and sends the rest
    assert moved["bytes_fwd"] == moved["bytes_bwd"] == pytest.approx((into + out) * (cp - 1) / cp)
    # attention layers of the hybrid keep the K/V ring
    assert layer_comm_bytes(NEMOTRON, "*", tp=tp, cp=cp)["cp_ring"]["ops_fwd"] == cp - 1
    assert "cp_ring" not in layer_comm_bytes(NEMOTRON, "-", tp=tp, cp=cp)


def test_chunk_states_in_activation_memory():
    lay = Layout(dp=1, tp=1, pp=1, micro_batch=1)
    terms = mamba_activation_terms(MAMBA2, lay)
    assert terms["chunk states (fp32)"] == 4 * (2048 / 256) * 80 * 64 * 128


@pytest.mark.parametrize("change, field", [
    ({"layer_pattern": "MM"}, "model.layer_pattern"),  # 2 chars for 4 layers
    ({"layer_pattern": "MMXM"}, "model.layer_pattern"),
    ({"ssm_head_dim": 48}, "model.ssm_head_dim"),  # 512 / 48 is not whole
    ({"ssm_groups": 3}, "model.ssm_groups"),  # 8 heads
    ({"layer_pattern": "M*M*", "heads": 0}, "model.heads"),  # attention layers need heads
    ({"mlp": "gelu"}, "model.mlp"),
])
def test_bad_mamba_specs_name_the_field(change, field):
    kw = dict(name="bad", layers=4, hidden=256, heads=0, kv_heads=0, ffn=0, vocab=100, seq_len=256,
              layer_pattern="MMMM", ssm_head_dim=64)
    kw.update(change)
    with pytest.raises(SpecError, match=field):
        ModelSpec(**kw)


def _case(model, chips=8, **parallel):
    fields = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "seq_len", "mlp",
              "layer_pattern", "ssm_state", "ssm_head_dim", "ssm_expand", "ssm_groups", "ssm_conv", "ssm_chunk")
    block = {f: getattr(model, f) for f in fields if getattr(model, f) not in (None, 0)}
    training = {"global_batch": 64, "ssm_cp": parallel.pop("ssm_cp", None)}
    return {"name": model.name, "model": block, "training": training, "parallel": parallel,
            "cluster": {"chip": "h100", "num_chips": chips, "chips_per_node": 8}}


def test_layouts_the_ssm_cannot_run_are_refused():
    with pytest.raises(SpecError, match="parallel.tp"):
        parse_case(_case(MAMBA2, tp=2))  # ngroups = 1: no TP for Mamba-2 2.7B
    with pytest.raises(SpecError, match="training.ssm_cp"):
        parse_case(_case(NEMOTRON, chips=64, tp=4, cp=4, ssm_cp="alltoall"))  # 16 does not divide 8 groups
    res = search(parse_case(_case(MAMBA2)), top=50)
    assert res.ranked and all(r.result.layout.tp == 1 for r in res.ranked)


def test_search_tries_both_cp_variants_and_reports_the_choice():
    case = parse_case(_case(NEMOTRON, chips=8, tp=2, cp=2, pp=1))
    variants = {r.result.layout.ssm_cp for r in search(case, top=100).ranked}
    assert variants == {"state", "alltoall"}
    assert estimate(case).chosen["training"]["ssm_cp"] in ("state", "alltoall")
    assert "ssm_cp" not in estimate(make_case("Llama 3 8B", "8x H100 (one node)")).chosen.get("training", {})


@pytest.mark.parametrize("name", ["Mamba-2 2.7B", "Nemotron-H 8B"])
@pytest.mark.parametrize("chips", [8, 64])
def test_estimate_and_search_run(name, chips):
    cluster = Cluster("h100", chips, 8)
    est = estimate(make_case(name, cluster))
    assert est.fits and 0.1 < est.mfu < 0.8
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s)
    report = search(make_case(name, cluster), top=3)
    assert report.ranked[0].result.step_time_s == pytest.approx(est.step_time_s)


def test_best_layouts_transformer_vs_mamba2_vs_hybrid_on_one_cluster(capsys):
    rows = compare_architectures(["GPT-3 2.7B", "Mamba-2 2.7B", "Nemotron-H 8B"], Cluster("h100", 64, 8))
    with capsys.disabled():
        print()
        for row in rows:
            best = row["ranked"][0]
            lay = best["layout"]
            print(f"{row['model']:>14}: {row['params'] / 1e9:.2f}B  step {best['step_time_s']:.3f} s  "
                  f"MFU {100 * best['mfu']:.1f}%  {row['tokens_per_s'] / 1e6:.2f}M tok/s  "
                  f"dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} mb={lay['micro_batch']} "
                  f"zero={lay['zero_stage']} rc={lay['recompute']} sp={lay['sequence_parallel']} "
                  f"ssm_cp={lay['ssm_cp']}")
            print("                " + " ".join(f"{k}={v:.3f}" for k, v in best["breakdown_s"].items() if v))
    gpt, mamba = rows[0]["ranked"][0], rows[1]["ranked"][0]
    assert mamba["layout"]["tp"] == 1  # ngroups = 1 leaves it no TP
    assert gpt["mfu"] > mamba["mfu"]  # SSD's small chunk matmuls and memory-bound passes


def test_a_mamba_layer_under_zero3_gathers_its_weights_and_pays_for_what_hides():
    # the same collectives and slowdown as any ZeRO-3 layer (costs._with_zero3_and_slowdown): one gather of its
    # bf16 weights forward, a re-gather and a gradient reduce-scatter backward, each second that hides costing
    # overlap_slowdown of compute, and FSDP's copies of the gathered weights on the compute stream
    from dataclasses import replace

    from planner.costs import overlap_slowdown
    from planner.flops import layer_params

    lay = Layout(dp=8, tp=1, pp=1, micro_batch=1, zero_stage=3, recompute="none")
    z3, z0 = (layer_cost(NEMOTRON, replace(lay, zero_stage=s), H100, "bf16", "M", 8) for s in (3, 0))
    assert not [c for c in z0.fwd_comms + z0.bwd_comms if c.group == "dp"]
    (gather,) = [c for c in z3.fwd_comms if c.group == "dp"]
    assert [c.kind for c in z3.bwd_comms if c.group == "dp"] == ["all_gather", "reduce_scatter"]
    lp = layer_params(NEMOTRON, "M")
    assert gather.nbytes == pytest.approx(2 * (lp.ssm + lp.norms), rel=1e-9)
    hidden_fwd = sum(c.hidden_s for c in z3.fwd_comms)
    assert hidden_fwd > 0 and z3.fwd_compute_s > z0.fwd_compute_s + overlap_slowdown(H100) * hidden_fwd
