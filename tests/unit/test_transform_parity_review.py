"""Transform review fixes (2026-11-27): a Parquet decimal is read as the number its text says
(Arrow's cast gave 0.35000000000000003, and a bucket edge on it split training rows from
requests of 0.35); a timestamp far from today parses whatever its neighbours are; target
statistics keep values that differ only by a trailing NUL apart."""

import logging
from decimal import Decimal

import pandas as pd
import pyarrow as pa

from rayload._feature_fit import FitPlan, finalize, merge_stats, partial_stats
from rayload.data.validate import Schema, _parse_numbers, validate_table
from rayload.spec import FeatureSpec, SplitSpec

LABEL = {"column": "y", "task": "binary", "threshold": None, "domain": None}


def _column(name, role):
    return {"name": name, "role": role, "required": False, "separator": "|"}


def test_a_decimal_column_reads_as_its_text_and_buckets_as_a_request_does():
    schema = Schema((_column("price", "numeric"),), LABEL)
    prices = [Decimal(f"{c / 100:.2f}") for c in range(0, 10_000)]
    table = pa.table({"price": pa.array(prices, pa.decimal128(10, 2)), "y": [i % 2 for i in range(len(prices))]})
    good, _ = validate_table(table, schema)
    assert good.column("price").to_pylist() == [float(str(p)) for p in prices]  # 1,327 of them were one ulp off
    values = [Decimal(p) for p in ["0.10", "0.35", "0.70", "0.70", "1.20", "2.50", "0.35", "0.70"] * 5]  # a frequent 0.35: an edge
    good, _ = validate_table(pa.table({"price": pa.array(values, pa.decimal128(10, 2)), "y": [i % 2 for i in range(40)]}), schema)
    plan = FitPlan.from_spec(FeatureSpec.model_validate({"numeric": {"price": {"buckets": {"quantiles": 4}}}}), schema)
    fitted = finalize(merge_stats([partial_stats(good, plan)]), plan)
    offline = fitted.transform_table(good).column("price").to_pylist()
    for i, value in enumerate(values[:6]):
        for sent in (float(value), str(value)):
            assert fitted.transform_rows([{"price": sent}]).column("price").to_pylist() == [offline[i]], (value, sent)


def test_a_float32_column_reads_as_its_shortest_text_in_numeric_and_categorical_roles():
    """A float32 was widened exactly (0.35f is 0.3499999940395355): bucket edges were fitted on
    values no request sends, while the same value in a categorical float32 column reads as
    "0.35", so no JSON spelling of the row gave the offline features."""
    schema = Schema((_column("x", "numeric"), _column("c", "categorical")), LABEL)
    values = [0.35 if i % 2 else 1.0 for i in range(40)] + [0.1, 0.7] * 5
    table = pa.table({"x": pa.array(values, pa.float32()), "c": pa.array(values, pa.float32()), "y": [i % 3 == 0 for i in range(50)]})
    good, _ = validate_table(table, schema)
    assert good.column("x").to_pylist()[:2] == [1.0, 0.35]
    plan = FitPlan.from_spec(FeatureSpec.model_validate({"numeric": {"x": {"buckets": {"quantiles": 4}}},
                                                         "categorical": {"c": {"encode": "vocab"}}}), schema)
    fitted = finalize(merge_stats([partial_stats(good, plan)]), plan)
    offline = fitted.transform_table(good).select(["x", "c"]).to_pylist()
    for i in range(4):
        assert fitted.transform_rows([{"x": values[i], "c": values[i]}]).select(["x", "c"]).to_pylist() == [offline[i]], values[i]
    # a float32 timestamp keeps the instant it stores (its shortest text, 1.7000036e9, is 16 s later)
    stamps = Schema((_column("t", "timestamp"), _column("x", "numeric")), LABEL)
    good, _ = validate_table(pa.table({"t": pa.array([1700003584.0], pa.float32()), "x": [1.0], "y": [1]}), stamps)
    assert good.column("t").to_pylist() == [1700003584.0]


def test_a_far_timestamp_parses_beside_a_nanosecond_one():
    for far in ("2300-01-01T00:00:00Z", "1600-01-01T00:00:00Z"):
        alone = _parse_numbers(pd.Series([far], dtype=object), timestamp=True)
        beside = _parse_numbers(pd.Series([far, "2020-09-13T12:26:40.123456789Z"], dtype=object), timestamp=True)
        assert alone.notna().all() and beside.tolist()[0] == alone.tolist()[0] and beside.notna().all()
    assert _parse_numbers(pd.Series(["not a date", "2020-01-01T00:00:00Z"], dtype=object), timestamp=True).isna().tolist() == [True, False]


def test_target_statistics_keep_values_that_differ_by_a_trailing_nul_apart():
    logging.disable(logging.WARNING)
    try:
        schema = Schema((_column("c", "categorical"), _column("k", "numeric")), LABEL)
        raw = pa.table({"c": ["a"] * 10 + ["a\x00"] * 10, "k": list(range(20)), "y": [0] * 10 + [1] * 10})
        good, _ = validate_table(raw, schema)
        plan = FitPlan.from_spec(FeatureSpec.model_validate({"categorical": {"c": {"target_stats": True, "smoothing": 0}}}),
                                 schema, SplitSpec(key=["k"]))
        fitted = finalize(merge_stats([partial_stats(good, plan)]), plan)
    finally:
        logging.disable(logging.NOTSET)
    assert fitted.target[0].values == ["a", "a\x00"] and fitted.target[0].counts == [10.0, 10.0]
    assert fitted.transform_rows([{"c": "a", "k": 0}, {"c": "a\x00", "k": 0}]).column("c__te").to_pylist() == [-1.0, 1.0]


def _fit(table, schema, spec, batches):
    plan = FitPlan.from_spec(FeatureSpec.model_validate(spec), schema, SplitSpec(key=list(table.column_names)))
    good, _ = validate_table(table, schema)
    return finalize(merge_stats([partial_stats(good.slice(a, b - a), plan) for a, b in batches]), plan)


def test_a_vocabulary_tie_between_values_that_differ_by_a_trailing_nul_does_not_follow_batch_order():
    schema = Schema((_column("c", "categorical"),), LABEL)
    table = pa.table({"c": ["a\x00", "a", "a", "a\x00", "b"], "y": [0, 1, 0, 1, 0]})
    vocabs = [_fit(table, schema, {"categorical": {"c": cfg}}, batches).categorical[0].vocab
              for cfg in ({}, {"top_k": 1}) for batches in ([(0, 5)], [(0, 2), (2, 5)], [(2, 5), (0, 2)])]
    assert vocabs[0] == vocabs[1] == vocabs[2] and vocabs[3] == vocabs[4] == vocabs[5] and len(vocabs[3]) < len(vocabs[0])


def test_a_real_but_small_relative_spread_is_z_scored():
    """Epoch nanoseconds 0.4 ms apart (std 9e5 at 1.7e18) were taken for rounding noise and left
    unscaled: their z-scores were near 1e6."""
    import numpy as np

    schema = Schema((_column("t", "numeric"),), LABEL)
    table = pa.table({"t": (1.7e18 + np.arange(8) * 4e5).tolist(), "y": [0, 1] * 4})
    fitted = _fit(table, schema, {"numeric": {"t": {"scale": "zscore"}}}, [(0, 8)])
    out = np.asarray(fitted.transform_rows([{"t": v} for v in table.column("t").to_pylist()]).column("t").to_pylist())
    assert not fitted.numeric[0].constant and np.abs(out).max() < 2.0


def test_a_spread_of_a_few_dozen_ulps_of_large_values_is_z_scored():
    """Epoch nanoseconds 5 us apart at 1.7e18 (about 20 ulps; std 8.5e3) were still taken for rounding
    noise: the divisor stayed 1 and the outputs were raw offsets up to 12,544. A std of 1 or more
    cannot blow noise up, so it is divided by."""
    import numpy as np

    schema = Schema((_column("t", "numeric"),), LABEL)
    table = pa.table({"t": (1.7e18 + np.arange(6) * 5000.0).tolist(), "y": [0, 1] * 3})
    fitted = _fit(table, schema, {"numeric": {"t": {"scale": "zscore"}}}, [(0, 6)])
    out = np.asarray(fitted.transform_rows([{"t": v} for v in table.column("t").to_pylist()]).column("t").to_pylist())
    assert not fitted.numeric[0].constant and 1.0 < np.abs(out).max() < 2.0
