"""Deterministic splits: a row's split depends on its key and the seed, never on blocks or files.

Every row gets a number in [0, 1) from a stable hash of its key columns. Random, group and
k-fold splits compare it with fixed cut points. Stratified and temporal splits need cut points
computed from the data (per-label quantiles of the hash, quantiles of time), so they take one
extra light pass: `split_keys` per batch, then `SplitPlan.with_cutoffs` on the driver.

A stratified split with a key that does not hold the label (split.key: [user]) can meet a key
whose rows carry both labels; cut per label at exact quantiles, such a key could land in two
splits. Every label's cut is therefore placed between the same two consecutive such keys, as
close to its quantile as that allows: a key never spans splits, and the split is exactly
stratified when those keys are few and as close to it as keeping keys whole permits otherwise,
never leaving a split that was asked for empty when some placement of whole keys fills it.

A row whose key columns are all missing (a group split's group, split.key) has no key to keep
together: it is split by its own identity (every declared column), as a row without a key. Hashing
the missing value instead made every such row one key, all in one split.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from ..errors import DataError
from ..hashing import combine, hash_strings, seed_key, to_unit
from .validate import as_string

TRAIN, VAL, TEST = 0, 1, 2
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class SplitPlan:
    kind: str
    train: float
    val: float
    test: float
    seed: int
    key: tuple[str, ...]
    label: str
    time_column: str | None = None
    k: int = 5
    fold: int = 0
    cutoffs: tuple = ()  # stratified: ((label, c1, c2), ...); temporal: (t1, t2)
    columns: tuple[str, ...] = ()  # every declared column: what tells one row from another

    @classmethod
    def from_spec(cls, split, schema) -> "SplitPlan":
        if split.kind == "group" or (split.kind == "kfold" and split.group):  # kfold with a group: group k-fold
            key = (split.group,)
        elif split.key:
            key = tuple(split.key)
        else:
            key = tuple(schema.names)
        time_cols = [c["name"] for c in schema.columns if c["role"] == "timestamp"]
        time_column = split.time_column or (time_cols[0] if time_cols else None)
        return cls(
            kind=split.kind, train=split.train, val=split.val, test=split.test, seed=split.seed,
            key=key, label=schema.label["column"], time_column=time_column,
            k=split.k, fold=split.fold, columns=tuple(schema.names),
        )

    @property
    def needs_cutoffs(self) -> bool:
        return self.kind in ("stratified", "temporal")

    def with_cutoffs(self, keys: list[dict[str, np.ndarray]]) -> "SplitPlan":
        """Cut points from the gathered `split_keys` of every batch."""
        if self.kind == "temporal":
            t = np.sort(np.concatenate([k["time"] for k in keys]))
            cuts = (_cut(t, self.train), _cut(t, self.train + self.val))
            self._check_temporal(t, *cuts)
            return replace(self, cutoffs=cuts)
        labels = np.concatenate([k["label"] for k in keys])
        u = np.concatenate([k["u"] for k in keys])
        strata = [np.sort(u[labels == value]) for value in np.unique(labels)]
        if not strata:
            return replace(self, cutoffs=())  # no good rows: preprocessing refuses that with its own error
        edges = np.concatenate([[-np.inf], _mixed_keys(u, labels), [np.inf]])
        # A label with enough rows gives each split asked for at least one: rounded alone, 3-9 rows of
        # a rare label at 0.8 / 0.1 / 0.1 left val or test without it (a validation AUC of one class)
        # Counted in runs of equal units (duplicate rows, a key's rows), which a cut cannot part.
        val, test = int(self.val > 0), int(self.test > 0)
        runs = [_run_starts(st) for st in strata]  # the ranks a cut can take: 0, ..., len
        first = [(b[1], b[-1 - val - test]) if len(b) - 1 >= 1 + val + test else None for b in runs]
        gap1, c1, k1 = _stratified_cuts(strata, runs, edges, self.train, 0, rest_wanted=self.val > 0 or self.test > 0, bounds=first,
                                        rest_splits=val + test)
        at = [int(np.searchsorted(b, k)) for b, k in zip(runs, k1)]  # the first cut's place among the runs
        second = [(b[j + val], b[-1 - test]) if len(b) - 1 - j >= val + test and j >= 1 else None for b, j in zip(runs, at)]
        _, c2, _ = _stratified_cuts(strata, runs, edges, self.train + self.val, gap1, rest_wanted=self.test > 0, before=k1,
                                    between_wanted=self.val > 0, bounds=second)
        return replace(self, cutoffs=tuple((float(v), a, b) for v, a, b in zip(np.unique(labels), c1, c2)))


    def _check_temporal(self, t: np.ndarray, c1: float, c2: float) -> None:
        """Rows at one time never go to two splits (all rows at a cut time go to the later one),
        so coarse timestamps can leave a split empty: train (the preprocessor would be fitted on
        no rows), or a val or test split that was asked for. Refused, not warned: the cut points
        follow from the data, so every run would do the same; training needs val (early
        stopping, the best checkpoint) and would fail only after every shard was written, and a
        missing test split silently drops the test metrics."""
        if not len(t):
            return  # no good rows: preprocessing refuses that with its own error
        n_train, n_before_test = np.searchsorted(t, [c1, c2], side="left")
        rows = {"train": int(n_train), "val": int(n_before_test - n_train), "test": int(len(t) - n_before_test)}
        i1, i2 = (int(round(len(t) * f)) for f in (self.train, self.train + self.val))
        targets = {"train": i1, "val": i2 - i1, "test": len(t) - i2}  # the rows each fraction rounds to
        for name in SPLITS:
            if rows[name] or (name != "train" and getattr(self, name) == 0):
                continue
            at = t[0] if name == "train" else c2  # the time whose rows all went to the later split
            why = (f"too few rows ({len(t)}) for a {name} fraction of {getattr(self, name)}: it rounds to 0 rows"
                   if np.isinf(at) or targets[name] == 0 else
                   f"rows at one time never go to two splits (the later one takes them all), and {int((t == at).sum())} rows "
                   f"share the time {_when(at)} ({len(np.unique(t))} distinct times in all)")
            fix = {"train": ", or a random or group split", "val": " (training needs val: early stopping, the best epoch)",
                   "test": ", or split.test: 0 to go without it"}[name]
            raise DataError(
                f"split.kind=temporal on '{self.time_column}': the {name} split is empty (train {rows['train']}, val {rows['val']}, "
                f"test {rows['test']} of {len(t)} rows for train={self.train}, val={self.val}, test={self.test}): {why}. "
                f"{'Use more rows or a larger fraction' if np.isinf(at) or targets[name] == 0 else 'Use finer timestamps or fractions that put the cuts between two times'}{fix}."
            )


def _when(seconds: float) -> str:
    try:
        return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()
    except (OverflowError, OSError, ValueError):
        return f"{seconds:g} s"


def _mixed_keys(u: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The keys (by their hash unit) whose rows carry more than one label, sorted."""
    order = np.lexsort((labels, u))
    us, ls = u[order], labels[order]
    return np.unique(us[1:][(us[1:] == us[:-1]) & (ls[1:] != ls[:-1])])


def _stratified_cuts(strata: list[np.ndarray], runs: list[np.ndarray], edges: np.ndarray, fraction: float, first_gap: int, rest_wanted: bool,
                     before: list[int] | None = None, between_wanted: bool = False,
                     bounds: list | None = None, rest_splits: int = 0) -> tuple[int, list[float], list[int]]:
    """One cut per label (rows with u < cut come before it), all in the same gap (edges[j], edges[j + 1]]
    between two consecutive keys that carry several labels: such a key then falls on the same
    side of every label's cut, so its rows stay in one split. Within the gap each label's cut
    takes the rank closest to round(n * fraction); the gap is the one whose ranks come closest
    (summed relative error), from `first_gap` on so a later cut never precedes an earlier one.
    Without such keys (the default key holds the label) there is one gap and the split is exact,
    but for a label's target held within `bounds` (each split asked for gets one of its rows).

    A gap that would leave a split that was asked for without rows loses to every gap that does
    not: with relative errors one step of a 5-row label outweighed 32 steps of a 158-row one and
    put every label's val at 0 rows. Checked: rows before the cut (train), rows after it
    (`rest_wanted`: a later split was asked for; `rest_splits` of them: runs of equal units after it
    for each) and, given `before` (the first cut's ranks), rows between the two cuts
    (`between_wanted`: val).
    `runs`: each label's `_run_starts`. Returns the gap, the cuts and each label's rank."""
    # `bounds`: per label, (lowest, highest) rank the target may take, or None: kept as rounded
    targets = [_snap(b, int(round(len(s) * fraction)), bounds[i] if bounds else None) for i, (s, b) in enumerate(zip(strata, runs))]
    lo = [np.searchsorted(s, edges[:-1], side="right") for s in strata]  # rows at or before the gap
    hi = [np.searchsorted(s, edges[1:], side="left") for s in strata]  # rows before the gap's end
    ranks = [np.minimum(np.maximum(r, lo_l), hi_l) for r, lo_l, hi_l in zip(targets, lo, hi)]  # each label's rank per gap
    cost = sum(np.abs(k - r) / max(len(s), 1) for s, r, k in zip(strata, targets, ranks))
    total = sum(len(s) for s in strata)
    taken = sum(ranks)  # rows before the cut, per gap
    empty = taken == 0
    if rest_wanted:
        empty |= taken == total
    if rest_splits > 1:  # the rows after the cut must still part into val and test: runs of equal units cannot
        after = sum((len(b) - 1) - np.searchsorted(b, k) for b, k in zip(runs, ranks))
        # a key of several labels is a run in each of their strata, and one unit: those after gap g are edges[g + 1:-1]
        mixed = edges[1:-1]
        extra = sum(np.isin(mixed, st).astype(int) for st in strata) - 1
        empty |= after - np.append(np.cumsum(extra[::-1])[::-1], 0) < rest_splits
    if before is not None and between_wanted:
        empty |= taken == sum(before)
    cost = cost + np.where(empty, len(strata) + 1.0, 0.0)  # above any sum of relative errors
    gap = first_gap + int(np.argmin(cost[first_gap:]))
    cuts = [float(min(s[k[gap]] if k[gap] < len(s) else np.inf, edges[gap + 1])) for s, k in zip(strata, ranks)]
    return gap, cuts, [int(k[gap]) for k in ranks]


def _snap(ranks: np.ndarray, target: int, bound: tuple[int, int] | None) -> int:
    """The rank nearest `target` that a cut can take, of `ranks` (a label's `_run_starts`): a run
    of equal units (duplicate rows, the rows of one split.key) falls on one side of any cut, so a
    rank inside one counted rows for a split that got none (5 positives, 3 of them one row, went
    2/0/3). Within `bound` where a run boundary lies there."""
    if bound is not None:
        inside = ranks[(ranks >= bound[0]) & (ranks <= bound[1])]
        ranks = inside if len(inside) else ranks
    return int(ranks[np.argmin(np.abs(ranks - target))])


def _run_starts(s: np.ndarray) -> np.ndarray:
    """Where each run of equal values starts in the sorted `s`, and len(s)."""
    return np.append(np.flatnonzero(np.r_[True, s[1:] != s[:-1]]), len(s))


def _cut(sorted_values: np.ndarray, fraction: float) -> float:
    """The value below which the first round(n * fraction) sorted values fall."""
    n = len(sorted_values)
    i = int(round(n * fraction))
    return float("inf") if i >= n else float(sorted_values[i])


def row_hash(table: pa.Table, columns: tuple[str, ...], seed: int, salt: str) -> np.ndarray:
    key = seed_key(seed, salt)
    h = None
    for name in columns:
        part = hash_strings(as_string(table.column(name), name), key)
        h = part if h is None else combine(h, part)
    return h if h is not None else np.zeros(table.num_rows, np.uint64)


def row_unit(table: pa.Table, plan: SplitPlan, salt: str = "split") -> np.ndarray:
    h = row_hash(table, plan.key, plan.seed, salt)
    if plan.columns and set(plan.key) != set(plan.columns):
        keyless = None  # rows whose key columns are all missing: split by the row's own identity
        for name in plan.key:
            missing = as_string(table.column(name), name).is_null().to_numpy(zero_copy_only=False)
            keyless = missing if keyless is None else keyless & missing
        if keyless is not None and keyless.any():
            h = np.where(keyless, row_hash(table, plan.columns, plan.seed, salt + "-keyless"), h)
    return to_unit(h)


def split_keys(table: pa.Table, plan: SplitPlan) -> dict[str, np.ndarray]:
    """What the driver needs to compute stratified or temporal cut points."""
    if plan.kind == "temporal":
        return {"time": table.column(plan.time_column).to_numpy()}
    return {"label": table.column(plan.label).to_numpy(), "u": row_unit(table, plan)}


def assign(table: pa.Table, plan: SplitPlan) -> np.ndarray:
    """Split code per row: 0 train, 1 val, 2 test."""
    if plan.kind == "temporal":
        return _by_cuts(table.column(plan.time_column).to_numpy(), *plan.cutoffs)
    u = row_unit(table, plan)
    if plan.kind == "kfold":
        return _kfold(table, plan, u)
    if plan.kind == "stratified":
        labels = table.column(plan.label).to_numpy()
        out = np.full(len(u), TRAIN, dtype=np.int8)
        for value, c1, c2 in plan.cutoffs:
            mask = labels == value
            out[mask] = _by_cuts(u[mask], c1, c2)
        return out
    return _by_cuts(u, plan.train, plan.train + plan.val)


def _by_cuts(x: np.ndarray, c1: float, c2: float) -> np.ndarray:
    out = np.full(len(x), TEST, dtype=np.int8)
    out[x < c2] = VAL
    out[x < c1] = TRAIN
    return out


def _kfold(table: pa.Table, plan: SplitPlan, u: np.ndarray) -> np.ndarray:
    """Hold out `test` first (its own hash), then fold = floor(u * k) of the rest."""
    fold = kfold_index(u, plan.k)
    out = np.where(fold == plan.fold, VAL, TRAIN).astype(np.int8)
    if plan.test > 0:
        out[row_unit(table, plan, salt="kfold-test") < plan.test] = TEST
    return out


def kfold_index(u: np.ndarray, k: int) -> np.ndarray:
    return np.minimum((u * k).astype(np.int64), k - 1)
