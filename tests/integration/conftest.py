import pytest


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module (2 CPUs, no dashboard)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()
