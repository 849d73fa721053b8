"""Suite-wide: the machine calibration the live prediction uses is cached in a folder of this test
session, never in the user's cache (engine/predict.py measures it there once, on first use)."""

import os
import tempfile

import pytest


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
