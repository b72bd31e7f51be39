import os
import sys

import numpy as np
import pandas as pd
import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)


@pytest.fixture(autouse=True)
def _isolated_runs(tmp_path, monkeypatch):
    """Every test gets its own runs/ folder (cache included)."""
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))


def pytest_configure(config):
    """The Ray auth token, made once before pytest-xdist starts its workers: two e2e modules
    generating it at the same moment in two workers would each start a head with its own."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller already did it
        return
    sys.path.insert(0, os.path.join(HERE, "e2e"))
    from ray_head import ensure_token

    ensure_token()


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
