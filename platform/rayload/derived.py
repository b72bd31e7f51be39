"""Derived numeric features computed from validated columns before fitting and transforming.

Calendar parts of a timestamp ("the year the rating was made") and differences with another
numeric column ("the movie's age when it was rated"). They are computed the same way for
training batches and for serving requests, then scaled like any numeric feature.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

PARTS = ("year", "month", "dayofweek", "hour", "days")


def derive(table: pa.Table, derived: dict[str, dict]) -> pa.Table:
    """Append each derived column (float64, null where an input is missing)."""
    for name, cfg in derived.items():
        table = table.append_column(name, pa.array(_values(table, cfg), pa.float64(), from_pandas=True))
    return table


# pandas' datetime range (nanoseconds in int64): a stamp outside it is missing, as
# pd.to_datetime(errors="coerce") would make it.
_LOW_S, _HIGH_S = pd.Timestamp.min.value / 1e9, pd.Timestamp.max.value / 1e9


def calendar_part(seconds: np.ndarray, part: str) -> np.ndarray:
    """A calendar part (UTC) of Unix seconds, as pandas' `.dt.<part>` gives it, NaN where the
    stamp is missing or out of range. numpy's datetime64 arithmetic instead of pandas: the
    same numbers at a fraction of the cost per request (pandas took 2 ms per call)."""
    seconds = np.asarray(seconds, dtype=np.float64)
    if part == "days":
        return seconds / 86400.0
    valid = np.isfinite(seconds) & (seconds >= _LOW_S) & (seconds <= _HIGH_S)
    whole = np.floor(np.where(valid, seconds, 0.0)).astype(np.int64)
    if part == "year":
        out = whole.astype("datetime64[s]").astype("datetime64[Y]").astype(np.int64) + 1970
    elif part == "month":
        out = whole.astype("datetime64[s]").astype("datetime64[M]").astype(np.int64) % 12 + 1
    elif part == "dayofweek":  # Monday = 0; 1970-01-01 was a Thursday
        out = (np.floor_divide(whole, 86400) + 3) % 7
    elif part == "hour":
        out = np.floor_divide(whole, 3600) % 24
    else:
        raise ValueError(f"unknown calendar part {part!r}; expected one of {', '.join(PARTS)}")
    return np.where(valid, out.astype(np.float64), np.nan)


def _values(table: pa.Table, cfg: dict) -> np.ndarray:
    seconds = table.column(cfg["source"]).to_numpy(zero_copy_only=False).astype(np.float64)
    out = calendar_part(seconds, cfg["part"])
    if cfg.get("minus"):
        out = out - table.column(cfg["minus"]).to_numpy(zero_copy_only=False).astype(np.float64)
    return out
