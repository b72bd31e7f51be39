"""`ray job submit --working-dir .` of the specs in jobs/ that serve an A/B test (the A/B spec
and the pipeline), on a head of their own, so they run beside test_job_submit.py's."""

import pytest
from ray_head import Head, ensure_token
from small_jobs import SERVING, submit_and_check

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def head():
    ensure_token()
    h = Head(num_cpus=2)
    yield h
    h.stop()


@pytest.mark.parametrize("spec", SERVING)
def test_ray_job_submit_runs_every_serving_spec(head, spec):
    submit_and_check(head, spec)
