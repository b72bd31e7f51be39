"""Parsing of text shards (CSV, JSONL) that never loses a line.

Ray Data's read_csv/read_json stop a whole job on one malformed line, and pyarrow's schema
inference turns one stray "n/a" into a failed cast. Text files are therefore read whole with
`read_binary_files`, declared columns are parsed as strings, and every line that cannot be
split into columns is returned as a quarantine row instead of being dropped.
"""

from __future__ import annotations

import csv
import io
import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ..errors import DataError
from .validate import json_texts, python_array


def parse_csv(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]]]:
    """Declared columns as strings; lines that cannot be split into them, or are not UTF-8, are
    returned as quarantine rows.

    A stray quote makes pyarrow read on past the end of its line (quoted fields may not hold
    newlines here, but its chunker still follows the quote): to the end of the file as one bad
    row, or up to the next stray quote as one "good" row holding many lines. Either shows
    (a bad row, or a value, holding a newline); such a file is parsed again line by line."""
    try:
        table, bad, spanned = _read_csv(data, names, source)
        malformed = []
    except _NotUtf8:  # rare: only then is every line decoded, to set the bad ones aside
        data, malformed = _utf8_lines(data)
        table, bad, spanned = _read_csv(data, names, source)
    if spanned or any(pc.any(pc.match_substring(table.column(n), "\n")).as_py() for n in names):
        table, bad = _read_csv_by_line(data, names, source)
    return table, malformed + bad


def _read_csv(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]], bool]:
    malformed: list[tuple[str, str]] = []
    spanned = []

    def on_invalid(row) -> str:
        text = row.text or ""
        spanned.append("\n" in text)
        malformed.append((text, f"malformed CSV line {row.number}: expected {row.expected_columns} columns, got {row.actual_columns}"))
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
            _missing_columns(data, names, source)
        if "invalid UTF8" in msg:
            raise _NotUtf8() from None
        raise DataError(f"{source}: cannot read as CSV: {msg}") from None
    return table, malformed, any(spanned)


def _missing_columns(data: bytes, names: list[str], source: str):
    header = data.split(b"\n", 1)[0].decode(errors="replace")
    raise DataError(f"{source}: declared columns {names} are not all in the CSV header: {header!r}") from None


def _read_csv_by_line(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]]]:
    """Each line parsed on its own (Python's csv module): a quote never reaches past its line."""
    lines = data.decode("utf-8").split("\n")
    header = next(csv.reader([lines[0].rstrip("\r")]))
    if any(n not in header for n in names):
        _missing_columns(data, names, source)
    where = [header.index(n) for n in names]
    columns: dict[str, list] = {n: [] for n in names}
    malformed: list[tuple[str, str]] = []
    for number, line in enumerate(lines[1:], start=2):
        line = line.rstrip("\r")
        if not line:
            continue
        fields = next(csv.reader([line]))
        if len(fields) != len(header):
            quote = " (an unterminated quote)" if line.count('"') % 2 else ""
            malformed.append((line, f"malformed CSV line {number}: expected {len(header)} columns, got {len(fields)}{quote}"))
            continue
        for n, i in zip(names, where):
            columns[n].append(fields[i] or None)
    return pa.table({n: pa.array(v, pa.string()) for n, v in columns.items()}), malformed


class _NotUtf8(Exception):
    pass


def _utf8_lines(data: bytes) -> tuple[bytes, list[tuple[str, str]]]:
    """The lines that are UTF-8, and a quarantine row for each line that is not (the header,
    line 1, must be)."""
    kept, malformed = [], []
    for number, line in enumerate(data.split(b"\n"), start=1):
        try:
            line.decode("utf-8")
            kept.append(line)
        except UnicodeDecodeError as exc:
            if number == 1:
                raise DataError(f"the header line is not UTF-8 text: {exc}") from None
            malformed.append((line.decode(errors="replace"), f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})"))
    return b"\n".join(kept), malformed


def parse_jsonl(data: bytes, names: list[str], source: str) -> tuple[pa.Table, list[tuple[str, str]]]:
    columns: dict[str, list] = {n: [] for n in names}
    malformed: list[tuple[str, str]] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except UnicodeDecodeError as exc:
            malformed.append((line.decode(errors="replace"), f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})"))
            continue
        except ValueError as exc:
            malformed.append((line.decode(errors="replace"), f"invalid JSON on line {number}: {getattr(exc, 'msg', exc)}"))
            continue
        if not isinstance(obj, dict):
            malformed.append((line.decode(errors="replace"), f"line {number} is not a JSON object"))
            continue
        for n in names:
            columns[n].append(obj.get(n))
    return pa.table({n: _column(v) for n, v in columns.items()}), malformed


def _column(values: list) -> pa.Array:
    """Typed when the JSON values agree; text otherwise, so validation can name the bad row.
    Read exactly as serving reads a request's values (validate.python_array): the same raw value
    must get the same text offline and online, whatever the other lines of its file hold."""
    if any(isinstance(v, (list, dict)) for v in values):
        return json_texts(values)
    return python_array(values)
