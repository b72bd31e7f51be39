"""`rayload validate`: does the data match the declared schema? Reads only schemas, no rows."""

from __future__ import annotations

import csv
import io
import itertools

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError
from ..paths import cache_root
from .readers import header_line, jsonl_lines, parse_jsonl, strip_bom
from .sources import Inputs, resolve_inputs
from .validate import Schema, validate_table


def check_data_schema(job) -> int:
    """Raise DataError naming the file and column when a declared column is absent or mistyped."""
    inputs = resolve_inputs(job.data, cache_root())
    check_files(inputs, Schema.from_spec(job.data))
    return len(inputs.paths)


def check_files(inputs: Inputs, schema: Schema) -> None:
    """Every Parquet footer (cheap), or the head of the first text file that is not empty.

    JSONL: the first file whose head holds JSON objects and every declared column a row cannot
    do without. A file whose head holds no object, or a small file read whole that lacks such a
    column, is passed over (its lines are quarantined one by one when read, as they are in any
    other file): refusing it only when it sorted first made the outcome depend on file names.
    Only when no file qualifies is one refused: the first lacking a column, else the first
    without an object."""
    lacks = no_objects = None
    for path in inputs.paths:
        found = file_schema(inputs, path)
        if found is None:  # an empty text file: no rows, nothing to check
            continue
        if inputs.fmt == "jsonl":
            if found.names == []:  # no JSON object in its first lines
                no_objects = no_objects or DataError(f"{path}: no JSON objects in the first lines")
                continue
            found, lacking = _sampled_columns(found, schema)
            if lacking:
                lacks = lacks or _checked(path, found, schema, keep=True)
                continue
        _checked(path, found, schema)
        if inputs.fmt != "parquet":
            return
    if lacks or no_objects:
        raise lacks or no_objects


def _checked(path: str, found: pa.Schema, schema: Schema, keep: bool = False):
    """An empty table with the file's types runs the same type checks as real rows do; a mistyped
    column names the shard (three shards, one bad, said nothing of which), once. With `keep`, the
    error is returned instead of raised."""
    try:
        validate_table(found.empty_table(), schema, path)
    except DataError as exc:
        error = exc if path in str(exc) else DataError(f"{path}: {exc}")
        if keep:
            return error
        raise error from None
    return None


def file_schema(inputs: Inputs, path: str) -> pa.Schema | None:
    if inputs.fmt == "parquet":
        try:
            return pq.read_schema(path, filesystem=inputs.filesystem)
        except (pa.ArrowInvalid, OSError) as exc:  # a 0-byte or cut-off shard: Arrow's error named no file
            raise DataError(f"{path}: not a readable Parquet file ({exc}); remove it, or name the files to read in "
                            "data.source.path") from None
    with inputs.filesystem.open_input_stream(path) as f:
        raw = f.read(1 << 20)
        head = b"".join(itertools.islice(io.BytesIO(raw), 101))
    if not head.strip():
        return None
    if inputs.fmt == "csv":
        try:
            names = next(csv.reader([header_line(strip_bom(head)).decode(errors="replace").rstrip("\r")]), [])
        except csv.Error as exc:  # a binary file, or old Mac \r line ends: the csv module's traceback named no file
            raise DataError(f"{path}: no CSV header line ({exc}); CSV lines end with \\n or \\r\\n") from None
        return pa.schema([(n, pa.string()) for n in names])
    whole = len(raw) < 1 << 20 and len(head) == len(raw)  # the sample is the whole file
    lines = jsonl_lines(head)  # as the reader splits them (splitlines() also broke lines at a lone \r)
    lines = lines[:-1] if len(lines) > 1 and not whole else lines  # the last may be cut off by the sample
    table, _ = parse_jsonl(b"\n".join(lines), _keys(lines), path)
    if table.num_columns == 0:  # no JSON object: an empty schema, which check_files tells apart
        return pa.schema([])
    return table.schema.with_metadata({"whole_file": str(whole)})


def _sampled_columns(found: pa.Schema, schema: Schema) -> tuple[pa.Schema, bool]:
    """A JSONL line omits a key whose value is null, so a declared column absent from the first
    lines is only absent there: the file lacks it only when the sample was the whole file and a
    row cannot do without it (the label, a required, id or timestamp column). The others are
    checked as null columns; their rows are validated one by one when read."""
    whole = (found.metadata or {}).get(b"whole_file") == b"True"
    required = {schema.label["column"]} | {c["name"] for c in schema.columns if c.get("required") or c["role"] in ("id", "timestamp")}
    lacking = False
    for name in schema.names:
        if name not in found.names and not (whole and name in required):
            found = found.append(pa.field(name, pa.null()))
        lacking = lacking or name not in found.names
    return found, lacking


def _keys(lines: list[bytes]) -> list[str]:
    import json

    keys: dict[str, None] = {}
    for line in lines:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # the reader quarantines it
            continue
        if isinstance(obj, dict):
            keys.update(dict.fromkeys(obj))
    return list(keys)
