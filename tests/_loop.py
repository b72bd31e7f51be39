"""The training loop's in-process helpers (no Ray): fitted features, a table that fits them, a
session over in-memory tables, a tiny DeepFM spec, and two gloo ranks in spawned processes.
Used by the loop's unit tests and by tests/integration/test_gpu.py."""

from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import pyarrow as pa
import torch

from rayload.features import CategoricalState, FittedFeatures, LabelState, NumericState
from rayload.spec import JobSpec
from rayload.train.batch import Layout, collate
from rayload.train.session import Session


def features() -> FittedFeatures:
    return FittedFeatures(
        numeric=[NumericState("x", 0.0, None, None, False, "zscore")],
        categorical=[CategoricalState("c", "vocab", vocab=[str(i) for i in range(30)]),
                     CategoricalState("b", "vocab", multi=True, vocab=["p", "q", "r"])],
        crosses=[], label=LabelState("y", "binary"), columns=[],
    )


def table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    c = rng.integers(2, 32, n)
    x = rng.normal(size=n).astype(np.float32)
    logit = 1.5 * x + np.where(c % 2 == 0, 1.0, -1.0)
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    bags = [list(rng.integers(2, 5, rng.integers(1, 3))) for _ in range(n)]
    return pa.table({"x": x, "c": c.astype(np.int64), "b": pa.array(bags, pa.list_(pa.int64())), "label": y})


class MemorySession(Session):
    """Batches from an in-memory table (the Ray sessions are exercised in integration tests)."""

    def __init__(self, train: pa.Table, val: pa.Table, folder: str):
        super().__init__({"layout": Layout(("x",), ("c",), ("b",)), "seed": 0, "prefetch_batches": 0, "shuffle_buffer": 0})
        self.train, self.val, self.folder, self.reports = train, val, folder, []

    def _batches(self, t: pa.Table, size: int):
        for start in range(0, t.num_rows, size):
            yield collate(t.slice(start, size), self.loader["layout"])

    def train_batches(self, epoch, batch_size):
        return self._batches(self.train, batch_size)

    def val_batches(self, batch_size):
        return self._batches(self.val, batch_size)

    def latest_checkpoint(self):
        return contextlib.nullcontext(self.reports[-1][1] if self.reports else None)

    def report(self, metrics, checkpoint_dir, name):
        dest = os.path.join(self.folder, name)
        if checkpoint_dir:
            shutil.copytree(checkpoint_dir, dest)
        self.reports.append((metrics, dest))


class RankSession(MemorySession):
    """A MemorySession on one rank of a real gloo group, the model wrapped in DDP."""

    def __init__(self, rank: int, *args):
        super().__init__(*args)
        self.rank, self.world_size = rank, 2

    def prepare(self, model):
        return torch.nn.parallel.DistributedDataParallel(model)


def job(**train) -> JobSpec:
    return JobSpec.model_validate({
        "name": "t", "data": {"source": {"kind": "movielens"}},
        "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0},
        "train": {"batch_size": 256, "lr": 0.01, **train},
    })


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_two(target, *args) -> list:
    """Run target(rank, port, *args, queue) on two gloo ranks; returns what each put, by rank."""
    import queue
    import time

    import torch.multiprocessing as mp

    ctx, port = mp.get_context("spawn"), _free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, port, *args, out), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 300
    while len(got) < 2:
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        assert not failed and time.monotonic() < deadline, f"rank exit codes {[p.exitcode for p in procs]}"
        try:
            rank, value = out.get(timeout=1)
            got[rank] = value
        except queue.Empty:
            pass
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    return [got[0], got[1]]
