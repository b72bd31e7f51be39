import os
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)


@pytest.fixture(autouse=True)
def _isolated_runs(tmp_path, monkeypatch):
    """Every test gets its own runs/ folder (cache included)."""
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))


def pytest_configure(config):
    """Made once before pytest-xdist starts its workers, which inherit it: the Ray auth token (two
    e2e modules generating it at the same moment in two workers would each start a head with its
    own), and one preprocessed-shard cache for the session (RAYLOAD_CACHE, fresh each session):
    the tests that train on the full MovieLens data set in their own run folders, CLI runs and
    Ray jobs included, preprocess it once instead of once each."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller already did it
        return
    config._rayload_cache = os.environ["RAYLOAD_CACHE"] = tempfile.mkdtemp(prefix="rayload-test-cache-")
    sys.path.insert(0, os.path.join(HERE, "e2e"))
    from ray_head import ensure_token

    ensure_token()


def pytest_unconfigure(config):
    cache = getattr(config, "_rayload_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
