"""Drift of hash-encoded categoricals: the fit keeps the column's heavy hitters (counted
within 10% across batches that each hand on only their most frequent values), and drift
monitoring bins served values into those, the other values and missing, so a shift among a
hashed column's values is flagged, not only a change of its missing rate (no Ray)."""

import numpy as np
import pandas as pd
import pytest
from helpers import fit_features as fit, frame

from rayload import _categorical_fit
from rayload.serve import drift

HASHED = {"categorical": {"item": {"encode": "hash", "buckets": 64}}}


def _rows(df) -> list[dict]:
    return [{"item": v} for v in df["item"].tolist()]


def _report(features, rows) -> dict:
    counter = drift.DriftCounter(features)
    counter.observe(rows, features.transform_rows(rows))
    return {r["feature"]: r for r in drift.report(list(counter.bins.values()), counter.snapshot())}["item"]


def _skewed(n: int, seed: int) -> pd.DataFrame:
    df = frame(n, seed=seed)
    rng = np.random.default_rng(seed + 7)
    df["item"] = rng.zipf(1.6, n) % 50  # a few frequent items, a tail of rare ones
    return df


def test_a_hashed_column_keeps_its_heavy_hitters_and_is_binned_by_them():
    features, good = fit(_skewed(4000, 1), HASHED, chunks=4)
    item = next(c for c in features.categorical if c.name == "item")
    true = pd.Series(good.column("item").to_pylist()).value_counts(normalize=True)
    # small batches (nothing left out): exact counts, the 20 most frequent values, most frequent first
    assert item.stats["top_shares"] == pytest.approx(true.values[:20].tolist())
    assert item.stats["top_shares"] == [true[v] for v in item.stats["top_values"]]
    bins = drift._categorical_bins(item)
    assert bins.kind == "hashed" and bins.labels[-1] == "other values" and sum(bins.expected) == pytest.approx(1.0)


def test_unshifted_traffic_is_not_flagged_and_a_shift_among_the_values_is():
    features, _ = fit(_skewed(6000, 1), HASHED)
    for seed in range(20, 25):  # fresh draws of the same distribution
        out = _report(features, _rows(_skewed(2000, seed)))
        assert out["kind"] == "hashed" and not out["flagged"] and out["psi"] < 0.05, out
    shifted = _skewed(2000, 30)
    shifted["item"] = (shifted["item"] + 1) % 50  # the same missing rate, the popular items moved
    out = _report(features, _rows(shifted))
    assert out["flagged"] and "oov_rate" not in out, out


def test_heavy_hitters_counted_over_batches_that_leave_values_out_are_within_ten_percent(monkeypatch):
    """Batches of 3,000 rows with ~2,000 distinct values each hand on their 512 most frequent:
    the merged counts are lower bounds; only values known within 10% are kept."""
    monkeypatch.setattr(_categorical_fit, "HEAVY", 512)
    rng = np.random.default_rng(3)
    n = 12_000
    heavy = rng.choice(np.array([f"h{i}" for i in range(5)]), n, p=[0.3, 0.2, 0.1, 0.05, 0.35])
    values = np.where(rng.random(n) < 0.3, heavy, np.array([f"t{i}" for i in rng.integers(0, 100_000, n)]))
    df = frame(n, seed=4).assign(item=values)
    features, _ = fit(df, HASHED, chunks=4)
    item = next(c for c in features.categorical if c.name == "item")
    true = pd.Series(values).value_counts(normalize=True)
    assert set(item.stats["top_values"]) == {f"h{i}" for i in range(5)}  # no tail value passes the 10% bound
    for v, share in zip(item.stats["top_values"], item.stats["top_shares"]):
        assert share <= true[v] + 1e-12 and share >= 0.9 * true[v], (v, share, true[v])


def test_a_request_sized_and_a_large_batch_bin_alike():
    features, _ = fit(_skewed(3000, 1), HASHED)
    bins = next(b for b in drift.bins_for(features) if b.feature == "item")
    values = [3, "3", None, "", 1, 7.0, "x", 2] * 50
    small = np.concatenate([bins.index(values[i:i + 8]) for i in range(0, len(values), 8)])
    assert len(values) > drift.SMALL_LOOKUP and bins.index(values).tolist() == small.tolist()
    top = bins.top
    assert bins.index([top[0], None, "never-seen"]).tolist() == [1, 0, len(top) + 1]


def test_a_features_json_without_heavy_hitters_and_a_hashed_bag_track_the_missing_rate_only():
    features, _ = fit(_skewed(2000, 1), {"categorical": {"item": {"encode": "hash", "buckets": 64},
                                                          "tags": {"encode": "hash", "buckets": 64}}})
    item = next(c for c in features.categorical if c.name == "item")
    tags = next(c for c in features.categorical if c.name == "tags")
    assert "top_values" not in tags.stats and drift._categorical_bins(tags).kind == "missing-only"
    item.stats = {"count": item.stats["count"], "null_rate": item.stats["null_rate"]}  # as an older fit wrote it
    assert drift._categorical_bins(item).kind == "missing-only"
