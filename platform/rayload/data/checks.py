"""`rayload validate`: does the data match the declared schema? Reads only schemas, no rows."""

from __future__ import annotations

import io
import itertools

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError
from ..paths import cache_root
from .readers import parse_jsonl
from .sources import Inputs, resolve_inputs
from .validate import Schema, validate_table


def check_data_schema(job) -> int:
    """Raise DataError naming the file and column when a declared column is absent or mistyped."""
    inputs = resolve_inputs(job.data, cache_root())
    check_files(inputs, Schema.from_spec(job.data))
    return len(inputs.paths)


def check_files(inputs: Inputs, schema: Schema) -> None:
    """Every Parquet footer (cheap), or the head of the first text file that is not empty."""
    for path in inputs.paths:
        found = file_schema(inputs, path)
        if found is None:  # an empty text file: no rows, nothing to check
            continue
        # An empty table with the file's types runs the same type checks as real rows do.
        validate_table(found.empty_table(), schema, path)
        if inputs.fmt != "parquet":
            break


def file_schema(inputs: Inputs, path: str) -> pa.Schema | None:
    if inputs.fmt == "parquet":
        return pq.read_schema(path, filesystem=inputs.filesystem)
    with inputs.filesystem.open_input_stream(path) as f:
        head = b"".join(itertools.islice(io.BytesIO(f.read(1 << 20)), 101))
    if not head.strip():
        return None
    if inputs.fmt == "csv":
        names = head.split(b"\n", 1)[0].decode(errors="replace").strip().split(",")
        return pa.schema([(n.strip().strip('"'), pa.string()) for n in names])
    lines = head.splitlines()[:-1] if len(head.splitlines()) > 1 else head.splitlines()
    table, _ = parse_jsonl(b"\n".join(lines), _keys(lines), path)
    if table.num_columns == 0:
        raise DataError(f"{path}: no JSON objects in the first lines")
    return table.schema


def _keys(lines: list[bytes]) -> list[str]:
    import json

    keys: dict[str, None] = {}
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            keys.update(dict.fromkeys(obj))
    return list(keys)
