"""Drift monitoring's reference and counting against what served traffic really looks like:
an out-of-sample OOV share for long-tailed vocabularies, the missing rate of hashed bags,
ranking requests counted per request, values read as the model reads them (no Ray)."""

import numpy as np
import pytest
from helpers import fit_features as fit, frame

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


@pytest.mark.parametrize("cut", [{"min_count": 2}, {"min_count": 5}, {"top_k": 100}])
def test_a_cut_vocabulary_does_not_count_the_values_it_left_out_twice(cut):
    """With min_count or top_k the singletons were already out of the vocabulary (1 - coverage)
    and were added again as unseen: the expected OOV share was 0.32 against 0.21 served at
    top_k 100, and traffic from the training distribution was flagged in half the draws."""
    features, _ = fit(_long_tail(20000, 1), {"categorical": {"user": cut}})
    user = next(c for c in features.categorical if c.name == "user")
    b = drift._categorical_bins(user)
    expected_oov = b.expected[-1] / sum(b.expected)
    served = [_report(features, _rows(_long_tail(2000, seed)))["user"] for seed in range(50, 60)]
    assert abs(expected_oov - np.mean([r["oov_rate"] for r in served])) < 0.03, (expected_oov, [r["oov_rate"] for r in served])
    assert not any(r["flagged"] for r in served) and max(r["psi"] for r in served) < 0.1, [r["psi"] for r in served]


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


def _ranking(features, requests: int, candidates: int, seed: int, shift_age: float = 0.0) -> tuple[drift.DriftCounter, dict]:
    """Ranking requests: each request's candidates share its user and age (request-level)."""
    pool = _rows(frame(requests * (candidates + 1), seed=seed))
    counter = drift.DriftCounter(features)
    for q in range(requests):
        user = pool[q]
        age = None if user["age"] is None else user["age"] + shift_age
        rows = [dict(pool[requests + q * candidates + j], user=user["user"], age=age) for j in range(candidates)]
        counter.observe(rows, features.transform_rows(rows), [len(rows)])
    return counter, {r["feature"]: r for r in drift.report(list(counter.bins.values()), counter.snapshot())}


def test_ranking_requests_count_request_level_values_once_and_judge_by_requests():
    features, _ = fit(frame(5000, seed=1), {})
    counter, out = _ranking(features, 5, 100, seed=7)  # 500 candidate rows, but 5 requests: too few to judge
    assert counter.rows == 5 and out["user"]["rows"] == 5 and out["age"]["rows"] == 5 and out["price"]["rows"] == 500
    assert not any(r["flagged"] for r in out.values()), out
    for seed in (11, 12):
        counter, out = _ranking(features, 600, 10, seed=seed)  # the training distribution: not flagged
        assert counter.rows == 600 and out["user"]["rows"] == 600 and out["item"]["rows"] == 6000
        assert not any(r["flagged"] for r in out.values()), out
    _, out = _ranking(features, 600, 10, seed=13, shift_age=40)  # a shifted request-level feature still is
    assert out["age"]["flagged"] and not out["user"]["flagged"], out


def test_requests_with_one_row_each_count_as_before():
    features, _ = fit(frame(1500, seed=1), {})
    rows = _rows(frame(300, seed=3))
    for r in rows[1:]:
        r["user"] = rows[0]["user"]  # the same value in consecutive single-row requests still counts per request
    a, b = drift.DriftCounter(features), drift.DriftCounter(features)
    a.observe(rows, features.transform_rows(rows))
    b.observe(rows, features.transform_rows(rows), [1] * len(rows))
    assert a.snapshot() == b.snapshot() and b.rows == 300 and sum(b.counts["user"]) == 300


def test_score_grouped_hands_each_requests_row_count_to_the_scorer():
    from rayload.serve.batch_scoring import score_grouped

    features, _ = fit(frame(1500, seed=1), {})

    class Fake:
        transform_key, version = "k", "v"

        def __init__(self):
            self.features, self.seen = features, []

        def score_table(self, table, rows, sizes=None):
            self.seen.append((len(rows), sizes))
            return np.zeros(len(rows))

    rows = _rows(frame(10, seed=4))
    scorers = {"a": Fake(), "b": Fake()}
    out = score_grouped(scorers, [("a", rows[:1]), ("b", rows[1:4]), ("a", rows[4:9]), ("b", rows[9:])])
    assert [len(o[0]) for o in out] == [1, 3, 5, 1]
    assert scorers["a"].seen == [(6, [1, 5])] and scorers["b"].seen == [(4, [3, 1])]


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_drift_row_counts_past_int32_are_stored_and_a_version_2_store_is_migrated(dialect, tmp_path):
    import contextlib

    import sqlalchemy as sa
    from helpers import pg_database

    from rayload.serve import events

    def snapshot(rows: int) -> dict:
        return {"experiment": "e", "arm": "a", "replica": "r", "model_version": "v", "rows": rows, "counts": "{}", "ts": 1.0}

    with contextlib.ExitStack() as stack:
        url = f"sqlite:///{tmp_path / 'events.db'}" if dialect == "sqlite" else stack.enter_context(pg_database("rayload_drift"))
        events.EventReader(url).close()  # a new store
        engine = events.engine_for(url)
        events.upsert_drift(engine, [snapshot(2**31 + 5)])
        reader = events.EventReader(url)
        assert reader.drift("e")["a"][0]["rows"] == 2**31 + 5
        reader.close()
        if dialect == "postgresql":  # a store written by schema version 2: rows was INTEGER (int32)
            with engine.begin() as conn:
                conn.execute(sa.text('DELETE FROM ab_drift'))
                conn.execute(sa.text('ALTER TABLE ab_drift ALTER COLUMN "rows" TYPE INTEGER'))
                conn.execute(sa.text("UPDATE ab_meta SET value = '2'"))
                conn.execute(sa.text("INSERT INTO ab_drift VALUES ('e', 'a', 'r', 'v', 7, '{}', 1.0)"))
            with pytest.raises(sa.exc.DBAPIError, match="out of range"):
                events.upsert_drift(engine, [snapshot(2**31 + 5)])
            reader = events.EventReader(url)  # opening it migrates it
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT value FROM ab_meta")).scalar_one() == str(events.SCHEMA_VERSION)
            assert reader.drift("e")["a"][0]["rows"] == 7  # the counts kept
            events.upsert_drift(engine, [snapshot(2**31 + 6)])
            assert reader.drift("e")["a"][0]["rows"] == 2**31 + 6
            reader.close()
        engine.dispose()


def test_drift_reads_numeric_text_and_a_nan_category_as_the_model_does():
    import math

    from rayload.data.validate import validate_request
    from rayload.features import CategoricalState, NumericState

    st = NumericState("x", 0.0, None, None, False, "none")
    st.stats = {"count": 100, "null_rate": 0.0, "histogram": {"edges": [0.5], "shares": [0.5, 0.5]}}
    b = drift._numeric_bins(st)
    for values in (["true", "false", "1", "0", " 2 ", "", None], [True, 0, 1.0, None, math.nan]):
        model = validate_request([{"x": v} for v in values], [{"name": "x", "role": "numeric"}]).column("x").to_pylist()
        expect = [0 if v is None else 2 if v >= 0.5 else 1 for v in model]
        assert b.index(values).tolist() == expect, (values, model)
    h = CategoricalState(name="h", encode="hash")
    h.buckets, h.stats = 16, {"null_rate": 0.0}
    hb = drift._categorical_bins(h)
    for values in ([math.nan, "x", "", None], ["x", "", None], [3, 0.0, math.nan, True]):
        model = validate_request([{"h": v} for v in values], [{"name": "h", "role": "categorical"}]).column("h").to_pylist()
        assert hb.index(values).tolist() == [0 if v is None else 1 for v in model], (values, model)
