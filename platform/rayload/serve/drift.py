"""Feature drift of served traffic against the training data, in bounded memory.

Every model deployment counts the raw feature values it scores into fixed bins taken from
its checkpoint's `features.json`:

- numeric: the training deciles (distinct inner edges) plus a missing bin; the reference
  shares are the training histogram over those edges (`stats.histogram`), or an even split
  per decile for a features.json written before histograms were kept;
- categorical (vocabulary): the most frequent training values (`stats.top_values`), the rest
  of the vocabulary, out-of-vocabulary, missing; without `top_values`: in-vocabulary, OOV,
  missing. A hash-encoded column has no vocabulary: its heavy hitters (`stats.top_values`, the
  values whose training count the fit knows within 10%), the other values, missing; a hashed
  bag, or a features.json without heavy hitters, tracks the missing rate only.
  A value is read as the model's transform reads it (JSON true is "true", 5.0 is "5"), so a
  value the model finds in its vocabulary is never counted out of vocabulary. A scorer hands
  over the rows' transformed table too: a vocabulary-encoded column's bins are then read off
  the IDs the model got (one array lookup) instead of converting the raw values a second
  time; the two ways count the same (tests/unit/test_drift_values.py).

The counts (a few dozen integers per feature, whatever the traffic) are flushed to the event
store per replica and summed over replicas when read, so the statistics cover all of them.

PSI = sum over bins of (observed - expected) * ln(observed / expected), with empty bins
floored at EPS. With n rows and B bins a sample from the training distribution itself gives
PSI of about (B - 1) / n on average, so a feature is flagged only past `threshold` (0.2, the
usual "significant shift") and after `min_rows` rows, which keeps false alarms rare
(tests/unit/test_drift.py measures the rate). A ranking request's candidates are one
observation, not many: a value the same in all of them (a request-level feature) is counted
once per request, and `min_rows` counts requests (tests/unit/test_drift_fixes.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..features import MISSING_ID

EPS = 1e-4
SMALL_LOOKUP = 256  # rows up to which a dict lookup beats pyarrow's index_in (which hashes the vocabulary per call)


@dataclass(frozen=True)
class Bins:
    feature: str
    kind: str  # numeric | categorical | hashed | missing-only
    labels: tuple[str, ...]
    expected: tuple[float, ...]
    edges: tuple[float, ...] = ()
    top: tuple[str, ...] = ()
    vocab: frozenset = frozenset()
    multi: bool = False
    separator: str = "|"
    ids: tuple[str, ...] = ()  # vocabulary-encoded (not one-hot, not hashed): the vocabulary in ID order
    max_bag: int = 0  # bags: IDs the model keeps per row; a row at the limit may have had more tokens

    def index(self, values: list) -> np.ndarray:
        """Bin of every raw value (bags: of every token)."""
        if self.kind == "numeric":
            return self._numeric(values)
        if self.multi:  # a bag sent as a JSON array: its text form, as the model's validation reads it
            from ..data.json_values import bag_values

            values = bag_values(values, self.separator)
        if self.kind == "missing-only":
            if all(v is None or type(v) is str for v in values):  # the usual request: as_string reads null and "" as missing
                return np.fromiter((0 if v is None or v == "" else 1 for v in values), dtype=np.int64, count=len(values))
            return np.where(_text(values, self.feature).is_null().to_numpy(zero_copy_only=False), 0, 1)  # NaN too
        if self.kind == "hashed":
            return self._hashed(values)
        return self._categorical(values)

    def _hashed(self, values: list) -> np.ndarray:
        """missing 0, the heavy hitters 1..k, any other value k + 1."""
        tokens = _text(values, self.feature)
        other = len(self.top) + 1
        if len(tokens) <= SMALL_LOOKUP:
            bin_of = self._lookup[0]
            return np.fromiter((0 if t is None else bin_of.get(t, other) for t in tokens.to_pylist()), dtype=np.int64, count=len(tokens))
        position = pc.index_in(tokens, value_set=pa.array(self.top, pa.string())).to_numpy(zero_copy_only=False)
        out = np.where(np.isnan(position), other, np.nan_to_num(position) + 1).astype(np.int64)
        out[tokens.is_null().to_numpy(zero_copy_only=False)] = 0
        return out

    def _numeric(self, values: list) -> np.ndarray:
        if any(type(v) is str for v in values):  # numeric text ("1e3", "true"): as the model's validation parses it
            from ..data.validate import numeric_values

            x = numeric_values(values, self.feature)
        else:  # numbers, booleans and nulls: what Arrow's cast to float64 gives, without building the array
            x = np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
        out = np.searchsorted(np.asarray(self.edges), x, side="right") + 1
        out[np.isnan(x)] = 0
        return out

    def _categorical(self, values: list) -> np.ndarray:
        tokens = _text(values, self.feature)
        if self.multi:
            from ..features import split_bag

            tokens = split_bag(self, tokens).values  # the model's own tokens: trimmed, empty ones dropped
        oov = len(self.top) + 2
        bin_of, known, bins = self._lookup
        if len(tokens) <= SMALL_LOOKUP:  # a request's worth: a dict beats hashing the vocabulary again
            return np.fromiter((0 if t is None else bin_of.get(t, oov) for t in tokens.to_pylist()), dtype=np.int64, count=len(tokens))
        position = pc.index_in(tokens, value_set=known).to_numpy(zero_copy_only=False)  # NaN: not in the vocabulary
        found = ~np.isnan(position)
        out = np.full(len(tokens), oov, dtype=np.int64)
        out[found] = bins[position[found].astype(np.int64)]
        out[tokens.is_null().to_numpy(zero_copy_only=False)] = 0
        return out

    def index_ids(self, column) -> np.ndarray | None:
        """Bin of every value, read off the model's IDs for it (`features.transform_categorical`'s
        output for this column), or None where they cannot tell: a bag at `max_bag` IDs may
        have been cut short, and the raw tokens past the cut still count."""
        arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if self.multi:
            if len(arr) and pc.max(pc.list_value_length(arr)).as_py() >= self.max_bag:
                return None
            ids = arr.flatten().to_numpy()
            ids = ids[ids != MISSING_ID]  # an empty bag holds the missing ID; no token is missing
        else:
            ids = arr.to_numpy()
        return self._id_bins[ids]

    @cached_property
    def _id_bins(self) -> np.ndarray:
        """The bin of every ID: missing, out of vocabulary, then the vocabulary's values."""
        bin_of = self._lookup[0]
        oov = len(self.top) + 2
        return np.array([0, oov, *(bin_of.get(v, oov) for v in self.ids)], dtype=np.int64)

    @cached_property
    def _lookup(self) -> tuple[dict[str, int], pa.Array, np.ndarray]:
        """The bin of every vocabulary value, as a dict and as an Arrow set with each entry's bin;
        built once per model, not per batch."""
        rest = sorted(self.vocab.difference(self.top))
        bin_of = {v: len(self.top) + 1 for v in rest} | {v: i + 1 for i, v in enumerate(self.top)}
        bins = np.concatenate([np.arange(1, len(self.top) + 1), np.full(len(rest), len(self.top) + 1)]).astype(np.int64)
        return bin_of, pa.array([*self.top, *rest], pa.string()), bins


def _text(values: list, name: str) -> pa.Array:
    """Raw request values as the model's transform reads a categorical column (serving's
    validate_request): JSON true -> "true", 5.0 -> "5", "" -> missing, mixed types as text."""
    from ..data.validate import as_string, python_array

    return as_string(python_array(values), name)


def _varying(values: list, starts: list[int]) -> list[int] | None:
    """The rows to count: a request's first row where its value is the same in all its rows,
    all of them otherwise; None when that is every row."""
    keep, dropped = [], False
    for s, e in zip(starts[:-1], starts[1:]):
        first = values[s]
        if e - s > 1 and all(v is first or (type(v) is type(first) and v == first) for v in values[s + 1:e]):
            keep.append(s)
            dropped = True
        else:
            keep.extend(range(s, e))
    return keep if dropped else None


def bins_for(features) -> list[Bins]:
    """The bins of every raw input column a model reads, with the training shares."""
    inputs = {c["name"] for c in features.columns if c["role"] not in ("label", "timestamp", "id")}
    out = [_numeric_bins(s) for s in features.numeric if s.name in inputs and s.stats.get("count")]
    out += [_categorical_bins(s) for s in features.categorical if s.name in inputs]
    return out


def _numeric_bins(state) -> Bins:
    null = float(state.stats.get("null_rate", 0.0))
    hist = state.stats.get("histogram")
    if hist:
        edges, shares = hist["edges"], hist["shares"]
    else:  # older features.json: the deciles split the values evenly, tied deciles into one bin
        q = state.stats["quantiles"]
        # a share per bin by where its edges sit among the deciles: an even share per distinct edge
        # gave a bin of eight tied deciles (a column 70% zeros) a fifth of the reference, and
        # traffic from the training data itself a PSI near 3 (always flagged). The share below an
        # edge is its first decile's, exact for a value held once and for one tied at the minimum;
        # below a value tied inside the range (60% zeros among signed values) it lies anywhere
        # within a decile, so that edge is left out and its two bins are one
        edges = [e for e in sorted(set(q[1:-1])) if q.count(e) == 1 or q.index(e) == 0]
        cdf = [0.0, *(q.index(e) / (len(q) - 1) for e in edges), 1.0]
        shares = [max(b - a, 0.0) for a, b in zip(cdf, cdf[1:])]
    # searchsorted(side="right") as in the fit's histogram: a value equal to an edge is counted above it
    labels = ["missing", f"< {edges[0]:g}" if edges else "all"] + [f">= {e:g}" for e in edges]
    return Bins(state.name, "numeric", tuple(labels), (null, *[(1 - null) * s for s in shares]), edges=tuple(edges))


def _categorical_bins(state) -> Bins:
    null = float(state.stats.get("null_rate", 0.0))
    top, shares = state.stats.get("top_values", []), state.stats.get("top_shares", [])
    if state.encode == "hash" and top and not state.multi:
        rest = max(1.0 - sum(shares), 0.0)
        return Bins(state.name, "hashed", ("missing", *top, "other values"), (null, *[(1 - null) * s for s in shares], (1 - null) * rest),
                    top=tuple(top), vocab=frozenset(top))
    if state.encode == "hash" or state.vocab is None:  # rows, bags included: a null or empty one is missing
        return Bins(state.name, "missing-only", ("missing", "present"), (null, 1 - null), multi=state.multi, separator=state.separator)
    null = 0.0 if state.multi else null  # a vocabulary bag's bins count its tokens, and an empty bag has none
    coverage = float(state.stats.get("coverage", 1.0))
    # Fresh traffic brings values the training split never had: their expected share (Good-Turing,
    # mostly the tail's mass) moves from the rest of the vocabulary to out-of-vocabulary. A
    # features.json written before `unseen_share` was kept: the training split's own OOV share.
    unseen = float(state.stats.get("unseen_share", 0.0))
    rest = max(coverage - sum(shares) - unseen, 0.0)
    oov = min(1.0 - coverage + unseen, 1.0)
    expected = (null, *[(1 - null) * s for s in shares], (1 - null) * rest, (1 - null) * oov)
    labels = ("missing", *top, "other (in vocabulary)", "out of vocabulary")
    return Bins(state.name, "categorical", labels, expected, top=tuple(top), vocab=frozenset(state.vocab),
                multi=state.multi, separator=state.separator, ids=tuple(state.vocab) if state.encode == "vocab" else (),
                max_bag=state.max_bag)


class DriftCounter:
    """Bin counts of one model's traffic: fixed size, whatever the number of requests."""

    def __init__(self, features, period_s: float | None = None, clock=time.time):
        self.bins = {b.feature: b for b in bins_for(features)}
        self.version = 0  # bumps on every observe: the flusher writes only what changed
        # Counts by period (`period_s`, None: one period, since the replica started), so that
        # readers can merge the periods of a recent window only (monitor.py). A period's counts
        # are final once the next one starts: `closed` holds them, (period, snapshot), for the
        # flusher to write and drop. Only `observe` changes the counts, one call at a time (a
        # shadow's thread and the serving loop may score the same model while shadow mode ends).
        self.period_s, self.clock = period_s, clock
        self._observing = threading.Lock()
        self.closed: list[tuple[int, dict]] = []
        self._start(self._period())

    def _start(self, period: int) -> None:
        self.period = period
        self.counts = {name: np.zeros(len(b.labels), dtype=np.int64) for name, b in self.bins.items()}
        self.rows = 0

    def count_by(self, period_s: float | None) -> None:
        """Count by periods of `period_s` from now on (None: one period), starting afresh."""
        self.period_s = period_s
        self.closed.clear()
        self._start(self._period())

    def _period(self) -> int:
        return int(self.clock() // self.period_s) if self.period_s else 0

    def observe(self, rows: list[dict], table: pa.Table | None = None, sizes: list[int] | None = None) -> None:
        with self._observing:
            self._observe(rows, table, sizes)

    def _observe(self, rows: list[dict], table: pa.Table | None, sizes: list[int] | None) -> None:
        """Count raw request rows; `table`, when given, is their transform by this model's
        features (`FittedFeatures.transform_rows`), whose IDs stand in for the raw values of
        vocabulary-encoded columns.

        `sizes`: how many of the rows each request gave, in order (None: one each). A ranking
        request's candidates repeat its request-level values (the user's ID and age): a value
        the same in all of a request's rows is counted once, and `rows` counts requests, the
        independent observations `report`'s min_rows asks for."""
        if self.period_s:
            period = self._period()
            if period != self.period:
                if self.rows:
                    self.closed.append((self.period, self.snapshot()))
                self._start(period)
        starts = None if sizes is None or len(sizes) == len(rows) else np.cumsum([0, *sizes]).tolist()
        for name, b in self.bins.items():
            if starts is None:  # one row per request, the usual case: nothing to select
                keep, values = None, None
            else:
                values = [r.get(name) for r in rows]
                keep = _varying(values, starts)
                values = values if keep is None else [values[i] for i in keep]
            idx = None
            if table is not None and b.ids and name in table.column_names:
                column = table.column(name)
                idx = b.index_ids(column if keep is None else column.take(keep))
            if idx is None:
                idx = b.index([r.get(name) for r in rows] if values is None else values)
            if len(idx):
                self.counts[name] += np.bincount(idx, minlength=len(b.labels))
        self.rows += len(rows) if sizes is None else len(sizes)
        self.version += 1

    def snapshot(self) -> dict:
        return {"rows": self.rows, "counts": {k: v.tolist() for k, v in self.counts.items()}}

    def period_end(self, period: int) -> float | None:
        """When `period` ends (None without periods)."""
        return (period + 1) * self.period_s if self.period_s else None


def merge(snapshots: list[dict]) -> dict:
    """Sum of several replicas' snapshots of the same model."""
    out = {"rows": 0, "counts": {}}
    for snap in snapshots:
        out["rows"] += snap["rows"]
        for name, counts in snap["counts"].items():
            prev = out["counts"].get(name)
            out["counts"][name] = counts if prev is None else [a + b for a, b in zip(prev, counts)]
    return out


def psi(expected, counts) -> float:
    e = np.maximum(np.asarray(expected, dtype=np.float64), EPS)
    total = float(np.sum(counts))
    if total == 0:
        return 0.0
    a = np.maximum(np.asarray(counts, dtype=np.float64) / total, EPS)
    e = e / e.sum()
    return float(np.sum((a - e) * np.log(a / e)))


def report(bins: list[Bins], snapshot: dict, threshold: float = 0.2, min_rows: int = 500) -> list[dict]:
    """Per feature: values counted, PSI, OOV rate (categoricals), and whether it is flagged: only
    past `min_rows` values and as many requests (a snapshot's `rows`)."""
    out = []
    for b in bins:
        counts = snapshot["counts"].get(b.feature)
        if counts is None:
            continue
        n = int(sum(counts))
        value = psi(b.expected, counts)
        enough = n >= min_rows and snapshot.get("rows", n) >= min_rows  # values counted, and requests they came from
        # judged: past min_rows; below it "ok" read as fine a feature not judged yet (PSI 8.4 on 100 rows)
        row = {"feature": b.feature, "kind": b.kind, "rows": n, "psi": value, "flagged": bool(enough and value > threshold),
               "judged": bool(enough)}
        if b.kind == "categorical":
            row["oov_rate"] = counts[-1] / n if n else 0.0
            row["training_oov_rate"] = b.expected[-1] / max(sum(b.expected), EPS)
        out.append(row)
    return sorted(out, key=lambda r: -r["psi"])
