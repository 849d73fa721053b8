"""Suite-wide: no result cache in the server's queue (below), and the machine calibration the live prediction
uses lives in a folder of this test session, never in the user's cache.

That folder starts with the recorded 2-core calibration (tests/planner/data/calibration-2core.json, worlds
2 and 4) filed under this machine's key, so the many tests that only need *a* prediction beside a run do
not each wait ~50 s for a measurement; no test asserts a predicted number from it. Measuring itself is tested
on one real measurement of world 2 (`measured_calibration`, ~25 s, taken once for the session in a folder of
its own): tests/engine/test_predict.py checks it and the Hardware page's button in tests/ui/test_app.py is
handed it. Neither changes the session's folder."""

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import pytest

# The server's run queue answers identical runs from its cache; a test that makes the engine fail on
# purpose must not be answered by an earlier test's success. Tests of the cache turn it on themselves.
os.environ["SHARDLAB_RESULT_CACHE"] = "0"

RECORDED_CALIBRATION = Path(__file__).parent / "planner" / "data" / "calibration-2core.json"


def _recorded():
    from hardware.this_machine import Calibration

    return Calibration.from_dict(json.loads(RECORDED_CALIBRATION.read_text()))


@pytest.fixture
def recorded_calibration():
    """The recorded 2-core calibration, as it was measured (for tests that need a machine, not this one)."""
    return _recorded()


def seed_calibration() -> None:
    """File the recorded calibration under this machine's key in the current cache folder."""
    from engine.predict import torch_version
    from hardware import this_machine as tm

    tm.save(dataclasses.replace(_recorded(), key=tm.machine_key(torch_version()), created_s=time.time(),
                                cpus=tm.cpu_count(), torch=torch_version()))


@pytest.fixture(scope="session", autouse=True)
def calibration_cache_dir():
    with tempfile.TemporaryDirectory(prefix="shardlab-cache-") as d:
        old = os.environ.get("SHARDLAB_CACHE_DIR")
        os.environ["SHARDLAB_CACHE_DIR"] = d
        seed_calibration()
        yield d
        if old is None:
            os.environ.pop("SHARDLAB_CACHE_DIR", None)
        else:
            os.environ["SHARDLAB_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def measured_calibration(tmp_path_factory):
    """This machine's calibration of world 2, measured for real once for the session, starting from a corrupt
    file (a crash mid-write leaves half a file; `save` cannot) in a cache folder of its own:
    (calibration, messages, progress steps, that folder). The session's folder is set back after measuring."""
    from engine.predict import ensure_calibration, torch_version
    from hardware import this_machine as tm

    folder = tmp_path_factory.mktemp("measured-calibration")
    session_dir = os.environ["SHARDLAB_CACHE_DIR"]
    os.environ["SHARDLAB_CACHE_DIR"] = str(folder)
    try:
        path = tm.cache_path(tm.machine_key(torch_version()))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"format": 2, "key": ')
        steps = []
        cal, messages = ensure_calibration([2], progress=lambda fraction, text: steps.append((fraction, text)))
    finally:
        os.environ["SHARDLAB_CACHE_DIR"] = session_dir
    return cal, messages, steps, folder
