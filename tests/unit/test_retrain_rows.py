"""Training rows for `rayload retrain` from a real SQLite event store: the sliding window, the
attribution window, labels still unknown, and the schema migration that added features."""

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa

from rayload.data.validate import validate_request
from rayload.errors import DataError, RayloadError
from rayload.retrain_rows import _labelled, check_rows, parse_duration, training_rows
from rayload.serve import event_writer, events
from _loop import features

NOW = 1_800_000_000.0


@pytest.fixture()
def store(tmp_path):
    champion = tmp_path / "champion"
    champion.mkdir()
    columns = [{"name": "x", "role": "numeric"}, {"name": "c", "role": "categorical"}, {"name": "b", "role": "multi_categorical"},
               {"name": "y", "role": "label"}]
    dataclasses.replace(features(), columns=columns).save(str(champion / "features.json"))
    url = f"sqlite:///{tmp_path / 'events.db'}"
    writer = event_writer.EventWriter(url, flush_ms=1)

    def exposure(rid, age, outcome_after=None, feats=True, experiment="exp"):
        row = {"request_id": rid, "experiment": experiment, "unit_id": "u", "arm": "a", "model_version": "v", "score": 0.5,
               "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": NOW - age,
               "features": None if not feats else json.dumps(feats if isinstance(feats, dict) else {"x": 1.5, "c": "3", "b": "p|q"})}
        writer.submit("exposure", row).result()
        if outcome_after is not None:
            writer.submit("outcome", {"request_id": rid, "event": "click", "value": 1.0, "ts": NOW - age + outcome_after}).result()

    yield {"url": url, "exposure": exposure, "champion": str(champion)}
    writer.close()


def _args(url):
    return {"events_url": url, "experiment": "exp", "spec": {"name": "exp", "arms": [{"name": "a", "weight": 0.5, "checkpoint": "x"},
                                                                                     {"name": "b", "weight": 0.5, "checkpoint": "y"}]}}


def test_labels_follow_the_attribution_window_and_unknown_labels_are_left_out(store):
    e = store["exposure"]
    e("clicked-fast", age=3600, outcome_after=10)          # positive
    e("clicked-late", age=7200, outcome_after=3000)        # outcome after the 30 min window: negative
    e("no-click-old", age=3600)                            # window passed without an outcome: negative
    e("no-click-young", age=60)                            # still inside the window: unknown, left out
    e("clicked-young", age=60, outcome_after=30)           # young: left out too, or young rows would all be positive
    e("too-old", age=9 * 86400, outcome_after=5)           # outside the 7-day sliding window
    e("no-features", age=3600, outcome_after=5, feats=False)
    e("other-experiment", age=3600, outcome_after=5, experiment="other")
    table = training_rows(_args(store["url"]), store["champion"], parse_duration("7d", "w"), parse_duration("30m", "a"), NOW)
    labels = dict(zip(table.column("request_id").to_pylist(), table.column("y").to_pylist()))
    assert labels == {"clicked-fast": 1.0, "clicked-late": 0.0, "no-click-old": 0.0}
    assert set(table.column_names) == {"x", "c", "b", "y", "request_id"}
    assert table.column("c").to_pylist() == ["3"] * 3


def test_an_outcome_of_value_zero_or_less_is_no_click_as_the_ab_analysis_counts_it(store):
    e, writer = store["exposure"], event_writer.EventWriter(store["url"], flush_ms=1)
    for rid, value in (("pos", 1.0), ("zero", 0.0), ("negative", -1.0), ("none", None)):
        e(rid, age=3600)
        if value is not None:
            writer.submit("outcome", {"request_id": rid, "event": "click", "value": value, "ts": NOW - 3590}).result()
    writer.close()
    reader = events.EventReader(store["url"])
    clicked = {r: float(o > 0) for r, o in zip(*(reader.frame("exp")[c] for c in ("request_id", "outcome")))}
    reader.close()
    table = training_rows(_args(store["url"]), store["champion"], None, parse_duration("30m", "a"), NOW)
    labels = dict(zip(table.column("request_id").to_pylist(), table.column("y").to_pylist()))
    assert labels == clicked == {"pos": 1.0, "zero": 0.0, "negative": 0.0, "none": 0.0}


def test_recent_exposures_do_not_bias_the_labels_toward_positives():
    rng = np.random.default_rng(0)
    n, ctr, attribution = 100_000, 0.10, 1800.0
    ts = NOW - rng.uniform(0, 3600, n)  # an hour of even traffic, half of it inside the attribution window
    click = rng.random(n) < ctr
    frame = pd.DataFrame({"ts": ts, "outcome_ts": np.where(click, ts + 5, np.nan)})
    kept, labels = _labelled(frame, attribution, NOW)
    assert len(kept) == len(labels) == int((NOW - ts >= attribution).sum())
    assert abs(labels.mean() - click[NOW - ts >= attribution].mean()) < 1e-12
    assert abs(labels.mean() - ctr) < 0.005  # before: 0.18, every young row kept was a click
    _, every = _labelled(frame, None, NOW)  # --attribution all: any outcome, every exposure
    assert len(every) == n and every.sum() == click.sum()


def test_mixed_value_types_that_serving_accepts_become_text_rows(store):
    e = store["exposure"]
    for i, value in enumerate([5, "6", 7.0, None, True]):
        e(f"r{i}", age=3600, outcome_after=10 if i % 2 else None, feats={"x": 1.5, "c": value, "b": "p"})
    table = training_rows(_args(store["url"]), store["champion"], None, parse_duration("30m", "a"), NOW)
    values = dict(zip(table.column("request_id").to_pylist(), table.column("c").to_pylist()))
    assert values == {"r0": "5", "r1": "6", "r2": "7", "r3": None, "r4": "true"}  # spelled as each value alone is
    served = validate_request([{"c": v} for v in [5, "6", 7.0, None, True]], [{"name": "c", "role": "categorical"}])
    assert served.column("c").to_pylist() == list(values.values())  # the text serving reads for the same values


def test_durations_parse_and_bad_ones_name_the_option():
    assert parse_duration("7d", "--window") == 7 * 86400 and parse_duration("1.5h", "--window") == 5400
    assert parse_duration("all", "--window") is None
    with pytest.raises(RayloadError, match="--window must look like"):
        parse_duration("7 days", "--window")


def test_too_few_or_one_class_rows_are_refused_with_what_to_do():
    with pytest.raises(DataError, match="widen --window"):
        check_rows(1000, 0, "exp")
    with pytest.raises(DataError, match="too few"):
        check_rows(10, 5, "exp")
    check_rows(1000, 100, "exp")


def test_a_version_1_store_is_migrated_in_place(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # the version-1 layout: no features column, no drift table
        conn.execute(sa.text("CREATE TABLE ab_meta (key VARCHAR(64) PRIMARY KEY, value TEXT)"))
        conn.execute(sa.text("INSERT INTO ab_meta VALUES ('schema_version', '1')"))
        conn.execute(sa.text("CREATE TABLE ab_exposures (request_id VARCHAR(64) PRIMARY KEY, experiment VARCHAR(128) NOT NULL, "
                             "unit_id VARCHAR(256) NOT NULL, arm VARCHAR(64) NOT NULL, model_version VARCHAR(128) NOT NULL, score FLOAT, "
                             "status VARCHAR(16) NOT NULL, latency_ms FLOAT NOT NULL, layout VARCHAR(256) NOT NULL, ts FLOAT NOT NULL)"))
        conn.execute(sa.text("INSERT INTO ab_exposures VALUES ('old', 'exp', 'u', 'a', 'v', 0.5, 'ok', 1.0, '{}', 1.0)"))
    reader = events.EventReader(url)
    with reader.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT value FROM ab_meta")).scalar_one() == str(events.SCHEMA_VERSION)
        assert conn.execute(sa.text("SELECT request_id, features FROM ab_exposures")).all() == [("old", None)]
    assert reader.drift("exp") == {}
    reader.close()
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE ab_meta SET value = '99'"))
    with pytest.raises(RayloadError, match="newer than this rayload"):
        events.EventReader(url)


def test_sdk_entry_points_stay_functions_after_their_modules_load():
    # A submodule named like an SDK function would replace it on the package once imported.
    import rayload
    import rayload.compression  # noqa: F401
    import rayload.retraining  # noqa: F401
    import rayload.tuning  # noqa: F401

    assert all(callable(getattr(rayload, name)) for name in ("compress", "retrain", "tune", "train", "run"))


@pytest.mark.parametrize("derived", [{}, {"hour": {"source": "ts", "part": "hour"}}])
def test_retrain_rows_carry_the_columns_serving_reads_no_id_or_timestamp_it_does_not_need(derived):
    """Serving reads an id or timestamp column only when a derived feature uses it, so an
    exposure's logged features lack it otherwise; declaring it in the retrain job quarantined
    every row (a missing required value)."""
    from rayload.retrain_rows import input_columns

    columns = [{"name": "x", "role": "numeric"}, {"name": "c", "role": "categorical"}, {"name": "sid", "role": "id"},
               {"name": "ts", "role": "timestamp"}, {"name": "y", "role": "label"}]
    fitted = dataclasses.replace(features(), columns=columns, derived=derived)
    names = [c["name"] for c in input_columns(fitted)]
    assert names == (["x", "c", "ts"] if derived else ["x", "c"])
    served = validate_request([{"x": 1.0, "c": "3", "sid": "s", "ts": 1.7e9}], columns, {d["source"] for d in derived.values()})
    assert served.column_names == names  # the rule serving reads requests by


def test_a_bag_logged_as_a_list_trains_on_the_tokens_serving_read(store):
    """Exposures log the request's features as sent: a bag as ["p", "q"] in one request and
    "r|s" in another. Retraining read such a window as the single token '["p", "q"]', which
    serving never produces (all-list windows happened to read right)."""
    e = store["exposure"]
    sent = [{"x": 1.0, "c": "3", "b": ["p", "q"]}, {"x": 2.0, "c": "4", "b": "r|s"}, {"x": 3.0, "c": 5, "b": ["t", 1]}]
    for i, feats in enumerate(sent):
        e(f"r{i}", age=3600 + i, outcome_after=5, feats=feats)
    table = training_rows(_args(store["url"]), store["champion"], None, parse_duration("30m", "a"), NOW)
    by_id = dict(zip(table.column("request_id").to_pylist(), table.column("b").to_pylist()))
    served = validate_request(sent, [{"name": "b", "role": "multi_categorical", "separator": "|"}]).column("b").to_pylist()
    assert [by_id[f"r{i}"] for i in range(3)] == served == ["p|q", "r|s", "t|1"]
