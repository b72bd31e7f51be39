"""How refused rows are kept: the quarantine table (each row as JSON text, its reason, its source
file), written beside the shards and shown in the bad-fraction error."""

from __future__ import annotations

import json
import math

import pyarrow as pa

QUARANTINE_SCHEMA = pa.schema([("row", pa.string()), ("reason", pa.string()), ("source", pa.string())])


def quarantine_rows(rows: list[dict], reasons: list[str], source: str) -> pa.Table:
    """Refused rows (as dicts of their values) with one reason each, from `source`."""
    return pa.table({"row": [row_text(r) for r in rows], "reason": reasons, "source": [source] * len(rows)},
                    schema=QUARANTINE_SCHEMA)


def malformed_rows(items: list[tuple[str, str]], source: str) -> pa.Table:
    """Rows a parser could not even split into columns: (raw text, reason)."""
    return pa.table(
        {"row": [t for t, _ in items], "reason": [r for _, r in items], "source": [source] * len(items)},
        schema=QUARANTINE_SCHEMA,
    )


def row_text(row: dict) -> str:
    """A quarantined row as JSON text, valid JSON: a non-finite number is written as the text
    "nan", "inf" or "-inf" (json.dumps wrote NaN and Infinity, which JSON parsers other than
    Python's refuse, and jq read as 1.8e308)."""
    try:
        return json.dumps(row, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(row), default=str)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
