"""Warm worker pools shared by every multi-process test in this folder: ranks start once per world size
(a cold start costs seconds; a warm run milliseconds)."""

import pytest

from engine.launch import Pool


@pytest.fixture(scope="session")
def pools():
    started: dict[int, Pool] = {}

    def get(world: int) -> Pool:
        if world not in started:
            started[world] = Pool(world, collective_timeout_s=20)
        return started[world]

    yield get
    for pool in started.values():
        pool.shutdown()
