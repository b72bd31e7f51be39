"""Row validation: typed good rows out, every bad row kept with the reason it was refused.

Canonical types after validation: numeric and timestamp columns float64, categorical, id and
multi_categorical columns string, the label float64 (0/1 for binary tasks). A value that
cannot become its type sends the whole row to quarantine; `good + bad == input` always.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import DataError
from ..hashing import as_array, kept_lists, value_text
from .quarantine import quarantine_rows
from .json_values import bag_values, json_texts, python_array, read_values  # noqa: F401  (readers and serving name them here)

RAW_LABEL = "__label_raw"  # the label before thresholding (target statistics may use it)
_STRING_ROLES = ("categorical", "multi_categorical", "id")


@dataclass(frozen=True)
class Schema:
    """The declared columns and label, in plain data so it pickles small into Ray tasks."""

    columns: tuple[dict, ...]  # name, role, separator, required
    label: dict  # column, task, threshold, domain

    @classmethod
    def from_spec(cls, data_spec) -> "Schema":
        # unit only where it is set: a schema without it (features.json, cache keys) reads as before
        cols = tuple(c.model_dump(exclude={"unit"} if c.unit is None else set())
                     for c in data_spec.resolved_columns() if c.role != "label")
        return cls(cols, data_spec.resolved_label().model_dump())

    @property
    def bags(self) -> dict[str, str]:
        """multi_categorical column -> its separator."""
        return {c["name"]: c.get("separator") or "|" for c in self.columns if c["role"] == "multi_categorical"}

    @property
    def names(self) -> list[str]:
        return [c["name"] for c in self.columns] + [self.label["column"]]


class _Reasons:
    """First reason per row; later checks never overwrite an earlier one."""

    def __init__(self, n: int):
        self.values = np.full(n, None, dtype=object)

    def add(self, mask: np.ndarray, reason: str) -> None:
        self.values[mask & (self.values == None)] = reason  # noqa: E711 (elementwise)

    @property
    def bad(self) -> np.ndarray:
        return self.values != None  # noqa: E711


def validate_table(table: pa.Table, schema: Schema, source: str = "") -> tuple[pa.Table, pa.Table]:
    """Split a raw batch into (good rows with canonical types, quarantine rows)."""
    checked, good_mask, reasons = check_table(table, schema, source)
    idx = np.flatnonzero(reasons.bad)
    return checked.filter(pa.array(good_mask)), quarantine_rows(table.take(pa.array(idx)).to_pylist(), list(reasons.values[idx]), source)


def check_table(table: pa.Table, schema: Schema, source: str = "") -> tuple[pa.Table, np.ndarray, "_Reasons"]:
    """Every row of a raw batch in canonical types, which rows are good, and why the others are
    not: what `validate_table` splits, for a reader that needs the raw rows beside the good ones
    (the A/B simulator replays raw test rows, split as the training rows were)."""
    _require_columns(table, schema, source)
    reasons = _Reasons(table.num_rows)
    out = {}
    for col in schema.columns:
        out[col["name"]] = _validate_column(table.column(col["name"]), col, reasons)
    out[schema.label["column"]], raw = _validate_label(table.column(schema.label["column"]), schema.label, reasons)
    out[RAW_LABEL] = raw
    return pa.table(out), ~reasons.bad, reasons


def _require_columns(table: pa.Table, schema: Schema, source: str) -> None:
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        where = f" in {source}" if source else ""
        raise DataError(
            f"declared column(s) {missing} not found{where}; the data has columns {table.column_names}. "
            "Fix data.columns / data.label.column or the data."
        )
    if twice := sorted({n for n in schema.names if table.column_names.count(n) > 1}):  # Arrow's KeyError named no file
        where = f"{source}: " if source else ""
        raise DataError(f"{where}the data names the column(s) {twice} more than once; which one is meant is not clear")


def _validate_column(column, col: dict, reasons: _Reasons) -> pa.Array:
    name, role = col["name"], col["role"]
    if role == "multi_categorical" and _is_list(as_array(column).type):
        values = join_bag(column, col.get("separator") or "|", name)
    elif role in _STRING_ROLES:
        values = as_string(column, name)
    else:  # numeric, timestamp
        values = _as_float(column, name, reasons, timestamp=role == "timestamp", unit=col.get("unit"))
        values = pc.if_else(pc.is_nan(values), pa.scalar(None, pa.float64()), values)  # NaN = missing
        reasons.add(np.isinf(values.to_numpy(zero_copy_only=False)), f"{name}: infinite value")
    nulls = values.is_null().to_numpy(zero_copy_only=False)
    if col.get("required") or role in ("id", "timestamp"):
        reasons.add(nulls, f"{name}: missing required value")
    return values


def as_string(column, name: str) -> pa.Array:
    """A categorical column as text, the way fitting, serving, drift and retraining all read it
    (booleans as "true"/"false", whole-number floats without ".0", NaN and "" as missing)."""
    arr = as_array(column)
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.cast(t.value_type), t.value_type
    if pa.types.is_large_string(t) or pa.types.is_string(t):
        arr = arr.cast(pa.string())
        return pc.if_else(pc.equal(arr, ""), pa.scalar(None, pa.string()), arr)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t):
        return value_text(arr)
    raise DataError(f"column '{name}' has type {t}; a categorical column must hold strings, integers or booleans "
                    "(lists: declare it multi_categorical)")


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def join_bag(column, separator: str, name: str) -> pa.Array:
    """A multi_categorical column given as lists (a Parquet list column, JSON arrays) in its
    text form: each element's text as a categorical value's (`as_string`: 3 -> "3", True ->
    "true"), missing and empty elements dropped, the rest joined by the column's separator;
    an empty list is missing, as "" is. An element holding the separator is split by the
    transform as the text form would be: ["a|b"] is the tokens a and b with separator "|"."""
    arr = as_array(column)
    if pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        arr = arr.cast(pa.list_(arr.type.value_type))
    flat = arr.flatten()
    if _is_list(flat.type):
        raise DataError(f"column '{name}' holds lists of lists; a multi_categorical value is a list of values or a text")
    texts = as_string(flat, name) if len(flat) else pa.array([], pa.string())
    keep = texts.is_valid().to_numpy(zero_copy_only=False)
    # offsets into the flattened values: a null list has none there, even where Arrow keeps values behind it
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    lists = kept_lists(np.concatenate([[0], np.cumsum(lengths)]), texts, keep)
    joined = pc.binary_join(lists, separator)
    return pc.if_else(pc.equal(joined, ""), pa.scalar(None, pa.string()), joined)


def _as_float(column, name: str, reasons: _Reasons, timestamp: bool = False, unit: str | None = None) -> pa.Array:
    arr = as_array(column)
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.cast(t.value_type), t.value_type
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return _seconds(arr)
    if not timestamp:
        return _numbers(arr, t, name, reasons, None)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        numeric: list = []  # which texts were numbers: a date text ("9999-12-31") has no unit to get wrong
        return _epoch_seconds(_texts(arr, name, reasons, unit or "s", numeric), name, reasons, unit, numeric[0])
    return _epoch_seconds(_numbers(arr, t, name, reasons, unit or "s"), name, reasons, unit)


# Epoch numbers past this many seconds from 1970 (the year 5138, or 1200 BC) are not in their
# unit: read as seconds, epoch milliseconds became dates tens of thousands of years away
# (calendar parts NaN, "days" a thousand times too large)
_LATEST_SECONDS = 1e11


def _epoch_seconds(seconds: pa.Array, name: str, reasons: _Reasons, unit: str | None,
                   numeric: np.ndarray | None = None) -> pa.Array:
    """A timestamp column's epoch seconds, each one that was a number (`numeric`: which were;
    None: all) too far from 1970 for its unit refused with the unit that would read that row
    (the coarsest finer unit that brings it back)."""
    size = np.abs(np.nan_to_num(seconds.to_numpy(zero_copy_only=False), nan=0.0, posinf=0.0, neginf=0.0))
    far = size > _LATEST_SECONDS
    if numeric is not None:
        far &= numeric
    if far.any():
        per = _TICKS_PER_SECOND[unit or "s"]
        read = f"{name}: a timestamp more than 3,000 years from 1970 read as epoch {_UNIT_NAMES[unit or 's']}"
        for finer, ticks in _TICKS_PER_SECOND.items():  # coarse to fine: the first that fits is the unit
            if ticks > per:
                reasons.add(far & (size * per / ticks <= _LATEST_SECONDS),
                            f"{read}; if the column counts {_UNIT_NAMES[finer]}, set unit: {finer} on its entry in data.columns")
        reasons.add(far, read)
    return seconds


def _numbers(arr: pa.Array, t, name: str, reasons: _Reasons, unit: str | None) -> pa.Array:
    """Numbers as float64; `unit` set: a timestamp column, whose numbers count `unit`s since 1970
    and become seconds (its date texts parse to seconds)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return _texts(arr, name, reasons, unit)
    if unit in (None, "s"):
        return _float64(arr, t, name, shortest=unit is None)
    values = arr if pa.types.is_integer(t) else _float64(arr, t, name)  # integers stay integers: floored exactly
    nulls = values.is_null().to_numpy(zero_copy_only=False)
    return pa.array(_in_seconds(values.fill_null(0).to_numpy(zero_copy_only=False), unit), pa.float64(), mask=nulls)


def _in_seconds(values: np.ndarray, unit: str | None) -> np.ndarray:
    """Epoch numbers in `unit` as float seconds, floored to whole microseconds below a second as
    typed and text timestamps are (`_seconds`, `_micro_seconds`); whole numbers of us or ns are
    floored in integers (through float64 a stamp just under a microsecond rounded up, 1 us off
    the same instant typed as timestamp[ns]). Seconds, and plain numbers, stay as they are."""
    if unit in (None, "s"):
        return values.astype(np.float64)
    per = _TICKS_PER_SECOND[unit]
    if per >= 1_000_000 and np.issubdtype(values.dtype, np.integer):
        return np.floor_divide(values, per // 1_000_000).astype(np.float64) / 1e6
    values = values.astype(np.float64)
    micros = values * (1_000_000 // per) if per <= 1_000_000 else values / (per // 1_000_000)
    return np.floor(micros) / 1e6


def _float64(arr: pa.Array, t, name: str, shortest: bool = False) -> pa.Array:
    """`shortest`: a float32 feature reads as its shortest text (below); a timestamp's float32
    keeps its exact value, the stored instant (its shortest text moved 1700003584 by 16 s)."""
    if pa.types.is_decimal(t):
        # a decimal (Spark's and databases' Parquet exports write money and rates as decimal128) is
        # read through its text: Arrow's decimal-to-float64 cast is not correctly rounded (0.35 gave
        # 0.35000000000000003, one value in eight of decimal(10,2)), so a bucket edge fitted on it
        # put the row in another bucket than a request's 0.35
        return arr.cast(pa.string()).cast(pa.float64())
    if shortest and pa.types.is_float32(t):
        # likewise a float32 (Parquet from numpy/pandas float32 frames), through its shortest text:
        # widened exactly, 0.35f is 0.3499999940395355, so bucket edges were fitted on values no
        # request sends, and a categorical float32 column already reads it as "0.35" (hashing.value_text)
        return arr.cast(pa.string()).cast(pa.float64())
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t):
        # A numeric feature is a float64: an integer past 2**53 becomes the nearest float (Arrow's
        # safe cast refuses it and stopped the whole job, or answered a request with a 500).
        return arr.cast(pa.float64(), safe=False)
    raise DataError(f"column '{name}' has type {t}; a numeric column must hold numbers or numeric strings")


def _texts(arr: pa.Array, name: str, reasons: _Reasons, unit: str | None, numeric: list | None = None) -> pa.Array:
    timestamp = unit is not None
    text = pd.Series(arr.to_numpy(zero_copy_only=False), dtype=object)
    blank = text.isna() | (text.str.strip() == "")
    parsed = _parse_numbers(text, timestamp, unit, numeric)
    failed = (~blank & parsed.isna() & (text.str.strip().str.lower() != "nan")).to_numpy()
    reasons.add(failed, f"{name}: cannot parse as a {'timestamp' if timestamp else 'number'}")
    # A literal "nan" stays NaN (a NaN label is its own reason); blanks and failures are null.
    return pa.array(parsed.to_numpy(dtype=np.float64, na_value=np.nan), pa.float64(), mask=(blank.to_numpy() | failed))


_TICKS_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}


def _seconds(arr: pa.Array) -> pa.Array:
    """Timestamps and dates as float seconds since the epoch, sub-microsecond digits dropped.

    Computed from each type's own integer ticks: Arrow's cast to timestamp[us] refuses
    nanoseconds it would truncate, refuses (safe) or silently wraps (unsafe) dates and
    second timestamps past int64 microseconds."""
    t = arr.type
    if pa.types.is_date32(t):  # days
        return pc.multiply(arr.cast(pa.int32()).cast(pa.float64()), 86_400.0)
    if pa.types.is_date64(t):  # milliseconds
        return pc.divide(arr.cast(pa.int64()).cast(pa.float64(), safe=False), 1e3)
    per_second = _TICKS_PER_SECOND[t.unit]
    if t.unit == "ns":  # floored to whole microseconds, as text timestamps are (_parse_numbers)
        arr, per_second = pc.floor_temporal(arr, unit="microsecond").cast(pa.timestamp("us", t.tz)), 1_000_000
    return pc.divide(arr.cast(pa.int64()).cast(pa.float64(), safe=False), float(per_second))


def _parse_numbers(text: pd.Series, timestamp: bool, unit: str | None = None, numeric: list | None = None) -> pd.Series:
    """Numeric texts as float64; for a timestamp, numbers in `unit` as seconds (`_in_seconds`)
    and date texts as epoch seconds. `numeric`, given, gets
    which rows were numbers."""
    lowered = text.str.strip().str.lower()
    numbers = pd.to_numeric(lowered.replace({"true": "1", "false": "0"}), errors="coerce")
    parsed = pd.Series(_in_seconds(numbers.to_numpy(), unit), index=numbers.index)
    if numeric is not None:
        numeric.append(parsed.notna().to_numpy())
    if timestamp:
        needs = parsed.isna() & lowered.notna()
        if needs.any():
            dates = pd.to_datetime(text[needs], errors="coerce", utc=True, format="ISO8601")
            parsed[needs] = _micro_seconds(dates.dt.tz_convert(None).to_numpy())
            # one call gives the column one resolution: a stamp in nanoseconds made every stamp
            # outside 1677-2262 missing, accepted alone (a row's fate hung on its neighbours)
            lost = needs & parsed.isna()
            if lost.any() and lost.sum() < needs.sum():
                parsed[lost] = [_one_stamp(v) for v in text[lost]]
    # "nan" parses to NaN: the same as a missing value, which imputation handles.
    return parsed


def _one_stamp(value) -> float:
    """One text timestamp as `_parse_numbers` reads a column of it alone (NaN where it is none)."""
    dates = pd.to_datetime(pd.Series([value], dtype=object), errors="coerce", utc=True, format="ISO8601")
    return float(_micro_seconds(dates.dt.tz_convert(None).to_numpy())[0])


def _micro_seconds(dates: np.ndarray) -> np.ndarray:
    """datetime64 to float seconds as a typed timestamp column is read (`_seconds`): floored to
    whole microseconds, then divided, so text and typed timestamps give the same float."""
    micros = dates.astype("datetime64[us]")  # numpy truncates toward zero: floor it
    micros[micros > dates] -= np.timedelta64(1, "us")
    seconds = micros.astype(np.int64).astype(np.float64) / 1e6
    seconds[np.isnat(dates)] = np.nan
    return seconds


def _validate_label(column, label: dict, reasons: _Reasons) -> tuple[pa.Array, pa.Array]:
    name = label["column"]
    values = _as_float(column, name, reasons)
    y = values.to_numpy(zero_copy_only=False)
    missing = values.is_null().to_numpy(zero_copy_only=False)
    reasons.add(missing, f"{name}: missing label")
    reasons.add(~missing & np.isnan(y), f"{name}: label is NaN")
    reasons.add(np.isinf(y), f"{name}: label is infinite")
    y = np.nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0) + 0.0  # + 0.0: a label -0.0 ("-0" in a CSV) is 0.0 (class counts and weights key on its text)
    raw = pa.array(y, pa.float64())
    if label["task"] == "binary":
        if label.get("threshold") is not None:
            y = (y >= label["threshold"]).astype(np.float64)
        else:
            reasons.add((y != 0) & (y != 1), f"{name}: label outside {{0, 1}} (set data.label.threshold to binarise)")
    elif label.get("domain") is not None:
        low, high = label["domain"]
        reasons.add((y < low) | (y > high), f"{name}: label outside the domain [{low}, {high}]")
    return pa.array(y, pa.float64()), raw


def request_columns(columns: list[dict], needed=frozenset()) -> list[dict]:
    """The columns a served request carries: the schema less the label, and less the id and
    timestamp columns except those a derived feature is computed from (`needed`)."""
    return [c for c in columns if c["role"] not in ("label", "id", "timestamp") or c["name"] in needed]


def numeric_values(values: list, name: str) -> np.ndarray:
    """Raw JSON values as a numeric column of a request reads them (float64; "true" -> 1,
    " 5 " -> 5; missing and unreadable values NaN): what drift counting compares with the bins."""
    return _validate_column(python_array(values), {"name": name, "role": "numeric"}, _Reasons(len(values))).to_numpy(zero_copy_only=False)


def validate_request(rows: list[dict], columns: list[dict], needed: set[str] = frozenset()) -> pa.Table:
    """Serving path: request dicts through the same column validation as training data, over
    `request_columns(columns, needed)`."""
    feature_cols = request_columns(columns, needed)
    raw = {}
    reasons = _Reasons(len(rows))
    for col in feature_cols:
        values, why = read_values([r.get(col["name"]) for r in rows], col)
        for i, reason in enumerate(why):
            if reason:
                reasons.values[i] = reasons.values[i] or f"{col['name']}: {reason}"
        raw[col["name"]] = python_array(values)
    out = {c["name"]: _validate_column(raw[c["name"]], dict(c, required=c.get("required", False)), reasons) for c in feature_cols}
    # An id or timestamp column the model does not read may come along (and is logged with the
    # exposure): one value each, as in a column that is read (a list nested 1,000 deep failed
    # the exposure's JSON, and with it every request of its batch)
    for col in columns:
        if col["role"] in ("id", "timestamp") and col not in feature_cols and any(col["name"] in r for r in rows):
            for i, reason in enumerate(read_values([r.get(col["name"]) for r in rows], col)[1]):
                if reason:
                    reasons.values[i] = reasons.values[i] or f"{col['name']}: {reason}"
    if reasons.bad.any():
        i = int(np.flatnonzero(reasons.bad)[0])
        raise DataError(f"request row {i}: {reasons.values[i]}")
    return pa.table(out) if out else pa.table({"__rows__": pa.nulls(len(rows))})
