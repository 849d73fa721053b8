"""The Expert parallel lesson: the routing simulation and cost builders against hand counts, the page
through AppTest, one live ep run at world 2."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from core.timeline import Span, Timeline
from hardware.chips import CHIPS
from planner.models import MODEL_PRESETS
from tests.ui.apptest_util import open_app
from ui.charts import TITLE_LINE_CHARS
from ui.expert_parallel import (
    a2a_bytes,
    a2a_bytes_by_name,
    capacity,
    capacity_keep,
    cost_rows,
    ep_config_error,
    live_load_rows,
    load_figure,
    matrix_figure,
    measured_a2a_formula,
    moe_numbers,
    placement_figure,
    router_probabilities,
    simulate_routing,
)

PAGE = "app_pages/expert_parallel.py"
MIXTRAL = MODEL_PRESETS["Mixtral 8x7B"]
DEEPSEEK = MODEL_PRESETS["DeepSeek-V3"]


# ---- the routing simulation ---------------------------------------------------------------------

@pytest.mark.parametrize("c", [None, 0.5, 1.0, 1.25])
@pytest.mark.parametrize("skew", [0.0, 1.0])
def test_routing_conserves_token_copies_and_respects_capacity(c, skew):
    t, e, k, ep = 256, 8, 2, 4
    r = simulate_routing(t, e, k, ep, c, skew, seed=3)
    # every rank routes each of its T tokens to k experts: kept + dropped = T * k per rank
    assert r.routed.sum(1).tolist() == [t * k] * ep
    assert r.kept.sum() + r.dropped == ep * t * k
    assert (r.kept <= r.routed).all()
    if c is None:
        assert r.dropped == 0 and r.capacity_line is None
    else:
        cap = math.ceil(c * t * k / e)  # GShard sec. 3.2, one group per rank here
        assert r.capacity_per_group == cap and r.capacity_line == cap * ep
        assert r.kept.max() <= cap
        # an expert drops only once it is full: then it kept exactly its capacity from that rank
        full = r.routed > cap
        assert (r.kept[full] == cap).all() and (r.kept[~full] == r.routed[~full]).all()


def test_capacity_per_group_of_tokens():
    # 2 ranks x 64 tokens in groups of 16: each expert takes at most ceil(1.0 * 16 * 2 / 4) = 8 per group
    r = simulate_routing(64, 4, 2, 2, 1.0, 0.8, seed=1, group_tokens=16)
    assert r.capacity_per_group == 8 and r.groups == 8 and r.capacity_line == 64
    assert (r.kept <= 8 * 4).all()  # 4 groups per rank


def test_capacity_order_is_the_engines():
    torch = pytest.importorskip("torch")
    from engine.model import capacity_keep as engine_keep

    chosen = np.random.default_rng(7).integers(0, 4, size=(3 * 10, 2))
    ours = capacity_keep(chosen, 10, 4, 3)
    theirs = engine_keep(torch.tensor(chosen).view(3, 10, 2), 4, 3).view(30, 2).numpy()
    assert (ours == theirs).all() and 0 < ours.sum() < ours.size


def test_all_to_all_matrix_rows_are_what_each_rank_sends():
    t, e, k, ep = 128, 8, 2, 4
    r = simulate_routing(t, e, k, ep, 1.0, 0.5, seed=0)
    m = r.matrix
    assert m.shape == (ep, ep)
    # row sums: the kept copies each rank sends (its own tokens' T*k minus its drops)
    assert m.sum(1).tolist() == (t * k - (r.routed - r.kept).sum(1)).tolist()
    # column sums: the rows each rank's experts process
    assert m.sum(0).tolist() == r.processed_per_rank.tolist()
    # destination rank d holds experts [2d, 2d + 1]
    assert m[1, 3] == r.kept[1, 6] + r.kept[1, 7]


def test_skew_loads_the_first_experts_and_rank_0():
    assert router_probabilities(4, 0.0).tolist() == [0.25] * 4
    p = router_probabilities(4, 1.0)
    assert p[0] / p[1] == pytest.approx(2.0) and p.sum() == pytest.approx(1.0)
    flat = simulate_routing(1024, 16, 2, 4, None, 0.0, seed=0).stats()
    skewed = simulate_routing(1024, 16, 2, 4, None, 1.2, seed=0)
    assert flat["expert_max_over_mean"] < 1.2 and flat["rank_max_over_mean"] < 1.1
    assert skewed.tokens_per_expert.argmax() == 0
    assert skewed.stats()["rank_max_over_mean"] > 1.5
    assert skewed.processed_per_rank.argmax() == 0


def test_same_seed_same_routing_and_bad_shapes_refused():
    a = simulate_routing(64, 8, 2, 2, 1.0, 0.3, seed=5)
    b = simulate_routing(64, 8, 2, 2, 1.0, 0.3, seed=5)
    assert (a.routed == b.routed).all() and (a.kept == b.kept).all()
    with pytest.raises(ValueError, match="experts=6 divisible by ep=4"):
        simulate_routing(64, 6, 2, 4, None, 0.0)


def test_figures():
    r = simulate_routing(256, 8, 2, 4, 0.75, 1.0, seed=0)
    fig = load_figure(r.tokens_per_expert, r.dropped_per_expert, 4, r.capacity_line, "t")
    names = [d.name for d in fig.data]
    assert "capacity" in names and "dropped (over capacity)" in names
    kept = next(d for d in fig.data if d.name.startswith("kept"))
    assert list(kept.y) == (r.tokens_per_expert - r.dropped_per_expert).tolist()
    no_cap = simulate_routing(256, 8, 2, 4, None, 0.0, seed=0)
    fig = load_figure(no_cap.tokens_per_expert, no_cap.dropped_per_expert, 4, None, "t")
    names = [d.name for d in fig.data]
    assert "capacity" not in names and "dropped (over capacity)" not in names
    heat = matrix_figure(r.matrix, "t").data[0]
    assert np.array_equal(np.asarray(heat.z), r.matrix)
    placed = placement_figure(8, 4)
    assert len(placed.data) == 4 and all(len(d.x) == 2 for d in placed.data)


# ---- parameters and cost ------------------------------------------------------------------------


def test_a_long_load_title_hangs_on_lines_above_the_panels():
    """The simulation's title ("4 ranks x 512 tokens x k = 2, ...: capacity 160 per expert per rank (the dashed
    line: x 4 ranks)") ran past the chart's right edge on one line."""
    r = simulate_routing(512, 8, 2, 4, 1.25, 0.0, seed=0)
    title = "4 ranks x 512 tokens x k = 2, E = 8, s = 0: capacity 160 per expert per rank (the dashed line: x 4 ranks)"
    fig = load_figure(r.tokens_per_expert, r.dropped_per_expert, 4, r.capacity_line, title)
    lines = fig.layout.title.text.split("<br>")
    assert " ".join(lines) == title and max(len(line) for line in lines) <= TITLE_LINE_CHARS
    assert fig.layout.title.yanchor == "top" and fig.layout.margin.t >= 40 + 20 * len(lines)

def test_total_and_active_parameters_of_the_presets():
    mixtral = moe_numbers(MIXTRAL)
    # Jiang et al. 2024: 46.7 B total, 12.9 B active; one expert 3 x 4096 x 14336
    assert mixtral["total"] / 1e9 == pytest.approx(46.7, abs=0.05)
    assert mixtral["active"] / 1e9 == pytest.approx(12.9, abs=0.05)
    assert mixtral["per_expert"] == 3 * 4096 * 14336
    deepseek = moe_numbers(DEEPSEEK)
    # DeepSeek-AI 2024 (arXiv 2412.19437): 671 B total, 37 B active
    assert deepseek["total"] / 1e9 == pytest.approx(671, abs=1)
    assert deepseek["active"] / 1e9 == pytest.approx(37.5, abs=0.6)
    assert deepseek["experts_all_layers"] == 58 * 256 * 3 * 7168 * 2048


def test_ep_fit_uses_the_engine_message():
    assert ep_config_error(8, 2, 4) is None
    assert ep_config_error(6, 2, 4).startswith("experts=6 is not divisible by ep=4")


def test_all_to_all_bytes_by_hand():
    # Mixtral, T = 4096 tokens, k = 2, D = 4096, bf16: a chip holds 4096 x 2 x 4096 x 2 B = 64 MiB of token
    # copies; at ep = 8, 7/8 leave: 56 MiB per all-to-all, x 4 (dispatch, combine; fwd, bwd) = 224 MiB
    b = a2a_bytes(4096, 2, 4096, 8)
    assert b["held"] == 64 * 2**20 and b["one"] == 56 * 2**20 and b["per_layer_step"] == 224 * 2**20
    assert a2a_bytes(4096, 2, 4096, 1)["per_layer_step"] == 0


def test_cost_rows_on_h100():
    chip = CHIPS["h100"]
    rows = {r["ep"]: r for r in cost_rows(MIXTRAL, chip, 4096, [1, 2, 3, 8, 16])}
    assert set(rows) == {1, 2, 8}  # 3 does not divide 8 experts, 16 is more than 8
    r8 = rows[8]
    held = 4096 * 2 * 4096 * 2
    w = chip.scaleup_bytes_per_s * chip.link_efficiency
    # switch all-to-all: alpha + the measured pipeline fill + (n-1)/n * b / W ([SB] Part 12), four of them
    assert r8["a2a_s"] == pytest.approx(4 * (chip.scaleup_latency_s + chip.scaleup_fill_s + 7 / 8 * held / w))
    assert r8["inside_domain"] and r8["a2a_spread_s"] > 5 * r8["a2a_s"]
    assert rows[1]["a2a_s"] == 0
    # ep divides the expert weights each chip holds
    assert rows[1]["expert_weights_bytes"] == 8 * r8["expert_weights_bytes"]
    ds = {r["ep"]: r for r in cost_rows(DEEPSEEK, chip, 4096, [8, 16, 64])}
    assert not ds[16]["inside_domain"] and ds[16]["a2a_s"] > 3 * ds[8]["a2a_s"]


# ---- live-run helpers ---------------------------------------------------------------------------

def _summary(dropped=(0.25, 0.0)):
    layers = {f"L{i}": {"tokens_per_expert": [10, 6], "dropped_per_expert": [3, 0],
                        "processed_per_ep_rank": [7, 6], "expert_max_over_mean": 1.25,
                        "ep_rank_max_over_mean": 1.08, "dropped_fraction": d}
              for i, d in enumerate(dropped)}
    load = {"experts": 2, "ep": 2, "top_k": 2, "capacity_factor": 1.0, "layers": layers}
    return SimpleNamespace(stats={"expert_load": load},
                           config={"micro_batches": 1, "micro_batch_size": 2, "model": {"seq_len": 32}})


def test_measured_formula_and_rows():
    # per layer 4 x (2 x 32 tokens) x k=2 x (1 - dropped) x D=64 x 4 bytes x 1/2
    assert measured_a2a_formula(_summary(), 64) == 4 * 64 * 2 * 64 * 4 / 2 * (0.75 + 1.0)
    rows = live_load_rows(_summary())
    assert [r["layer"] for r in rows] == ["L0", "L1"]
    assert rows[0]["routed to expert 0"] == 10 and rows[0]["routed to expert 1"] == 6 and rows[0]["dropped"] == 3
    assert rows[0]["rows on ep rank 0"] == 7 and rows[0]["busiest rank / mean"] == "1.08"
    assert rows[0]["dropped fraction"] == "25.0%"


def test_a2a_bytes_by_name():
    def comm(name, nbytes, rank=0):
        return Span(rank, "comm", name, 0.0, 1.0, bytes=nbytes, group="ep")

    tl = Timeline([comm("all_to_all counts L0", 32), comm("all_to_all dispatch L0", 100),
                   comm("all_to_all dispatch L0 bwd", 60), comm("all_to_all combine L0", 60),
                   comm("all_to_all combine L0 bwd", 100), comm("all_reduce dense", 400),
                   comm("all_to_all dispatch L0", 999, rank=1), Span(0, "compute", "fwd L0", 0.0, 1.0)])
    assert a2a_bytes_by_name(tl, 0, steps=2) == {"counts": 16, "dispatch": 80, "combine": 80, "other": 200}


def test_capacity_helper():
    assert capacity(None, 32, 2, 8) is None
    assert capacity(1.0, 32, 2, 8) == 8 and capacity(1.25, 32, 2, 8) == 10 and capacity(0.5, 30, 1, 8) == 2


# ---- the page -----------------------------------------------------------------------------------

def _text(at: AppTest) -> str:
    return " ".join(m.value for m in at.markdown)


def test_page_opens_for_a_dense_sidebar_model_with_an_moe_preset():
    at = open_app(PAGE, model="Llama 3 8B", chip="h100")
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Expert parallel" and not at.error
    assert "is a **dense** model" in at.info[0].value
    assert at.selectbox(key="ep_moe_model").value == "Mixtral 8x7B"
    text = _text(at)
    assert "**45.1 B** of the model's **46.7 B** parameters" in text and "**12.9 B**" in text
    # ep = 8 by default: 56 MiB per all-to-all, 224 MiB per layer (see test_all_to_all_bytes_by_hand)
    assert "one all-to-all sends **56 MiB** per chip, the four of a step **224 MiB**" in text
    assert len(at.get("plotly_chart")) == 5  # placement, load, matrix, cost, bound meter; no live run yet


def test_an_moe_sidebar_model_is_used_directly():
    at = open_app(PAGE, model="DeepSeek-V3", chip="h100", ep="16")
    assert not at.exception and not at.error and not at.info
    text = _text(at)
    assert "**671.0 B** parameters" in text
    assert at.select_slider(key="ep_model_degree").value == 16
    assert "At ep = 16 the group spans 2 nodes: 8 of every 16 rows leave the node" in text


def test_ep_1_says_why_the_meter_and_the_exercises_are_gone():
    at = open_app(PAGE, model="DeepSeek-V3", chip="h100", ep="16")
    at.select_slider(key="ep_model_degree").set_value(1).run()
    assert not at.exception
    assert any("At ep = 1 one chip holds every expert" in i.value for i in at.info)
    assert len(at.get("plotly_chart")) == 4  # placement, load, matrix, cost: no bound meter


def test_a_tpu_slice_is_named_as_such():
    at = open_app(PAGE, model="Mixtral 8x7B", chip="tpu-v5p")
    assert not at.exception and not at.error
    text = _text(at)
    assert "fits inside" in text and "one chip per slice" in text and "NVLink" not in text


def test_sliders_change_the_numbers():
    at = open_app(PAGE)
    at.select_slider(key="ep_capacity").set_value("0.5")
    at.slider(key="ep_skew").set_value(1.0)
    at.select_slider(key="ep_degree").set_value(2).run()
    assert not at.exception and not at.error
    r = simulate_routing(512, 8, 2, 2, 0.5, 1.0, seed=0)
    assert f"**{r.dropped:,}** were dropped" in _text(at) and r.dropped > 0
    assert f"**{r.stats()['rank_max_over_mean']:.2f}x** the mean number of rows" in _text(at)


def test_experts_not_divisible_by_ep_is_a_message():
    at = open_app(PAGE)
    at.select_slider(key="ep_experts").set_value(6)
    at.select_slider(key="ep_degree").set_value(4).run()
    assert not at.exception
    assert "experts=6 is not divisible by ep=4" in at.error[0].value
    assert len(at.get("plotly_chart")) == 3  # no load chart or matrix; placement, cost and bound meter remain


def test_a_bad_live_run_is_the_engine_message_without_starting_workers():
    at = open_app(PAGE)
    at.select_slider(key="ep_live_world").set_value(4)
    at.select_slider(key="ep_live_experts").set_value(6)
    at.button[0].click().run()
    assert not at.exception
    assert "experts=6 is not divisible by ep=4" in at.error[0].value


@pytest.mark.multiprocess
def test_live_ep_run_matches_the_reference():
    at = open_app(PAGE)
    at.select_slider(key="ep_live_steps").set_value(1)
    at.button[0].click().run(timeout=180)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert "matches the single-process reference" in at.success[0].value
    table = next(t.value for t in at.table if "L0" in t.value.columns)  # the load table: a column per layer
    assert list(table.columns) == ["", "L0", "L1"]
    routed = table[table[""].str.startswith("routed to expert")]
    assert len(routed) == 8  # the lesson's default eight experts, a row each
    # 2 ranks x 2 sequences x 32 tokens x k = 2 token copies per layer
    assert all(sum(int(c.replace(",", "")) for c in routed[layer]) == 256 for layer in ("L0", "L1"))
    text = _text(at)
    assert "dispatch **" in text
    assert "(T = m x b x s = 1 x 2 x 32 = 64 tokens per rank per step" in text  # the formula's T (live_step_tokens)
    assert {m.label for m in at.metric} >= {"Measured step time", "Predicted step time", "Prediction error"}
    assert len(at.get("plotly_chart")) == 5 + 4  # + predicted and measured step, measured and simulated load


def test_a_shared_link_opens_the_same_simulation():
    at = open_app(PAGE, ep_tokens="256", ep_experts="16", ep_top_k="4", ep_degree="8", ep_capacity="none",
                  ep_skew="0.5")
    assert not at.exception and not at.error and not at.warning, [w.value for w in at.warning]
    assert at.select_slider(key="ep_experts").value == 16
    assert at.select_slider(key="ep_capacity").value == "none"
    assert at.slider(key="ep_skew").value == 0.5
    assert "**0** were dropped" in _text(at)


def test_the_bound_meter_shows_deepseek_v3_communication_bound_across_nodes():
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/expert_parallel.py", model="DeepSeek-V3", chip="h100", ep="64")
    assert not at.exception
    text = next((m.value for m in at.markdown if "expert width F >" in m.value), None)
    assert text is not None and text.startswith("**Communication-bound**"), text


def test_one_rank_holds_every_expert_in_words():
    from ui.expert_parallel import placement_figure

    assert placement_figure(8, 1).layout.title.text == "8 experts over ep = 1 rank: all 8 on it"
    assert placement_figure(8, 4).layout.title.text == "8 experts over ep = 4 ranks: 2 whole experts each"


# ---- the reviewer's findings --------------------------------------------------------------------

def _chart(at: AppTest, key: str) -> dict:
    import json

    return json.loads(next(c.proto.spec for c in at.get("plotly_chart") if c.proto.id and key in c.proto.id))


def test_a_group_that_no_whole_domains_tile_is_costed_and_told_as_a_flat_network():
    # GB200 NVL72: 128 consecutive GPUs touch ceil(128 / 72) = 2 racks, and 72 does not divide 128, so the
    # collective model puts the group on the flat scale-out network (every row that leaves a chip crosses it)
    rows = {r["ep"]: r for r in cost_rows(DEEPSEEK, CHIPS["gb200-nvl72"], 4096, [64, 128, 256])}
    assert (rows[64]["domains"], rows[64]["rows_leaving_domain"]) == (1, 0)
    assert (rows[128]["domains"], rows[128]["rows_leaving_domain"]) == (2, None)
    h100 = {r["ep"]: r for r in cost_rows(DEEPSEEK, CHIPS["h100"], 4096, [16, 64])}
    assert (h100[16]["domains"], h100[16]["rows_leaving_domain"]) == (2, 8)
    assert (h100[64]["domains"], h100[64]["rows_leaving_domain"]) == (8, 56)
    at = open_app(PAGE, model="DeepSeek-V3", chip="gb200-nvl72")
    assert not at.exception
    text = _text(at)
    assert "At ep = 128 the group spans 2 NVLink domains, but 128 is no multiple of the 72-chip NVLink domain" in text
    assert "every row that leaves a chip goes through each GPU's own network card" in text
    assert "of every 128 rows leave" not in text and "1 nodes" not in text
    assert "Inside one 72-chip NVLink domain" in text and "one chip per NVLink domain" in text


def test_the_spec_link_rates_are_said_to_be_spec_beside_the_achievable_table():
    at = open_app(PAGE, model="DeepSeek-V3", chip="h100", ep="16")
    chip = CHIPS["h100"]
    assert (f"at 50 GB/s instead of NVLink's 450 GB/s (spec line rates; the table counts the achievable "
            f"{chip.scaleout_bw(True) / 1e9:.0f} and {chip.scaleup_bw(True) / 1e9:.0f} GB/s)") in _text(at)


def test_the_bytes_do_not_shrink_like_tps_and_capacity_below_1_drops_by_arithmetic():
    at = open_app(PAGE)
    text = _text(at)
    assert "Like tensor parallel's all-reduces, the bytes per chip do\nnot shrink as ep grows" in text
    assert "unlike tensor parallel, the FLOPs per chip do not shrink either" in text
    assert "Unlike tensor parallel's all-reduces, the bytes" not in text
    assert "at least 1 - CF of them (less what rounding the capacity up adds) are dropped by arithmetic alone" in text
    assert "because random routing is never exactly even" not in text
    # the arithmetic: a perfectly even router (every expert gets T k / E) at CF = 0.5 keeps exactly half
    r = simulate_routing(512, 8, 2, 4, 0.5, 0.0, seed=0)
    assert r.stats()["dropped_fraction"] >= 0.5


@pytest.mark.parametrize("params, said", [
    ({"ep_capacity": "3", "ep_tokens": "abc", "ep_skew": "99"}, ["ep_capacity=`3`", "ep_tokens=`abc`", "ep_skew=`99`"]),
    ({"model": "DeepSeek-V3", "ep_model_degree": "256"},
     ["ep_model_degree=`256` (it takes one of 1, 2, 4, 8, 16, 32, 64)"]),
    ({"ep_experts": "5", "ep_top_k": "16"}, ["ep_experts=`5`", "ep_top_k=`16`"]),
    ({"ep_moe_model": "Llama 3 8B"}, ["ep_moe_model=`Llama 3 8B`"]),
    ({"ep_capacity": ["3", "1.0"]}, ["ep_capacity=`3, 1.0`"]),  # a repeated key is quoted with all its values
    # the model-ep slider's options follow the model: 16 is one for DeepSeek-V3, not for Mixtral's 8 experts
    ({"ep_model_degree": "16"}, ["ep_model_degree=`16` (it takes one of 1, 2, 4, 8)"]),
])
def test_link_values_that_no_control_takes_are_said(params, said):
    at = open_app(PAGE, **params)
    assert not at.exception
    note = next((i.value for i in at.info if i.value.startswith("Ignored from the link")), "")
    assert all(s in note for s in said), note


def test_link_values_the_controls_take_are_used_without_a_word():
    # ep_model_degree=64 is one of DeepSeek-V3's options, picked in this same link (the slider follows the model)
    at = open_app(PAGE, ep_moe_model="DeepSeek-V3", ep_model_degree="64", ep_skew="0.15", ep_capacity="1.0",
                  ep_micro_batch="2")
    assert not at.exception
    assert not any(i.value.startswith("Ignored from the link") for i in at.info)
    assert at.select_slider(key="ep_model_degree").value == 64 and at.slider(key="ep_skew").value == 0.15


def test_slider_link_problems():
    from ui.state import slider_link_problems

    ranges = {"s": (0.0, 1.5)}
    assert slider_link_problems({"s": "0.15"}, ranges) == {} and slider_link_problems({"s": " 1.5"}, ranges) == {}
    assert slider_link_problems({"s": "inf"}, ranges) == {}  # the app shell says it
    for bad in ("abc", "99", "-0.1", "", ["0.5", "0.7"]):
        assert slider_link_problems({"s": bad}, ranges) == {"s": "one number from 0 to 1.5"}, bad
    assert slider_link_problems({"t": "abc"}, ranges) == {}


def test_the_model_ep_help_and_a_sidebar_ep_it_cannot_use():
    at = open_app(PAGE, model="Mixtral 8x7B", ep="16")
    slider = at.select_slider(key="ep_model_degree")
    assert slider.value == 8
    assert slider.help == ("Starts at the sidebar's ep (again whenever that changes) where that is one of these "
                           "(2, 4, 8: more than 1, at most 64 and dividing Mixtral 8x7B's E = 8); otherwise at ep = 8.")
    assert any("The sidebar's ep = 16 cannot spread Mixtral 8x7B's E = 8 experts" in c.value and
               "starts at ep = 8 instead" in c.value for c in at.caption)
    # the sidebar's ep = 1 (its default) is no substitution to mention: the page starts at 8 as its help says
    at = open_app(PAGE, model="Mixtral 8x7B")
    assert at.select_slider(key="ep_model_degree").value == 8
    assert not any("cannot spread" in c.value for c in at.caption)


@pytest.mark.parametrize("chip, ep, nic", [("tpu-v5e", "8", False), ("h100", "8", False), ("h100", "64", True),
                                           ("gb200-nvl72", "64", False)])
def test_the_verdict_names_the_link_the_bound_uses(chip, ep, nic):
    from planner.bounds import expert_parallel_bound
    from planner.costs import group_links_chip

    at = open_app(PAGE, model="DeepSeek-V3", chip=chip, ep=ep)
    assert not at.exception
    verdict = next(m.value for m in at.markdown if "expert width F >" in m.value)
    assert ("each GPU's own network card is the link" in verdict) == nic, verdict
    if not nic:
        job = int(ep) * 8  # the sidebar's dp = 8 x ep
        bound = expert_parallel_bound(DEEPSEEK, group_links_chip(CHIPS[chip], int(ep), job), 4096, int(ep))
        assert f"here it runs over {bound.link}." in verdict


def test_the_bound_meter_draws_the_all_to_all_in_its_own_colour():
    from planner.bounds import expert_parallel_bound
    from ui.bound_meter import bound_figure
    from ui.timeline import KIND_COLORS

    bound = expert_parallel_bound(MIXTRAL, CHIPS["h100"], 4096, 8)
    assert bound_figure(bound, "t").data[1].marker.color == KIND_COLORS["all_to_all"]
    at = open_app(PAGE)
    bars = [t["marker"]["color"] for t in _chart(at, "ep_bound")["data"]]
    assert bars == [KIND_COLORS["forward"], KIND_COLORS["all_to_all"]]
    assert KIND_COLORS["all_to_all"] in [t["line"]["color"] for t in _chart(at, "ep_cost")["data"] if "line" in t]


def test_the_routing_charts_marks_are_no_timeline_kind_and_no_rank():
    from ui.charts import RANK_COLORS
    from ui.expert_parallel import BALANCED_COLOR, CAPACITY_COLOR, DROPPED_COLOR, DROPPED_HATCH, SPAN_COLOR
    from ui.timeline import KIND_COLORS

    taken = {c.upper() for c in [*KIND_COLORS.values(), *RANK_COLORS]}
    assert not taken & {c.upper() for c in (CAPACITY_COLOR, DROPPED_COLOR, DROPPED_HATCH, SPAN_COLOR)}
    r = simulate_routing(256, 8, 2, 4, 0.75, 1.0, seed=0)
    fig = load_figure(r.tokens_per_expert, r.dropped_per_expert, 4, r.capacity_line, "t")
    by_name = {d.name: d for d in fig.data if d.name}
    assert by_name["dropped (over capacity)"].marker.color == DROPPED_COLOR
    assert by_name["dropped (over capacity)"].marker.pattern.shape == "/"
    cap, mean = by_name["capacity"].line, by_name["balanced load"].line
    assert (cap.color, cap.dash, mean.color, mean.dash) == (CAPACITY_COLOR, "dash", BALANCED_COLOR, "dot")
    # every line sits on a white halo, so it reads across any rank's bar (rank 5 is near black); the halos go
    # first, so where the lines coincide (CF = 1) neither halo covers the other line
    lines = [d.line.color for d in fig.data if d.type == "scatter"]
    assert lines == ["white", "white", CAPACITY_COLOR, BALANCED_COLOR, "white", BALANCED_COLOR]
    # the cost chart's "spans several domains" shading is neutral: the pink all-to-all lines run over it
    rows = cost_rows(DEEPSEEK, CHIPS["h100"], 4096, [2, 8, 16, 64])
    from ui.expert_parallel import cost_figure

    assert cost_figure(rows, 16, 8, "t").layout.shapes[0].fillcolor == SPAN_COLOR


def test_at_cf_1_the_capacity_and_the_balanced_load_are_told_apart():
    r = simulate_routing(512, 8, 2, 4, 1.0, 0.0, seed=0)
    assert r.capacity_line == 4 * 512 * 2 / 8  # the capacity is the balanced load
    fig = load_figure(r.tokens_per_expert, r.dropped_per_expert, 4, r.capacity_line, "t")
    names = [d.name for d in fig.data if d.showlegend is not False and d.name]
    assert "capacity (= the balanced load here)" in names and "balanced load" in names
    over = simulate_routing(512, 8, 2, 4, 1.25, 0.0, seed=0)
    fig = load_figure(over.tokens_per_expert, over.dropped_per_expert, 4, over.capacity_line, "t")
    assert "capacity" in [d.name for d in fig.data]


def test_the_measured_and_simulated_loads_stand_on_one_scale_with_whole_ranks():
    from ui.expert_parallel import load_tops

    a = simulate_routing(256, 8, 2, 4, 0.75, 1.0, seed=0)
    b = simulate_routing(512, 8, 2, 4, None, 0.0, seed=1)
    tops = tuple(map(max, zip(load_tops(a.tokens_per_expert, a.dropped_per_expert, 4, a.capacity_line),
                              load_tops(b.tokens_per_expert, b.dropped_per_expert, 4, None), strict=True)))
    assert tops[0] >= max(b.tokens_per_expert) and tops[1] >= max(a.tokens_per_expert)
    figs = [load_figure(a.tokens_per_expert, a.dropped_per_expert, 4, a.capacity_line, "t", tops=tops),
            load_figure(b.tokens_per_expert, b.dropped_per_expert, 4, None, "t", tops=tops)]
    assert figs[0].layout.yaxis.range == figs[1].layout.yaxis.range == (0, 1.12 * tops[0])
    assert figs[0].layout.yaxis2.range == figs[1].layout.yaxis2.range == (0, 1.12 * tops[1])
    assert figs[0].layout.xaxis2.type == "category"  # ranks 0-3, not ticks at -0.5, 0, 0.5 ...


def test_placement_names_the_experts_only_where_the_bars_are_tall_enough():
    from ui.expert_parallel import PLACEMENT_TEXT_MIN_PX, placement_bar_px

    for experts, ep, named in ((8, 8, True), (256, 16, True), (256, 32, False), (256, 64, False)):
        fig = placement_figure(experts, ep)
        margin = {k: getattr(fig.layout.margin, k) for k in "tb"}
        assert (placement_bar_px(fig.layout.height, margin, ep) >= PLACEMENT_TEXT_MIN_PX) == named
        assert all((d.text is not None) == named for d in fig.data), (experts, ep)


def test_the_live_paragraph_counts_t_as_the_formula_and_says_what_dispatch_holds():
    from ui.expert_parallel import live_a2a_text, live_step_tokens

    summary = _summary()
    summary.config["micro_batches"] = 3
    summary.comm_bytes = [2000.0]
    assert live_step_tokens(summary.config) == 3 * 2 * 32
    text = live_a2a_text({"dispatch": 80.0, "combine": 80.0, "counts": 16.0, "other": 200.0}, summary, 64, 2)
    assert "T = m x b x s = 3 x 2 x 32 = 192 tokens per rank per step" in text
    assert f"gives **{measured_a2a_formula(summary, 64):,.0f}**" in text
    assert "its forward all-to-all and that one's own backward" in text and "the backward of the other" not in text
