"""The app shell and the lessons through Streamlit's AppTest (no browser: fast)."""

import pytest
from streamlit.testing.v1 import AppTest

from tests.ui.apptest_util import TIMEOUT_S, open_app
from ui.lessons import LESSONS


def _app(**params) -> AppTest:
    return open_app(None, **params)


def _page(path: str, **params) -> AppTest:
    return open_app(path, **params)


def _metric(at: AppTest, label_start: str) -> str:
    return next(m.value for m in at.metric if m.label.startswith(label_start))


def test_home_opens_with_sidebar_choices_and_links_every_lesson():
    at = _app()
    assert not at.exception
    assert at.sidebar.selectbox(key="chip").value == "h100"
    assert at.sidebar.selectbox(key="model").value == "Llama 3 8B"
    assert at.sidebar.number_input(key="dp").value == 8
    assert not at.sidebar.warning
    assert at.session_state["choices"].num_chips == 8
    assert at.title[0].value == "ShardLab"
    body = " ".join(m.value for m in at.markdown)
    for lesson in LESSONS:
        assert lesson.title in body or any(lesson.title in str(p.proto) for p in at.get("page_link"))


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda lesson: lesson.url_path)
def test_every_lesson_opens_without_exception(lesson):
    at = _page(lesson.path)
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == lesson.title


def test_link_choices_reach_the_pages():
    at = _page("app_pages/hardware.py", chip="tpu-v5p", model="GPT-3 175B", dp="4", tp="4")
    assert not at.exception
    choices = at.session_state["choices"]
    assert (choices.chip, choices.model, choices.num_chips) == ("tpu-v5p", "GPT-3 175B", 16)
    assert "TPU v5p" in _metric(at, "Ridge point") or "v5p" in next(
        m.label for m in at.metric if m.label.startswith("Ridge point"))


def test_bad_link_shows_messages_and_uses_defaults():
    at = _app(chip="h900", dp="-3", tp="zero", bogus="1")
    assert not at.exception
    warnings = " ".join(w.value for w in at.sidebar.warning)
    assert "h900" in warnings and "dp=`-3`" in warnings and "tp=`zero`" in warnings and "bogus" in warnings
    assert at.sidebar.selectbox(key="chip").value == "h100"
    assert at.session_state["choices"].mesh["dp"] == 8
    at.sidebar.button[0].click().run()
    assert not at.sidebar.warning


def test_roofline_verdict_follows_the_batch_slider():
    # scaling book: bf16 matmul with B=128, D=F=4096 is HBM-bound on H100 (ridge ~295)
    at = _page("app_pages/hardware.py")
    assert _metric(at, "Bound by") == "memory"
    before = _metric(at, "Arithmetic intensity")
    at.select_slider(key="tokens").set_value(4096).run()
    assert not at.exception
    assert _metric(at, "Bound by") == "compute"
    assert _metric(at, "Arithmetic intensity") != before
    assert at.get("plotly_chart")


def test_fp8_on_a_chip_without_fp8_explains_and_falls_back():
    at = _page("app_pages/hardware.py", chip="a100-80gb")
    at.radio(key="dtype").set_value("fp8").run()
    assert not at.exception
    assert any("no fp8" in w.value for w in at.warning)


def test_fp16_on_a_tpu_explains_and_falls_back():
    at = _page("app_pages/hardware.py", chip="tpu-v5p", dtype="fp16")
    assert not at.exception
    assert any("no fp16" in w.value for w in at.warning)


def test_chips_without_the_dtype_are_left_out_of_the_comparison_with_a_note():
    at = _page("app_pages/hardware.py", chip="h100", dtype="fp8")
    assert not at.exception and not at.warning
    note = next(c.value for c in at.caption if c.value.startswith("Not drawn"))
    assert "A100" in note and "TPU v5e" in note and "B200" not in note


def test_achievable_toggle_lowers_the_ridge_numbers():
    at = _page("app_pages/hardware.py", tokens="8192")
    spec_time = _metric(at, "Time")
    at.toggle(key="achievable").set_value(True).run()
    assert not at.exception
    assert _metric(at, "Time") != spec_time


@pytest.mark.multiprocess
def test_measure_this_machine_adds_its_roofline(monkeypatch, tmp_path, measured_calibration):
    # the probe is the calibration the live prediction uses: the button calibrates world 2, the result is
    # cached and shown again on the next visit without measuring (in a cache folder of its own: the session's
    # holds a recorded one). The measuring itself is the session's one real measurement (tests/conftest.py,
    # checked in tests/engine/test_predict.py): the page is handed it, as the cache file it would have written.
    import engine.predict
    from hardware import this_machine as tm

    measured, *_ = measured_calibration
    asked = []

    def calibrate(worlds, remeasure=False, progress=None, stop=None, **kwargs):
        asked.append((list(worlds), remeasure))
        progress(0.0, "timing the engine's modules on one rank")
        tm.save(measured)
        return real(worlds, remeasure=False, progress=progress, stop=stop, **kwargs)

    real = engine.predict.ensure_calibration
    monkeypatch.setattr(engine.predict, "ensure_calibration", calibrate)
    monkeypatch.setenv("SHARDLAB_CACHE_DIR", str(tmp_path))
    at = _page("app_pages/hardware.py")
    assert at.button[0].label == "Measure this machine"
    at.button[0].click().run(timeout=TIMEOUT_S)
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert asked == [([2], False)]
    probe = at.session_state["probe"]
    assert probe.matmul_flops_per_s > 0 and probe.memory_bytes_per_s > 0
    assert _metric(at, "Matmul (fp32)") == f"{measured.probe_result().matmul_flops_per_s / 1e9:,.1f} GFLOP/s"
    again = _page("app_pages/hardware.py")  # a new session: from the cache
    assert _metric(again, "Matmul (fp32)") == _metric(at, "Matmul (fp32)")
    assert again.button[0].label == "Measure again"


LIVE_PAGES = ["app_pages/data_parallel.py", "app_pages/tensor_parallel.py", "app_pages/pipeline.py",
              "app_pages/context_parallel.py", "app_pages/expert_parallel.py"]


@pytest.mark.parametrize("page", LIVE_PAGES)
def test_a_failing_engine_is_a_message_on_every_live_page(monkeypatch, page):
    import engine.run
    from engine.launch import RankFailed

    def fail(*args, **kwargs):
        raise RankFailed(1, "Traceback ...\nRuntimeError: boom")

    monkeypatch.setattr(engine.run, "run", fail)
    at = _page(page)
    at.button[0].click().run()
    assert not at.exception
    assert "Rank 1 failed: RuntimeError: boom" in at.error[0].value
