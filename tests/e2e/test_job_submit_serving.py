"""`ray job submit --working-dir .` of the specs in jobs/ that serve an A/B test (the A/B spec
and the pipeline), on a head of their own (the `head` fixture of tests/e2e/conftest.py), so
they run beside test_job_submit.py's."""

import pytest
from small_jobs import SERVING, submit_and_check

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("spec", SERVING)
def test_ray_job_submit_runs_every_serving_spec(head, spec):
    submit_and_check(head, spec)
