"""Preprocessed Arrow batches to model tensors: dense [B, D], IDs [B, S], bags as (values, offsets).

Bags use EmbeddingBag's flat-values-plus-offsets input: no padding, no per-row Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from ..hashing import as_array


@dataclass(frozen=True)
class Layout:
    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    bags: tuple[str, ...]

    @classmethod
    def from_features(cls, features) -> "Layout":
        return cls(tuple(features.dense_columns), tuple(features.sparse_columns), tuple(features.bag_columns))

    @property
    def columns(self) -> list[str]:
        return [*self.dense, *self.sparse, *self.bags]


@dataclass
class Batch:
    dense: torch.Tensor
    sparse: torch.Tensor
    bag_values: list[torch.Tensor]
    bag_offsets: list[torch.Tensor]
    label: torch.Tensor | None

    def __len__(self) -> int:
        return self.dense.shape[0]

    def to(self, device: torch.device, non_blocking: bool = True) -> "Batch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.dense), move(self.sparse), [move(v) for v in self.bag_values],
                     [move(o) for o in self.bag_offsets], None if self.label is None else move(self.label))

    def inputs(self) -> tuple:
        return self.dense, self.sparse, self.bag_values, self.bag_offsets

    def nbytes(self) -> int:
        tensors = [self.dense, self.sparse, *self.bag_values, *self.bag_offsets] + ([] if self.label is None else [self.label])
        return sum(t.element_size() * t.numel() for t in tensors)


def _column(table, name: str):
    return as_array(table.column(name) if isinstance(table, pa.Table) else table[name])


def _numpy(col, dtype) -> np.ndarray:
    if isinstance(col, (pa.Array, pa.ChunkedArray)):
        col = col.to_numpy(zero_copy_only=False)
    # A writable copy: Arrow buffers are read-only and torch.from_numpy would warn on them.
    return np.array(col, dtype=dtype)


def collate(table: pa.Table, layout: Layout) -> Batch:
    """A pyarrow Table of preprocessed rows to a CPU Batch."""
    n = table.num_rows
    dense = np.empty((n, len(layout.dense)), dtype=np.float32)
    for i, name in enumerate(layout.dense):
        dense[:, i] = _numpy(_column(table, name), np.float32)
    sparse = np.empty((n, len(layout.sparse)), dtype=np.int64)
    for i, name in enumerate(layout.sparse):
        sparse[:, i] = _numpy(_column(table, name), np.int64)
    values, offsets = [], []
    for name in layout.bags:
        col = _column(table, name)
        raw = col.offsets.to_numpy().astype(np.int64)
        values.append(torch.from_numpy(_numpy(col.values.slice(raw[0], raw[-1] - raw[0]), np.int64)))
        offsets.append(torch.from_numpy(raw[:-1] - raw[0]))
    label = torch.from_numpy(_numpy(_column(table, "label"), np.float32)) if "label" in table.column_names else None
    return Batch(torch.from_numpy(dense), torch.from_numpy(sparse), values, offsets, label)
