import os
import subprocess
import sys

import pytest
from ray_head import ROOT, Head

RAYLOAD = os.path.join(os.path.dirname(sys.executable), "rayload")


@pytest.fixture(scope="module")
def head():
    """A `ray start --head` cluster with token auth for one module (the token itself is made once
    per session by tests/conftest.py)."""
    h = Head(num_cpus=2)
    yield h
    h.stop()


@pytest.fixture(scope="session")
def cli():
    """cli(*args, home=..., timeout=300) or cli(*args, env=..., timeout=300): the installed
    `rayload` console script run from the repository as a user runs it, its output captured. With
    `home`, in this environment plus RAYLOAD_HOME=home and COLUMNS=200; with `env`, in that one."""
    def run(*args, home=None, env=None, timeout=300):
        assert (home is None) != (env is None), "give home or env"
        if env is None:
            env = dict(os.environ, RAYLOAD_HOME=str(home), COLUMNS="200")
        return subprocess.run([RAYLOAD, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    return run
