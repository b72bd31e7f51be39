"""The per-batch work of preprocessing, free of Ray so it is unit-tested and benchmarked alone.

A batch is either a pyarrow Table (Parquet blocks) or a Table of whole text files (`bytes`,
`path`) from `read_binary_files`. Each pass re-parses and re-validates its input instead of
materialising validated rows in the object store: validation is cheap next to a copy through
shared memory on a small machine, and the passes stay fused with the read.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .._feature_fit import FitPlan, partial_stats
from ..errors import DataError
from ..features import FittedFeatures, far_reason
from . import rebalance as rb
from .readers import parse_csv, parse_jsonl
from .sources import PATH_COLUMN
from .split import SPLITS, TRAIN, SplitPlan, assign, row_hash, split_keys
from .quarantine import QUARANTINE_SCHEMA, malformed_rows, quarantine_rows
from .validate import Schema, validate_table

EXAMPLES = 3


@dataclass(frozen=True)
class BatchPlan:
    fmt: str  # parquet | csv | jsonl
    schema: Schema
    split: SplitPlan
    fit: FitPlan | None = None
    rebalance: rb.RebalancePlan | None = None
    features: FittedFeatures | None = None
    out_dir: str | None = None


def validated(batch: pa.Table, plan: BatchPlan) -> list[tuple[pa.Table, pa.Table]]:
    """(good rows, quarantine rows) per input unit of the batch."""
    return [(good, bad) for good, bad, _ in validated_from(batch, plan)]


def validated_from(batch: pa.Table, plan: BatchPlan) -> list[tuple[pa.Table, pa.Table, str]]:
    """(good rows, quarantine rows, their source) per input unit of the batch."""
    if plan.fmt == "parquet":
        if PATH_COLUMN in plan.schema.names or PATH_COLUMN not in batch.column_names or not batch.num_rows:  # the data's own column
            return [(*validate_table(batch, plan.schema, "parquet"), "parquet")]
        paths = batch.column(PATH_COLUMN).to_numpy(zero_copy_only=False)
        cuts = [0, *(np.flatnonzero(paths[1:] != paths[:-1]) + 1).tolist(), len(paths)]  # runs of one file, in order
        batch = batch.drop_columns([PATH_COLUMN])
        return [(*validate_table(batch.slice(a, b - a), plan.schema, str(paths[a])), str(paths[a]))
                for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    out = []
    for data, path in zip(batch.column("bytes").to_pylist(), batch.column("path").to_pylist()):
        if plan.fmt == "csv":
            table, malformed = parse_csv(data, plan.schema.names, path)
        else:
            table, malformed = parse_jsonl(data, plan.schema.names, path, plan.schema.bags)
        good, bad = validate_table(table, plan.schema, path)
        if malformed:
            bad = pa.concat_tables([bad, malformed_rows(malformed, path)])
        out.append((good, bad, path))
    return out


def _pickled(obj) -> pa.Table:
    return pa.table({"payload": pa.array([pickle.dumps(obj, protocol=5)], pa.binary())})


def unpickle(rows: list[dict]) -> list:
    return [pickle.loads(r["payload"]) for r in rows]


# ---------------------------------------------------------------- passes


def keys_pass(batch: pa.Table, plan: BatchPlan) -> pa.Table:
    """Pre-pass for stratified and temporal splits: the values their cut points come from."""
    return _pickled([split_keys(good, plan.split) for good, _ in validated(batch, plan)])


def fit_pass(batch: pa.Table, plan: BatchPlan) -> pa.Table:
    """Counts, bad-row examples and feature statistics of the training rows."""
    results = []
    for good, bad in validated(batch, plan):
        codes = assign(good, plan.split)
        y = good.column(plan.split.label).to_numpy()
        train = good.filter(pa.array(codes == TRAIN))
        results.append({
            "good": good.num_rows,
            "bad": bad.num_rows,
            "examples": bad.slice(0, EXAMPLES).to_pylist(),
            "reasons": _reason_counts(bad),
            "split_rows": {SPLITS[c]: int((codes == c).sum()) for c in range(3)},
            "train_labels": {float(v): int(n) for v, n in zip(*np.unique(y[codes == TRAIN], return_counts=True))},
            "stats": partial_stats(train, plan.fit),
        })
    return _pickled(results)


_LINE = re.compile(r"\bline \d+\b")


def _reason_counts(bad: pa.Table) -> dict[str, int]:
    """Quarantined rows per reason, a reason's line number left out (each row keeps it in the
    quarantine): one entry per bad CSV/JSONL line grew the counts and the max_bad_fraction
    error by a line each (57 KB for 1,000 ragged rows)."""
    counts: dict[str, int] = {}
    for reason in bad.column("reason").to_pylist():
        reason = _LINE.sub("line N", reason)
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def write_pass(batch: pa.Table, plan: BatchPlan) -> pa.Table:
    """Transform and write every split (and the quarantine) of the batch; return the manifest."""
    fs, base = filesystem(plan.out_dir)
    manifest = []
    for good, bad, source in validated_from(batch, plan):
        name = _shard_name(good, bad, plan)
        codes = assign(good, plan.split)
        far = []
        for code, split in enumerate(SPLITS):
            rows = good.filter(pa.array(codes == code))
            moved = {}
            if split == "train" and not plan.features.fitted_here:
                # another fit's scales (train.init_from): training values can be far too (this data's own
                # fit refused only values that overflow it); checked before rebalancing copies rows
                found: dict = {}
                plan.features.transform_table(rows, training=True, far=found)
                rows, moved = _without_far_rows(rows, rows, found, source, far)
            if split == "train" and plan.rebalance is not None:
                u = rb.row_rebalance_unit(rows, tuple(plan.schema.names), plan.rebalance.seed)
                rows = rb.apply(rows, rows.column(plan.split.label).to_numpy(), u, plan.rebalance)
            found = {} if split != "train" else None  # a fit never scales its own training rows far (_far_values.far_limit)
            out = plan.features.transform_table(rows, training=split == "train", far=found)
            if found:
                out, moved = _without_far_rows(out, rows, found, source, far)
            if split == "train":
                out = out.take(_row_order(out.num_rows, name, plan.split.seed))
            manifest.append(dict(_write(fs, base, split, name, out), moved=json.dumps(moved) if moved else None))
        if far:
            bad = pa.concat_tables([bad.cast(QUARANTINE_SCHEMA), *far])
        manifest.append(dict(_write(fs, base, "quarantine", _quarantine_name(name, bad), bad.cast(QUARANTINE_SCHEMA)), moved=None))
    return pa.Table.from_pylist([m for m in manifest if m["rows"] or m["moved"]], schema=MANIFEST_SCHEMA)


def _without_far_rows(out: pa.Table, rows: pa.Table, found: dict, source: str, far: list) -> tuple[pa.Table, dict]:
    """A row whose scaled numeric value is beyond what a model can score (`_far_values.far_limit`;
    inf past float32 scored NaN and read as a diverged model) goes to the quarantine, with the
    feature named, as a request with it gets a 422. `found`: the transform's far rows of `rows`
    ({row: (state, value)}), `out`: a table row-aligned with them. Returns `out` without them
    and {reason: rows moved}; the moved rows are appended to `far`."""
    if not found:
        return out, {}
    idx = sorted(found)
    raw = rows.take(pa.array(idx)).to_pylist()
    reasons = [far_reason(found[j]) for j in idx]
    far.append(quarantine_rows(raw, reasons, source))
    keep = np.ones(out.num_rows, bool)
    keep[idx] = False
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    return out.filter(pa.array(keep)), counts


def _row_order(rows: int, shard: str, seed: int) -> np.ndarray:
    """The order a training shard's rows are written in: a permutation seeded by the split seed
    and the shard's name. Input files are often sorted (by user, by time, by label), and
    rebalancing puts a row's up-sampled copies side by side; in that order the first epoch,
    which streams the shards as written, would train on runs of one user or one label, and a
    batch would hold a row's copies together. Deterministic: the same data and seed give the
    same shards."""
    digest = hashlib.blake2b(f"{seed}:{shard}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "big")).permutation(rows)


# moved: on a val or test shard, {reason: rows} it gave to the quarantine (JSON), else null
MANIFEST_SCHEMA = pa.schema([("split", pa.string()), ("path", pa.string()), ("rows", pa.int64()), ("moved", pa.string())])


def _shard_name(good: pa.Table, bad: pa.Table, plan: BatchPlan) -> str:
    """Named by content, so a retried task overwrites its own file instead of adding one. The
    content is every declared column, not the split key alone: with a group split (or a key that
    does not identify a row) two input blocks with the same keys in the same order, such as two
    daily snapshots of the same users, would share a name and one would overwrite the other.
    Two input files with the very same rows share a name and write the same bytes: the manifest
    lists the shard once per file, so its rows are read once per file (and the data's content
    digest stays the same wherever the input lies)."""
    h = hashlib.blake2b(digest_size=10)
    h.update(row_hash(good, plan.split.columns or plan.split.key, 0, "shard-name").tobytes())
    h.update(str((good.num_rows, bad.num_rows)).encode())
    h.update("\n".join(bad.column("row").to_pylist()).encode())
    return f"part-{h.hexdigest()}.parquet"


def _quarantine_name(name: str, bad: pa.Table) -> str:
    """A quarantine shard's name: its rows' shard name and their input files. Quarantined rows
    name their file, so two files with the same bad rows write two quarantine shards (sharing
    the shard name, the second overwrote the first: one file's record was lost)."""
    sources = sorted(set(bad.column("source").to_pylist())) if bad.num_rows else []
    if not sources:
        return name
    return f"{name.removesuffix('.parquet')}-{hashlib.blake2b(chr(0).join(sources).encode(), digest_size=6).hexdigest()}.parquet"


def _write(fs: pafs.FileSystem, base: str, split: str, name: str, table: pa.Table) -> dict:
    path = f"{base}/{split}/{name}"
    if table.num_rows:
        try:
            fs.create_dir(f"{base}/{split}", recursive=True)
            pq.write_table(table, path, filesystem=fs, compression="snappy")
        except OSError as exc:  # a full disk or a read-only cache: Arrow's error named no folder
            raise DataError(f"cannot write the preprocessed shards to {base} ({exc}); free space there, or point "
                            "RAYLOAD_CACHE (or --out) at another folder") from None
    return {"split": split, "path": path, "rows": table.num_rows}


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)
