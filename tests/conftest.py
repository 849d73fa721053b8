"""Suite-wide: no result cache in the server's queue (below), and the machine calibration the live prediction
uses lives in a folder of this test session, never in the user's cache.

That folder starts with the recorded 2-core calibration (tests/planner/data/calibration-2core.json, worlds
2 and 4) filed under this machine's key, so the many tests that only need *a* prediction beside a run do
not each wait ~50 s for a measurement; no test asserts a predicted number from it. The tests of measuring
itself (tests/engine/test_predict.py, the Hardware page's button in tests/ui/test_app.py) measure for real,
in folders of their own, and leave this one as it is."""

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
