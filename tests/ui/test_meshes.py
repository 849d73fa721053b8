"""The N-D mesh lesson: how each axis lands on the hardware (strides and placements against hand-worked
numbers), the published layouts, "apply" setting the sidebar, the exercise, and the scaled-down live run."""

import json
import re

import pytest

from core.mesh import Mesh
from hardware.chips import CHIPS
from planner.bounds import fsdp_tp_tradeoff
from planner.models import MODEL_PRESETS
from tests.ui.apptest_util import open_app
from ui.charts import PALETTE
from ui.exercises import axes_leaving_the_domain
from ui.meshes import (
    PRESETS,
    axis_rows,
    layout_label,
    mesh_caption,
    mesh_figure,
    placement,
    scaled_down,
    sidebar_mesh,
    tradeoff_figure,
)
from ui.timeline import KIND_COLORS

PAGE = "app_pages/meshes.py"
LLAMA_405B = "Llama 3 405B on 16,384 H100"
SCIENTIFIC = re.compile(r"\de[+-]\d")  # 9.89e+14: not for students


def test_llama3_405b_axes_land_where_the_paper_says():
    # tp 8 inside one 8-GPU NVLink node; pp and dp cross the network (Dubey et al. 2024, section 3.3)
    mesh = Mesh(PRESETS["Llama 3 405B on 16,384 H100"].mesh)
    rows = {r["axis"]: r for r in axis_rows(mesh, CHIPS["h100"])}
    assert [r for r in rows] == ["tp", "dp", "pp"]  # innermost first
    assert (rows["tp"]["members apart"], rows["dp"]["members apart"], rows["pp"]["members apart"]) == \
        ("1", "8", "1,024")
    assert rows["tp"]["lands on"] == "one NVLink domain"
    assert rows["dp"]["lands on"] == rows["pp"]["lands on"] == "the network between nodes"
    assert rows["tp"]["rank 0's group"] == "{0, 1, ..., 7}" and rows["pp"]["rank 0's group"] == "{0, 1024, ..., 15360}"


def test_placement_inside_across_and_both():
    h100 = CHIPS["h100"]
    assert placement(h100, 4, 2) == "one NVLink domain"
    assert placement(h100, 4, 8) == "the network between nodes"
    assert placement(h100, 4, 4).startswith("both")


def test_the_exercise_names_the_axes_that_leave_the_node():
    ex = axes_leaving_the_domain(Mesh(PRESETS["DeepSeek-V3 on 2,048 H800"].mesh), CHIPS["h800"])
    assert ex.answer == "ep, dp, pp"  # ep 64 spans 8 nodes (DeepSeek-V3 section 3.2), innermost first
    ex = axes_leaving_the_domain(Mesh({"tp": 8}), CHIPS["h100"])
    assert ex.answer == "none"


def test_scaled_down_keeps_the_kinds_of_groups():
    assert scaled_down({"dp": 128, "tp": 8, "pp": 16, "cp": 1, "ep": 1}) == {"pp": 2, "dp": 2, "tp": 2}
    assert scaled_down({"dp": 2, "pp": 16, "ep": 64, "tp": 1}) == {"pp": 2, "dp": 2, "ep": 2}
    # four axes: the one of smallest degree goes (cp 2), ties the outermost
    assert scaled_down({"dp": 8, "tp": 4, "pp": 4, "cp": 2}) == {"pp": 2, "dp": 2, "tp": 2}
    assert scaled_down({"dp": 1}) == {"dp": 1}


def test_a_mesh_of_any_size_draws_at_once():
    mesh = Mesh({"dp": 65536, "tp": 65536, "pp": 65536})
    fig = mesh_figure(mesh, CHIPS["h100"], "dp")
    assert len(fig.data) == 64 and "4,294,967,296 groups" in fig.layout.title.text
    # which ranks are drawn on a line of its own: on one line the title ran past a narrow window's edge
    assert fig.layout.title.text.endswith("apart<br>(the first 64 of 281,474,976,710,656 ranks)")
    assert len(axis_rows(mesh, CHIPS["h100"])) == 3


def test_the_group_picture_colours_one_group_per_colour():
    fig = mesh_figure(Mesh({"pp": 2, "dp": 2, "tp": 2}), CHIPS["h100"], "dp")
    assert len(fig.data) == 4  # four dp groups of 2
    assert sorted(int(t) for t in fig.data[0].text) == [0, 2]


def test_the_group_picture_and_its_caption_agree():
    mesh = Mesh(PRESETS[LLAMA_405B].mesh)
    # pp groups are 1,024 ranks apart: each of the 64 drawn ranks is in a group of its own, drawn grey
    fig = mesh_figure(mesh, CHIPS["h100"], "pp")
    assert len(fig.data) == 64 and {t.marker.color for t in fig.data} == {KIND_COLORS["idle"]}
    caption = mesh_caption(mesh, "pp")
    assert "one colour form one group" not in caption and "1,024 ranks apart" in caption
    # tp: 8 groups of 8 neighbours, each a colour of its own
    fig = mesh_figure(mesh, CHIPS["h100"], "tp")
    assert len({t.marker.color for t in fig.data}) == len(fig.data) == 8
    assert "Squares of one colour form one group of the chosen axis." in mesh_caption(mesh, "tp")
    # 32 groups of 2 drawn: the colours repeat, and the caption says so
    assert len(PALETTE) < 32 and f"share {len(PALETTE)} colours" in mesh_caption(Mesh({"dp": 64, "tp": 2}), "tp")


def test_the_tradeoff_chart_marks_x_opt_and_leaves_gaps_where_nothing_moves():
    # X_opt = 12.0 (SwiGLU: three matrices)
    t = fsdp_tp_tradeoff(MODEL_PRESETS["Llama 3 70B"], CHIPS["tpu-v5p"], 48000, 64)
    fig = tradeoff_figure(t)
    assert [tr.name for tr in fig.data][:2] == ["FSDP: the MLP's weights all-gathered",
                                                 "TP: its activations gathered and reduce-scattered"]
    assert fig.data[0].y[0] is None and fig.data[1].y[-1] is None  # X = 1 gathers no weights, Y = 1 no activations
    (line,) = fig.layout.shapes
    # in data units: this Plotly places a vertical line on a log axis itself (in log10 units it had been drawn at
    # X = 1.2 for an X_opt of 14.6, two matrices counted then; checked in Chromium against the crossing of the
    # two lines)
    assert line.x0 == pytest.approx(t.x_opt)


def test_the_axis_table_shows_the_bytes_each_axis_carries_per_step():
    rows = axis_rows(Mesh({"dp": 4, "tp": 2}), CHIPS["h100"], sent={"tp": 3 * 2**30, "dp": 2**20})
    assert {r["axis"]: r["sent per step, per chip"] for r in rows} == {"tp": "3 GiB", "dp": "1 MiB"}


def test_the_page_shows_the_sidebar_mesh_and_the_presets():
    at = open_app(PAGE, model="Llama 3 8B", chip="h100", dp="4", tp="2")
    assert not at.exception, [e.value for e in at.exception]
    table = at.table[0].value  # a column per axis: a column per quantity ran past a narrow page's edge
    assert list(table.columns) == ["tp", "dp"]
    assert all(v.endswith("B") for v in table.loc["sent per step, per chip"])
    assert any("FSDP + tensor parallel of Llama 3 8B" in m.value for m in at.markdown)
    for name in PRESETS:
        at.selectbox(key="mesh_preset").set_value(name).run()
        assert not at.exception, (name, [e.value for e in at.exception])
        assert PRESETS[name].source[:20] in " ".join(c.value for c in at.caption)


def test_the_page_states_the_real_batch_in_words_and_units():
    at = open_app(PAGE)  # Llama 3 8B on 8 H100: about 4M tokens, 512 sequences
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(m.value for m in at.markdown)
    assert "C / W_network = 989 TFLOP/s / 50 GB/s = 19,780; here 4,194,304. This mesh fits" in text
    assert "4,194,304 tokens per step (512 sequences of 8,192)" in " ".join(c.value for c in at.caption)
    at.selectbox(key="mesh_preset").set_value(LLAMA_405B).run()
    at.radio(key="mesh_axis").set_value("pp").run()
    assert not at.exception, [e.value for e in at.exception]
    captions = " ".join(c.value for c in at.caption)
    # the published batch (ui.meshes.Preset.global_batch): Table 4's 16M tokens, 2,048 sequences of 8,192
    assert "about 4M" not in captions
    assert "16,777,216 tokens per step (2,048 sequences of 8,192, as published)" in captions
    assert "one colour form one group" not in captions
    text = " ".join(m.value for m in at.markdown)
    assert "with 16,777,216 tokens per step" in text and not SCIENTIFIC.search(text)
    assert not any(SCIENTIFIC.search(v) for v in at.table[0].value.loc["exposed per step"])


def test_apply_loads_the_preset_into_the_sidebar():
    at = open_app(PAGE)
    at.selectbox(key="mesh_preset").set_value("DeepSeek-V3 on 2,048 H800").run()
    at.button[0].click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["model"] == "DeepSeek-V3" and at.session_state["chip"] == "h800"
    assert (at.session_state["ep"], at.session_state["pp"], at.session_state["dp"]) == (64, 16, 2)
    assert at.selectbox(key="mesh_preset").value == "the sidebar's setup"


def test_search_ranks_layouts_and_apply_loads_the_fastest():
    at = open_app(PAGE, model="Llama 3 8B", chip="h100", dp="4", tp="2")
    at.button(key="mesh_search").click().run()
    assert not at.exception, [e.value for e in at.exception]
    table = next(d.value for d in at.dataframe if "rank" in d.value.columns)
    assert list(table["rank"]) == [1, 2, 3, 4, 5] and list(table["step s"]) == sorted(table["step s"])
    assert "schedule" not in table.columns  # no layout here has pipeline stages: the column had stood empty
    bars = next(c for c in at.get("plotly_chart") if "mesh_search_chart" in str(c.proto.id))
    names = json.loads(bars.proto.spec)["data"][0]["customdata"]
    # two layouts of one mesh had read alike ("2. dp=4,cp=2" and "4. dp=4,cp=2"): their ZeRO stages differ
    assert len(set(names)) == len(names) and all(", ZeRO-" in n for n in names)
    assert all(n.startswith(f"{mesh}, ") for n, mesh in zip(names, table["mesh"], strict=True))  # the table's rows
    assert len(at.get("plotly_chart")) >= 3  # the groups, the FSDP-TP trade-off, the ranked layouts
    # the planner page's words: "125 layouts considered, 244 simulated" had read as a contradiction
    assert any("simulations of them and their ZeRO and recomputation variants" in c.value for c in at.caption)
    best = at.session_state["mesh_search_report"].ranked[0].result.layout
    at.button(key="mesh_apply_best").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert {a: at.session_state[a] for a in ("dp", "tp", "pp", "cp", "ep")} == sidebar_mesh(best)
    # applied, the fastest is the sidebar's mesh: the page says so, with no button that would do nothing
    at.button(key="mesh_search").click().run()
    assert not any(getattr(b, "key", None) == "mesh_apply_best" for b in at.button)
    assert any("is the sidebar's already" in c.value for c in at.caption)


def test_a_fastest_layout_the_sidebar_cannot_draw_is_not_applied():
    # Mixtral 8x7B on 16 H100s: the search ranks first a layout whose ep = 8 reaches over dp = 4 x cp = 2
    at = open_app(PAGE, model="Mixtral 8x7B", chip="h100", dp="16")
    at.button(key="mesh_search").click().run()
    assert not at.exception, [e.value for e in at.exception]
    best = at.session_state["mesh_search_report"].ranked[0].result.layout
    assert sidebar_mesh(best) is None, best  # the case this test is for: else it tests nothing
    table = next(d.value for d in at.dataframe if "rank" in d.value.columns)
    assert table["mesh"][0] == layout_label(best) and "over dp x cp" in table["mesh"][0]
    assert not any(getattr(b, "key", None) == "mesh_apply_best" for b in at.button)
    assert any("cannot be applied there" in c.value for c in at.caption)


def test_sidebar_mesh_carves_ep_out_of_dp():
    from planner.case import Layout

    assert sidebar_mesh(Layout(dp=128, tp=1, pp=16, ep=64)) == {"dp": 2, "tp": 1, "pp": 16, "cp": 1, "ep": 64}
    # the planner's ep can reach over cp's ranks too (Mixtral on 16 H100s ranks this first): the sidebar cannot
    # draw it, and had been given dp=0 ("pp=2,cp=2,ep=8", 32 chips)
    over_cp = Layout(dp=4, tp=1, pp=2, cp=2, ep=8)
    assert sidebar_mesh(over_cp) is None
    assert layout_label(over_cp) == "pp=2,dp=4,cp=2, ep=8 over dp x cp"
    assert layout_label(Layout(dp=8, tp=2, pp=1, ep=4)) == "dp=2,ep=4,tp=2"


@pytest.mark.multiprocess
def test_the_scaled_down_mesh_runs_and_matches_the_reference():
    at = open_app(PAGE)
    at.selectbox(key="mesh_preset").set_value("Llama 3 8B on 64 TPU v5p").run()
    at.button(key="mesh_run").click().run(timeout=240)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert any("matches the single-process reference" in s.value for s in at.success)


def test_a_server_allowing_fewer_processes_gets_a_smaller_run(monkeypatch):
    # a teacher's SHARDLAB_MAX_WORLD=4: the published 3-D layouts scaled to 8 processes could never run, and the
    # page had no control for it
    import server.queue
    from server.queue import RunQueue
    from server.settings import Settings

    q = RunQueue(Settings(max_concurrent=1, max_world=4))
    monkeypatch.setattr(server.queue, "_queue", q)
    try:
        at = open_app(PAGE)
        at.selectbox(key="mesh_preset").set_value("Llama 3 8B on 64 TPU v5p").run()
        text = " ".join(m.value for m in at.markdown)
        assert "at most\n4 processes, as this server allows (SHARDLAB_MAX_WORLD)" in text
        assert "on 4 processes" in text and "on 8 processes" not in text
    finally:
        q.shutdown()


def test_a_published_layout_is_costed_with_its_own_batch_and_recipe():
    # DeepSeek-V3 at 2,048 sequences (one per chip) left its 16 pipeline stages 16 micro-batches: a 28 % bubble and
    # 510 tokens/s a GPU against the report's ~1,540; it ran 15,360 sequences, in FP8, with DualPipe's overlap
    at = open_app(PAGE)
    at.selectbox(key="mesh_preset").set_value("DeepSeek-V3 on 2,048 H800").run()
    at.radio(key="mesh_axis").set_value("ep").run()
    assert not at.exception, [e.value for e in at.exception]
    captions = " ".join(c.value for c in at.caption)
    assert "62,914,560 tokens per step (15,360 sequences of 4,096, as published)" in captions
    assert "FP8 training" in captions and "DualPipe" in captions
    from core.mesh import Mesh
    from planner.api import estimate
    from planner.case import Cluster, mesh_parallel
    from planner.models import MODEL_PRESETS
    from planner.presets import make_case
    from ui.meshes import PRESETS

    preset, spec = PRESETS["DeepSeek-V3 on 2,048 H800"], MODEL_PRESETS["DeepSeek-V3"]
    est = estimate(make_case(spec, Cluster("h800", 2048), global_batch=15360, parallel=mesh_parallel(
        Mesh(preset.mesh), spec), zero_stage=1, dtype="fp8", ep_comm_overlap=True))
    shown = next(m.value for m in at.metric if m.label == "Predicted step time (this cluster)")
    assert shown == f"{est.step_time_s:,.2f} s"


def test_one_chip_says_there_is_nothing_to_split_and_whether_it_fits():
    at = open_app(PAGE, model="Llama 3 405B", chip="a100-80gb", dp="1")
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(m.value for m in at.markdown)
    assert "nothing for FSDP or tensor parallel to split" in text
    assert "X_opt" not in text and "1 chips" not in text and "1 processes" not in text
    assert "Try it yourself" not in [h.value for h in at.subheader]  # no heading over no question
    memory = next(m for m in at.metric if m.label == "Memory per chip")
    assert memory.delta == "does not fit"  # 405B parameters' training state on one A100
    step = next(m for m in at.metric if m.label == "Predicted step time (this cluster)").value
    assert step.endswith(" h")  # in hours, not 57,162.19 s
