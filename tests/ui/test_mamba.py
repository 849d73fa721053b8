"""The Transformer-vs-Mamba lesson: its models, FLOPs and per-layer traffic against the planner's own numbers,
the layouts and why they differ, the exercises, the page in AppTest, and its live runs."""

import pytest

from planner.flops import total_params
from tests.ui.apptest_util import open_app, runs_table
from ui.exercises import attention_crossover, state_passing_chain
from ui.mamba import (
    HYBRID,
    MAMBA2,
    TRANSFORMER,
    best_rows,
    comm_rows,
    flops_figure,
    hybrid_spec,
    lesson_models,
    model_rows,
    position_embedding_note,
)

PAGE = "app_pages/mamba.py"


def test_the_three_models_are_the_same_size():
    specs = lesson_models(2048)
    assert [s.name for s in specs] == [TRANSFORMER, MAMBA2, HYBRID]
    sizes = [total_params(s) for s in specs]
    assert max(sizes) / min(sizes) < 1.06
    hybrid = hybrid_spec()
    assert hybrid.layer_kinds.count("*") == 8 and hybrid.layer_kinds[7] == "*"


def test_attention_grows_with_the_sequence_and_the_scan_does_not():
    short, long = model_rows(lesson_models(2048), 2048), model_rows(lesson_models(131072), 131072)
    gflop = [k for k in short[0] if k.startswith("forward")][0]
    gflop_long = [k for k in long[0] if k.startswith("forward")][0]
    assert float(long[0][gflop_long]) > 3 * float(short[0][gflop])  # the Transformer
    assert float(long[1][gflop_long]) == float(short[1][gflop])  # Mamba-2: the same per token
    fig = flops_figure(lesson_models(2048), [2048, 8192])
    assert len(fig.data) == 6


def test_the_traffic_table_says_why_mamba2_27b_cannot_use_tp():
    rows = comm_rows(lesson_models(8192), tp=2, cp=4, dp=8, chip="h100")
    mamba = [r for r in rows if r["model"] == MAMBA2]
    assert mamba[0]["operations fwd + bwd"] == "impossible: 1 SSM group"
    assert {r["layer"] for r in mamba[1:]} == {"Mamba-2 at tp = 1"}  # its other rows say which tp they show
    hybrid = {r["strategy"]: r for r in rows if r["model"] == HYBRID and r["layer"] == "Mamba-2"}
    # one all-reduce each way for a Mamba-2 layer under tp (Dao & Gu 2024 sec. 8); the hybrid's zig-zag
    # chain is 2 (cp - 1) = 6 hops plus the conv halo, each way
    assert hybrid["TP"]["operations fwd + bwd"] == "1 + 1"
    assert hybrid["CP: state passing"]["operations fwd + bwd"] == "7 + 7"
    assert hybrid["CP: all-to-all"]["operations fwd + bwd"] == "2 + 2"
    transformer = {r["strategy"]: r for r in rows if r["model"] == TRANSFORMER}
    assert transformer["TP"]["operations fwd + bwd"] == "2 + 2"
    # the hybrid's attention layers have rows of their own: attention only (one TP all-reduce, not the
    # Transformer's two), 8 KV heads (a quarter of GPT-3's ring bytes)
    attention = {r["strategy"]: r for r in rows if r["model"] == HYBRID and r["layer"] == "attention"}
    assert attention["TP"]["operations fwd + bwd"] == "1 + 1"
    assert attention["CP: ring attention"]["bytes fwd + bwd"] == "7.5 MiB + 15 MiB"
    assert transformer["CP: ring attention"]["bytes fwd + bwd"] == "30 MiB + 60 MiB"


def test_one_chip_of_a_state_chain_sends_one_state_whatever_cp():
    # the chain's hops run on different chips: the busiest chip sends one state (80 heads x 64 x 128 fp32 =
    # 2.5 MiB) and one conv halo (3 x 5,376 x 2 B), at cp = 4 as at 128 (the table had summed the chain's hops:
    # 318 MiB at cp = 128, as much as GPT-3's ring)
    for cp in (4, 128):
        rows = comm_rows(lesson_models(32768), tp=1, cp=cp, dp=1, chip="h100")
        state = next(r for r in rows if r["model"] == MAMBA2 and r["strategy"] == "CP: state passing")
        assert state["bytes fwd + bwd"] == "2.53 MiB + 2.53 MiB"
        assert state["operations fwd + bwd"] == f"{cp} + {cp}"  # cp - 1 hops one after the other, and the halo


def test_a_tp_that_does_not_divide_the_heads_is_impossible_and_one_chip_moves_nothing():
    rows = comm_rows(lesson_models(32768), tp=3, cp=1, dp=1, chip="h100")
    assert {(r["model"], r["operations fwd + bwd"]) for r in rows} == {
        (TRANSFORMER, "impossible: 32 heads"), (MAMBA2, "impossible: 1 SSM group"),
        (HYBRID, "impossible: 8 SSM groups"), (HYBRID, "impossible: 32 heads")}
    assert comm_rows(lesson_models(32768), tp=1, cp=1, dp=1, chip="h100") == []


def test_the_search_bullets_leave_out_the_full_square_mfu():
    from ui.mamba import why_they_differ

    def result(tp: int, lines: list[str]) -> dict:
        return {"tokens_per_s": 1e5, "ranked": [{"layout": {"tp": tp, "cp": 1, "recompute": "selective"},
                                                 "explanation": lines}]}

    specs = lesson_models(32768)
    lines = ["Selective recomputation (attention core only); peak memory 70.1 GB of the 79.0 GB a chip can use",
             "MFU 58.4%, 570 model TFLOP/s per chip (600 executed, recomputation included)."]
    out = why_they_differ([result(2, lines), result(1, lines), result(2, lines)], specs, 32768)
    assert any(line.startswith(f"{TRANSFORMER}: Selective recomputation") for line in out)
    assert not any("MFU" in line for line in out)


def test_the_causal_mfu_stays_below_one_at_long_context():
    from planner.api import compare_architectures
    from planner.case import Cluster

    specs = lesson_models(131072)
    results = compare_architectures(specs, Cluster("h100", 64), global_batch=64)
    rows = best_rows(results, specs, 64)
    for res in results:  # the full-square MFU of the Transformer passes 1 here; the causal one never does
        best = res["ranked"][0]
        assert 0 < best["mfu_causal"] < 1 and best["mfu_causal"] <= best["mfu"]
    assert {r["model"] for r in rows} == {TRANSFORMER, MAMBA2, HYBRID}


def test_the_exercises_follow_the_model():
    gpt = lesson_models(2048)[0]
    assert attention_crossover(gpt).answer == 6 * gpt.hidden  # 24 D^2 weights against 4 D S per token
    mamba = lesson_models(2048)[1]
    ex = state_passing_chain(mamba, 8)
    assert ex.answer == f"7 hops of {80 * 64 * 128 * 4:,} bytes"


def test_the_page_opens_with_every_section():
    at = open_app(PAGE, chip="h100", dp="8", cp="4", tp="2")
    assert not at.exception, [e.value for e in at.exception]
    headers = [h.value for h in at.header]
    assert headers == ["Same size, two architectures", "What each strategy moves, per layer",
                       "The fastest layout for each", "Run it for real"]
    assert not any("fastest layout" in t.value.columns for t in at.table)  # searched on the button
    at.button(key="ssm_search").click().run()
    assert not at.exception, [e.value for e in at.exception]
    layouts = next(t.value for t in at.table if "fastest layout" in t.value.columns)  # wraps: no column hidden
    assert list(layouts["model"]) == [TRANSFORMER, MAMBA2, HYBRID]
    assert any(m.value.startswith("- At S = 32,768") for m in at.markdown)
    at.select_slider(key="ssm_seq_len").set_value(131072).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("search again" in c.value for c in at.caption)


@pytest.mark.multiprocess
def test_the_three_live_runs_match_the_reference():
    at = open_app(PAGE)
    at.select_slider(key="ssm_live_steps").set_value(1).run()
    at.button(key="ssm_live_run").click().run(timeout=300)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    table = runs_table(at, "transfers per layer, rank 0")
    assert list(table["check"]) == ["passed"] * 3
    # per layer, rank 0 of 2: ring 1 K/V send forward, 1 K/V and 2 dK/dV sends backward (3 cp - 2 per
    # direction pair, engine/cp.py); state passing 1 state forward (+ the halo), 0 gradients back
    ring, state, alltoall = (int(x) for x in table["transfers per layer, rank 0"])
    assert ring == 4 and state == 2 and alltoall == 4
    assert any(m.value.startswith("- Most bytes over cp") for m in at.markdown)


def test_the_page_says_what_is_unset_and_the_real_batch():
    at = open_app(PAGE, chip="h100", dp="8")
    text = " ".join(m.value for m in at.markdown)
    assert "Set tp or cp above 1 in the sidebar to see them." in text
    assert "4,194,304 tokens per step (128 sequences of 32,768)" in text
    at = open_app(PAGE, chip="h100", dp="8", cp="4")
    assert "Set tp above 1 in the sidebar to see it." in " ".join(m.value for m in at.markdown)
    at = open_app(PAGE, chip="h100", dp="16", cp="2", tp="2")
    at.select_slider(key="ssm_seq_len").set_value(524288).run()
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(m.value for m in at.markdown)
    assert "Set tp" not in text and "Set cp" not in text and "about 4M" not in text
    # one 512K sequence per chip at least (planner.presets.make_case): 64 x 524,288 tokens
    assert "33,554,432 tokens per step (64 sequences of 524,288: one per chip" in text


def test_gpt3_growing_with_the_sequence_is_explained():
    assert position_embedding_note(lesson_models(2048)[0]) is None  # as released
    assert all(position_embedding_note(s) is None for s in lesson_models(524288)[1:])  # no position embeddings
    at = open_app(PAGE)
    at.select_slider(key="ssm_seq_len").set_value(524288).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.table[0].value["parameters"][0] == "3.99\u00a0B"  # a number and its unit on one line (text_table)
    # 2,560 learned numbers per position: (524,288 - 2,048) x 2,560 = 1.34 B more than GPT-3 2.7B as released
    note = next(c.value for c in at.caption if "position embedding" in c.value)
    assert "1.34 B parameters more than the released model" in note and "3.99 B in all" in note
