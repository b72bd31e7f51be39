import pytest
from ray_head import Head


@pytest.fixture(scope="module")
def head():
    """A `ray start --head` cluster with token auth for one module (the token itself is made once
    per session by tests/conftest.py)."""
    h = Head(num_cpus=2)
    yield h
    h.stop()
