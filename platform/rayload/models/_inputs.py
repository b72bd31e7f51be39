"""Shared input layer: one embedding table per categorical column, EmbeddingBag per bag column.

Sizes come from `features.json` (via `InputShape`), so a checkpoint rebuilds the same model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class InputShape:
    dense: int  # number of float features
    sparse: tuple[int, ...]  # cardinality per single-ID column
    bags: tuple[int, ...]  # cardinality per multi-ID column

    @classmethod
    def from_features(cls, features) -> "InputShape":
        return cls(len(features.dense_columns), tuple(features.sparse_columns.values()), tuple(features.bag_columns.values()))

    @property
    def fields(self) -> int:
        return len(self.sparse) + len(self.bags)

    def to_dict(self) -> dict:
        return asdict(self)


class FieldEmbeddings(nn.Module):
    """Embeds every ID field into `dim` dimensions: output [batch, fields, dim]."""

    def __init__(self, shape: InputShape, dim: int, sparse_grad: bool = False):
        super().__init__()
        self.dim = dim
        self._used: tuple | None = None  # this training step's lookups, for `last_sq` (L2 on the rows used)
        # train.embedding_prior: 1 / training count of every ID, per table then per bag (set by
        # train.prior.attach; plain attributes, not buffers: DDP would broadcast buffers every step)
        self.inv_counts: list[torch.Tensor] | None = None
        self.last_prior: torch.Tensor | None = None  # sum over the rows used of |row|^2 / count, / batch size
        self.tables = nn.ModuleList(nn.Embedding(n, dim, sparse=sparse_grad) for n in shape.sparse)
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="mean", sparse=sparse_grad) for n in shape.bags)
        for m in [*self.tables, *self.bags]:
            nn.init.normal_(m.weight, std=0.01)

    def forward(self, sparse: torch.Tensor, bag_values: list[torch.Tensor], bag_offsets: list[torch.Tensor]) -> torch.Tensor:
        parts = [table(sparse[:, i]) for i, table in enumerate(self.tables)]
        parts += [bag(v, o) for bag, v, o in zip(self.bags, bag_values, bag_offsets)]
        if not parts:
            return torch.zeros((sparse.shape[0], 0, self.dim), device=sparse.device)
        out = torch.stack(parts, dim=1)
        self._used = (out, bag_values) if self.training else None
        self.last_prior = self._prior(sparse, out, bag_values) if self.training and self.inv_counts is not None else None
        return out

    @property
    def last_sq(self) -> torch.Tensor | None:
        """The squared norms of the rows the last training step used, summed, / batch size (for
        train.embedding_l2; None outside training). Only the rows a batch used: L2 over whole
        tables would touch every row. A bag's rows count one by one, as `_prior` weighs them: its
        pooled mean was penalised instead, so rows that cancel got no penalty and a bag of n rows
        about 1/n of theirs. Computed when asked for: a job without embedding_l2 pays nothing."""
        if self._used is None:
            return None
        out, bag_values = self._used
        n = len(self.tables)
        total = out[:, :n].float().pow(2).sum()
        for bag, values in zip(self.bags, bag_values):
            total = total + nn.functional.embedding(values, bag.weight, sparse=bag.sparse).float().pow(2).sum()
        return total / max(out.shape[0], 1)

    def _prior(self, sparse: torch.Tensor, out: torch.Tensor, bag_values: list[torch.Tensor]) -> torch.Tensor:
        """Each row used, weighted by 1 / its ID's training count: summed over an epoch every ID
        contributes |row|^2 once, whatever its frequency (a Gaussian prior per ID). A bag's
        values are weighed one by one (the bag's pooled vector is not one ID's row)."""
        n = len(self.tables)
        total = (out[:, :n].float().pow(2).sum(-1) * torch.stack([w[sparse[:, i]] for i, w in enumerate(self.inv_counts[:n])], 1)).sum() \
            if n else out.new_zeros((), dtype=torch.float32)
        for bag, values, w in zip(self.bags, bag_values, self.inv_counts[n:]):
            rows = nn.functional.embedding(values, bag.weight, sparse=bag.sparse)
            total = total + (rows.float().pow(2).sum(-1) * w[values]).sum()
        return total / max(out.shape[0], 1)


def aligned(width: int, align: int) -> int:
    """`width` rounded up to a multiple of `align`."""
    return -(-width // max(1, align)) * max(1, align)


def cat_padded(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Concatenate [B, *] blocks and zero-fill to `width` columns (the aligned input of an MLP).

    GPU tensor-core matrix products want the inner dimension divisible by 8 (bf16/fp16) or 4
    (TF32); at 1,677 columns cuBLAS falls back to older, 3-4x slower kernels (bench_gpu.py's
    profile on an H200). Where several blocks are concatenated the copy happens anyway and the
    padding adds no pass; a single block is copied only when it needs padding. The weights
    facing the zero columns get zero gradients and never change the output."""
    have = sum(p.shape[1] for p in parts)
    if width > have:
        parts = [*parts, parts[0].new_zeros(parts[0].shape[0], width - have)]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def mlp(sizes: list[int], dropout: float, batch_norm: bool, out: int | None = 1) -> nn.Sequential:
    """Linear-(BatchNorm)-ReLU-Dropout blocks, then an optional output layer."""
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers.append(nn.Linear(a, b))
        if batch_norm:
            layers.append(nn.BatchNorm1d(b))
        layers.append(nn.ReLU())
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
    if out is not None:
        layers.append(nn.Linear(sizes[-1], out))
    return nn.Sequential(*layers)
