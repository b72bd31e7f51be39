"""Target statistics of a categorical column (smoothed label mean and count), fitted on train.

A training row must not see its own label through its feature, or the model learns to trust
the feature far more than it deserves on new rows. Training rows are therefore encoded out
of fold: rows are hashed into `folds` groups by the split key, and a training row's
statistics leave out its own group. Validation, test and serving rows use all training rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .hashing import to_unit


@dataclass
class TargetState:
    name: str
    values: list[str]
    sums: list[float]
    counts: list[float]
    fold_sums: list[list[float]]  # [fold][value]
    fold_counts: list[list[float]]
    prior: float
    smoothing: float
    folds: int
    key: list[str] = field(default_factory=list)
    seed: int = 0
    source: str = "label"  # label | raw (the label's value before its threshold)

    @property
    def outputs(self) -> list[str]:
        if self.source == "raw":
            return [f"{self.name}__te_raw"]
        return [f"{self.name}__te", f"{self.name}__logcount"]


def row_folds(table: pa.Table, key: list[str] | tuple[str, ...], seed: int, folds: int) -> np.ndarray:
    from .data.split import kfold_index, row_hash

    return kfold_index(to_unit(row_hash(table, tuple(key), seed, "target-stats")), folds)


def partial(table: pa.Table, name: str, label: str, folds: np.ndarray) -> pa.Table:
    """Per (value, fold): label sum and row count of one batch."""
    t = pa.table({"value": table.column(name), "fold": pa.array(folds), "y": table.column(label)})
    return t.group_by(["value", "fold"]).aggregate([("y", "sum"), ("y", "count")])


def finalize(name: str, parts: list[pa.Table], prior: float | None, smoothing: float, folds: int, key, seed: int, source: str = "label") -> TargetState:
    t = pa.concat_tables(parts).group_by(["value", "fold"]).aggregate([("y_sum", "sum"), ("y_count", "sum")])
    t = t.filter(pc.is_valid(t.column("value")))
    values, inverse = np.unique(t.column("value").to_numpy(zero_copy_only=False).astype(str), return_inverse=True)
    fold = t.column("fold").to_numpy()
    fold_sums, fold_counts = np.zeros((folds, len(values))), np.zeros((folds, len(values)))
    np.add.at(fold_sums, (fold, inverse), t.column("y_sum_sum").to_numpy())
    np.add.at(fold_counts, (fold, inverse), t.column("y_count_sum").to_numpy())
    if prior is None:  # the mean over all training rows
        prior = float(fold_sums.sum() / max(fold_counts.sum(), 1.0))
    return TargetState(name, values.tolist(), fold_sums.sum(0).tolist(), fold_counts.sum(0).tolist(),
                       fold_sums.tolist(), fold_counts.tolist(), float(prior), float(smoothing), folds, list(key), seed, source)


def transform(state: TargetState, table: pa.Table, out_of_fold: bool) -> dict[str, pa.Array]:
    values = table.column(state.name)
    found = pc.index_in(values, value_set=pa.array(state.values, pa.string()))
    idx = pc.fill_null(found, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    known = idx >= 0  # unseen and missing values get the prior
    idx = np.maximum(idx, 0)
    sums, counts = np.asarray(state.sums)[idx], np.asarray(state.counts)[idx]
    if out_of_fold and len(state.values):
        f = row_folds(table, state.key, state.seed, state.folds)
        sums = sums - np.asarray(state.fold_sums)[f, idx]
        counts = counts - np.asarray(state.fold_counts)[f, idx]
    sums, counts = np.where(known, sums, 0.0), np.where(known, counts, 0.0)
    mean = (sums + state.prior * state.smoothing) / (counts + state.smoothing)
    # Centred on the prior and scaled to about [-1, 1] so they enter the model like z-scores.
    if state.source == "raw":
        return {state.outputs[0]: pa.array((mean - state.prior).astype(np.float32))}
    scale = max(np.log1p(max(state.counts, default=0.0)), 1.0)
    return {state.outputs[0]: pa.array((2 * (mean - state.prior)).astype(np.float32)),
            state.outputs[1]: pa.array((np.log1p(counts) / scale).astype(np.float32))}
