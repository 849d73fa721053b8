"""The Collectives lesson: ring schedules and charts as pure data, then the page through AppTest."""

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.engine_errors import engine_error_message
from hardware.chips import CHIPS
from hardware.collectives import Link, group_topology, ring
from tests.ui.apptest_util import open_app
from ui.collectives import (
    CAPTION_CHARS,
    CAPTION_LINE_PX,
    COLLECTIVES,
    Block,
    cost_figure,
    crossover_bytes,
    machine_link,
    pow2_sizes,
    ring_figure,
    ring_formula_latex,
    ring_steps,
    sweep_figure,
)
from ui.tables import format_bytes, format_seconds

RING_SIZES = range(2, 9)
PAGE = "app_pages/collectives.py"


def _per_link_blocks(steps) -> dict[tuple[int, int], int]:
    load: dict[tuple[int, int], int] = {}
    for step in steps:
        for t in step.transfers:
            load[t.src, t.dst] = load.get((t.src, t.dst), 0) + len(t.blocks)
    return load


# ---- ring schedules -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", RING_SIZES)
def test_all_gather_leaves_every_shard_on_every_chip(n):
    steps = ring_steps("all_gather", n)
    assert len(steps) == n  # the start and N-1 steps
    assert steps[0].held[2 % n] == tuple(Block(k, frozenset({k})) if k == 2 % n else None for k in range(n))
    for step in steps[1:]:
        # every chip sends exactly one shard to its clockwise neighbour at every step
        assert sorted((t.src, t.dst) for t in step.transfers) == [(i, (i + 1) % n) for i in range(n)]
        assert all(len(t.blocks) == 1 for t in step.transfers)
    for row in steps[-1].held:
        assert row == tuple(Block(k, frozenset({k})) for k in range(n))


@pytest.mark.parametrize("n", RING_SIZES)
def test_reduce_scatter_leaves_one_fully_reduced_shard_per_chip(n):
    steps = ring_steps("reduce_scatter", n)
    assert len(steps) == n
    everyone = frozenset(range(n))
    for chip, row in enumerate(steps[-1].held):
        assert row[chip] == Block(chip, everyone)
        assert [b for k, b in enumerate(row) if k != chip] == [None] * (n - 1)
    # each step frees one slot per chip: what was passed on is no longer needed
    for step in steps:
        assert all(sum(b is not None for b in row) == n - step.index for row in step.held)


@pytest.mark.parametrize("n", RING_SIZES)
def test_all_reduce_is_reduce_scatter_then_all_gather(n):
    steps = ring_steps("all_reduce", n)
    assert len(steps) - 1 == 2 * (n - 1)
    assert [s.phase for s in steps[1:]] == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
    assert steps[n - 1].held == ring_steps("reduce_scatter", n)[-1].held
    everyone = frozenset(range(n))
    for row in steps[-1].held:
        assert row == tuple(Block(k, everyone) for k in range(n))


@pytest.mark.parametrize("n", RING_SIZES)
def test_all_to_all_moves_chunk_j_of_chip_i_to_chip_j(n):
    steps = ring_steps("all_to_all", n)
    assert len(steps) == n
    for step in steps:  # nothing lost or duplicated on the way
        blocks = [b for row in step.held for b in row if b is not None]
        assert len(blocks) == len(set(blocks)) == n * n
    for j, row in enumerate(steps[-1].held):
        assert row == tuple(Block(j, frozenset({i})) for i in range(n))  # slot i: the chunk chip i sent


@pytest.mark.parametrize("n", RING_SIZES)
def test_link_loads_match_the_ring_cost_model(n):
    # With 1-byte shards, W = 1 byte/s and no latency, the model's time is the bytes on the busiest link.
    unit = ring(n, Link(1.0, 0.0))
    expected = {"all_gather": unit.all_gather_s(n), "reduce_scatter": unit.reduce_scatter_s(n),
                "all_reduce": unit.all_reduce_s(n), "all_to_all": unit.all_to_all_s(n)}
    for op in COLLECTIVES:
        load = _per_link_blocks(ring_steps(op, n))
        assert len(load) == n, op  # every link of the ring is used
        assert list(load.values()) == [pytest.approx(expected[op])] * n, op


@pytest.mark.parametrize(("op", "n"),
                         [("all_gather", 1), ("all_gather", 9), ("broadcast", 4), ("all_reduce", 2.0)])
def test_ring_steps_rejects_what_it_cannot_draw(op, n):
    with pytest.raises(ValueError):
        ring_steps(op, n)


# ---- figures ------------------------------------------------------------------------------------

def _slot_colors(frame) -> list:
    return list(frame.data[0].marker.color)


def test_ring_figure_has_a_frame_per_step_with_slider_and_buttons():
    fig = ring_figure("all_reduce", 4)
    assert len(fig.frames) == 7
    assert [s["label"] for s in fig.layout.sliders[0].steps] == ["start", "1", "2", "3", "4", "5", "6"]
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["▶ Play", "❚❚ Pause"]
    assert "white" in _slot_colors(fig.frames[3])  # mid-way, chips hold one reduced shard each
    assert "white" not in _slot_colors(fig.frames[-1])
    assert len(fig.frames[0].data[1].x) == 0  # no link active before the first step
    assert "Phase 2" in fig.frames[-1].layout.title.text


def test_the_ring_caption_and_controls_fit_a_narrow_column():
    """The ring has three quarters of the page: a caption line of 95 characters ran past its right edge in a
    window 800 px wide, and the step slider, beside the buttons, ran under them."""
    fig = ring_figure("all_reduce", 8)
    lines = [line.removeprefix("<b>").removesuffix("</b>") for frame in fig.frames
             for line in frame.layout.title.text.split("<br>")]
    assert max(len(line) for line in lines) <= CAPTION_CHARS
    most = max(frame.layout.title.text.count("<br>") + 1 for frame in fig.frames)
    assert fig.layout.margin.t >= most * CAPTION_LINE_PX  # the longest caption fits above the ring
    slider = fig.layout.sliders[0]
    assert slider.x == 0 and slider.pad.t >= 40  # on a row of its own, under the buttons
    # the worked example's sums on a second line
    assert r"\\ &= 7\,\mu\text{s}" in ring_formula_latex("all_gather", 8, 1e-6, 450e9, 2**25)


def test_ring_figure_follows_n_and_collective():
    four, eight = ring_figure("all_gather", 4), ring_figure("all_gather", 8)
    assert len(four.frames[0].data[0].x) == 16 and len(eight.frames[0].data[0].x) == 64
    texts = ring_figure("all_to_all", 3).frames[-1].data[0].text
    assert "2→0" in texts and "0→2" in texts


def test_crossover_is_n_alpha_w_on_a_ring():
    # V* = N alpha W where (N-1) alpha = (N-1)/N V/W
    topo = ring(8, Link(450e9, 1e-6))
    assert crossover_bytes(topo.all_gather_s) == pytest.approx(8 * 1e-6 * 450e9)
    assert crossover_bytes(ring(8, Link(450e9, 0.0)).all_gather_s) == 0
    assert crossover_bytes(lambda b: 1e-6) is None


def test_cost_figure_draws_four_collectives_and_both_regions():
    topo = group_topology(CHIPS["h100"], 8, 1)
    fig = cost_figure(topo, pow2_sizes(2**10, 2**34), example_bytes=2 * 1024 * 16384)
    names = [t.name for t in fig.data if t.showlegend is not False]
    assert names == ["All-gather", "Reduce-scatter", "All-reduce", "All-to-all"]
    assert {a.text for a in fig.layout.annotations} == {"<b>latency-bound</b>", "<b>bandwidth-bound</b>"}
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"


def test_worked_example_all_gather_of_bf16_1024_by_16384_on_8_h100():
    # scaling book Part 12 style: (N-1)/N V/W = 7/8 * 33.55 MB / 450 GB/s = 65.2 us, plus 7 x 1 us latency
    nbytes = 2 * 1024 * 16384
    latex = ring_formula_latex("all_gather", 8, 1e-6, 450e9, nbytes)
    assert r"= 7\,\mu\text{s} + 65.2\,\mu\text{s} = 72.2\,\mu\text{s}" in latex
    assert r"\tfrac{33.55\,\text{MB}}{450\,\text{GB/s}}" in latex
    # the measured pipeline fill is a term of its own, so the sum is the cost model's
    assert r"+ 3\,\mu\text{s}_\text{fill} = 75.2\,\mu\text{s}" in ring_formula_latex(
        "all_gather", 8, 1e-6, 450e9, nbytes, fill_s=3e-6)
    # the table's H100: 7 ring steps of 1.5 us on the spec link; achievable adds the measured
    # efficiency and pipeline fill
    h100 = CHIPS["h100"]
    assert group_topology(h100, 8, 1).all_gather_s(nbytes) == pytest.approx(65.24e-6 + 7 * 1.5e-6, rel=1e-3)
    assert group_topology(h100, 8, 1, achievable=True).all_gather_s(nbytes) == pytest.approx(
        nbytes * 7 / 8 / (450e9 * h100.link_efficiency) + 7 * h100.scaleup_latency_s + h100.scaleup_fill_s, rel=1e-3)
    assert format_seconds(72.24e-6) == "72.2 µs" and format_bytes(nbytes) == "32 MiB"


def _synthetic_sweep(alpha_s: float, beta_s_per_byte: float, world: int = 2) -> list[dict]:
    from hardware.this_machine import ring_terms

    out = []
    for op in COLLECTIVES:
        for size in pow2_sizes(2**10, 2**22)[::2]:
            a, b = ring_terms(op, world, size)
            seconds = a * alpha_s + b * beta_s_per_byte
            out.append({"op": op, "bytes": size, "seconds": seconds, "world": world})
    return out


def test_machine_link_recovers_alpha_and_beta_and_makes_a_link():
    result = machine_link(_synthetic_sweep(50e-6, 1e-9), world=2)
    assert result.alpha_s == pytest.approx(50e-6) and result.beta_s_per_byte == pytest.approx(1e-9)
    assert set(result.per_op) == set(COLLECTIVES)
    link = result.link()
    assert (link.bytes_per_s, link.latency_s) == (pytest.approx(1e9), pytest.approx(50e-6))
    assert len(sweep_figure(result).data) == 8  # measured points and fitted line per collective


def test_engine_errors_become_one_clear_sentence():
    from engine.config import ConfigError
    from engine.launch import RankFailed, RunStopped, RunTimedOut

    assert engine_error_message(RunStopped(1), what="run")[0].startswith("Stopped, as asked, after 1 step.")
    assert "after 3 steps." in engine_error_message(RunStopped(3), what="run")[0]
    message, details = engine_error_message(ConfigError("world=9 must be between 2 and 8"))
    assert message.endswith("world=9 must be between 2 and 8") and details is None
    detail = ('Traceback (most recent call last):\n  File "x.py", line 1\n'
              "RuntimeError: Connection closed by peer\n")
    message, details = engine_error_message(RankFailed(1, detail))
    assert message.startswith("Rank 1 failed: RuntimeError: Connection closed by peer")
    assert "Traceback" not in message and details == detail
    message, _ = engine_error_message(RunTimedOut(60, {0: "in all_gather", 1: "in barrier"}))
    assert "60 s" in message and "0, 1" in message
    assert "OSError" in engine_error_message(OSError("no space left"))[0]


# ---- the page -----------------------------------------------------------------------------------

def _page(**params) -> AppTest:
    return open_app(PAGE, **params)


def _chart(at: AppTest, key: str) -> str:
    return next(c.proto.spec for c in at.get("plotly_chart") if c.proto.id and key in c.proto.id)


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def test_page_shows_the_ring_and_the_h100_worked_example():
    at = _page()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.get("plotly_chart")) == 2  # ring animation and cost curves; no sweep yet
    # spec links (no measured fill): 65.24 us of bytes plus 7 ring steps of the table's 1.5 us
    assert _metric(at, "All-gather") == "75.7 µs"
    assert _metric(at, "All-reduce") == "151 µs"
    assert any("Worked example" in m.value and "bandwidth-bound" in m.value for m in at.markdown)
    assert at.toggle(key="achievable").proto.wrap  # in its narrow column the label was cut to "Achievable instea..."


def test_changing_n_and_collective_redraws_the_ring():
    at = _page()
    before = _chart(at, "ring")
    at.slider(key="ring_n").set_value(6).run()
    assert not at.exception
    after_n = _chart(at, "ring")
    assert after_n != before and "6 chips" in after_n
    at.radio(key="collective").set_value("all_to_all").run()
    assert not at.exception
    assert _chart(at, "ring") != after_n and "All-to-all, 6 chips" in _chart(at, "ring")


def test_crossing_nodes_costs_more_than_staying_on_nvlink():
    inside = _page(group="16", stride="1")
    across = _page(group="16", stride="8")
    assert not inside.exception and not across.exception
    text = next(m.value for m in inside.markdown if "2 domains of 8 chips" in m.value)
    assert "one ring per card through every chip of the group" in text and "15/16 of that share" in text
    assert float(_metric(across, "All-gather").split()[0]) > float(_metric(inside, "All-gather").split()[0])


def test_a_tree_all_reduce_is_named_and_the_equation_reads_in_ms():
    # 4,096 chips one per node: 2 GiB gathered over the network; NCCL's all-reduce runs double binary trees
    at = _page(group="4096", stride="4096", rows="65536")
    assert not at.exception, [e.value for e in at.exception]
    assert (_metric(at, "All-gather"), _metric(at, "All-reduce")) == ("67.5 ms", "86 ms")
    assert next(m for m in at.metric if m.label == "All-reduce").proto.help.startswith("double binary trees")
    note = next(m.value for m in at.markdown if "not the ring of the formulas" in m.value)
    assert "2⌈log₂ 4,096⌉ = 24 latency steps, 144 µs, instead of the ring's 2(4,096 − 1) = 8,190" in note
    assert "its curve lies under the all-gather's" in note
    assert any("86 ms (double binary trees)" in m.value for m in at.markdown if "Worked example" in m.value)
    latex = [e.proto.body for e in at.get("latex")]
    assert any(r"= 24.6\,\text{ms} + 42.9\,\text{ms} = 67.5\,\text{ms}" in b for b in latex), latex
    table = next(d.value for d in at.dataframe if "Placement" in d.value.columns)
    assert table["All-reduce"].iloc[-1] == "86 ms (trees)"  # one chip per node, the placement asked for


def test_the_worked_equation_adds_the_achievable_links_fill():
    at = _page(achievable="true")
    assert not at.exception
    body = next(e.proto.body for e in at.get("latex") if "_\\text{fill}" in e.proto.body)
    assert f"= {_metric(at, 'All-gather').replace(' µs', '')}\\,\\mu\\text{{s}}\\end{{aligned}}\n$$" in body
    assert not any("not the ring of the formulas" in m.value for m in at.markdown)  # NVLink: rings


def test_engine_failure_shows_an_error_not_a_traceback(monkeypatch):
    import engine.sweep
    from engine.launch import RankFailed

    def fail(*args, **kwargs):
        raise RankFailed(1, "Traceback (most recent call last):\nRuntimeError: gloo connection reset\n")

    monkeypatch.setattr(engine.sweep, "run_collective_sweep", fail)
    at = _page()
    at.button[0].click().run()
    assert not at.exception
    assert any("Rank 1 failed: RuntimeError: gloo connection reset" in e.value for e in at.error)
    assert "this_machine_link" not in at.session_state


@pytest.fixture
def clean_pools():
    from engine import launch

    yield
    launch.shutdown_all()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_live_sweep_at_world_2_fits_alpha_and_beta(clean_pools):
    at = _page()
    at.select_slider(key="live_max").set_value(2**16).run()
    at.slider(key="live_repeats").set_value(1).run()
    at.button[0].click().run(timeout=180)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    result = at.session_state["this_machine_link"]
    assert result.world == 2 and {m["bytes"] for m in result.measurements} == {2**10, 2**12, 2**14, 2**16}
    assert result.alpha_s >= 0 and result.beta_s_per_byte >= 0
    assert _metric(at, "α (latency per step)").endswith(("µs", "ms", " s"))
    assert len(at.get("plotly_chart")) == 3


def test_calibration_rows_list_every_blocking_operation():
    import json
    from pathlib import Path

    from hardware.this_machine import Calibration
    from ui.collectives import calibration_rows

    path = Path(__file__).resolve().parents[1] / "planner" / "data" / "calibration-2core.json"
    cal = Calibration.from_dict(json.loads(path.read_text()))
    rows = calibration_rows(cal)
    assert {r["group"] for r in rows} == {"2 of 2", "2 of 4", "4 of 4"}
    assert {r["operation"] for r in rows} >= {"all reduce", "all gather", "reduce scatter", "all to all"}
    ar = next(r for r in rows if r["group"] == "2 of 2" and r["operation"] == "all reduce")
    assert ar["α (per operation)"].endswith("ms") or ar["α (per operation)"].endswith("µs")
    # a pipeline's messages, each row saying how it was timed
    timed = {r["timed"] for r in rows if r["group"] == "2 of 4" and r["operation"] == "send recv"}
    assert {"receive posted after its send, 2 senders computing", "receive posted after its send, its sender blocked",
            "sent to a receive already waiting, 1 sender computing"} <= timed
    assert all(r["timed"] and not r["timed"].startswith(("late", "early", "sync")) for r in rows)
    # and how long posting one holds its sender, read off the engine's own pipeline (no CPU time there)
    post = [r for r in rows if r["operation"] == "send recv" and r["timed"].startswith("posting its isend")]
    assert {r["group"] for r in post} == {"2 of 2", "2 of 4"} and all(r["CPU busy"] == "not timed" for r in post)
    # two asynchronous operations posted at once, beside one alone in the same blocks
    pair = {r["timed"] for r in rows if r["group"] == "4 of 4" and r["operation"] == "all reduce"}
    assert {"asynchronous, alone, after 300 µs of compute",
            "two asynchronous at once, after 300 µs of compute"} <= pair
    assert all(r["timed"] not in ("alone", "pair") for r in rows)
