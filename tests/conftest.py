"""Suite-wide: no result cache in the server's queue (below), and the machine calibration the live prediction
uses is cached in a folder of this test session, never in the user's cache (engine/predict.py measures it
there once, on first use)."""

import os
import tempfile

import pytest

# The server's run queue answers identical runs from its cache; a test that makes the engine fail on
# purpose must not be answered by an earlier test's success. Tests of the cache turn it on themselves.
os.environ["SHARDLAB_RESULT_CACHE"] = "0"


@pytest.fixture(scope="session", autouse=True)
def calibration_cache_dir():
    with tempfile.TemporaryDirectory(prefix="shardlab-cache-") as d:
        old = os.environ.get("SHARDLAB_CACHE_DIR")
        os.environ["SHARDLAB_CACHE_DIR"] = d
        yield d
        if old is None:
            os.environ.pop("SHARDLAB_CACHE_DIR", None)
        else:
            os.environ["SHARDLAB_CACHE_DIR"] = old
