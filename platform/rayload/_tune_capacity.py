"""How many trials of a search fit: a trial shape the cluster can never hold is refused before
the search starts, and the default concurrency is the free resources over one trial's needs."""

from __future__ import annotations

from .errors import RayloadError


class SearchResourceError(RayloadError):
    pass


def _check_shape(workers: int, cpus: float, gpus: float, accelerator: str | None, driver: dict[str, float] | None = None) -> None:
    """A trial the cluster can never hold is refused before the search starts (`driver`: what
    a multi-worker trial holds itself while its TorchTrainer's workers run)."""
    from .spec import ResourcesSpec
    from .train.resources import ResourceError, check_resources

    try:
        check_resources(ResourcesSpec(workers=workers, cpus_per_worker=cpus, gpus_per_worker=gpus, accelerator_type=accelerator),
                        driver)
    except ResourceError as exc:
        raise SearchResourceError(f"trial_resources: one trial can never run here: {exc}") from None


def _concurrency(requested: int | None, need: dict[str, float], total: int) -> int:
    """Default: the cluster's free resources divided by one trial's needs."""
    import ray

    if requested:
        return min(requested, total)
    free = ray.available_resources()
    fits = [int(free.get(k, 0) // v) for k, v in need.items() if v > 0]
    return max(1, min([total, *fits]))
