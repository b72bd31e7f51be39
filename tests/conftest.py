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
