"""How the training split reaches the Ray Train workers: `ray.train.get_dataset_shard("train")`
either way, through a `DataConfig` that picks the cheaper of two routes.

- Ray's default, `streaming_split`: a SplitCoordinator actor streams blocks to the ranks. It is
  the only choice when the rows are not materialised (a Parquet read every epoch,
  `train.cache_dataset: false`), when the group size is elastic, and on clusters of more than
  one node (the coordinator hands each rank blocks on its own node).
- Pre-split: when the training rows are already materialised in the object store (the default,
  `train.cache_dataset: true`) on a one-node cluster, the driver splits them once into equal
  parts (`MaterializedDataset.split(n, equal=True)`: the same rows per rank, as streaming_split
  with `equal=True` gives) and each rank iterates its own part. No coordinator actor (one fresh
  Python process fewer per group start on a 2-core node) and no block hand-off through it during
  the first epoch. The split is made in the driver on purpose: a task launched from Ray Train's
  actors inherits their runtime environment and cannot run on the driver's idle worker processes.

A group restarted after a worker failure gets fresh iterators over the same parts; a group of
another size than the parts were made for (elastic) falls back to streaming_split.
"""

from __future__ import annotations

import logging

import ray
import ray.train
from ray.data.dataset import MaterializedDataset

log = logging.getLogger(__name__)


class PresplitDataConfig(ray.train.DataConfig):
    """`DataConfig` that serves datasets split beforehand (`parts[name]`, one per rank) and
    leaves every other dataset to Ray's own rules (split names: streaming_split; others: the
    whole dataset per rank)."""

    def __init__(self, parts: dict[str, list[MaterializedDataset]], datasets_to_split: list[str]):
        super().__init__(datasets_to_split=datasets_to_split)
        self._parts = parts

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        ready = {name for name, parts in self._parts.items() if name in datasets and len(parts) == world_size}
        for name in set(self._parts) - ready:
            log.info("dataset %r was split for %d workers, the group has %d: streaming_split instead",
                     name, len(self._parts[name]), world_size)
        rest = {name: ds for name, ds in datasets.items() if name not in ready}
        out = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs) if rest else \
            [{} for _ in range(world_size)]
        for name in ready:
            for rank, part in enumerate(self._parts[name]):
                part.context.execution_options = self._resolve_execution_options(name)
                out[rank][name] = part.iterator()
        return out


def data_config(datasets: dict, workers, split: str = "train") -> ray.train.DataConfig:
    """The DataConfig for a TorchTrainer over `datasets` with `workers` ranks (an int, or a
    (min, max) pair for an elastic group). Splits `datasets[split]` in this process when that is
    the cheaper route (module docstring)."""
    ds = datasets.get(split)
    one_node = len([n for n in ray.nodes() if n.get("Alive")]) == 1
    if isinstance(workers, int) and isinstance(ds, MaterializedDataset) and one_node:
        return PresplitDataConfig({split: ds.split(workers, equal=True)}, [split])
    return ray.train.DataConfig(datasets_to_split=[split])
