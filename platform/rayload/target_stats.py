"""Target statistics of a categorical column (smoothed label mean and count), fitted on train.

A training row must not see its own label through its feature, or the model learns to trust
the feature far more than it deserves on new rows. Training rows are therefore encoded out
of fold: rows are hashed into `folds` groups by the split key, and a training row's
statistics leave out its own group. Validation, test and serving rows use all training rows,
and so do the training rows of a job that reuses a checkpoint's fitted features
(`train.init_from`, `FittedFeatures.fitted_here` False): those statistics never saw their labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ._memo import Memo
from .errors import DataError
from .hashing import as_strings, to_unit


@dataclass
class TargetState(Memo):
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
    # What the smoothed mean's distance from the prior is divided by, so it enters the model at
    # about z-score size: 0.5 for a binary label (a rate's full range), the training rows' standard
    # deviation of a regression label or of the raw label. None in features.json files written
    # before it existed: 0.5 for the label, 1 for the raw label (ratings entered at +-4, a
    # price-like label at thousands).
    spread: float | None = None

    @property
    def outputs(self) -> list[str]:
        return output_names(self.name, self.source)


def output_names(name: str, source: str = "label") -> list[str]:
    """The model inputs a column's target statistic adds (the spec checks them against the columns)."""
    return [f"{name}__te_raw"] if source == "raw" else [f"{name}__te", f"{name}__logcount"]


def onehot_name(name: str, slot: int | str) -> str:
    """The model input of one-hot slot `slot` of column `name` (features.py; the spec checks)."""
    return f"{name}__oh{slot}"


def row_folds(table: pa.Table, key: list[str] | tuple[str, ...], seed: int, folds: int) -> np.ndarray:
    from .data.split import kfold_index, row_hash

    missing = [k for k in key if k not in table.column_names]
    if missing:
        raise DataError(f"target statistics encode a training row out of fold, by a hash of its columns {list(key)} "
                        f"(every declared column when fitted; the split key before), but these rows lack {missing} (they have "
                        f"{table.column_names}): the training rows must carry the columns the statistics were fitted with")
    return kfold_index(to_unit(row_hash(table, tuple(key), seed, "target-stats")), folds)


def partial(table: pa.Table, name: str, label: str, folds: np.ndarray) -> pa.Table:
    """Per (value, fold): label sum and row count of one batch."""
    t = pa.table({"value": table.column(name), "fold": pa.array(folds), "y": table.column(label)})
    return t.group_by(["value", "fold"]).aggregate([("y", "sum"), ("y", "count")])


def finalize(name: str, parts: list[pa.Table], prior: float | None, smoothing: float, folds: int, key, seed: int, source: str = "label",
             spread: float | None = None) -> TargetState:
    t = pa.concat_tables(parts).group_by(["value", "fold"]).aggregate([("y_sum", "sum"), ("y_count", "sum")])
    if prior is None:  # the mean over all training rows, those missing the value too (as the label's prior)
        prior = float(pc.sum(t.column("y_sum_sum")).as_py() or 0.0) / max(float(pc.sum(t.column("y_count_sum")).as_py() or 0.0), 1.0)
    t = t.filter(pc.is_valid(t.column("value")))
    # as Python strings: NumPy's fixed-width ones drop trailing NULs, merging "a\x00" into "a"
    values, inverse = np.unique(np.array([str(v) for v in t.column("value").to_pylist()], dtype=object), return_inverse=True)
    fold = t.column("fold").to_numpy()
    fold_sums, fold_counts = np.zeros((folds, len(values))), np.zeros((folds, len(values)))
    np.add.at(fold_sums, (fold, inverse), t.column("y_sum_sum").to_numpy())
    np.add.at(fold_counts, (fold, inverse), t.column("y_count_sum").to_numpy())
    return TargetState(name, values.tolist(), fold_sums.sum(0).tolist(), fold_counts.sum(0).tolist(),
                       fold_sums.tolist(), fold_counts.tolist(), float(prior), float(smoothing), folds, list(key), seed, source,
                       None if spread is None else float(spread))


def _lookups(state: TargetState) -> dict:
    """The state's lists as numpy arrays and its values as a dict, built once per state."""

    def build():
        index: dict[str, int] = {}
        for i, v in enumerate(state.values):
            index.setdefault(v, i)
        counts = np.asarray(state.counts, dtype=np.float64)
        return {"index": index, "value_set": pa.array(state.values, pa.string()), "sums": np.asarray(state.sums, dtype=np.float64),
                "counts": counts, "fold_sums": np.asarray(state.fold_sums, dtype=np.float64),
                "fold_counts": np.asarray(state.fold_counts, dtype=np.float64),
                "log_scale": max(np.log1p(counts.max() if len(counts) else 0.0), 1.0)}

    return state._memo(build, state.values, state.sums, state.counts, state.fold_sums, state.fold_counts)


def transform(state: TargetState, table: pa.Table, out_of_fold: bool) -> dict[str, pa.Array]:
    values = as_strings(table.column(state.name))
    look = _lookups(state)
    if len(values) <= 256:  # a request's few rows: dict lookups beat building Arrow's hash table
        idx = np.fromiter((look["index"].get(v, -1) for v in values.to_pylist()), dtype=np.int64, count=len(values))
    else:
        idx = pc.fill_null(pc.index_in(values, value_set=look["value_set"]), -1).to_numpy(zero_copy_only=False).astype(np.int64)
    known = idx >= 0  # unseen and missing values get the prior
    idx = np.maximum(idx, 0)
    sums, counts = (look["sums"][idx], look["counts"][idx]) if len(state.values) else (np.zeros(len(idx)), np.zeros(len(idx)))
    # The log count reports all of a value's training rows, out of fold or not: a count holds no
    # label, so nothing leaks, and a training row then gets exactly what serving gets (the rows
    # outside its fold made it log(k/(k-1)) lower on average).
    seen = counts
    if out_of_fold and len(state.values):
        f = row_folds(table, state.key, state.seed, state.folds)
        sums = sums - look["fold_sums"][f, idx]
        counts = counts - look["fold_counts"][f, idx]
    sums, counts, seen = np.where(known, sums, 0.0), np.where(known, counts, 0.0), np.where(known, seen, 0.0)
    mean = _smoothed_mean(sums, counts, state.prior, state.smoothing)
    # Centred on the prior and scaled to about [-1, 1] so they enter the model like z-scores.
    spread = state.spread if state.spread is not None else (1.0 if state.source == "raw" else 0.5)
    centred = pa.array(((mean - state.prior) / spread).astype(np.float32))
    if state.source == "raw":
        return {state.outputs[0]: centred}
    return {state.outputs[0]: centred, state.outputs[1]: pa.array((np.log1p(seen) / look["log_scale"]).astype(np.float32))}


def spread_of(moments) -> float:
    """The standard deviation of a label's training values (mergeable `_moments`), or 1 where
    it is none (a constant label) or not a number."""
    from ._moments import _std

    std = _std(moments) if moments[0] else 0.0
    return std if np.isfinite(std) and std > 0 else 1.0


def _smoothed_mean(sums: np.ndarray, counts: np.ndarray, prior: float, smoothing: float) -> np.ndarray:
    """The label mean pulled towards the prior by `smoothing` rows; the prior itself where no
    row is left to average (an unseen or missing value, or a value seen only in the row's own
    fold), which smoothing: 0 would otherwise turn into 0/0 = NaN."""
    weight = counts + smoothing
    mean = np.full(len(sums), prior, dtype=np.float64)
    np.divide(sums + prior * smoothing, weight, out=mean, where=weight > 0)
    return mean
