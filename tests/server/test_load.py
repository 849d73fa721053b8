"""A short form of bench/bench_classroom.py: a few browser sessions press Run at once on one server."""

import os

import pytest

from bench.bench_classroom import CHROMIUM, measure

pytestmark = [
    pytest.mark.browser, pytest.mark.multiprocess,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason="needs Debian's Chromium: sudo apt-get install -y chromium"),
]


def test_every_session_gets_its_verified_result_and_nothing_is_left():
    # three lessons of different imports opened at once on a fresh server, as a class does when a teacher
    # shares links: their first script runs overlap (which once exposed a half-imported pandas through Plotly)
    lessons = ("data-parallel", "pipeline", "expert-parallel")
    r = measure(sessions=3, env={"SHARDLAB_RESULT_CACHE": "0"}, page_path=lessons)
    assert (r["completed"], r["unfinished"], r["messages"], r["exceptions"]) == (3, 0, 0, 0), r
    assert r["workers_left"] == 0 and not r["server_had_to_be_killed"], r


def test_stopping_the_server_with_runs_queued_leaves_nothing_behind():
    r = measure(sessions=3, env={"SHARDLAB_RESULT_CACHE": "0", "SHARDLAB_MAX_CONCURRENT": "1"}, stop_midway=True)
    assert r["unfinished"] >= 1, r  # it really stopped with runs still to do
    assert r["workers_left"] == 0 and not r["server_had_to_be_killed"], r


def test_tabs_closed_while_waiting_leave_the_others_to_finish():
    # one run at a time: the first closed tab's run is running or about to, the second's waits behind it
    r = measure(sessions=3, env={"SHARDLAB_RESULT_CACHE": "0", "SHARDLAB_MAX_CONCURRENT": "1"}, close_tabs=2)
    assert r["closed_tabs"] == 2 and (r["completed"], r["unfinished"]) == (1, 0), r
    assert r["workers_left"] == 0 and not r["server_had_to_be_killed"], r
