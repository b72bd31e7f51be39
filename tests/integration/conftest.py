import pytest


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module (2 CPUs, no dashboard)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def bucket():
    """A real S3 endpoint (moto's server on loopback) with one bucket, for one module; its URI.
    Ask for it before the module's Ray or nodes start: their processes inherit the credentials."""
    import helpers

    with helpers.s3_bucket() as uri:
        yield uri
