"""The planner lesson through AppTest: the sidebar setup is estimated, bad meshes explained, search ranks."""

import json
import re

from streamlit.testing.v1 import AppTest

from tests.ui.apptest_util import open_app


def _page(**params) -> AppTest:
    return open_app("app_pages/planner.py", **params)


def _metric(at, label):
    return next(m.value for m in at.metric if m.label == label)


def test_sidebar_mesh_is_estimated_with_timeline_and_explanation():
    at = _page(model="Llama 3 70B", chip="h100", dp="8", tp="8")
    assert not at.exception, [e.value for e in at.exception]
    assert "dp=8, tp=8, pp=1" in " ".join(m.value for m in at.markdown)
    assert _metric(at, "Step time").endswith(" s")
    assert 0 < float(_metric(at, "MFU").split()[0]) < 100
    assert len(at.get("plotly_chart")) == 3  # memory, breakdown, timeline
    assert any("TP=8" in m.value for m in at.markdown)


def test_a_partial_recomputation_is_named_with_its_layers():
    # Llama 3 70B on 64 H100 at dp 8 x tp 8 and 4M tokens fits only recomputing some layers: the layout line,
    # the chosen fields and the explanation say how many
    at = _page(model="Llama 3 70B", chip="h100", dp="8", tp="8")
    assert not at.exception
    layout = next(m.value for m in at.markdown if m.value.startswith("**Layout:**"))
    assert "recompute full (" in layout and " layers)" in layout
    assert "recompute_layers=" in at.caption[0].value
    assert any("Full recomputation of the first" in m.value for m in at.markdown)


def test_a_mesh_that_does_not_divide_the_model_is_a_message():
    # Llama 3 8B: 32 heads are not divisible by tp=3; a dense model has no experts to spread over ep=2
    for params, field in (({"tp": "3"}, "parallel.tp"), ({"ep": "2"}, "parallel.ep")):
        at = _page(model="Llama 3 8B", chip="h100", dp="1", **params)
        assert not at.exception
        assert at.error and field in at.error[0].value and "Change the mesh" in at.error[0].value


def test_planner_chooses_and_search_ranks_layouts():
    at = _page(model="Llama 3 8B", chip="h100", dp="16", layout_mode="let the planner choose")
    assert not at.exception
    assert at.caption[0].value.startswith("Chosen by the planner")
    at.button[0].click().run(timeout=120)
    assert not at.exception
    table = next(d.value for d in at.dataframe if "step s" in d.value.columns)  # the search's ranking
    assert len(table) >= 3
    assert list(table["step s"]) == sorted(table["step s"])  # ranked fastest first
    assert (table["dp"] * table["tp"] * table["pp"] * table["cp"]).eq(16).all()
    # another chip in the sidebar: the ranking was the H100's, shown under the new setup's heading
    at.sidebar.selectbox(key="chip").set_value("tpu-v5p").run(timeout=120)
    assert not at.exception and not any("step s" in d.value.columns for d in at.dataframe)
    assert any("The setup changed since the last search" in c.value for c in at.caption)


def test_the_batch_slider_sets_the_batch_at_any_chip_count():
    """Rounded to a multiple of the chip count, 0.5M and 32M tokens on 16,384 chips had both been 134M."""
    at = _page(model="Llama 3 405B", chip="h100", dp="128", tp="8", pp="16")
    layouts = {}
    for tokens in (2**19, 2**25):
        at.select_slider(key="batch_tokens").set_value(tokens).run(timeout=120)
        assert not at.exception
        layouts[tokens] = next(m.value for m in at.markdown if m.value.startswith("**Layout:**"))
    assert "global batch 128 sequences of 8,192 tokens (1M tokens: the slider's 0.5M rounded" in layouts[2**19]
    assert "global batch 4,096 sequences of 8,192 tokens." in layouts[2**25]


def test_out_of_memory_advice_on_one_chip_names_only_what_one_chip_can_do():
    at = _page(model="Llama 3 8B", chip="h100", dp="1")
    warning = next(w.value for w in at.warning if "more than the" in w.value)
    assert "Try full recomputation" in warning or "Use more chips" in warning
    assert "ZeRO-3" not in warning and "more tp" not in warning


def test_the_page_says_how_far_to_trust_it_from_the_published_runs():
    from planner.validation import (
        HELDOUT_RUNS,
        accuracy,
        checkpointed,
        llmfoundry_sweep_runs,
        load_published_runs,
        validate,
    )
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/planner.py")
    assert not at.exception
    trust = next(e for e in at.expander if e.label == "How far to trust these numbers")
    n, mean, _ = accuracy(load_published_runs(HELDOUT_RUNS))
    trust_text = trust.markdown[0].value
    assert f"{n} other published runs" in trust_text and f"mean error {mean:.1%}" in trust_text
    runs = llmfoundry_sweep_runs()  # llm-foundry's tables, said apart, split by activation checkpointing
    n, mean, worst = accuracy(runs)
    assert f"throughput tables ({n} runs" in trust_text and f"mean error is {mean:.1%}, worst {worst:.1%}" in trust_text
    rows = validate(runs)
    for flag, words in ((True, "for runs with activation checkpointing"), (False, "for runs without it")):
        errors = [r.error for r, run in zip(rows, runs, strict=True) if checkpointed(run) is flag]
        mean = sum(errors) / len(errors)
        assert f"{abs(mean):.0%} {'shorter' if mean < 0 else 'longer'} than measured {words}" in trust_text
    assert "MFU**: the model's FLOPs per step" in " ".join(m.value for m in at.markdown)


def test_the_mfu_says_its_convention_and_gives_the_causal_one():
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/planner.py")
    (mfu,) = [m for m in at.metric if m.label == "MFU"]
    assert "full S x S square" in mfu.help and "causal half only:" in mfu.help


def test_the_page_shows_real_gpu_steps_beside_their_prediction():
    from planner.gpu_steps import comparisons
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/planner.py")
    assert not at.exception
    trust = next(e for e in at.expander if e.label == "How far to trust these numbers")
    table = trust.table[0].value  # app_pages.text_table
    steps = comparisons()
    assert len(table) == len(steps) == 8
    assert list(table["measured ms"]) == [f"{c.measured_s * 1e3:.1f}" for c in steps]
    assert list(table["predicted ms"]) == [f"{c.predicted_s * 1e3:.1f}" for c in steps]
    by_class = trust.table[1].value  # the kernel classes in a table of their own (800 px)
    assert list(by_class.columns) == ["step on one H200", "gemm", "attention", "memory-bound", "GPU idle"]
    text = " ".join(m.value for m in trust.markdown)
    lo, hi = min(c.error for c in steps), max(c.error for c in steps)
    assert "Checked on a real GPU" in text and f"whole steps {lo:+.0%} to {hi:+.0%}" in text


def test_the_page_shows_the_published_ab_gains_beside_the_predicted():
    from planner.validation import feature_ab
    from tests.ui.apptest_util import open_app

    at = open_app("app_pages/planner.py")
    assert not at.exception
    trust = next(e for e in at.expander if e.label == "How far to trust these numbers")
    text = " ".join(m.value for m in trust.markdown)
    assert "Checked against published A/Bs" in text
    for ab in feature_ab():
        assert f"{ab.label}: measured **{ab.measured_gain:+.0%}**, predicted **{ab.predicted_gain:+.0%}**" in text
        # what the sentence after them says of the expert all-to-all overlap
        assert ab.field != "ep_comm_overlap" or ab.predicted_gain > ab.measured_gain
    assert "read its gain as an upper bound" in text


def test_the_page_says_what_each_unstated_recipe_field_is_worth():
    from planner import assumptions, estimate, make_case
    from planner.case import Cluster, Parallel
    from planner.models import MODEL_PRESETS
    from planner.presets import default_global_batch
    from planner.validation import HELDOUT_RUNS, attention_stated_only, load_published_runs, validate

    at = _page(model="Llama 3 70B", chip="h100", dp="8", tp="8")
    assert not at.exception
    worth = next(e for e in at.expander if e.label == "What the unstated recipe is worth")
    table = worth.table[0].value
    spec = MODEL_PRESETS["Llama 3 70B"]
    case = make_case(spec, Cluster("h100", 64), global_batch=default_global_batch(spec.seq_len, 64, 2**22),
                     parallel=Parallel(dp=8, tp=8, pp=1, cp=1, ep=1))
    found = assumptions(case, estimate(case))
    moving = [a for a in found if abs(a.change) >= 0.0005]  # the rest: "making no difference", in a caption
    assert list(table["field"]) == [a.field.removeprefix("training.") for a in moving]
    assert list(table["change"]) == [f"{a.change:+.1%}" for a in moving]
    assert "one at a time on this same layout" in worth.markdown[0].value
    # the trust section counts the held-out runs whose published step the unstated fields' span holds
    trust = next(e for e in at.expander if e.label == "How far to trust these numbers")
    rows = validate([attention_stated_only(r) for r in load_published_runs(HELDOUT_RUNS)], bands=True)
    text = " ".join(m.value for m in trust.markdown)
    assert f"in **{sum(r.within_band for r in rows)} of {len(rows)}**" in text


def _chosen_caption(at) -> str:
    return next(c.value for c in at.caption if c.value.startswith("Chosen by the planner"))


def _layout_line(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("**Layout:**"))


def test_fields_that_do_nothing_for_the_layout_are_not_listed_and_flags_read_on_or_off():
    """At dp 8 (pp 1, tp 1) the caption had listed pp_schedule=1f1b, virtual_stages=1 and sequence_parallel=False,
    and the Layout line "schedule 1f1b (v=1)", where the search's table leaves the schedule blank; flags had read
    True / False there and on / off in the recipe table."""
    at = _page()
    assert not at.exception
    chosen = _chosen_caption(at)
    assert not any(f in chosen for f in ("pp_schedule", "virtual_stages", "sequence_parallel"))
    assert "grad_reduce_overlap=on" in chosen and "=True" not in chosen and "=False" not in chosen
    assert "schedule" not in _layout_line(at)
    piped = _page(model="Llama 3 405B", dp="128", tp="8", pp="16")
    assert "schedule 1f1b v=1;" in _layout_line(piped)  # as the search's table writes it


def test_the_memory_metric_says_fits_without_an_arrow():
    from streamlit.proto.Metric_pb2 import Metric

    at = _page()
    (memory,) = [m for m in at.metric if m.label == "Memory per chip"]
    assert memory.proto.delta == "fits" and memory.proto.direction == Metric.MetricDirection.NONE


def test_one_step_is_said_in_one_unit_on_the_page():
    """One chip of Llama 3 8B: the metric had read "8.33 min", the timeline's axis "time (s)" up to 500 and the
    span of the unstated recipe "between 492.30 s and 833.85 s"."""
    at = _page(dp="1")
    assert not at.exception
    step = _metric(at, "Step time")
    assert step.endswith(" min")
    timeline = next(c.proto.spec for c in at.get("plotly_chart") if "Predicted timeline" in c.proto.spec)
    assert json.loads(timeline)["layout"]["xaxis"]["title"]["text"] == "time (min)"
    worth = next(e for e in at.expander if e.label == "What the unstated recipe is worth")
    band = re.search(r"between \*\*(.+?)\*\* and \*\*(.+?)\*\*", worth.markdown[0].value)
    assert band and all(b.endswith(" min") for b in band.groups())


def test_out_of_memory_advice_offers_only_what_can_help():
    # one chip: no other layout to choose; 16 bytes a parameter of Llama 3 8B fit no batch, a B200 holds them
    one = next(w.value for w in _page(dp="1").warning if "more than the" in w.value)
    assert "let the planner choose" not in one and "smaller batch" not in one
    assert "Use more chips or a chip with more HBM (" in one and "whatever the batch" in one
    # Llama 3 405B on one chip: 6.5 TB of training state fits no chip and no batch
    at = _page(model="Llama 3 405B", dp="1", layout_mode="let the planner choose")
    assert not at.exception
    huge = next(w.value for w in at.warning if "more than the" in w.value)
    assert "No layout of 1 chip fits. Use more chips. The weights, gradients and optimizer state" in huge
    assert "the leanest (none fits)" in _chosen_caption(at)  # not "the fastest: none fits"
    # the search ranks nothing: no empty table above its warning, and the counts say none was simulated
    at.button[0].click().run(timeout=120)
    assert not at.exception
    assert not any("step s" in d.value.columns for d in at.dataframe)
    counts = next(c.value for c in at.caption if "divide the model" in c.value)
    assert counts.startswith("7 layouts divide the model and the batch") and "none was simulated" in counts
    assert any(w.value.startswith("No layout of 1 chip fits in memory. Use more chips.") for w in at.warning)
    assert not any("smaller batch" in w.value or "more HBM" in w.value for w in at.warning)


def test_another_layout_of_the_same_chips_is_offered_where_one_fits():
    at = _page(model="Llama 3 405B", dp="128")  # ZeRO-3 over 128 does not fit; tp 8 x pp 16 does
    warning = next(w.value for w in at.warning if "more than the" in w.value)
    assert "Another layout of these 128 chips fits: try more tp or pp in the sidebar's mesh, or let the planner " \
           "choose" in warning


def test_a_setup_the_planner_cannot_use_gets_advice_for_the_field_that_failed():
    # too many chips: letting the planner choose keeps the count
    at = _page(dp="65536", tp="8", pp="126", cp="64")
    (error,) = [e.value for e in at.error]
    assert "cluster.num_chips" in error and "let the planner choose" not in error
    assert "its degrees multiply to the chip count" in error
    # a batch too long to run pass by pass: the slider fixes it
    at = _page(model="GPT-3 175B", chip="a100-80gb", dp="1", tp="8", pp="12", batch_tokens="32M")
    (error,) = [e.value for e in at.error]
    assert "training.global_batch" in error and "global batch with the slider above" in error
    assert "the degrees must fit the model" not in error


def test_bad_values_of_the_pages_own_link_parameters_are_said():
    at = _page(batch_tokens="123", layout_mode="foo", search_top="7")
    assert not at.exception
    (info,) = [i.value for i in at.info if i.value.startswith("Ignored from the link")]
    for said in ("batch_tokens=`123` (it takes one of 0.5M, 1M, 2M, 4M, 8M, 16M, 32M)",
                 "layout_mode=`foo` (it takes one of my mesh (sidebar), let the planner choose)",
                 "search_top=`7` (it takes one of 3, 5, 10)"):
        assert said in info
    assert not any(k in at.query_params for k in ("batch_tokens", "layout_mode", "search_top"))
    # good values pass without a word
    at = _page(batch_tokens="1M", layout_mode="let the planner choose", search_top="10")
    assert not any(i.value.startswith("Ignored from the link") for i in at.info)
    assert at.select_slider(key="batch_tokens").value == 2**20 and at.select_slider(key="search_top").value == 10
