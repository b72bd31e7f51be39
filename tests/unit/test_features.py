"""Every transform against a numpy/pandas reference; JSON round trip; batch vs request parity."""

import json
import pickle
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from helpers import fit_features as fit, frame, frame_schema
from rayload._feature_fit import FitPlan, finalize, merge_stats, partial_stats
from rayload.data.validate import validate_table
from rayload.errors import DataError
from rayload.features import MISSING_ID, OOV_ID, FittedFeatures
from rayload.spec import FeatureSpec


@pytest.fixture(scope="module")
def df():
    return frame(1500, seed=1)


@pytest.mark.parametrize("impute", ["mean", "median", "constant", "most_frequent"])
def test_impute_matches_pandas(df, impute):
    feats, good = fit(df, {"numeric": {"age": {"impute": impute, "fill_value": -1, "scale": "none"}}})
    ref = {"mean": df.age.mean(), "median": np.quantile(df.age.dropna(), 0.5, method="inverted_cdf"),
           "constant": -1.0, "most_frequent": df.age.mode().min()}[impute]
    out = feats.transform_table(good).column("age").to_numpy()
    np.testing.assert_allclose(out, df.age.fillna(ref).to_numpy(), rtol=1e-6)


def test_zscore_and_minmax_match_numpy(df):
    feats, good = fit(df, {"numeric": {"price": {"impute": "mean", "scale": "zscore"}, "age": {"impute": "median", "scale": "minmax"}}}, chunks=4)
    p = df.price.fillna(df.price.mean()).to_numpy()
    out = feats.transform_table(good)
    np.testing.assert_allclose(out.column("price").to_numpy(), (p - p.mean()) / p.std(), rtol=1e-4, atol=1e-5)
    a = df.age.fillna(np.quantile(df.age.dropna(), 0.5, method="inverted_cdf")).to_numpy()
    np.testing.assert_allclose(out.column("age").to_numpy(), (a - a.min()) / (a.max() - a.min()), rtol=1e-5, atol=1e-6)


def test_fixed_clip_then_log_then_zscore(df):
    feats, good = fit(df, {"numeric": {"price": {"impute": "constant", "fill_value": 0, "clip": {"min": 1, "max": 100}, "log": True}}}, chunks=3)
    x = np.log1p(np.clip(df.price.fillna(0).to_numpy(), 1, 100))
    got = feats.transform_table(good).column("price").to_numpy()
    np.testing.assert_allclose(got, (x - x.mean()) / x.std(), rtol=1e-4, atol=1e-5)


def test_quantile_clip_matches_numpy_quantiles(df):
    feats, good = fit(df, {"numeric": {"price": {"impute": "median", "clip": {"quantiles": [0.05, 0.95]}, "scale": "none"}}})
    valid = df.price.dropna().to_numpy()
    lo, hi = np.quantile(valid, [0.05, 0.95], method="inverted_cdf")
    state = feats.numeric[[n.name for n in feats.numeric].index("price")]
    assert (state.clip_low, state.clip_high) == pytest.approx((lo, hi))
    got = feats.transform_table(good).column("price").to_numpy()
    med = np.quantile(valid, 0.5, method="inverted_cdf")
    np.testing.assert_allclose(got, np.clip(df.price.fillna(med), lo, hi), rtol=1e-6)


def test_sketch_quantiles_are_close_on_large_batches():
    rng = np.random.default_rng(3)
    x = rng.lognormal(0, 1, 200_000)
    df = frame(200_000, seed=2).assign(price=x)
    feats, _ = fit(df, {"numeric": {"price": {"impute": "median", "scale": "none"}}}, chunks=3)
    state = [n for n in feats.numeric if n.name == "price"][0]
    true_rank = (x < state.impute_value).mean()
    assert abs(true_rank - 0.5) < 0.002  # rank error of the merged sketch


def test_buckets_fixed_and_quantile(df):
    feats, good = fit(df, {"numeric": {"age": {"impute": "constant", "fill_value": 0, "buckets": {"boundaries": [30, 50, 70]}},
                                       "price": {"impute": "mean", "buckets": {"quantiles": 4}}}})
    out = feats.transform_table(good)
    a = df.age.fillna(0).to_numpy()
    np.testing.assert_array_equal(out.column("age").to_numpy(), np.digitize(a, [30, 50, 70], right=False))
    counts = np.bincount(out.column("price").to_numpy(), minlength=4)
    assert len(counts) == 4 and counts.min() > 0.15 * len(df)  # roughly equal-frequency bins
    assert feats.sparse_columns["age"] == 4 and feats.sparse_columns["price"] == 4


def test_vocab_top_k_min_count_oov_and_missing(df):
    feats, good = fit(df, {"categorical": {"user": {"encode": "vocab", "min_count": 3, "top_k": 20}}})
    counts = df.user.value_counts()
    eligible = counts[counts >= 3]
    expected = sorted(eligible.index, key=lambda v: (-eligible[v], v))[:20]
    state = [c for c in feats.categorical if c.name == "user"][0]
    assert state.vocab == expected
    ids = feats.transform_table(good).column("user").to_numpy()
    ref = np.array([expected.index(u) + 2 if u in expected else OOV_ID for u in df.user])
    np.testing.assert_array_equal(ids, ref)
    rows = feats.transform_rows([{"user": None}, {"user": "never-seen"}, {"user": expected[0]}])
    assert rows.column("user").to_pylist() == [MISSING_ID, OOV_ID, 2]
    # The serve-time lookup cache stays out of what is shipped to Ray workers and out of the JSON.
    assert "_memo_cache" in state.__dict__ and "_memo_cache" not in pickle.loads(pickle.dumps(state)).__dict__
    assert FittedFeatures.from_json(feats.to_json()) == feats


def test_hash_is_stable_across_processes(df):
    feats, good = fit(df, {"categorical": {"item": {"encode": "hash", "buckets": 97}}})
    ids = feats.transform_table(good).column("item").to_pylist()[:20]
    code = (
        "import sys, json, pyarrow as pa; sys.path.insert(0, 'platform');"
        "from rayload.features import CategoricalState, encode_ids;"
        f"print(json.dumps(encode_ids(CategoricalState('item', 'hash', buckets=97), pa.array({[str(v) for v in df.item[:20]]!r})).tolist()))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"})
    assert eval(other.stdout) == ids
    assert max(ids) < 97


def test_onehot(df):
    feats, good = fit(df, {"categorical": {"item": {"encode": "onehot", "top_k": 5}}})
    out = feats.transform_table(good)
    cols = [c for c in feats.dense_columns if c.startswith("item__oh")]
    assert len(cols) == 6
    mat = np.stack([out.column(c).to_numpy() for c in cols], axis=1)
    assert (mat.sum(axis=1) == 1).all()
    vocab = [c for c in feats.categorical if c.name == "item"][0].vocab
    hot = mat.argmax(axis=1)
    ref = np.array([vocab.index(str(v)) + 1 if str(v) in vocab else 0 for v in df.item])
    np.testing.assert_array_equal(hot, ref)


def test_onehot_refuses_high_cardinality(df):
    with pytest.raises(DataError, match="max_onehot"):
        fit(df, {"categorical": {"user": {"encode": "onehot", "max_onehot": 4}}})


def test_bags_and_truncation(df):
    feats, good = fit(df, {"categorical": {"tags": {"encode": "vocab", "max_bag": 2}}})
    state = [c for c in feats.categorical if c.name == "tags"][0]
    bags = feats.transform_table(good).column("tags").to_pylist()
    for raw, bag in zip(df.tags, bags):
        tokens = [t for t in raw.split("|") if t]
        expected = [state.vocab.index(t) + 2 for t in tokens][:2] or [MISSING_ID]
        assert bag == expected
    assert feats.bag_columns == {"tags": len(state.vocab) + 2}


def test_cross_is_hash_of_both_columns(df):
    feats, good = fit(df, {"crosses": [{"columns": ["user", "item"], "buckets": 1000}]})
    out = feats.transform_table(good).column("x_user_item").to_numpy()
    pairs = pd.Series(list(zip(df.user, df.item.astype(str))))
    # Same pair, same bucket; distinct buckets match a uniform hash of the distinct pairs.
    assert pd.Series(out).groupby(pairs.values).nunique().max() == 1
    expected = 1000 * (1 - np.exp(-pairs.nunique() / 1000))
    assert abs(len(set(out)) - expected) < 0.1 * expected


def test_json_round_trip_is_exact(df):
    feats, good = fit(df, {"numeric": {"price": {"clip": {"quantiles": [0.01, 0.99]}, "log": True}},
                           "categorical": {"item": {"encode": "onehot"}, "user": {"encode": "hash", "buckets": 50}},
                           "crosses": [{"columns": ["user", "item"], "buckets": 64}]})
    again = FittedFeatures.from_json(feats.to_json())
    assert again == feats
    assert again.transform_table(good).equals(feats.transform_table(good))
    assert "pickle" not in feats.to_json()


def test_batch_and_single_row_transforms_agree_on_1000_random_rows():
    train = frame(3000, seed=5)
    feats, _ = fit(train, {"numeric": {"price": {"clip": {"quantiles": [0.01, 0.99]}, "log": True}, "age": {"buckets": {"quantiles": 5}}},
                           "categorical": {"item": {"encode": "onehot"}, "user": {"encode": "vocab", "min_count": 2}, "tags": {"encode": "hash", "buckets": 31}},
                           "crosses": [{"columns": ["user", "item"], "buckets": 128}]})
    test = frame(1000, seed=99)  # unseen users and items appear; NaNs are missing values
    rng = np.random.default_rng(7)
    test.loc[rng.random(1000) < 0.1, "user"] = None
    test.loc[rng.random(1000) < 0.1, "item"] = 10_000 + rng.integers(0, 100)
    test.loc[rng.random(1000) < 0.1, "tags"] = None
    schema = frame_schema()
    good, bad = validate_table(pa.Table.from_pandas(test, preserve_index=False), schema)
    assert bad.num_rows == 0
    batch = feats.transform_table(good).drop(["label"])
    records = test.drop(columns=["y", "ts"]).to_dict("records")
    for r in records:  # requests carry JSON values: None for missing, never NaN
        for k, v in r.items():
            if isinstance(v, float) and np.isnan(v):
                r[k] = None
    rows = [feats.transform_rows([r]) for r in records]
    single = pa.concat_tables(rows)
    assert single.column_names == batch.column_names
    for name in batch.column_names:
        assert single.column(name).to_pylist() == batch.column(name).to_pylist(), name


def test_request_with_unparsable_value_names_row_and_column(df):
    feats, _ = fit(df, {})
    with pytest.raises(DataError, match=r"request row 1: price: cannot parse"):
        feats.transform_rows([{"price": 3}, {"price": "abc"}])


@pytest.mark.parametrize("rows", [40, 1500], ids=["dict-lookup", "arrow-lookup"])
def test_raw_integer_ids_get_the_ids_of_their_text_on_both_lookup_paths(df, rows):
    # A raw Arrow table (item as int64, as Parquet holds MovieLens IDs) encodes like the validated one.
    feats, good = fit(df, {"categorical": {"item": {"encode": "vocab", "min_count": 2, "target_stats": True}}})
    raw = pa.Table.from_pandas(df.drop(columns=["y"]), preserve_index=False).slice(0, rows)
    assert pa.types.is_integer(raw.schema.field("item").type)
    want = feats.transform_table(good.slice(0, rows)).drop(["label"])
    got = feats.transform_table(raw)
    for name in ("item", "item__te", "item__logcount"):
        assert got.column(name).to_pylist() == want.column(name).to_pylist(), name


@pytest.mark.parametrize("impute", ["mean", "median"])
def test_zscore_of_a_constant_column_divides_by_one_whatever_the_blocks(impute):
    """The std of 1000 copies of 0.1 came out as rounding noise (1e-17): training values became
    +-1 depending on the block layout, and a served 0.2 became 7e15."""
    df = frame(1000, seed=2)
    df["price"] = 0.1
    df.loc[::7, "price"] = np.nan  # imputed with the constant itself
    for chunks in (1, 3, 7, 10):
        feats, good = fit(df, {"numeric": {"price": {"scale": "zscore", "impute": impute}}}, chunks=chunks)
        assert feats.numeric[0].divisor == 1.0
        assert np.abs(feats.transform_table(good).column("price").to_numpy()).max() < 1e-12
        # every training value was 0.1: a served value transforms to 0, as they all did
        assert feats.numeric[0].constant and feats.transform_rows([{"price": 0.2}]).column("price")[0].as_py() == 0.0
    # a real spread, however small next to the mean, is still divided by
    df["price"] = 1e6 + np.arange(1000) % 2 * 1e-3
    feats, _ = fit(df, {"numeric": {"price": {"scale": "zscore", "impute": impute}}}, chunks=3)
    assert feats.numeric[0].divisor == pytest.approx(5e-4, rel=1e-6)


def test_target_statistics_without_smoothing_fall_back_to_the_prior_where_no_row_is_left(df):
    """smoothing: 0 (allowed) gave 0/0 = NaN for unseen and missing values at serving, and for
    training rows whose value occurs only in their own fold."""
    from rayload.spec import SplitSpec

    schema = frame_schema()
    good, _ = validate_table(pa.Table.from_pandas(df, preserve_index=False), schema)
    plan = FitPlan.from_spec(FeatureSpec.model_validate({"categorical": {"user": {"target_stats": True, "smoothing": 0}}}),
                             schema, SplitSpec(key=["user", "item", "ts"]))
    feats = finalize(merge_stats([partial_stats(good, plan)]), plan)
    state = feats.target[0]
    train = feats.transform_table(good, training=True).column("user__te").to_numpy()
    assert not np.isnan(train).any()
    once = df.user.map(df.user.value_counts()) == 1  # a value seen once is only in its own fold
    assert once.any() and (train[once.to_numpy()] == 0).all()  # the prior, centred
    served = feats.transform_rows([{"user": "never-seen"}, {"user": None}, {"user": state.values[0]}]).column("user__te").to_numpy()
    ys = df.y[df.user == state.values[0]]
    np.testing.assert_allclose(served, [0.0, 0.0, 2 * (ys.mean() - state.prior)], rtol=1e-6, atol=1e-7)


def test_huge_finite_values_scale_without_overflow_or_are_refused_by_column():
    """Moments of [1, 2, 3, 1e200] overflowed (divisor inf, every output 0) and features.json
    refused the inf only after the shards were written."""
    df = frame(400, seed=5).assign(price=lambda d: np.resize([1.0, 2.0, 3.0, 1e200], len(d)))
    for chunks in (1, 3):
        feats, good = fit(df, {"numeric": {"price": {"scale": "zscore", "impute": "mean"}}}, chunks=chunks)
        ref = np.resize([1.0, 2.0, 3.0, 1e200], 400) / 1e200
        np.testing.assert_allclose(feats.transform_table(good).column("price").to_numpy(), (ref - ref.mean()) / ref.std(), rtol=1e-6)
        assert feats.numeric[0].stats["std"] == pytest.approx(1e200 * ref.std()) and feats.to_json()
    df["price"] = np.resize([1e308, 1.7e308], len(df))  # the sum alone overflowed
    feats, good = fit(df, {"numeric": {"price": {"scale": "zscore", "impute": "mean"}}}, chunks=3)
    np.testing.assert_allclose(feats.transform_table(good).column("price").to_numpy(), np.resize([-1.0, 1.0], 400), rtol=1e-6)
    # what float32 outputs (or a float64 range) cannot hold is refused, naming the column and the fix
    df["price"] = np.resize([1.0, 2.0, 3.0, 1e200], len(df))
    with pytest.raises(DataError, match=r"features.numeric.price: training values from 1 to 1e\+200 overflow the scale=none "
                                        r"transform \(outputs past float32.*features.numeric.price.clip.*features.numeric.price.log: true"):
        fit(df, {"numeric": {"price": {"scale": "none"}}})
    df["price"] = np.resize([-1.7e308, 1.7e308], len(df))
    with pytest.raises(DataError, match=r"features.numeric.price: .*scale=minmax transform \(divisor"):
        fit(df, {"numeric": {"price": {"scale": "minmax"}}})
    feats, good = fit(df, {"numeric": {"price": {"scale": "none", "log": True}}})
    assert np.isfinite(feats.transform_table(good).column("price").to_numpy()).all() and feats.to_json()


def _state(feats: FittedFeatures, name: str):
    return next(s for s in feats.numeric + feats.categorical if s.name == name)


@pytest.mark.parametrize("scale", ["zscore", "minmax", "none"])
@pytest.mark.parametrize("value", [5.0, np.nan], ids=["constant", "all-null"])
def test_a_column_constant_or_null_in_training_outputs_zero_for_every_served_value(scale, value, caplog):
    """A served 1e6 reached the model as 999995 (or 1e6) on weights that never saw a varying
    input: every training output of the column was one value."""
    df = frame(300, seed=3).assign(price=value)
    with caplog.at_level("WARNING", logger="rayload"):
        feats, good = fit(df, {"numeric": {"price": {"scale": scale, "impute": "median"}}}, chunks=3)
    assert _state(feats, "price").constant
    assert any("features.numeric.price" in r.getMessage() for r in caplog.records)
    assert set(feats.transform_table(good).column("price").to_pylist()) == {0.0}
    served = feats.transform_rows([{"price": 1e6}, {"price": -3}, {"price": None}, {"price": 5.0}])
    assert served.column("price").to_pylist() == [0.0] * 4
    again = FittedFeatures.from_json(feats.to_json())
    assert again == feats and again.transform_rows([{"price": 1e6}]).column("price").to_pylist() == [0.0]


def test_features_json_without_the_constant_field_transforms_as_before():
    df = frame(300, seed=3).assign(price=5.0)
    feats, _ = fit(df, {"numeric": {"price": {"scale": "zscore"}}})
    raw = json.loads(feats.to_json())
    for n in raw["numeric"]:
        del n["constant"]
    old = FittedFeatures.from_json(json.dumps(raw))
    assert not _state(old, "price").constant
    assert old.transform_rows([{"price": 1e6}]).column("price").to_pylist() == [999995.0]


@pytest.mark.parametrize("buckets", [{"quantiles": 4}, {"boundaries": [3.0, 10.0]}])
def test_a_constant_bucketised_column_has_one_bucket_for_every_value(buckets):
    df = frame(300, seed=3).assign(price=5.0)
    feats, good = fit(df, {"numeric": {"price": {"buckets": buckets}}})
    assert feats.sparse_columns["price"] == 1 and _state(feats, "price").constant
    assert set(feats.transform_table(good).column("price").to_pylist()) == {0}
    assert feats.transform_rows([{"price": -1e6}, {"price": 1e6}]).column("price").to_pylist() == [0, 0]


def test_quantile_buckets_of_a_zero_inflated_column_leave_no_bucket_untrained(caplog):
    """70% zeros, 10 quantiles asked: 5 buckets came out, bucket 0 (below the minimum) held no
    training row, and a served -1 landed in its untrained embedding."""
    rng = np.random.default_rng(0)
    x = np.where(rng.random(5000) < 0.7, 0.0, rng.lognormal(0, 1, 5000))
    df = frame(5000, seed=4).assign(price=x)
    with caplog.at_level("INFO", logger="rayload"):
        feats, good = fit(df, {"numeric": {"price": {"buckets": {"quantiles": 10}}}}, chunks=3)
    card = feats.sparse_columns["price"]
    ids = np.asarray(feats.transform_table(good).column("price").to_pylist())
    assert np.bincount(ids, minlength=card).min() > 0 and card == 10
    assert len(set(ids[x == 0])) == 1 and not (ids[x != 0] == ids[x == 0][0]).any()  # the atom has its own bucket
    served = feats.transform_rows([{"price": -1.0}, {"price": 1e9}]).column("price").to_pylist()
    assert served == [ids[x == 0][0], ids.max()]
    assert any("features.numeric.price" in r.getMessage() and "10" in r.getMessage() for r in caplog.records)


def test_quantile_buckets_of_a_few_tied_values_give_each_value_its_bucket():
    df = frame(2000, seed=4).assign(price=np.resize([0.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 7.0], 2000))
    feats, good = fit(df, {"numeric": {"price": {"buckets": {"quantiles": 10}}}})
    ids = np.asarray(feats.transform_table(good).column("price").to_pylist())
    assert feats.sparse_columns["price"] == 5 and np.bincount(ids).min() > 0
    assert pd.Series(ids).groupby(df.price.to_numpy()).nunique().max() == 1


@pytest.mark.parametrize("asked", [2, 3, 4, 10])
def test_quantile_buckets_with_an_atom_inside_the_range_never_exceed_the_number_asked(asked):
    """An atom inside the range (the zeros between negative and positive values) takes three
    buckets: with 2 asked, 3 came out (fuzzing found 22 asked -> 23 given as well)."""
    x = np.resize(np.concatenate([np.zeros(60), np.linspace(-1, -0.1, 20), np.linspace(0.1, 1, 20)]), 2000)
    df = frame(2000, seed=4).assign(price=x)
    feats, good = fit(df, {"numeric": {"price": {"buckets": {"quantiles": asked}}}})
    card = feats.sparse_columns["price"]
    ids = np.asarray(feats.transform_table(good).column("price").to_pylist())
    assert card <= asked and np.bincount(ids, minlength=card).min() > 0
    assert pd.Series(ids).groupby(x).nunique().max() == 1 and ids[x < 0].max() < ids[x == 0].min()  # negatives told from the zeros


def test_quantile_buckets_keep_the_bucket_of_an_imputed_value_below_the_minimum():
    df = frame(2000, seed=4).assign(price=np.resize([0.0, 0.0, 0.0, 1.0, 2.0, np.nan], 2000))
    feats, good = fit(df, {"numeric": {"price": {"buckets": {"quantiles": 4}, "impute": "constant", "fill_value": -1}}})
    ids = np.asarray(feats.transform_table(good).column("price").to_pylist())
    assert np.bincount(ids, minlength=feats.sparse_columns["price"]).min() > 0
    assert len({ids[i] for i in range(5, 2000, 6)}) == 1 and ids[5] != ids[0]  # missing keeps its own bucket


def test_out_of_fold_log_count_agrees_with_serving_on_average():
    """Training rows counted the rows outside their fold, about (k-1)/k of the count serving uses;
    the log count holds no label, so a training row now gets serving's exactly (the mean stays out of fold)."""
    from rayload.spec import SplitSpec

    rng = np.random.default_rng(0)
    df = frame(4000, seed=6).assign(user=[f"v{v % 50}" for v in rng.zipf(1.3, 4000)])
    schema = frame_schema()
    good, _ = validate_table(pa.Table.from_pandas(df, preserve_index=False), schema)
    plan = FitPlan.from_spec(FeatureSpec.model_validate({"categorical": {"user": {"target_stats": True, "smoothing": 10}}}),
                             schema, SplitSpec(key=["user", "item", "ts"]))
    feats = finalize(merge_stats([partial_stats(good, plan)]), plan)
    train = feats.transform_table(good, training=True).column("user__logcount").to_numpy()
    serve = feats.transform_table(good).column("user__logcount").to_numpy()
    np.testing.assert_array_equal(train, serve)
    te_train = feats.transform_table(good, training=True).column("user__te").to_numpy()
    assert not np.array_equal(te_train, feats.transform_table(good).column("user__te").to_numpy())  # still out of fold


@pytest.mark.parametrize("edit, field", [
    (lambda raw: raw["numeric"][0].update(offset=float("nan")), "NaN"),
    (lambda raw: raw["numeric"][0].update(divisor=float("inf")), "Infinity"),
    (lambda raw: raw["numeric"][0].update(shift=1.0), "shift"),
    (lambda raw: raw["categorical"][0].pop("encode"), "encode"),
    (lambda raw: raw.pop("label"), "label"),
    # fields with defaults were taken as their defaults: a bag read as one token, no z-score
    (lambda raw: raw["categorical"][0].pop("multi"), "multi"),
    (lambda raw: raw["categorical"][0].pop("vocab"), "vocab"),
    (lambda raw: raw["numeric"][0].pop("offset"), "offset"),
    (lambda raw: raw["label"].pop("threshold"), "threshold"),
    (lambda raw: raw.update(version=2), "version 2"),
])
def test_features_json_with_bad_content_is_a_data_error_naming_the_file_and_field(df, tmp_path, edit, field):
    feats, _ = fit(df, {"categorical": {"user": {"encode": "vocab"}}})
    raw = json.loads(feats.to_json())
    edit(raw)
    path = tmp_path / "features.json"
    path.write_text(json.dumps(raw))  # json.dumps writes NaN and Infinity tokens
    where = re.escape(str(path))
    with pytest.raises(DataError, match=rf"{where}.*{field}.*version 1|{where}.*version 1.*{field}"):
        FittedFeatures.load(str(path))
    with pytest.raises(DataError, match=field):
        FittedFeatures.from_json(json.dumps(raw))



def test_a_raw_label_statistics_prior_is_the_mean_over_all_training_rows():
    """The raw label's prior left out the rows missing the value (the label's prior counts
    them): raw labels 1, 1, 5, 5 with values a, a, -, - gave a prior of 1.0, not 3.0, and an
    unseen value was encoded with it."""
    import pyarrow as pa

    from rayload import target_stats as ts

    t = pa.table({"cat": pa.array(["a", "a", None, None]), "k": pa.array(["1", "2", "3", "4"]), "raw": pa.array([1.0, 1.0, 5.0, 5.0])})
    state = ts.finalize("cat", [ts.partial(t, "cat", "raw", ts.row_folds(t, ["k"], 0, 2))], None, 20.0, 2, ["k"], 0, source="raw")
    assert state.prior == 3.0 and state.values == ["a"] and state.counts == [2.0]


def test_fitted_features_compare_by_their_transforms_not_their_statistics():
    """`rayload compress` checks that the spec's data still gives the checkpoint's transforms:
    drift statistics (a changed unseen share) and class weights are not transforms, and made it
    refuse checkpoints whose preprocessing had not changed."""
    import copy

    from helpers import fit_features

    a, _ = fit_features(frame(600, seed=1), {})
    b = copy.deepcopy(a)
    b.numeric[0].stats["mean"] = 123.0
    b.categorical[0].stats["unseen_share"] = 0.5
    b.label.class_weights = {"0.0": 0.6, "1.0": 3.0}
    assert a == b
    b.categorical[0].vocab = list(reversed(b.categorical[0].vocab))
    assert a != b


def test_target_statistics_of_a_regression_or_raw_label_are_scaled_by_its_spread():
    """A regression label's statistic entered the model as 2 x (mean - prior) in the label's
    units (ratings: +-9; a price-like label: thousands), the raw label's as mean - prior; both
    are now divided by the training labels' standard deviation, and a binary label's stays
    2 x (mean - prior). features.json files written before keep their old scale."""
    from rayload.data.validate import Schema
    from helpers import COLUMNS

    rng = np.random.default_rng(3)
    df = frame(3000, seed=7)
    df["y"] = 5_000 + 1_000 * rng.standard_normal(len(df)) + 800 * (df.user == "u1")
    for label, out, ref in [({"column": "y", "task": "regression", "threshold": None, "domain": None}, "user__te", df.y),
                            ({"column": "y", "task": "binary", "threshold": 5_000.0, "domain": None}, "user__te_raw", df.y)]:
        schema = Schema(tuple(dict(c, required=False, separator=c.get("separator", "|")) for c in COLUMNS), label)
        good, bad = validate_table(pa.Table.from_pandas(df, preserve_index=False), schema)
        plan = FitPlan.from_spec(FeatureSpec.model_validate({"categorical": {"user": {"target_stats": True, "target_raw": True}}}), schema)
        feats = finalize(merge_stats([partial_stats(good.slice(0, 1000), plan), partial_stats(good.slice(1000), plan)]), plan)
        state = next(t for t in feats.target if out in t.outputs)
        assert state.spread == pytest.approx(ref.std(ddof=0), rel=1e-9)
        got = feats.transform_rows([{"user": "u1"}]).column(out)[0].as_py()
        i = state.values.index("u1")
        mean = (state.sums[i] + state.prior * state.smoothing) / (state.counts[i] + state.smoothing)
        assert got == pytest.approx((mean - state.prior) / ref.std(ddof=0), rel=1e-5) and 0.3 < got < 1.5
        if label["task"] == "binary":  # the label's own statistic is a rate: 2 x (mean - prior), as before, and the
            # same features.json as before the field (evaluate and compress compare a fresh fit with a checkpoint's)
            own = next(t for t in feats.target if t.source == "label")
            assert own.spread is None
            raw_json = json.loads(feats.to_json())
            for t in raw_json["target"]:
                if t["source"] == "label":
                    t.pop("spread")
            assert FittedFeatures.from_json(json.dumps(raw_json)) == feats
        raw = json.loads(feats.to_json())
        for t in raw["target"]:
            t.pop("spread")  # a features.json written before the field: the old scale
        old = FittedFeatures.from_json(json.dumps(raw)).transform_rows([{"user": "u1"}]).column(out)[0].as_py()
        assert old == pytest.approx((mean - state.prior) * (1 if out.endswith("raw") else 2), rel=1e-5)


def test_quantile_buckets_of_tied_integers_put_each_tie_on_the_side_that_evens_the_buckets():
    """Integers 1..10, equally frequent, in 5 buckets: every edge sat at its quantile value,
    putting that value's rows above it, and the buckets held 10/30/10/30/20% of the rows."""
    df = frame(4000, seed=3)
    df["age"] = np.resize(np.arange(1.0, 11.0), len(df))
    feats, good = fit(df, {"numeric": {"age": {"impute": "median", "buckets": {"quantiles": 5}}}})
    ids = feats.transform_table(good).column("age").to_numpy()
    shares = np.bincount(ids)[np.bincount(ids) > 0] / len(ids)
    np.testing.assert_allclose(shares, [0.2] * 5)
    # continuous values keep their plain quantile edges (2,000 rows: within the fit's exact sketch)
    df = frame(2000, seed=3).assign(age=np.random.default_rng(0).normal(size=2000))
    feats, good = fit(df, {"numeric": {"age": {"impute": "median", "buckets": {"quantiles": 5}}}})
    age = next(n for n in feats.numeric if n.name == "age")
    np.testing.assert_allclose(age.boundaries, np.quantile(df.age, [0.2, 0.4, 0.6, 0.8], method="inverted_cdf"))


def test_tie_balanced_bucket_edges_never_cost_a_bucket_for_no_gain():
    """Choosing the balanced edges by (largest share x buckets) gave 7 buckets where the plain
    edges gave 8 with the same largest bucket."""
    from rayload._moments import quantile_edges

    v = np.repeat(np.arange(12.0), [19, 13, 14, 15, 16, 86, 2, 48, 22, 9, 14, 19])
    edges, _ = quantile_edges(v, np.ones(len(v)), 8, np.unique(v))
    shares = np.bincount(np.searchsorted(np.asarray(edges), v, side="right")) / len(v)
    assert len(edges) + 1 == 8 and shares.max() == pytest.approx(86 / len(v))
