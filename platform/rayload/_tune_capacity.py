"""How many trials of a search fit: a trial shape the cluster can never hold is refused before
the search starts, and the default concurrency is the free resources over one trial's needs."""

from __future__ import annotations

from .errors import RayloadError


class SearchResourceError(RayloadError):
    pass


def _check_shape(workers: int, cpus: float, gpus: float, accelerator: str | None, driver: dict[str, float] | None = None,
                 fields: str = "trial_resources.workers / cpus_per_worker / gpus_per_worker") -> None:
    """A trial the cluster can never hold is refused before the search starts (`driver`: what
    a multi-worker trial holds itself while its TorchTrainer's workers run; `fields`: what the
    message tells the user to lower)."""
    from .spec import ResourcesSpec
    from .train.resources import ResourceError, check_resources

    try:
        check_resources(ResourcesSpec(workers=workers, cpus_per_worker=cpus, gpus_per_worker=gpus, accelerator_type=accelerator),
                        driver, fields)
    except ResourceError as exc:
        where = "trial_resources" if fields.startswith("trial_resources") else fields
        raise SearchResourceError(f"{where}: one trial can never run here: {exc}") from None


def _concurrency(requested: int | None, bundles: list[dict[str, float]], total: int) -> int:
    """Default: how many trials the cluster's free resources place at once, each trial all of
    `bundles` (its own share, and a multi-worker trial's TorchTrainer workers), each bundle on one
    node: a sum over nodes would start trials whose worker groups cannot be placed (they wait
    out the placement timeout and fail)."""
    import ray

    if requested:
        return min(requested, total)
    nodes = list(ray._private.state.available_resources_per_node().values())
    return max(1, trials_that_fit(nodes, bundles, total))


def trials_that_fit(nodes: list[dict[str, float]], bundles: list[dict[str, float]], most: int) -> int:
    """How many trials of `bundles` the free resources `nodes` hold together (first fit, each
    bundle on one node), at most `most`."""
    free = [dict(n) for n in nodes]
    count = 0
    while count < most:
        trial = [dict(n) for n in free]
        for bundle in bundles:
            node = next((n for n in trial if all(n.get(k, 0) + 1e-9 >= v for k, v in bundle.items())), None)
            if node is None:
                return count
            for k, v in bundle.items():
                node[k] = node.get(k, 0) - v
        free, count = trial, count + 1
    return count
