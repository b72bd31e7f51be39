"""A NaN in a floating categorical column (how pandas writes an integer ID column with gaps) is a
missing value wherever the column is read as text: fitting, preprocessing, serving, drift.
It used to become the text "nan", which the vocabulary learned as a category. No Ray."""

from types import SimpleNamespace

import numpy as np
import pyarrow as pa

from rayload import __version__
from rayload._feature_fit import FitPlan, finalize, merge_stats, partial_stats
from rayload.data.pipeline import cache_key
from rayload.data.readers import parse_jsonl
from rayload.data.validate import Schema, as_string, json_texts, validate_table
from rayload.features import MISSING_ID, OOV_ID, FittedFeatures
from rayload.hashing import as_strings, digest
from rayload.serve.drift import _text as drift_text
from rayload.spec import FeatureSpec

COLUMNS = ({"name": "item", "role": "categorical", "required": False, "separator": "|"},)
LABEL = {"column": "y", "task": "binary", "threshold": None, "domain": None}
NAN = float("nan")


def fitted(items: list, encode: str = "vocab") -> tuple[FittedFeatures, pa.Table]:
    """Features fitted on an item column of float64 with NaN (an integer ID with gaps, as numpy,
    polars or a JSONL file hold it: pa.Table.from_pandas would turn the NaN into nulls)."""
    raw = pa.table({"item": pa.array(np.array(items, dtype=np.float64)), "y": [i % 2 for i in range(len(items))]})
    assert raw.column("item").null_count == 0  # real NaNs, not nulls
    schema = Schema(COLUMNS, LABEL)
    good, bad = validate_table(raw, schema)
    assert bad.num_rows == 0
    plan = FitPlan.from_spec(FeatureSpec.model_validate({"categorical": {"item": {"encode": encode}}}), schema)
    return finalize(merge_stats([partial_stats(good, plan)]), plan), good


ITEMS = [3.0, 3.0, NAN, 7.0, NAN, 3.0, 12.5, NAN]


def test_float_nan_reads_as_missing_and_whole_numbers_without_a_decimal_point():
    arr = pa.array([3.0, NAN, None, 2.5, -1.0])
    assert as_string(arr, "item").to_pylist() == ["3", None, None, "2.5", "-1"]
    assert as_strings(arr).to_pylist() == ["3", None, None, "2.5", "-1"]
    assert as_strings(pa.array([3.0, NAN], pa.float32())).to_pylist() == ["3", None]
    assert as_string(pa.array([3.0, NAN]).dictionary_encode(), "item").to_pylist() == ["3", None]
    # A JSON column of mixed types is read as text: its NaN is missing there too.
    assert json_texts([3, "x", NAN, None, 3.0]).to_pylist() == ["3", "x", None, None, "3"]


def test_vocabulary_has_no_nan_entry_and_nan_rows_get_the_missing_id():
    feats, good = fitted(ITEMS)
    state = feats.categorical[0]
    assert "nan" not in state.vocab
    assert state.vocab == ["3", "12.5", "7"]  # most frequent first, ties by value
    assert state.stats["null_rate"] == 3 / 8
    ids = feats.transform_table(good).column("item").to_pylist()
    assert ids == [2, 2, MISSING_ID, 4, MISSING_ID, 2, 3, MISSING_ID]


def test_serving_transform_maps_a_json_nan_like_a_missing_value():
    feats, good = fitted(ITEMS)
    rows = [{"item": 3.0}, {"item": NAN}, {"item": None}, {}, {"item": 7}, {"item": "nan"}, {"item": 99.0}]
    ids = feats.transform_rows(rows).column("item").to_pylist()
    assert ids == [2, MISSING_ID, MISSING_ID, MISSING_ID, 4, OOV_ID, OOV_ID]
    # One row alone, and a NaN among values of another type (read as text), too.
    assert feats.transform_rows([{"item": NAN}]).column("item").to_pylist() == [MISSING_ID]
    assert feats.transform_rows([{"item": NAN}, {"item": "3"}, {"item": 7}]).column("item").to_pylist() == [MISSING_ID, 2, 4]
    # The preprocessed NaN rows and the served NaN get the same ID.
    assert feats.transform_table(good).column("item")[2].as_py() == feats.transform_rows([{"item": NAN}]).column("item")[0].as_py()


def test_hash_encoding_puts_nan_in_the_missing_bucket():
    feats, good = fitted(ITEMS, encode="hash")
    ids = feats.transform_table(good).column("item").to_numpy()
    missing = feats.transform_rows([{"item": None}]).column("item")[0].as_py()
    assert list(ids[np.isnan(np.array(ITEMS))]) == [missing] * 3
    assert feats.transform_rows([{"item": NAN}]).column("item")[0].as_py() == missing


def test_drift_reads_a_request_nan_as_missing():
    assert drift_text([3.0, NAN, None], "item").to_pylist() == ["3", None, None]


def test_preprocessed_shards_from_before_the_change_are_not_reused():
    spec = SimpleNamespace(model_dump=lambda **_: {"data": {}})
    inputs = SimpleNamespace(fingerprint="f")
    before = digest({"rayload": __version__, "spec": {"data": {}}, "inputs": "f", "train_rows": "seeded-order"})
    assert cache_key(spec, inputs) != before


def test_a_jsonl_nan_is_missing_in_training_data():
    data = b'{"item": 3, "y": 1}\n{"item": NaN, "y": 0}\n{"item": 3.0, "y": 1}\n{"item": null, "y": 0}\n'
    table, malformed = parse_jsonl(data, ["item", "y"], "f.jsonl")
    assert not malformed
    good, bad = validate_table(table, Schema(COLUMNS, LABEL))
    assert bad.num_rows == 0 and good.column("item").to_pylist() == ["3", None, "3", None]
