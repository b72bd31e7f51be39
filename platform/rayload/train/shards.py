"""How the training split reaches the Ray Train workers: `ray.train.get_dataset_shard("train")`
either way, through a `DataConfig` that picks the cheaper of two routes.

- Ray's default, `streaming_split`: a SplitCoordinator actor streams blocks to the ranks. It is
  the route when the rows are not materialised (a Parquet read every epoch,
  `train.cache_dataset: false`), when the group size is elastic, on clusters of more than one
  node (the coordinator hands each rank blocks on its own node), and when no CPU is free for
  the split's tasks.
- Pre-split: when the training rows are already materialised in the object store (the default,
  `train.cache_dataset: true`) on a one-node cluster, they are split once, before the group
  starts, into equal parts (`MaterializedDataset.split(n, equal=True)`: the same rows per rank,
  as streaming_split with `equal=True` gives) and each rank iterates its own part. No
  coordinator actor (one fresh Python process fewer per group start on a 2-core node) and no
  block hand-off through it during the first epoch. The split cuts at most n-1 blocks, each in
  a Ray task of 1 CPU; the Trainer is then given the parts' union instead of the original
  dataset, so the cut blocks are not held twice for the whole run.

A group restarted after a worker failure gets fresh iterators over the same parts; a group of
another size than the parts were made for falls back to streaming_split.
"""

from __future__ import annotations

import logging

import ray
import ray.train
from ray.data.dataset import Dataset, MaterializedDataset

log = logging.getLogger(__name__)


class PresplitDataConfig(ray.train.DataConfig):
    """`DataConfig` that serves datasets split beforehand (`parts[name]`, one per rank) and
    leaves every other dataset to Ray's own rules (split names: streaming_split; others: the
    whole dataset per rank). Ray Train calls `configure` once per dataset name."""

    def __init__(self, parts: dict[str, list[MaterializedDataset]], datasets_to_split: list[str], execution_options=None):
        super().__init__(datasets_to_split=datasets_to_split, execution_options=execution_options)
        self._parts = parts

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        ready = {name for name in datasets if len(self._parts.get(name, ())) == world_size}
        for name in datasets:
            if name in self._parts and name not in ready:
                log.info("dataset %r was split for %d workers, the group has %d: streaming_split instead",
                         name, len(self._parts[name]), world_size)
        rest = {name: ds for name, ds in datasets.items() if name not in ready}
        out = super().configure(rest, world_size, worker_handles, worker_node_ids, **kwargs) if rest else \
            [{} for _ in range(world_size)]
        for name in ready:
            for rank, part in enumerate(self._parts[name]):
                part = Dataset.copy(part)  # as the base class does: options on a copy, named for metrics
                part.set_name(name)
                part.context.execution_options = self._resolve_execution_options(name)
                out[rank][name] = part.iterator()
        return out


def ingest(datasets: dict, workers, split: str = "train") -> tuple[ray.train.DataConfig, dict]:
    """The DataConfig for a TorchTrainer over `datasets` with `workers` ranks (an int, or a
    (min, max) pair for an elastic group), and the datasets to give the Trainer. Splits
    `datasets[split]` in this process when that is the cheaper route (module docstring)."""
    from .resources import alive_nodes

    ds = datasets.get(split)
    options = ordered_options(datasets)
    # The split's tasks need a CPU; a cluster whose CPUs are all held (serving replicas, other
    # trials) would leave them waiting with no timeout, so stream instead.
    if not (isinstance(workers, int) and isinstance(ds, MaterializedDataset) and len(alive_nodes()) == 1
            and ray.available_resources().get("CPU", 0) >= 1):
        return ray.train.DataConfig(datasets_to_split=[split], execution_options=options), datasets
    parts = ds.split(workers, equal=True)
    whole = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    return PresplitDataConfig({split: parts}, [split], options), {**datasets, split: whole}


def ordered_options(datasets: dict) -> dict:
    """Ray Train replaces each dataset's execution options with its ingest defaults, which take
    `preserve_order` from the global DataContext (off): a dataset that asked for its blocks in
    order (validation: every rank reads it whole and keeps every world_size-th batch, so every
    rank must see the same batches in the same order) keeps that through the DataConfig."""
    out = {}
    for name, ds in datasets.items():
        if ds.context.execution_options.preserve_order:
            options = ray.train.DataConfig.default_ingest_options()
            options.preserve_order = True
            out[name] = options
    return out
