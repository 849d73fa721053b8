"""The Tensor and sequence parallel lesson: builders against the papers' formulas, the page through AppTest,
one live TP / TP + SP run at world 2."""

from types import SimpleNamespace

import pytest
from streamlit.testing.v1 import AppTest

from core.timeline import Span, Timeline
from hardware.chips import CHIPS
from hardware.collectives import group_topology
from planner.memory import korthikanti_bytes
from planner.models import MODEL_PRESETS
from tests.ui.apptest_util import open_app, runs_table
from ui.charts import RANK_COLORS
from ui.tensor_parallel import (
    activation_bytes,
    comm_bytes_by_kind,
    head_owners,
    live_rows,
    scaling_rows,
    split_figure,
    tp_comm_bytes_per_layer,
    tp_comm_seconds_per_layer,
    tp_config_error,
)

PAGE = "app_pages/tensor_parallel.py"
LLAMA3_8B = MODEL_PRESETS["Llama 3 8B"]
GPT3 = MODEL_PRESETS["GPT-3 175B"]


def _extent(trace) -> tuple[float, float, float, float]:
    xs = [x for x in trace.x if x is not None]
    ys = [y for y in trace.y if y is not None]
    return min(xs), max(xs), min(ys), max(ys)


# ---- the split picture --------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_split_figure_gives_each_rank_its_colour_and_block(tp):
    d, f = 4096, 14336
    fig = split_figure(d, f, 32, 8, tp)
    w_in = [t for t in fig.data if t.xaxis == "x"]
    w_out = [t for t in fig.data if t.xaxis == "x2"]
    heads = [t for t in fig.data if t.xaxis == "x3"]
    assert len(w_in) == len(w_out) == len(heads) == tp
    assert [t.fillcolor for t in w_in] == list(RANK_COLORS[:tp])
    assert len(set(t.fillcolor for t in w_in)) == tp
    for r in range(tp):
        # column-parallel: rank r owns columns [r F/t, (r+1) F/t) of W_in, all D rows
        assert _extent(w_in[r]) == (r * f / tp, (r + 1) * f / tp, 0, d)
        # row-parallel: the same slice of F, now as rows of W_out, all D columns
        assert _extent(w_out[r]) == (0, d, r * f / tp, (r + 1) * f / tp)
        assert w_in[r].name == w_out[r].name == heads[r].name == f"rank {r}"
    # 32 query heads over t ranks: 32/t head cells per rank (plus the KV row under them)
    q_cells = [sum(1 for i in range(0, len(t.y), 6) if t.y[i] == 0) for t in heads]  # 6 points per box
    assert q_cells == [32 // tp] * tp


def test_split_figure_gives_each_panel_room():
    """Three panels in a row were too narrow in a window 1,024 px wide: their titles ran into each other and
    W_out's axis title lay over W_in's last block. The matrices share a row, their titles on two lines, W_out's
    rows labelled on its right; the heads take the width under them."""
    fig = split_figure(4096, 14336, 32, 8, 8)
    assert fig.layout.yaxis2.side == "right"
    assert list(fig.layout.xaxis3.domain) == [0.0, 1.0]
    titles = [a.text for a in fig.layout.annotations]
    assert titles[:2] == ["W_in[D, F_tp] by columns:<br>4,096 x 1,792 each",
                          "W_out[F_tp, D] by rows:<br>1,792 x 4,096 each"]


def test_split_figure_refuses_a_tp_that_does_not_divide():
    with pytest.raises(ValueError, match="tp=3"):
        split_figure(4096, 14336, 32, 8, 3)


def test_kv_heads_are_split_or_replicated():
    q_owner, kv = head_owners(32, 8, 4)
    assert q_owner[:9] == [0] * 8 + [1]
    assert kv == [[0], [0], [1], [1], [2], [2], [3], [3]]  # 2 whole KV heads per rank
    _, kv = head_owners(32, 8, 16)
    assert kv[0] == [0, 1] and all(len(ranks) == 2 for ranks in kv)  # tp > kv_heads: 2 copies each


def test_tp_fit_uses_the_engine_messages():
    assert tp_config_error(LLAMA3_8B, 8) is None
    assert tp_config_error(LLAMA3_8B, 16) is None  # 8 KV heads, each replicated on 2 ranks
    message = tp_config_error(LLAMA3_8B, 3)
    assert message.startswith("heads=32 is not divisible by tp=3") and "{1, 2, 4, 8, 16, 32}" in message
    assert "heads=40 is not divisible by tp=16" in tp_config_error(MODEL_PRESETS["Llama 2 13B"], 16)
    # the vocabulary is padded as Megatron does, so GPT-3's 50,257 tokens do not block tp = 8
    assert tp_config_error(GPT3, 8) is None


# ---- memory and communication -------------------------------------------------------------------

def test_activation_memory_is_korthikanti_table_2():
    s, b, h, a, t = GPT3.seq_len, 1, GPT3.hidden, GPT3.heads, 8
    sbh = s * b * h
    mem = activation_bytes(GPT3, b, t)
    # GPT-3: 5as/h = 5 * 96 * 2048 / 12288 = 80, so one chip keeps 114 sbh, TP 10 + 24/8 + 80/8 = 23 sbh,
    # TP + SP 114/8 = 14.25 sbh, selective recomputation 34/8 = 4.25 sbh
    assert mem["none"] == pytest.approx(114 * sbh)
    assert mem["tp"] == pytest.approx(23 * sbh)
    assert mem["tp+sp"] == pytest.approx(14.25 * sbh)
    assert mem["tp+sp+selective"] == pytest.approx(4.25 * sbh)
    for mode in ("tp", "tp+sp", "tp+sp+selective"):
        assert mem[mode] == korthikanti_bytes(s, b, h, a, t, mode)


def test_comm_bytes_are_four_ring_all_reduces_of_bsh():
    # 4 x 2(t-1)/t x b s h x 2 bytes. Llama 3 8B, t = 8, b = 1: V = 8192 x 4096 x 2 = 64 MiB,
    # 4 x 1.75 x V = 448 MiB
    assert tp_comm_bytes_per_layer(LLAMA3_8B, 1, 8) == 448 * 2**20
    assert tp_comm_bytes_per_layer(LLAMA3_8B, 2, 2) == 4 * 2 * 1 / 2 * 2 * 8192 * 4096 * 2
    assert tp_comm_bytes_per_layer(LLAMA3_8B, 1, 1) == 0


@pytest.mark.parametrize("tp", [2, 8, 16])
def test_sequence_parallel_costs_what_tp_costs(tp):
    # the same bytes over the same links; SP's two operations per all-reduce each fill their pipeline. Across
    # two nodes (t = 16) the all-gather and reduce-scatter are flat rings through all 16 GPUs, 2 x 7 NVLink
    # steps each, where the all-reduce runs NCCL's trees, 7 each way (hardware.collectives.Hierarchy): SP
    # pays 14 NVLink steps more per pair of collectives
    h100 = CHIPS["h100"]
    topo = group_topology(h100, tp, achievable=True)
    v = 8192 * 4096 * 2
    assert tp_comm_seconds_per_layer(topo, LLAMA3_8B, 1, False) == pytest.approx(4 * topo.all_reduce_s(v))
    ring_steps = 4 * 14 * h100.scaleup_latency_s if tp > h100.scaleup_domain else 0.0
    assert tp_comm_seconds_per_layer(topo, LLAMA3_8B, 1, True) == pytest.approx(
        tp_comm_seconds_per_layer(topo, LLAMA3_8B, 1, False) + 4 * topo.fill_s + ring_steps)


def test_scaling_rows_cross_the_nvlink_domain():
    rows = {r["tp"]: r for r in scaling_rows(LLAMA3_8B, CHIPS["h100"], 1, [1, 2, 4, 8, 16])}
    assert rows[1]["comm_s"] == 0 and rows[8]["inside_domain"] and not rows[16]["inside_domain"]
    assert "2 domains x 8" in rows[16]["topology"]
    # compute per chip falls with t while the communication grows, and more so past the node
    assert rows[16]["compute_s"] < rows[8]["compute_s"] < rows[2]["compute_s"]
    assert rows[2]["comm_s"] < rows[8]["comm_s"] < rows[16]["comm_s"]
    # a tp group spread over nodes pays the network for every byte
    assert rows[8]["comm_spread_s"] > 5 * rows[8]["comm_s"]


def test_measured_bytes_by_kind_and_rows():
    def span(rank, name, nbytes):
        return Span(rank, "comm", name, 0.0, 1.0, bytes=nbytes, group="tp")

    tp_tl = Timeline([span(0, "all_reduce L0 attn", 400), span(0, "all_reduce L0 mlp grad", 400),
                      Span(0, "compute", "fwd L0", 0.0, 1.0), span(1, "all_reduce L0 attn", 400)])
    sp_tl = Timeline([span(0, "all_gather L0 attn", 200), span(0, "reduce_scatter L0 attn", 200),
                      span(0, "all_gather L0 mlp grad", 200), span(0, "reduce_scatter L0 mlp", 200)])
    assert comm_bytes_by_kind(tp_tl, 0, steps=2) == {"all_reduce": 400}
    assert comm_bytes_by_kind(sp_tl, 0, steps=2) == {"all_gather": 200, "reduce_scatter": 200}

    def summary(sent, acts):
        return SimpleNamespace(steps=2, comm_bytes=[sent], memory_bytes=[{"activations_peak": acts}],
                               step_time_s=0.01)

    rows = live_rows([("TP", summary(800, 4096), tp_tl, 400), ("TP + SP", summary(800, 2048), sp_tl, 400)])
    assert [r["bytes sent per step (rank 0)"] for r in rows] == ["400", "400"]
    assert rows[1]["all-gather"] == rows[1]["reduce-scatter"] == "200" and rows[1]["all-reduce"] == "0"
    assert rows[0]["activations (rank 0)"] == "4 KiB" and rows[1]["activations (rank 0)"] == "2 KiB"


# ---- the page -----------------------------------------------------------------------------------

def _page(**params) -> AppTest:
    return open_app(PAGE, **params)


def _text(at: AppTest) -> str:
    return " ".join(m.value for m in at.markdown)


def test_page_opens_with_numbers_for_the_sidebar_model():
    at = _page(model="Llama 3 8B", chip="h100")
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Tensor and sequence parallel"
    assert not at.error
    text = _text(at)
    assert at.select_slider(key="tp_degree").value == 8  # sidebar tp = 1: start at a full NVLink node
    assert "which at t = **8** is **448 MiB**" in text
    assert "**1.78 GB** per layer per chip, sequence parallel **1.48 GB**" in text
    assert "At t = 16 the group spans 2 nodes of 8" in text
    assert len(at.get("plotly_chart")) == 4  # split, activations, bound meter, scaling; no live run yet


def test_slider_changes_the_numbers():
    at = _page(model="Llama 3 8B", chip="h100")
    at.select_slider(key="tp_degree").set_value(2).run()
    assert not at.exception and not at.error
    text = _text(at)
    # t = 2: 4 x 2(1/2) x 64 MiB = 256 MiB; TP keeps sbh(10 + 12 + 160) = 182 sbh = 6.11 GB per layer
    assert "which at t = **2** is **256 MiB**" in text
    assert "tensor parallel alone keeps **6.11 GB**" in text


def test_a_linked_tp_that_does_not_divide_the_heads_is_replaced_and_said():
    at = _page(model="Llama 3 8B", chip="h100", tp_degree="3")
    assert not at.exception
    assert "t = 3 cannot split Llama 3 8B (heads=32 is not divisible by tp=3" in at.info[0].value
    assert at.select_slider(key="tp_degree").value == 8
    assert len(at.get("plotly_chart")) == 4  # the split picture, activations, the bound meter, the scaling


def test_a_bad_live_run_is_the_engine_message_without_starting_workers():
    at = _page()
    at.select_slider(key="tp_live_world").set_value(4)
    at.select_slider(key="tp_live_heads").set_value(2)
    at.select_slider(key="tp_live_kv_heads").set_value(2)
    at.button[0].click().run()
    assert not at.exception
    assert "heads=2 is not divisible by tp=4" in at.error[0].value



@pytest.mark.multiprocess
def test_live_tp_and_sp_runs_match_the_reference():
    at = _page()
    at.select_slider(key="tp_live_world").set_value(2)
    at.select_slider(key="tp_live_steps").set_value(1)
    at.button[0].click().run(timeout=180)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert [s.value.split(" on ")[0] for s in at.success] == ["TP", "TP + SP"]
    assert all("matches the single-process reference" in s.value for s in at.success)
    # the measured table, a column per run (app_pages.text_table's columns_from): read back a row per run
    rows = runs_table(at, "formula (engine.tp)")
    assert list(rows.index) == ["TP", "TP + SP"]
    measured = [int(v.replace(",", "")) for v in rows["bytes sent per step (rank 0)"]]
    formula = [int(v.replace(",", "")) for v in rows["formula (engine.tp)"]]
    assert measured == formula
    assert abs(measured[1] - measured[0]) < 0.02 * measured[0]  # only the norms' weight gradients differ
    kib = [int(v.split()[0].replace(",", "")) for v in rows["activations (rank 0)"]]
    assert kib[1] < kib[0]
    # the 4 lesson charts + the predicted and the measured timeline of each run
    assert len(at.get("plotly_chart")) == 8
    assert [m.label for m in at.metric].count("Prediction error") == 2


def test_a_micro_batch_the_slider_does_not_offer_is_said_not_replaced_silently():
    at = _page(tp_micro_batch="3")
    assert not at.exception
    said = " ".join(i.value for i in at.info)
    assert "tp_micro_batch=`3` (it takes one of 1, 2, 4, 8)" in said
    assert at.select_slider(key="tp_micro_batch").value == 1
    assert not _page(tp_micro_batch="4").info  # one it offers: no word
    # two values it offers: the slider takes one, and had gone back to its default without a word
    twice = _page(tp_micro_batch=["2", "4"])
    assert "tp_micro_batch=`2, 4` (it takes one value, one of 1, 2, 4, 8)" in " ".join(i.value for i in twice.info)
    assert twice.select_slider(key="tp_micro_batch").value == 1


def test_a_shared_link_opens_the_same_tp():
    at = _page(model="Llama 3 70B", chip="b200", tp_degree="4", tp_micro_batch="2")
    assert not at.exception and not at.error and not at.warning, [w.value for w in at.warning]
    assert at.select_slider(key="tp_degree").value == 4 and at.select_slider(key="tp_micro_batch").value == 2
    # Llama 3 70B, b = 2: V = 2 x 8192 x 8192 x 2 bytes = 256 MiB; 4 x 2(3/4) x V = 1.5 GiB per layer
    assert "which at t = **4** is **1.5 GiB**" in _text(at)


def test_the_bound_meter_says_when_tp_is_communication_bound():
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/tensor_parallel.py", chip="tpu-v5p", model="GPT-3 2.7B", tp_degree="8")
    assert not at.exception
    text = next(m.value for m in at.markdown if "Y < F / (C / W)" in m.value)  # GPT-3's MLP: two matrices
    # t = 8 on the 2 x 2 x 2 slice of the sidebar's 8 chips spans all three axes, one link each way on each:
    # W = 3 x 90 GB/s, C / W = 4.59e14 / 2.7e11 = 1,700 (one wrapped axis would be [SB]'s 2,550)
    assert text.startswith("**Communication-bound**") and "10,240 / 1,700 = 6.0" in text
    assert "3 ICI axes of 2 x 2 x 2 chips" in text


def test_a_product_in_an_engine_message_is_written_out_not_eaten_by_markdown():
    from ui.collectives import markdown_text
    from ui.tensor_parallel import refused_degrees_text, tp_degrees

    # GPT-3 175B: seq_len 2,048 is not divisible by 3, 6 or 12, which sequence parallel needs
    assert refused_degrees_text(tp_degrees(GPT3)[1]).startswith(
        "t = 3, 6, 12 (seq_len=2048 is not divisible by tp); t = 5, 7, 9")
    assert markdown_text("2*cp chunks, a * b, V*") == "2 × cp chunks, a \\* b, V\\*"
    at = _page(model="GPT-3 175B", chip="h100", tp_degree="3")
    assert not at.exception
    caption = next(c.value for c in at.caption if c.value.startswith("Not offered for GPT-3 175B"))
    assert "*" not in caption and "(seq_len=2048 is not divisible by tp)" in caption
    assert "seq_len=2048 is not divisible by tp × cp=3: sequence parallel" in at.info[0].value


def test_the_bound_meter_and_the_estimate_each_say_what_they_count():
    import json

    at = _page(model="Llama 3 8B", chip="h100")  # t = 8: the rule counts one MLP, the estimate the layer (36%)
    assert not at.exception
    text = _text(at)
    assert "planner estimate of the whole layer" in text and "communication is **36%** of the compute" in text
    verdict = next(m.value for m in at.markdown if "x F / (C / W)" in m.value)
    # Llama's SwiGLU MLP: three matrices, 6 s D F / (t C) of math (the rule had counted two: 0.82x, 243 µs)
    assert verdict.startswith("**Compute-bound** by the rule: one MLP's matmuls take 1.22x")
    assert "1.5 x 14,336 / 2,198 = 9.8" in verdict
    assert "per layer" not in verdict  # the rule counts one MLP, one pass
    table = next(m.value for m in at.markdown if "| bound meter (the rule) | planner estimate |" in m.value)
    # the rule: 6 s D F / (t C) against 4 s D / W; the estimate 1 / 36%
    assert "| math | 365 µs | 4.21 ms |" in table and "| communication | 298 µs | 1.53 ms |" in table
    assert "| math / communication | **1.22x** | **2.75x** |" in table
    meter = json.loads(at.get("plotly_chart")[2].proto.spec)["layout"]
    assert meter["title"]["text"] == ("The scaling book's rule at t = 8, one MLP, one pass:<br>"
                                      "compute-bound")
    assert meter["xaxis"]["title"]["text"].startswith("µs per MLP pass")


def test_the_slider_offers_only_the_degrees_that_split_the_model():
    from ui.tensor_parallel import refused_degrees_text, tp_degrees

    valid, refused = tp_degrees(LLAMA3_8B)
    assert valid == [1, 2, 4, 8, 16]  # 32 heads, 8 KV heads (replicated beyond 8), F = 14,336
    assert refused_degrees_text(refused) == ("t = 3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15 "
                                             "(heads=32 is not divisible by tp)")
    at = open_app("app_pages/tensor_parallel.py", model="Llama 3 8B")
    assert [int(o) for o in at.select_slider(key="tp_degree").options] == valid
    assert any(c.value.startswith("Not offered for Llama 3 8B: t = 3, 5") for c in at.caption)


@pytest.mark.parametrize("page, params", [("app_pages/tensor_parallel.py", {}),
                                          ("app_pages/expert_parallel.py", {}),
                                          ("app_pages/data_parallel.py", {"dp": "1"})])
def test_the_lessons_open_on_a_gpu_mesh_of_links(page, params):
    """Each costs a group of one chip somewhere (t = 1, ep = 1, dp = 1): on MI300X it had raised."""
    from tests.ui.apptest_util import open_app

    at = open_app(page, chip="mi300x", **params)
    assert not at.exception, [e.value for e in at.exception]


def test_a_superscript_degree_in_a_link_is_not_a_number():
    """str.isdigit() takes "²", which int() refuses: the page had stopped (found by the link fuzz test)."""
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/tensor_parallel.py", tp_degree="²")
    assert not at.exception and any("not a whole number" in i.value for i in at.info)


def test_the_degree_starts_again_at_the_sidebar_s_when_that_changes():
    """Moving the sidebar's tp had left the lesson's t where it was (8), where a link opened with tp=2 showed
    t = 2: the same sidebar, two pages (app_pages.link_params.follow_sidebar)."""
    at = _page(model="Llama 3 8B", chip="h100")
    at.select_slider(key="tp_degree").set_value(4).run()
    at.number_input(key="tp").set_value(2).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.select_slider(key="tp_degree").value == 2
    at.select_slider(key="tp_degree").set_value(4).run()  # moved again by hand: kept while the sidebar stays
    at.number_input(key="dp").set_value(2).run()
    assert at.select_slider(key="tp_degree").value == 4
