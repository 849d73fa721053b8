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
    rows = about.dataframe[0].value
    assert "SHARDLAB_MAX_CONCURRENT" in set(rows["environment variable"])
