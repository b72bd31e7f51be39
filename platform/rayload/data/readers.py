"""Parsing of text shards (CSV, JSONL) that never loses a line.

Ray Data's read_csv/read_json stop a whole job on one malformed line, and pyarrow's schema
inference turns one stray "n/a" into a failed cast. Text files are therefore read whole with
`read_binary_files`, declared columns are parsed as strings, and every line that cannot be
split into columns is returned as a quarantine row instead of being dropped.
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.csv as pacsv

from ..errors import DataError


def parse_csv(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]]]:
    malformed: list[tuple[str, str]] = []

    def on_invalid(row) -> str:
        malformed.append((row.text or "", f"malformed CSV line {row.number}: expected {row.expected_columns} columns, got {row.actual_columns}"))
        return "skip"

    try:
        table = pacsv.read_csv(
            io.BytesIO(data),
            parse_options=pacsv.ParseOptions(invalid_row_handler=on_invalid, newlines_in_values=False),
            convert_options=pacsv.ConvertOptions(
                include_columns=names,
                column_types={n: pa.string() for n in names},
                strings_can_be_null=True,
                null_values=[""],
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowKeyError) as exc:
        msg = str(exc)
        if "include_columns" in msg or "No such column" in msg or "does not exist" in msg:
            header = data.split(b"\n", 1)[0].decode(errors="replace")
            raise DataError(f"{source}: declared columns {names} are not all in the CSV header: {header!r}") from None
        raise DataError(f"{source}: cannot read as CSV: {msg}") from None
    return table, malformed


def parse_jsonl(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]]]:
    columns: dict[str, list] = {n: [] for n in names}
    malformed: list[tuple[str, str]] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            malformed.append((line.decode(errors="replace"), f"invalid JSON on line {number}: {exc.msg}"))
            continue
        if not isinstance(obj, dict):
            malformed.append((line.decode(errors="replace"), f"line {number} is not a JSON object"))
            continue
        for n in names:
            columns[n].append(obj.get(n))
    return pa.table({n: _column(v) for n, v in columns.items()}), malformed


def _column(values: list) -> pa.Array:
    """Typed when the JSON values agree; text otherwise, so validation can name the bad row."""
    if any(isinstance(v, (list, dict)) for v in values):
        return pa.array([None if v is None else json.dumps(v) if isinstance(v, (list, dict)) else str(v) for v in values], pa.string())
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values], pa.string())
