"""Validation and quarantine: typed good rows, every bad row kept with its reason."""

import json

import numpy as np
import pyarrow as pa
import pytest

from rayload.data.readers import parse_csv, parse_jsonl
from rayload.data.validate import Schema, validate_table
from rayload.errors import DataError

COLS = (
    {"name": "x", "role": "numeric", "separator": "|", "required": False},
    {"name": "c", "role": "categorical", "separator": "|", "required": True},
    {"name": "t", "role": "timestamp", "separator": "|", "required": False},
)
BINARY = Schema(COLS, {"column": "y", "task": "binary", "threshold": None, "domain": None})


def test_each_bad_kind_is_quarantined_with_its_reason():
    raw = pa.table({
        "x": ["1.5", "abc", "2", "inf", "3", "", "4", "5", "6", "7"],
        "c": ["a", "b", None, "d", "e", "f", "g", "h", "i", "j"],
        "t": ["2020-01-01T00:00:00Z", "1", "2", "3", "oops", "5", "6", "7", "8", "9"],
        "y": ["1", "0", "1", "0", "1", "0", None, "nan", "2", "true"],
    })
    good, bad = validate_table(raw, BINARY, "f.csv")
    assert good.num_rows + bad.num_rows == raw.num_rows
    reasons = bad.column("reason").to_pylist()
    assert reasons == [
        "x: cannot parse as a number", "c: missing required value", "x: infinite value",
        "t: cannot parse as a timestamp", "y: missing label", "y: label is NaN", "y: label outside {0, 1} (set data.label.threshold to binarise)",
    ]
    assert json.loads(bad.column("row")[0].as_py()) == {"x": "abc", "c": "b", "t": "1", "y": "0"}
    assert set(bad.column("source").to_pylist()) == {"f.csv"}
    # Canonical types; an empty numeric string is a missing value, not a bad row.
    assert good.schema.field("x").type == pa.float64() and good.schema.field("c").type == pa.string()
    assert good.column("x").to_pylist() == [1.5, None, 7.0]
    assert good.column("t")[0].as_py() == pytest.approx(1577836800.0)
    assert good.column("y").to_pylist() == [1.0, 0.0, 1.0]


def test_threshold_and_regression_domain():
    raw = pa.table({"x": [1.0, 2.0, 3.0], "c": ["a", "b", "c"], "t": [1, 2, 3], "y": [3.5, 4.0, 6.0]})
    good, _ = validate_table(raw, Schema(COLS, {"column": "y", "task": "binary", "threshold": 4.0, "domain": None}))
    assert good.column("y").to_pylist() == [0.0, 1.0, 1.0]
    good, bad = validate_table(raw, Schema(COLS, {"column": "y", "task": "regression", "threshold": None, "domain": (0.5, 5.0)}))
    assert good.column("y").to_pylist() == [3.5, 4.0] and bad.column("reason").to_pylist() == ["y: label outside the domain [0.5, 5.0]"]


def test_conservation_on_random_garbage():
    rng = np.random.default_rng(0)
    n = 3000
    pool = ["1", "2.5", "", "x", "nan", "-inf", None, "1e3"]
    raw = pa.table({name: [pool[i] for i in rng.integers(0, len(pool), n)] for name in ("x", "c", "t", "y")})
    good, bad = validate_table(raw, BINARY)
    assert good.num_rows + bad.num_rows == n
    assert bad.num_rows > 0 and good.num_rows > 0


def test_missing_column_and_wrong_type_are_clear_errors():
    with pytest.raises(DataError, match=r"declared column\(s\) \['t'\] not found in s.parquet"):
        validate_table(pa.table({"x": [1.0], "c": ["a"], "y": [1]}), BINARY, "s.parquet")
    with pytest.raises(DataError, match="column 'x' has type list<item: int64>; a numeric column"):
        validate_table(pa.table({"x": [[1]], "c": ["a"], "t": [1], "y": [1]}), BINARY)


def test_csv_malformed_lines_become_quarantine_rows():
    data = b"x,c,t,y\n1,a,1,1\n2,b,2\n3,c,3,0\n4,d,4,1,extra\n"
    table, malformed = parse_csv(data, ["x", "c", "t", "y"], "f.csv")
    assert table.num_rows == 2
    assert len(malformed) == 2 and "expected 4 columns, got 3" in malformed[0][1]
    with pytest.raises(DataError, match="not all in the CSV header"):
        parse_csv(data, ["x", "nope"], "f.csv")


def test_jsonl_bad_lines_and_mixed_types():
    data = b'{"x": 1, "c": "a", "t": 1, "y": 1}\nnot json\n[1,2]\n{"x": "zz", "c": 7, "t": 2, "y": 0}\n\n'
    table, malformed = parse_jsonl(data, ["x", "c", "t", "y"], "f.jsonl")
    assert [r for _, r in malformed] == ["invalid JSON on line 2: Expecting value", "line 3 is not a JSON object"]
    good, bad = validate_table(table, BINARY)
    assert good.column("c").to_pylist() == ["a"]
    assert bad.column("reason").to_pylist() == ["x: cannot parse as a number"]


def test_integers_past_2_53_and_fine_timestamps_become_the_nearest_float():
    """Arrow's safe casts raised ArrowInvalid (the whole job stopped; a request got a 500) on an
    int64 past 2**53, a uint64, nanoseconds finer than a microsecond, and dates or second
    timestamps past int64 microseconds (an unsafe cast would silently wrap those)."""
    from rayload.data.validate import validate_request

    ns = [1_600_000_000_123_456_789, -1_500, 7_000]
    raw = pa.table({
        "x": pa.array([2**60, -(2**63), 3], pa.int64()), "c": ["a", "b", "c"],
        "t": pa.array(ns, pa.timestamp("ns", "UTC")),
        "y": pa.array([2**64 - 1, 1, 0], pa.uint64()),
    })
    regression = Schema(COLS, {"column": "y", "task": "regression", "threshold": None, "domain": None})
    good, bad = validate_table(raw, regression)
    assert bad.num_rows == 0
    assert good.column("x").to_pylist() == [float(2**60), -float(2**63), 3.0]
    assert good.column("y").to_pylist() == [float(2**64 - 1), 1.0, 0.0]
    # sub-microsecond digits dropped (floored), as the same instants written as text are read
    assert good.column("t").to_pylist() == [1_600_000_000.123456, -0.000002, 0.000007]
    text = pa.table({"x": ["1", "2"], "c": ["a", "b"], "t": ["2020-09-13T12:26:40.123456789Z", "1969-12-31T23:59:59.9999985Z"], "y": ["1", "0"]})
    assert validate_table(text, BINARY)[0].column("t").to_pylist() == good.column("t").to_pylist()[:2]
    for kind, ticks in (("date32", 2**31 - 1), ("s", 10**17)):
        t = pa.array([ticks], pa.int32() if kind == "date32" else pa.int64()).cast(pa.date32() if kind == "date32" else pa.timestamp("s"))
        one = pa.table({"x": [1.0], "c": ["a"], "t": t, "y": [1]})
        assert validate_table(one, BINARY)[0].column("t").to_pylist() == [ticks * 86400.0 if kind == "date32" else 1e17]
    served = validate_request([{"x": 2**60}, {"x": 2**63 - 1}], [{"name": "x", "role": "numeric"}])
    assert served.column("x").to_pylist() == [float(2**60), float(2**63 - 1)]


def test_a_negative_zero_label_is_zero():
    """"-0" in a CSV (or -0.0 in a float column) passed the binary check and stayed -0.0: the
    class counts keyed it "-0.0", and the loss, which looks up class 0's weight under "0.0",
    trained class 0 at weight 1.0 instead of its rebalancing weight."""
    raw = pa.table({"x": ["1", "2", "3"], "c": ["a", "b", "c"], "t": ["1", "2", "3"], "y": ["-0", "1", "-0.0"]})
    good, bad = validate_table(raw, BINARY)
    assert bad.num_rows == 0
    assert [str(v) for v in good.column("y").to_pylist()] == ["0.0", "1.0", "0.0"]


def test_epoch_numbers_in_a_declared_unit_and_milliseconds_read_as_seconds():
    """A timestamp column of epoch milliseconds was read as seconds: dates tens of thousands of
    years away (calendar parts NaN, `days` a thousand times too large), without a word. Now a
    column says its unit, and a number past the year 5000 for its unit is quarantined with the
    unit that would read it; the rows before it are kept."""
    from rayload.data.validate import validate_request
    from rayload.spec import JobSpec

    stamp = {"name": "t", "role": "timestamp", "separator": "|", "required": False}
    ms = Schema((COLS[0], COLS[1], dict(stamp, unit="ms")), BINARY.label)
    raw = pa.table({"x": [1.0, 2.0, 3.0], "c": ["a", "b", "c"], "t": [1_700_000_000_123, 1_700_000_000_000, 1_700_000_000_123_000],
                    "y": [1, 0, 1]})
    good, bad = validate_table(raw, ms)
    assert good.column("t").to_pylist() == [1_700_000_000.123, 1_700_000_000.0]
    assert bad.column("reason").to_pylist() == [
        "t: a timestamp more than 3,000 years from 1970 read as epoch milliseconds; if the column counts microseconds, set unit: us on its entry in data.columns"]
    # texts: numbers in the unit, dates in their own
    text = pa.table({"x": ["1", "2"], "c": ["a", "b"], "t": ["1700000000123", "2020-01-01T00:00:00Z"], "y": ["1", "0"]})
    assert validate_table(text, ms)[0].column("t").to_pylist() == [1_700_000_000.123, 1_577_836_800.0]
    # no unit: seconds, and milliseconds are refused with the fix
    good, bad = validate_table(raw.slice(0, 2), BINARY)
    assert good.num_rows == 0 and bad.num_rows == 2
    assert bad.column("reason")[0].as_py().endswith("read as epoch seconds; if the column counts milliseconds, set unit: ms on its entry in data.columns")
    with pytest.raises(DataError, match="request row 1: t: a timestamp more than 3,000 years from 1970 read as epoch seconds"):
        validate_request([{"t": 1_700_000_000}, {"t": 1_700_000_000_000}], [stamp], {"t"})
    assert validate_request([{"t": 1_700_000_000_000}], [dict(stamp, unit="ms")], {"t"}).column("t").to_pylist() == [1_700_000_000.0]
    # each far row gets the unit that reads it, not its neighbours'; a number past every unit gets none
    good, bad = validate_table(pa.table({"x": [1.0] * 3, "c": ["a"] * 3, "t": [1.6e12, 1.6e18, -1.6e30], "y": [1, 0, 1]}), BINARY)
    assert [r.split("; ")[-1] for r in bad.column("reason").to_pylist()] == [
        "if the column counts milliseconds, set unit: ms on its entry in data.columns",
        "if the column counts nanoseconds, set unit: ns on its entry in data.columns",
        "t: a timestamp more than 3,000 years from 1970 read as epoch seconds"]
    # numbers in ns are floored to whole microseconds, as the same instant typed or as text is
    ns = dict(stamp, unit="ns")
    typed = validate_request([{"t": "2020-09-13T12:26:40.123456789Z"}], [stamp], {"t"}).column("t").to_pylist()
    assert validate_request([{"t": 1_600_000_000_123_456_789}], [ns], {"t"}).column("t").to_pylist() == typed
    assert validate_request([{"t": "1600000000123456789"}], [ns], {"t"}).column("t").to_pylist() == typed
    # just under a microsecond: floored in integers (through float64 it rounded up, 1 us off the typed stamp)
    typed = validate_request([{"t": "2020-09-13T12:26:40.123456999Z"}], [stamp], {"t"}).column("t").to_pylist()
    assert validate_request([{"t": 1_600_000_000_123_456_999}], [ns], {"t"}).column("t").to_pylist() == typed
    assert validate_request([{"t": "1600000000123456999"}], [ns], {"t"}).column("t").to_pylist() == typed
    # a date text far away is a date, not epoch seconds to be told a unit: as a typed stamp, accepted
    assert validate_request([{"t": "9999-12-31"}], [stamp], {"t"}).column("t").to_pylist() == [253402214400.0]
    # the spec: unit only on a timestamp column, and left out of the schema where unset
    base = {"name": "j", "data": {"source": {"kind": "csv", "path": "x.csv"}, "label": {"column": "y"},
                                  "columns": [{"name": "p", "role": "numeric", "unit": "ms"}, {"name": "y", "role": "label"}]}}
    from rayload._spec_checks import check_job

    issues = check_job(JobSpec.model_validate(base))
    assert [i.path for i in issues] == ["data.columns[0].unit"] and "needs role: timestamp" in issues[0].message
    base["data"]["columns"][0] = {"name": "p", "role": "timestamp"}
    assert "unit" not in Schema.from_spec(JobSpec.model_validate(base).data).columns[0]
    base["data"]["columns"][0]["unit"] = "ms"
    assert Schema.from_spec(JobSpec.model_validate(base).data).columns[0]["unit"] == "ms"
