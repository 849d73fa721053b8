"""The Context parallel lesson: builders against hand counts and formulas, the LSE merge against one softmax,
the page through AppTest, one live ring / all-gather run at world 2."""

import re

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from core.timeline import Span, Timeline
from hardware.chips import CHIPS
from planner.models import MODEL_PRESETS
from tests.ui.apptest_util import open_app, runs_table
from ui.charts import TITLE_LINE_CHARS
from ui.context_parallel import (
    block_attention,
    block_owners,
    causal_split_figure,
    imbalance,
    kv_overlap_fraction,
    live_kv_bytes_formula,
    merge_partials,
    overlap_row,
    rank_work,
    ring_source,
)
from ui.tables import format_flops

PAGE = "app_pages/context_parallel.py"
LLAMA3_8B = MODEL_PRESETS["Llama 3 8B"]
H100 = CHIPS["h100"]


# ---- who computes which block ----------------------------------------------------------------------

def test_zigzag_owners_match_the_engine_split():
    # cp = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (engine.ring_attention docstring)
    owners = block_owners(2, "zig-zag")
    assert [row[0] for row in owners] == [0, 1, 1, 0]
    assert owners[0][1] is None and owners[3][3] == 0  # above the diagonal: masked
    assert [row[0] for row in block_owners(2, "contiguous")] == [0, 0, 1, 1]


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_work_per_rank(cp):
    contiguous = rank_work(cp, "contiguous")
    zigzag = rank_work(cp, "zig-zag")
    # contiguous: rank r owns query chunks 2r and 2r+1 -> 2r + 2r+1 full blocks below the diagonal... minus
    # none: chunk i sees i full blocks and its diagonal, so 2r + (2r + 1) = 4r + 1 full, 2 diagonal
    assert [(w["full"], w["diagonal"]) for w in contiguous] == [(4 * r + 1, 2) for r in range(cp)]
    assert [w["work"] for w in contiguous] == [4 * r + 2 for r in range(cp)]
    # zig-zag: chunks r and 2cp-1-r see r + (2cp-1-r) = 2cp - 1 full blocks and 2 diagonal ones
    assert [(w["full"], w["diagonal"], w["work"]) for w in zigzag] == [(2 * cp - 1, 2, 2 * cp)] * cp
    total = (2 * cp) ** 2 / 2  # half the matrix, diagonal counted half
    assert sum(w["work"] for w in contiguous) == sum(w["work"] for w in zigzag) == total
    assert imbalance(cp, "contiguous") == pytest.approx(2 - 1 / cp)
    assert imbalance(cp, "zig-zag") == 1


def test_split_figure_colours_blocks_by_rank():
    fig = causal_split_figure(4)
    contiguous, zigzag = fig.data[0], fig.data[1]
    assert contiguous.z[7][0] == 3.5 and zigzag.z[7][0] == 0.5  # last chunk: rank 3 vs rank 0
    assert contiguous.z[0][1] is None
    bars = [t for t in fig.data if t.type == "bar"]
    assert list(bars[0].y) == [2, 6, 10, 14] and list(bars[1].y) == [8] * 4


def test_ring_schedule():
    # at step k rank r holds the block of rank r - k: step 1 of cp = 4 gives r0 the block of r3
    assert [ring_source(r, 1, 4) for r in range(4)] == [3, 0, 1, 2]
    assert all(sorted(ring_source(r, k, 4) for k in range(4)) == [0, 1, 2, 3] for r in range(4))


# ---- the log-sum-exp merge -------------------------------------------------------------------------

def test_merge_equals_one_softmax_over_all_keys():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(6, 8)), 3 * rng.normal(size=(20, 8)), rng.normal(size=(20, 8))
    s = q @ k.T / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    reference = (p / p.sum(-1, keepdims=True)) @ v
    parts = [block_attention(q, k[a:b], v[a:b]) for a, b in ((0, 3), (3, 11), (11, 20))]
    merged = merge_partials(*merge_partials(*parts[2], *parts[0]), *parts[1])  # any order
    np.testing.assert_allclose(merged[0], reference, rtol=1e-12, atol=1e-12)  # float64, exact rule
    # the log-sum-exp of the merge is that of all scores
    np.testing.assert_allclose(merged[1] + np.log(merged[2]), np.log(np.exp(s).sum(-1)), rtol=1e-12)


# ---- overlap on real chips -------------------------------------------------------------------------

def test_overlap_numbers_by_hand():
    row = overlap_row(LLAMA3_8B, H100, 8, 131072)
    # K/V block: 2 x B=1 x S/cp=16384 x kv=8 x d=128 x 2 bytes = 64 MiB
    assert row["kv_block_bytes"] == 2 * 16384 * 8 * 128 * 2 == 64 * 2**20
    # half a block of attention: 0.5 x 4 x 16384^2 x 32 heads x 128
    assert row["block_flops"] == 2 * 16384**2 * 32 * 128
    # H100's best attention kernel (flash3: cuDNN / FA3) at 16384 keys: s / (s + 530) of its plateau
    f = H100.bf16_flops_per_s * H100.flash3_efficiency
    w = H100.scaleup_bytes_per_s * H100.link_efficiency  # 8 ranks inside one NVLink node
    assert row["compute_s"] == pytest.approx(row["block_flops"] / (f * 16384 / (16384 + 530)))
    # one message: latency + the measured pipeline fill + bytes over the NVLink plateau
    assert row["transfer_s"] == pytest.approx(H100.scaleup_latency_s + H100.scaleup_fill_s + 64 * 2**20 / w)
    assert row["hidden"] and row["ring_exposed_s"] == 0
    # S/cp >= kv/H x e x F/W, F the kernel's rate at this shard, the one the compute time runs at
    assert row["threshold_tokens"] == pytest.approx(8 / 32 * 2 * f * 16384 / (16384 + 530) / w)
    assert row["allgather_kv_held_bytes"] == 8 * row["kv_block_bytes"] == 4 * row["ring_kv_held_bytes"]
    assert row["ring_sent_bytes"] == row["allgather_sent_bytes"] == 7 * 64 * 2**20


def test_a_short_shard_across_nodes_is_exposed():
    row = overlap_row(LLAMA3_8B, H100, 16, 16384)  # 16 ranks = 2 NVLink nodes; S/cp = 1024
    w = H100.scaleout_bytes_per_s * H100.scaleout_efficiency
    assert row["transfer_s"] == pytest.approx(H100.scaleout_latency_s + H100.scaleout_fill_s
                                              + row["kv_block_bytes"] / w)
    assert not row["hidden"]
    assert row["ring_exposed_s"] == pytest.approx(15 * (row["transfer_s"] - row["compute_s"]))
    # the page shows the three terms, and they add up to the transfer
    assert (row["alpha_s"], row["fill_s"]) == (pytest.approx(H100.scaleout_latency_s),
                                               pytest.approx(H100.scaleout_fill_s))
    assert row["bandwidth_s"] == pytest.approx(row["kv_block_bytes"] / w)
    assert row["alpha_s"] + row["fill_s"] + row["bandwidth_s"] == pytest.approx(row["transfer_s"])


def test_flops_read_in_the_unit_their_size_needs():
    assert format_flops(134217728) == "134 MFLOP"
    assert [format_flops(f) for f in (2.2e12, 3.44e10, 1.5e15, 999)] == ["2.2 TFLOP", "34.4 GFLOP",
                                                                          "1.5 PFLOP", "999 FLOP"]


# ---- live-run bookkeeping ----------------------------------------------------------------------------

def live_config(world, seq_len, variant):
    from engine.cli import config_from_args, run_parser  # the page's own construction (app_pages/context_parallel.py)

    return config_from_args(run_parser("x").parse_args(
        ["--strategy", "cp", "--world", str(world), "--seq-len", str(seq_len), "--cp-variant", variant]))


def test_live_formula_and_overlap_fraction():
    cfg = live_config(2, 32, "ring")
    # default model: B = 2, kv_heads = 2, d = 16, 2 layers: block = 2 x 2 x 2 x 16 x 16 x 4 = 8 KiB
    assert live_kv_bytes_formula(cfg) == (3 * 2 - 2) * 8192 * 2
    assert live_kv_bytes_formula(live_config(2, 32, "allgather")) == 2 * 8192 * 2
    tl = Timeline([Span(0, "comm", "send kv L0", 0.0, 2.0, bytes=8, group="cp", is_async=True),  # as Comm.p2p
                   Span(0, "comm", "recv kv L0", 0.0, 2.0, group="cp", is_async=True),
                   Span(0, "compute", "attn L0 ring 0", 1.0, 4.0),
                   Span(0, "compute", "fwd L0", 0.0, 5.0)])
    assert kv_overlap_fraction(tl, 0) == 0.5  # only attention spans count, not the enclosing layer


# ---- the page ------------------------------------------------------------------------------------------

def _page(**params) -> AppTest:
    return open_app(PAGE, **params)


def _text(at: AppTest) -> str:
    # line breaks of the page source read as spaces
    return " ".join(" ".join(m.value.split()) for m in at.markdown)


def test_page_opens_with_numbers_for_the_sidebar_model():
    at = _page(model="Llama 3 8B", chip="h100")
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Context parallel"
    assert not at.error
    text = _text(at)
    assert "a K/V block is **64 MiB**" in text and "The ring is **hidden**" in text
    assert "every rank computes exactly **2·cp = 8** blocks" in text
    assert "largest difference" in at.caption[0].value
    assert len(at.get("plotly_chart")) == 2  # split picture, overlap; no live run yet


def test_a_small_block_shows_the_fill_that_makes_up_its_transfer():
    # cp = 64 at S = 8K across 8 nodes: 512 KiB take 11 µs of bytes but 154 µs in all, mostly the fill
    at = _page(model="Llama 3 8B", chip="h100", cp_degree="64", cp_seq_len="8K")
    assert not at.exception
    text = _text(at)
    assert ("a K/V block is **512 KiB** and takes **154 µs** to pass on (α 6 µs + T_fill 137 µs + bytes/W "
            "11.2 µs), while its attention step computes 134 MFLOP in") in text
    assert not re.search(r"\b0\.\d+ TFLOP", text)  # a small step's FLOPs in MFLOP, not a fraction of a TFLOP
    assert any(r"T_{comm} = \alpha + T_{fill} +" in e.proto.body for e in at.get("latex"))


def test_sliders_change_the_numbers():
    at = _page(model="Llama 3 8B", chip="h100")
    at.select_slider(key="cp_degree").set_value(16)
    at.select_slider(key="cp_seq_len").set_value(16384).run()
    assert not at.exception and not at.error
    text = _text(at)
    assert "S/cp = **1,024** tokens" in text and "The ring is **exposed**" in text
    at.select_slider(key="cp_split").set_value(2).run()
    assert "from 2 on rank 0 to 6 on rank 1" in _text(at)


def test_a_sequence_not_divisible_by_2cp_is_a_message():
    at = _page()
    at.number_input(key="cp_live_seq_len").set_value(30).run()
    assert not at.exception
    # 2 × cp written out with cp's own value beside it (2 × cp=4 had read as cp = 4 on 2 processes)
    assert ("seq_len=30 is not divisible by 2 × cp = 4 (cp=2): the load-balanced split cuts each sequence into "
            "2 × cp equal chunks; choose seq_len as a multiple of 4.") in at.error[0].value
    assert at.button[0].disabled


def test_a_shared_link_opens_the_same_view():
    at = _page(model="Llama 3 70B", chip="b200", cp_degree="4", cp_seq_len="1M", cp_split="8")
    assert not at.exception and not at.error and not at.warning, [w.value for w in at.warning]
    assert at.select_slider(key="cp_degree").value == 4 and at.select_slider(key="cp_seq_len").value == 2**20



@pytest.mark.multiprocess
def test_live_ring_and_allgather_runs_match_the_reference():
    at = _page()
    at.button[0].click().run(timeout=180)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert [s.value.split(" on ")[0] for s in at.success] == ["ring", "allgather"]
    assert all("matches the single-process reference" in s.value for s in at.success)
    rows = runs_table(at, "formula")  # by run
    assert list(rows.index) == ["ring", "allgather"]
    assert list(rows["K/V bytes sent per step (rank 0)"]) == list(rows["formula"])
    assert rows["K/V transfer under attention"].iloc[0].endswith("%")
    assert rows["K/V transfer under attention"].iloc[1] == "-"
    assert len(at.get("plotly_chart")) == 6  # the 2 lesson charts + predicted and measured per variant


def test_the_overlap_chart_writes_out_its_log_ticks_and_says_what_the_dotted_line_is():
    from hardware.chips import CHIPS
    from planner.models import MODEL_PRESETS
    from ui.context_parallel import overlap_figure

    fig = overlap_figure(MODEL_PRESETS["Llama 3 8B"], CHIPS["h100"], 4, 131072)
    ticks = list(fig.layout.yaxis.tickvals)
    assert ticks and all(str(t)[0] in "125" for t in ticks)  # 1-2-5 only, no minor-tick labels
    assert len(fig.layout.yaxis.ticktext) == len(ticks)
    assert "dotted line: your S = 128K" in fig.layout.title.text
    # on lines a window 800 px wide holds: on one line the title ran past the chart's right edge
    assert all(len(line) <= TITLE_LINE_CHARS for line in fig.layout.title.text.split("<br>"))
    assert fig.layout.margin.t >= 20 * (fig.layout.title.text.count("<br>") + 1)


def test_the_threshold_and_the_verdict_agree():
    # on TPU v5p at cp = 8, S = 8K (S/cp = 1,024) the verdict said hidden (compute 1.2x the transfer) and the
    # threshold, at the kernel's long-sequence rate, 1,275 tokens: the shard hid below its own threshold
    from hardware.chips import CHIPS

    for chip in ("tpu-v5p", "tpu-v5e", "h100", "mi300x"):
        for cp, seq in ((8, 8192), (8, 32768), (16, 16384), (4, 4096)):
            row = overlap_row(LLAMA3_8B, CHIPS[chip], cp, seq)
            bytes_hide = row["bandwidth_s"] <= row["compute_s"]
            assert (seq / cp >= row["threshold_tokens"]) == bytes_hide, (chip, cp, seq)
            if row["hidden"]:  # latency only ever adds to the transfer
                assert seq / cp >= row["threshold_tokens"], (chip, cp, seq)

