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


def _values(table: pa.Table, cfg: dict) -> np.ndarray:
    seconds = table.column(cfg["source"]).to_numpy(zero_copy_only=False).astype(np.float64)
    stamps = pd.to_datetime(pd.Series(seconds), unit="s", utc=True, errors="coerce")
    part = cfg["part"]
    if part == "days":
        out = seconds / 86400.0
    else:
        out = getattr(stamps.dt, part).to_numpy(dtype=np.float64, na_value=np.nan)
    if cfg.get("minus"):
        out = out - table.column(cfg["minus"]).to_numpy(zero_copy_only=False).astype(np.float64)
    return out
