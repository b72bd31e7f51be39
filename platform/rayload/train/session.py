"""Where the training loop meets its runtime: a Ray Train worker, or this process.

The loop (`loop.run`) only talks to a Session, so one function serves `rayload train` on a
cluster (RaySession inside TorchTrainer workers) and in-process runs with one worker
(LocalSession, in local_session.py: no worker group to start, which keeps tuning trials cheap).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from ..data.pipeline import LocalShards
from ..data.result import exact_tables
from .batch import Batch, Layout, collate

log = logging.getLogger(__name__)

try:  # Ray >= 2.40 lets collate functions receive Arrow tables directly
    from ray.data.collate_fn import ArrowBatchCollateFn
except ImportError:  # pragma: no cover
    ArrowBatchCollateFn = object


class ArrowCollate(ArrowBatchCollateFn):
    def __init__(self, layout: Layout):
        super().__init__()
        self.layout = layout

    def __call__(self, batch):
        return collate(batch, self.layout)


class Session:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    def __init__(self, loader: dict):
        self.loader = loader  # batch_size, prefetch_batches, shuffle_buffer, seed, layout

    def _iter(self, source, batch_size: int, seed: int | None, drop_last: bool):
        opts = self.loader

        def collated(tables):  # exact tables of batch_size rows, the last short one dropped with drop_last
            return (collate(t, opts["layout"]) for t in tables if not (drop_last and t.num_rows < batch_size))

        if isinstance(source, LocalShards):
            return collated(source.exact_batches(batch_size))
        shuffle = opts["shuffle_buffer"] if seed is not None else 0  # validation (no seed): every rank, the same order
        if shuffle:
            # Ray's shuffling batcher gives short batches mid-stream (a buffer up to about twice the
            # batch): ranks of equal rows took different numbers of steps by their block layout
            # (unmatched DDP collectives) and the LR plan miscounted. Re-cut to exact sizes, here.
            tables = source.iter_batches(batch_size=batch_size, batch_format="pyarrow", prefetch_batches=opts["prefetch_batches"],
                                         local_shuffle_buffer_size=shuffle, local_shuffle_seed=seed)
            return collated(exact_tables(tables, batch_size))
        return source.iter_torch_batches(batch_size=batch_size, prefetch_batches=opts["prefetch_batches"],
                                         collate_fn=ArrowCollate(opts["layout"]), drop_last=drop_last, device="cpu")

    def train_batches(self, epoch: int, batch_size: int):
        """This rank's training batches for `epoch`: streamed from Ray Data (the shards'
        training rows are written in a seeded order: data/_batch._row_order), or, once a whole
        epoch of them fitted in the worker cache (`train.worker_cache_mb`), the kept rows
        re-batched in a row order shuffled per rank and epoch."""
        # Data order differs per rank and epoch; model initialisation uses the shared seed.
        seed = self.loader["seed"] * 100_003 + epoch * 1009 + self.rank
        cached = getattr(self, "_train_cache", None)
        if cached is not None and cached[0] == batch_size:
            return cached[1].batches(seed)
        # With several ranks each drops its short last micro-batch (every rank must take as many
        # steps). A stream that may become the cache reads it all the same: kept, not trained on,
        # so that later epochs deal every row out (the same rows were left out of the whole run).
        hold_tail = self.world_size > 1
        budget = self.loader.get("cache_bytes", 0)
        keeping = bool(budget) and self.cached is not False
        stream = self._iter(self._train_source(), batch_size, seed, drop_last=hold_tail and not keeping)
        if not keeping:
            return stream
        if epoch > 0 and self.cached is None and self.cached_before and self._fits_as_before(budget):
            # A run resumed in this process (after a restart): the cache it had is gone. Read it
            # again before training on it (it fit in this budget before: the same rows on as many
            # ranks), then train in this epoch's seeded order, the one the run would have had
            # uninterrupted.
            batches = list(stream)
            self._train_cache = (batch_size, _Rows(batches, _dealt(batches, batch_size, hold_tail)))
            self.cache_bytes = self.cached_before_bytes
            return self._train_cache[1].batches(seed)
        return self._keeping(stream, batch_size, budget, hold_tail)

    # Set by the loop from a restored checkpoint: whether the run kept its training batches in
    # the cache before it stopped (None: not known, a checkpoint written before this was kept),
    # the largest rank's kept bytes and the ranks it had then (None: not recorded).
    cached_before: bool | None = None
    cached_before_bytes: int | None = None
    cached_before_world: int | None = None
    cache_bytes: int | None = None  # the largest rank's kept bytes, once the batches are cached

    def _fits_as_before(self, budget: int) -> bool:
        """Whether the resumed run's cache fits this launch: a relaunch may lower
        train.worker_cache_mb, and a group restarted on fewer ranks gives each more rows; read
        whole regardless, one epoch went into memory past the budget meant to prevent that."""
        if self.cached_before_bytes is None:  # a checkpoint from before the size was kept: as it was
            return True
        return self.cached_before_world == self.world_size and self.cached_before_bytes <= budget

    @property
    def cached(self) -> bool | None:
        """Whether this rank trains from its batch cache: True once kept, False once the rows
        were found over the budget (every epoch then streams), None before the first epoch."""
        if getattr(self, "_train_cache", None) is not None:
            return True
        return False if getattr(self, "_streaming", False) else None

    def _keeping(self, stream, batch_size: int, budget: int, hold_tail: bool):
        """Yield the stream's batches, keeping them while their tensors fit in `budget` bytes;
        an epoch read to the end and kept whole becomes the cache. With `hold_tail`, a short
        last batch is kept but not yielded (see train_batches)."""
        kept, size = [], 0
        for batch in stream:
            if kept is not None:
                size += batch.nbytes()
                if size <= budget:
                    kept.append(batch)
                else:
                    kept = None
            if not (hold_tail and len(batch) < batch_size):
                yield batch
        whole = bool(kept)
        if self.world_size > 1:
            # Every rank caches or none does: a rank that streams alone would wait forever at
            # the streaming split's next epoch for ranks that no longer read it. The largest
            # rank's bytes ride along (as a minimum of their negatives), for a resume to compare.
            flag = torch.tensor([int(whole), -size], dtype=torch.int64, device=self.device)  # NCCL reduces CUDA tensors only
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            whole, size = bool(flag[0].item()), -int(flag[1].item())
        if whole:
            self._train_cache = (batch_size, _Rows(kept, _dealt(kept, batch_size, hold_tail)))
            self.cache_bytes = size
        else:
            self._streaming = True  # every later epoch streams, without trying to keep it again
            log.info("rank %d: training batches exceed train.worker_cache_mb (here or on another rank); streaming every epoch", self.rank)

    VAL_CACHE_ROWS = 2_000_000

    def val_batches(self, batch_size: int):
        """Every rank reads the whole validation split and keeps its stride of batches, so
        gathering gives every row exactly once (an equal split could drop rows).

        This rank's batches are kept after the first epoch (up to VAL_CACHE_ROWS rows): a
        fresh Ray Data execution per epoch cost more than the validation itself."""
        cached = getattr(self, "_val_cache", None)
        if cached is not None:
            yield from cached
            return
        kept, rows = [], 0
        for i, batch in enumerate(self._iter(self._local_val() or self._val_source(), batch_size, None, drop_last=False)):
            if i % self.world_size == self.rank:
                rows += len(batch)
                if kept is not None and rows <= self.VAL_CACHE_ROWS:
                    kept.append(batch)
                else:
                    kept = None
                yield batch
        self._val_cache = kept

    def _local_val(self) -> "LocalShards | None":
        """The validation shards read with pyarrow when they are files on this machine: no Ray
        Data read tasks, whose worker processes (started for the read, killed idle a second
        later on a small node) competed with training for the CPUs (RESULTS.md). Every rank
        must agree (each keeps its stride of the same batch sequence; both readers give the
        same sequence, but a mixed group is not worth the doubt)."""
        if hasattr(self, "_val_local"):
            # Decided once, at the first validation, when every rank reads: later a rank whose
            # stride outgrew VAL_CACHE_ROWS reads again while the others serve their cache, and
            # a collective here would wait for them forever.
            return self._val_local
        local = LocalShards.on_this_machine(self.loader.get("val_files"))
        if self.world_size > 1:
            flag = torch.tensor([int(local is not None)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if not flag.item():
                local = None
        self._val_local = local
        return local

    def gather(self, array: np.ndarray) -> np.ndarray:
        if self.world_size == 1:
            return array
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, array)
        return np.concatenate(parts)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)


def cpu_fallback_device(allowed: bool, rank: int) -> torch.device:
    """A worker given GPUs that CUDA cannot see: logical GPUs (a fake multi-node cluster, a
    misconfigured node). Only `resources.cpu_fallback: true` lets it compute on the CPU, and
    it says so; otherwise training stops instead of running 50x slower without a word."""
    node_type = os.environ.get("RAY_NODE_TYPE_NAME", "?")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not allowed:
        from ..errors import RayloadError

        raise RayloadError(f"rank {rank} on node type {node_type} was given GPU(s) {visible!r} but CUDA sees none "
                           f"(torch {torch.__version__}, cuda available: {torch.cuda.is_available()}); fix the node's "
                           "drivers, or set resources.cpu_fallback: true to train on its CPU")
    log.warning("CPU FALLBACK: rank %d on node type %s was given GPU(s) %r but CUDA sees none; computing on CPU "
                "(resources.cpu_fallback: true)", rank, node_type, visible)
    return torch.device("cpu")


class RaySession(Session):
    """Inside a Ray Train worker (Train V2)."""

    def __init__(self, loader: dict):
        import ray.train
        import ray.train.torch

        super().__init__(loader)
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        # Ray picks cuda:N from the GPU ids it assigned, whether or not CUDA can see them.
        if loader.get("use_gpu") and not torch.cuda.is_available():
            self.device = cpu_fallback_device(loader.get("cpu_fallback", False), self.rank)

    def _train_source(self):
        import ray.train

        return ray.train.get_dataset_shard("train")

    def _val_source(self):
        import ray.train

        return ray.train.get_dataset_shard("val")

    @contextlib.contextmanager
    def latest_checkpoint(self):
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as path:
            yield path

    def report(self, metrics: dict, checkpoint_dir: str | None, name: str) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir and self.rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        import ray.train.torch

        if self.device.type == "cpu":
            # Ray's prepare_model would move the model to the (logical) GPU it assigned, also for
            # one worker (it failed there: "Torch not compiled with CUDA"); the CPU fallback wraps
            # DDP itself, on the CPU, over the gloo group Ray set up.
            model = model.to(self.device)
            return torch.nn.parallel.DistributedDataParallel(model) if self.world_size > 1 else model
        return ray.train.torch.prepare_model(model)


def scratch_dir() -> str:
    return tempfile.mkdtemp(prefix="rayload-ckpt-")


def _dealt(batches: list[Batch], batch_size: int, hold_tail: bool) -> list[int]:
    """The batch sizes an epoch trains on: all of them, less a short last one with `hold_tail`."""
    return [len(b) for b in batches if not (hold_tail and len(b) < batch_size)]


class _Rows:
    """One epoch of a rank's training batches, kept as one set of row tensors, dealt out again
    every epoch as batches of the given sizes in a row order drawn from the epoch's seed. Batches
    kept as they were read would hold the same rows together in every epoch (only their order
    would change), so rows that sit side by side in the shards would share every update. Sizes
    summing to fewer than the rows (a rank's short last batch held back) leave out other rows,
    drawn anew, each epoch."""

    def __init__(self, batches: list[Batch], sizes: list[int] | None = None):
        self.sizes = [len(b) for b in batches] if sizes is None else sizes
        if not batches:  # a rank without training rows: nothing to deal out
            batches = [Batch(torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.int64), [], [], None)]
        self.dense = torch.cat([b.dense for b in batches])
        self.sparse = torch.cat([b.sparse for b in batches])
        self.label = None if batches[0].label is None else torch.cat([b.label for b in batches])
        self.bag_values, self.bag_lengths, self.bag_starts = [], [], []
        for j in range(len(batches[0].bag_values)):
            values = torch.cat([b.bag_values[j] for b in batches])
            lengths = torch.cat([torch.diff(b.bag_offsets[j], append=torch.tensor([len(b.bag_values[j])])) for b in batches])
            self.bag_values.append(values)
            self.bag_lengths.append(lengths)
            self.bag_starts.append(torch.cumsum(lengths, 0) - lengths)

    def batches(self, seed: int):
        order = torch.from_numpy(np.random.default_rng(seed).permutation(int(self.dense.shape[0])))
        pos = 0
        for size in self.sizes:
            idx = order[pos:pos + size]
            pos += size
            values, offsets = [], []
            for vals, lengths, starts in zip(self.bag_values, self.bag_lengths, self.bag_starts):
                n = lengths[idx]
                first = torch.cumsum(n, 0) - n  # each row's first position in the new batch's values
                gather = torch.repeat_interleave(starts[idx] - first, n) + torch.arange(int(n.sum()))
                values.append(vals[gather])
                offsets.append(first)
            yield Batch(self.dense[idx], self.sparse[idx], values, offsets, None if self.label is None else self.label[idx])
