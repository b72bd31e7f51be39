"""Calendar parts of Unix seconds computed with numpy agree with pandas' .dt accessors."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from rayload.derived import PARTS, calendar_part, derive


@pytest.mark.parametrize("part", [p for p in PARTS if p != "days"])
def test_calendar_parts_match_pandas_including_missing_and_out_of_range(part):
    rng = np.random.default_rng(0)
    seconds = np.concatenate([rng.uniform(-3e9, 4e9, 5000), rng.integers(0, 2_000_000_000, 2000).astype(float),
                              [0.0, -0.5, 86399.999, 951782400.0, 1e12, -1e12, np.nan, np.inf, -np.inf]])
    stamps = pd.to_datetime(pd.Series(seconds), unit="s", utc=True, errors="coerce")
    accessor = {"dayofweek": "day_of_week"}.get(part, part)  # pandas' name since 2.x; dayofweek is deprecated
    expected = getattr(stamps.dt, accessor).to_numpy(dtype=np.float64, na_value=np.nan)
    got = calendar_part(seconds, part)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(got[~np.isnan(got)], expected[~np.isnan(expected)])


def test_derive_appends_parts_and_differences_with_nulls_where_inputs_are_missing():
    t = pa.table({"ts": pa.array([0.0, 951782400.0, None]), "year": pa.array([1960.0, None, 2000.0])})
    out = derive(t, {"y": {"source": "ts", "part": "year"}, "age": {"source": "ts", "part": "year", "minus": "year"}})
    assert out.column("y").to_pylist() == [1970.0, 2000.0, None]
    assert out.column("age").to_pylist() == [10.0, None, None]


def test_unknown_part_is_named():
    with pytest.raises(ValueError, match="unknown calendar part 'week'"):
        calendar_part(np.array([0.0]), "week")
