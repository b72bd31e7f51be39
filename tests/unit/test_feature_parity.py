"""A categorical value's text (and so its ID, bucket, cross, one-hot slot and target statistics)
depends on that value alone: not on the other rows of its request or file, not on whether a
float column or a JSON integer carried it, and not on whether the table was validated. Offline
(JSONL file) and serving (requests of any size) must give identical outputs, and the fitted
statistics must not depend on how the training rows were cut into blocks."""

import json
import logging
import math
import random

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from helpers import COLUMNS, frame
from rayload._feature_fit import FitPlan, finalize, merge_stats, partial_stats
from rayload.data.readers import parse_jsonl
from rayload.data.validate import Schema, as_string, json_texts, python_array, validate_table
from rayload.features import OOV_ID, FittedFeatures
from rayload.hashing import value_text
from rayload.spec import FeatureSpec, SplitSpec

LABEL = {"column": "y", "task": "binary", "threshold": None, "domain": None}


def schema_of(columns) -> Schema:
    return Schema(tuple(dict(c, required=False, separator=c.get("separator", "|")) for c in columns), LABEL)


def read_jsonl(rows: list[dict], schema: Schema) -> pa.Table:
    """The offline path: a JSONL file, parsed and validated as preprocessing reads it."""
    table, malformed = parse_jsonl("\n".join(json.dumps(r) for r in rows).encode(), schema.names, "t.jsonl")
    good, bad = validate_table(table, schema)
    assert not malformed and bad.num_rows == 0, bad.to_pylist()[:3]
    return good


def fit_good(good: pa.Table, schema: Schema, features: dict, chunks: int = 1, split=None) -> FittedFeatures:
    plan = FitPlan.from_spec(FeatureSpec.model_validate(features), schema, split)
    b = np.linspace(0, good.num_rows, chunks + 1).astype(int)
    return finalize(merge_stats([partial_stats(good.slice(x, y - x), plan) for x, y in zip(b[:-1], b[1:])]), plan)


def same(a: pa.Table, b: pa.Table) -> list[str]:
    """The columns whose values differ (NaN equal to NaN)."""
    def eq(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
    return [n for n in a.column_names if not all(eq(x, y) for x, y in zip(a.column(n).to_pylist(), b.column(n).to_pylist()))]


# ------------------------------------------------------------------ one value, one text

PAIR_COLS = [{"name": "c", "role": "categorical"}, {"name": "h", "role": "categorical"}, {"name": "x", "role": "numeric"}]
# x on a log scale: the pairs put IDs up to 2**60 into it, which a z-score over 0..6 would take
# past EXTREME_SCALED (a request refused, tested in test_feature_edges.py)
PAIR_FEATURES = {"numeric": {"x": {"log": True}},
                 "categorical": {"c": {"encode": "vocab", "target_stats": True}, "h": {"encode": "hash", "buckets": 1009}},
                 "crosses": [{"columns": ["c", "h"], "buckets": 1013}]}
PAIR_TEXTS = ["true", "1", "123456789012", "2.5", "0.5", "9007199254740993", "9007199254740992", "a"]


@pytest.fixture(scope="module")
def pair_features() -> FittedFeatures:
    schema = schema_of(PAIR_COLS)
    rows = [{"c": v, "h": v, "x": i % 7, "y": i % 2} for i, v in enumerate(PAIR_TEXTS * 5)]
    return fit_good(read_jsonl(rows, schema), schema, PAIR_FEATURES, split=SplitSpec(key=["x"]))


@pytest.mark.parametrize("a, b", [(2.5, True), (123456789012, 2.5), (2**53 + 1, 0.5), (True, 1), (0.5, 2**53 + 1),
                                  (1, 2.5), (False, 0.0), ("x", 2.5), (2**60, 0.5), (-0.0, 7)])
def test_rows_transformed_together_equal_each_row_alone(pair_features, a, b):
    rows = [{"c": v, "h": v, "x": None if isinstance(v, str) else v} for v in (a, b)]
    together = pair_features.transform_rows(rows)
    alone = pa.concat_tables([pair_features.transform_rows([r]) for r in rows])
    assert same(together, alone) == []


def test_mixed_python_types_keep_each_values_own_text():
    assert as_string(python_array([2.5, True]), "c").to_pylist() == ["2.5", "true"]
    assert as_string(python_array([123456789012, 2.5]), "c").to_pylist() == ["123456789012", "2.5"]
    assert as_string(python_array([2**53 + 1, 0.5, None]), "c").to_pylist() == ["9007199254740993", "0.5", None]
    assert python_array([1, 2, None]).type == pa.int64() and python_array([1.5, None]).type == pa.float64()
    assert python_array([3, 2.5]).type == pa.float64()  # a numeric column's usual mix stays typed: 3.0 is "3" too


def test_known_values_keep_their_ids_beside_floats(pair_features):
    vocab = pair_features.categorical[0].vocab
    ids = pair_features.transform_rows([{"c": True}, {"c": 2.5}, {"c": 2**53 + 1}]).column("c").to_pylist()
    assert ids == [vocab.index("true") + 2, vocab.index("2.5") + 2, vocab.index("9007199254740993") + 2]


# ------------------------------------------------------------------ integral floats

def test_integral_floats_get_integer_text():
    values = [12345678901.0, 1e10, -0.0, 0.0, 42.0, 2.5, -1e-7, 1e300, float("nan"), None, -9.0e15]
    want = ["12345678901", "10000000000", "0", "0", "42", "2.5", "-1e-7", "1e+300", None, None, "-9000000000000000"]
    assert value_text(pa.array(values, pa.float64())).to_pylist() == want
    assert json_texts(values).to_pylist() == want
    assert json_texts([3.0, "x", True, 10**22]).to_pylist() == ["3", "x", "true", "10000000000000000000000"]
    assert value_text(pa.array([3.0, 0.1, 1e10], pa.float32())).to_pylist() == ["3", "0.1", "10000000000"]


@pytest.mark.parametrize("chunked", [False, True])
def test_integer_ids_in_a_float_column_get_the_ids_of_json_integers(chunked):
    """A pandas integer column with a gap is float64: its 11-digit IDs were "1.2345678901e+10"
    offline and "12345678901" in a request, so every one was out of vocabulary at serving."""
    schema = schema_of([{"name": "user", "role": "categorical"}, {"name": "item", "role": "categorical"}])
    df = pd.DataFrame({"user": [12345678901, 12345678901, 42, None, 1e10], "item": [7, 7, 8, 9, 9], "y": [1, 0, 1, 0, 1]})
    assert df.user.dtype == np.float64
    good, _ = validate_table(pa.Table.from_pandas(df, preserve_index=False), schema)
    feats = fit_good(good, schema, {"categorical": {"user": {"encode": "vocab"}, "item": {"encode": "hash", "buckets": 101}},
                                    "crosses": [{"columns": ["user", "item"], "buckets": 103}]}, chunks=2 if chunked else 1)
    assert sorted(feats.categorical[0].vocab) == ["10000000000", "12345678901", "42"]
    offline = feats.transform_table(good)
    served = feats.transform_rows([{"user": u, "item": i} for u, i in [(12345678901, 7), (12345678901, 7), (42, 8), (None, 9), (10**10, 9)]])
    assert same(offline.drop(["label"]), served) == []
    assert OOV_ID not in served.column("user").to_pylist()


def test_csv_integral_float_text_is_kept_verbatim_and_warned_about(caplog):
    """Text is the user's data: "12345.0" in a CSV stays "12345.0" (a category "1.0" may differ
    from "1"), but a vocabulary made mostly of such text is what a float ID column written by
    pandas looks like, and requests sending the integer would be out of vocabulary: warned."""
    schema = schema_of([{"name": "user", "role": "categorical"}])
    table = pa.table({"user": ["12345.0", "12345.0", "7.0", None, "8.0"], "y": [1.0, 0.0, 1.0, 0.0, 1.0]})
    good, _ = validate_table(table, schema)
    with caplog.at_level(logging.WARNING, logger="rayload"):
        feats = fit_good(good, schema, {"categorical": {"user": {"encode": "vocab"}}})
    assert feats.categorical[0].vocab == ["12345.0", "7.0", "8.0"]
    assert any("user" in r.getMessage() and "12345.0" in r.getMessage() for r in caplog.records)
    assert feats.transform_rows([{"user": "12345.0"}]).column("user").to_pylist() == [2]


def test_csv_boolean_text_is_kept_verbatim_and_warned_about(caplog):
    """pandas' to_csv writes booleans as True/False: the vocabulary was ["True", "False"] and a
    request's JSON true ("true") went out of vocabulary without a word."""
    schema = schema_of([{"name": "flag", "role": "categorical"}])
    good, _ = validate_table(pa.table({"flag": ["True", "False", "True", None], "y": [1.0, 0.0, 1.0, 0.0]}), schema)
    with caplog.at_level(logging.WARNING, logger="rayload"):
        feats = fit_good(good, schema, {"categorical": {"flag": {"encode": "vocab"}}})
    assert feats.categorical[0].vocab == ["True", "False"]
    assert any("flag" in r.getMessage() and "'True' and 'False'" in r.getMessage() and "JSON true" in r.getMessage()
               for r in caplog.records)
    assert feats.transform_rows([{"flag": "True"}, {"flag": True}]).column("flag").to_pylist() == [2, OOV_ID]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rayload"):  # JSONL / Parquet booleans read as "true": nothing to warn of
        fit_good(validate_table(pa.table({"flag": [True, False, True], "y": [1.0, 0.0, 1.0]}), schema)[0], schema,
                 {"categorical": {"flag": {"encode": "vocab"}}})
    assert not [r for r in caplog.records if "boolean" in r.getMessage()]


# ------------------------------------------------------------------ raw tables, block layouts

@pytest.mark.parametrize("rows", [40, 1500], ids=["dict-lookup", "arrow-lookup"])
def test_raw_integer_ids_hash_and_cross_as_their_text(rows):
    """An int64 ID column of a raw (unvalidated) table failed to hash (ArrowInvalid) where a
    vocabulary encoding already read its text."""
    df = frame(1500, seed=1)
    schema = schema_of(COLUMNS)
    good, _ = validate_table(pa.Table.from_pandas(df, preserve_index=False), schema)
    feats = fit_good(good, schema, {"categorical": {"item": {"encode": "hash", "buckets": 97}},
                                    "crosses": [{"columns": ["user", "item"], "buckets": 101}]})
    raw = pa.Table.from_pandas(df.drop(columns=["y"]), preserve_index=False).slice(0, rows)
    assert pa.types.is_integer(raw.schema.field("item").type)
    want = feats.transform_table(good.slice(0, rows))
    got = feats.transform_table(raw)
    for name in ("item", "x_user_item"):
        assert got.column(name).to_pylist() == want.column(name).to_pylist(), name


@pytest.mark.parametrize("center, spread", [(1e15, 1.0), (-1e12, 1e-3), (1e9, 1.0), (0.0, 1.0), (1e200, 1e190)])
def test_moments_of_sorted_blocks_of_a_large_low_spread_column_are_exact(center, spread):
    """Blocks of sorted values (a time-sorted file) of 1e15 + N(0, 1): each merge rounded the
    running mean to 1e15's ulp (0.125), and the std came out 10% off (62% for -1e12 + U(0, 1e-3))."""
    from fractions import Fraction

    from rayload._moments import _merge_moments, _moments, _std, _weighted_moments

    x = np.sort(center + np.random.default_rng(1).normal(0, spread, 3000))
    exact = [Fraction(float(v)) for v in x]
    mean = sum(exact) / len(exact)
    std = float(sum((v - mean) ** 2 for v in exact) / len(exact) / Fraction(spread) ** 2) ** 0.5 * spread
    acc = _moments(x[:0])
    for block in np.array_split(x, 37):
        acc = _merge_moments(acc, _moments(block))
    assert _std(acc) == pytest.approx(std, rel=1e-9) and acc[1] == pytest.approx(float(mean), rel=1e-15, abs=spread * 1e-9)
    weighted = _merge_moments(_weighted_moments(x[:1500], np.ones(1500)), _weighted_moments(x[1500:], np.ones(1500)))
    assert _std(weighted) == pytest.approx(std, rel=1e-9)


# ------------------------------------------------------------------ differential fuzz

FUZZ_COLS = [{"name": "c", "role": "categorical"}, {"name": "h", "role": "categorical"},
             {"name": "o", "role": "categorical"}, {"name": "m", "role": "multi_categorical", "separator": "|"},
             {"name": "mh", "role": "multi_categorical", "separator": "|"},
             {"name": "x", "role": "numeric"}, {"name": "xl", "role": "numeric"}, {"name": "xb", "role": "numeric"},
             {"name": "ts", "role": "timestamp"}]
FUZZ_FEATURES = {
    "derived": {"hr": {"source": "ts", "part": "hour"}},
    "numeric": {"x": {"impute": "median"}, "xl": {"log": True, "scale": "minmax", "clip": {"quantiles": [0.05, 0.95]}},
                "xb": {"buckets": {"quantiles": 8}, "impute": "mean"}},
    "categorical": {"c": {"encode": "vocab", "target_stats": True, "smoothing": 2}, "h": {"encode": "hash", "buckets": 97},
                    "o": {"encode": "onehot"}, "m": {"encode": "vocab"}, "mh": {"encode": "hash", "buckets": 31, "max_bag": 2}},
    "crosses": [{"columns": ["c", "h"], "buckets": 101}]}
BIG = [123456789012, 2**53 + 1, 10**10, 2**63 - 1]
CAT = ["a", "b", "", " a", "1", "true", "2.5", None, 0, 1, 2, 1.0, 2.5, -0.0, True, False] + BIG + [float(b) for b in BIG[:3]]
BAG = ["x|y", "y", "x| z ", "", None, "q|x|y|z", "|", 1, 2.0, True]
NUM = [0, 1, -3, 2.5, -0.5, 1e6, "1", " 2 ", "true", True, False, None, "", "nan", 2**53 + 1, 2**63 - 1, 10**22, 1e300, -1e300]
ONEHOT = ["a", "b", None, "zz", 1, 1.0, True, 2.5]
TS = [1_600_000_000, 1_600_003_600.5, "2021-03-04T05:06:07Z", "1600007200"]


def _fuzz_row(r: random.Random) -> dict:
    d = {"c": r.choice(CAT), "h": r.choice(CAT), "o": r.choice(ONEHOT), "m": r.choice(BAG), "mh": r.choice(BAG),
         "x": r.choice(NUM), "xl": r.choice(NUM), "xb": r.choice(NUM), "ts": r.choice(TS)}
    for k in list(d):
        if r.random() < 0.1:
            del d[k]  # an absent key is a missing value
    d.setdefault("ts", TS[0])
    d["y"] = int(r.random() < 0.4)
    return d


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_offline_file_and_requests_of_one_and_three_rows_agree(seed):
    r = random.Random(seed)
    schema = schema_of(FUZZ_COLS)
    feats = fit_good(read_jsonl([_fuzz_row(r) for _ in range(300)], schema), schema, FUZZ_FEATURES, chunks=3,
                     split=SplitSpec(key=["c", "h", "x"]))
    feats = FittedFeatures.from_json(feats.to_json())
    test = [_fuzz_row(r) for _ in range(150)]
    offline = feats.transform_table(read_jsonl(test, schema)).drop(["label"])
    requests = [{k: v for k, v in t.items() if k != "y"} for t in test]
    for size in (1, 3):
        served = pa.concat_tables([feats.transform_rows(requests[i:i + size]) for i in range(0, len(requests), size)])
        assert served.column_names == offline.column_names
        assert same(offline, served) == [], f"requests of {size} row(s)"
