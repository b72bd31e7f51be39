"""Drift monitoring's reference and counting against what served traffic really looks like:
an out-of-sample OOV share for long-tailed vocabularies, the missing rate of hashed bags,
ranking requests counted per request, values read as the model reads them (no Ray)."""

import numpy as np
from helpers import frame
from test_features import fit

from rayload.serve import drift


def _rows(df, columns=("user", "item", "tags", "price", "age")) -> list[dict]:
    rows = [{k: r[k] for k in columns} for r in df.to_dict("records")]
    for r in rows:
        for k in ("price", "age"):
            r[k] = None if r[k] != r[k] else r[k]  # NaN: JSON null
    return rows


def _report(features, rows, **kw) -> dict:
    counter = drift.DriftCounter(features)
    counter.observe(rows, features.transform_rows(rows))
    return {r["feature"]: r for r in drift.report(list(counter.bins.values()), counter.snapshot(), **kw)}


def _long_tail(n: int, seed: int, offset: int = 0):
    df = frame(n, seed=seed)
    rng = np.random.default_rng(seed + 100)
    df["user"] = [f"u{u + offset}" for u in rng.zipf(1.3, n) % 20000]  # a user-ID column: many IDs seen once
    return df


def test_a_long_tailed_vocabulary_expects_unseen_ids_in_fresh_traffic():
    features, _ = fit(_long_tail(8000, 1), {})  # min_count=1: every training ID is in the vocabulary
    user = next(c for c in features.categorical if c.name == "user")
    assert user.stats["coverage"] == 1.0 and 0.05 < user.stats["unseen_share"] < 0.3
    for seed in range(50, 55):  # fresh draws of the same distribution: ~10% IDs the fit never saw
        out = _report(features, _rows(_long_tail(2000, seed)))["user"]
        assert out["oov_rate"] > 0.05 and not out["flagged"], out
    shifted = _long_tail(2000, 60)
    shifted.loc[: 999, "user"] = [f"new{i}" for i in range(1000)]  # half the traffic: IDs of a new population
    assert _report(features, _rows(shifted))["user"]["flagged"]


def test_an_old_features_json_without_unseen_share_keeps_the_training_oov_share():
    features, _ = fit(frame(1500, seed=1), {})
    user = next(c for c in features.categorical if c.name == "user")
    user.stats.pop("unseen_share")
    b = drift._categorical_bins(user)
    assert b.expected[-1] == (1 - user.stats["null_rate"]) * (1 - user.stats["coverage"])


def test_a_hashed_bag_with_empty_rows_is_not_flagged_on_unshifted_traffic():
    features, _ = fit(frame(3000, seed=1), {"categorical": {"tags": {"encode": "hash", "buckets": 64}}})
    tags = next(c for c in features.categorical if c.name == "tags")
    assert 0.1 < tags.stats["null_rate"] < 0.4  # a quarter of the training bags are empty
    out = _report(features, _rows(frame(2000, seed=9)))["tags"]
    assert out["kind"] == "missing-only" and out["psi"] < 0.05 and not out["flagged"], out
    rows = _rows(frame(2000, seed=9))
    for r in rows:
        r["tags"] = ""  # every bag empty: flagged
    assert _report(features, rows)["tags"]["flagged"]
