"""The live panel through the server's queue, as a student sees it: the cache mark, a Stop button, the
settings on "About this server"."""

import pytest

import server.queue
from server.queue import RunQueue
from server.settings import Settings
from tests.ui.apptest_util import open_app

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def cached_queue(monkeypatch):
    q = RunQueue(Settings(max_concurrent=1, result_cache=8))
    monkeypatch.setattr(server.queue, "_queue", q)
    yield q
    q.shutdown()


def test_an_identical_run_in_another_session_is_answered_from_the_cache(cached_queue):
    first = open_app("app_pages/data_parallel.py")
    first.button[0].click().run(timeout=180)
    assert not first.exception and first.success
    assert not any("Answered from this server's cache" in c.value for c in first.caption)
    second = open_app("app_pages/data_parallel.py")
    second.button[0].click().run(timeout=60)
    assert not second.exception and second.success
    assert any("Answered from this server's cache" in c.value for c in second.caption)
    assert cached_queue.snapshot()["cached"] == 1


def test_about_this_server_shows_the_settings(cached_queue):
    at = open_app("app_pages/data_parallel.py")
    about = next(e for e in at.expander if e.label == "About this server")
    text = " ".join(c.value for c in about.caption)
    assert "share one queue" in text
    rows = about.table[0].value
    assert "SHARDLAB_MAX_CONCURRENT" in set(rows["environment variable"])


def test_a_page_with_more_steps_than_the_server_allows_runs_fewer_and_says_so(monkeypatch):
    # a teacher's SHARDLAB_MAX_STEPS below a page's own steps had refused the run with advice to choose fewer
    # steps, on pages without a steps control
    q = RunQueue(Settings(max_concurrent=1, max_steps=1))
    monkeypatch.setattr(server.queue, "_queue", q)
    try:
        at = open_app("app_pages/data_parallel.py")
        at.button[0].click().run(timeout=180)
        assert not at.exception and at.success, [e.value for e in at.error]
        assert any("at most 1 optimizer step a run" in i.value for i in at.info)
        assert all(run.summary.steps == 1 for run in at.session_state["live_dp"])
    finally:
        q.shutdown()



@pytest.mark.parametrize("page", ["app_pages/hardware.py", "app_pages/collectives.py"])
def test_pages_that_measure_on_the_workers_show_the_server_too(cached_queue, page):
    """The Hardware and Collectives pages queue their measurement like a run but had no "About this server"."""
    at = open_app(page)
    assert not at.exception, [e.value for e in at.exception]
    about = [e for e in at.expander if e.label == "About this server"]
    assert len(about) == 1 and "SHARDLAB_MAX_RUN_S" in set(about[0].table[0].value["environment variable"])


@pytest.mark.parametrize("page, key, labels", [
    ("app_pages/context_parallel.py", "live_cp", ["ring", "allgather"]),
    ("app_pages/tensor_parallel.py", "live_tp", ["TP", "TP + SP"]),
    ("app_pages/mamba.py", "live_ssm", None),
])
def test_a_press_stopped_in_its_second_run_shows_the_first(monkeypatch, page, key, labels):
    # the CP and TP pages unpacked exactly two runs, and the queue dropped a finished run when a later one
    # of the same press was stopped: the first run was lost
    from engine.launch import RunStopped

    def second_stopped(cfg, on_step, progress, stop):
        if calls.append(cfg) or len(calls) > 1:
            stop.set()  # as the page's Stop button does
            raise RunStopped(0)
        return server.queue.engine_runner(cfg, on_step, progress, stop)

    if labels is None:  # the Mamba page's three variants
        from ui.mamba import LIVE_VARIANTS

        labels = list(LIVE_VARIANTS)
    calls = []
    q = RunQueue(Settings(max_concurrent=1, result_cache=0), runner=second_stopped)
    monkeypatch.setattr(server.queue, "_queue", q)
    try:
        at = open_app(page)
        run = next(b for b in at.button if b.label.startswith("Run "))
        run.click().run(timeout=180)
        assert not at.exception, [e.value for e in at.exception]
        assert [r.label for r in at.session_state[key]] == labels[:1]
        assert any("Stopped, as asked" in w.value for w in at.warning)
        said = [i.value for i in at.info if "this press asked for" in i.value]
        assert said == [f"1 run of the {len(labels)} this press asked for finished before it ended; not finished: "
                        f"{', '.join(labels[1:])}. "
                        "They are shown below; press the button again for all of them."]
        at.run(timeout=60)  # a rerun (a widget moved) still shows them, and says why only one
        assert not at.exception and [r.label for r in at.session_state[key]] == labels[:1]
        assert any("this press asked for" in i.value for i in at.info)
    finally:
        q.shutdown()
