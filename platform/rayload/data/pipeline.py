"""`preprocess(spec)`: validate, split, fit on train, transform and write shards, with Ray Data.

Passes over the source, each fused with the read (see `_batch`):
  keys  (stratified/temporal splits only) - the values the split cut points come from
  fit   - counts, bad-row examples, partial feature statistics of the training rows
  write - transform every split, rebalance train, write shards and the quarantine
The output folder is keyed by a hash of the spec and the input fingerprint; a folder that
finished (`_SUCCESS`) with the same key is reused instead of recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import pickle
import time
from dataclasses import asdict, replace

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .. import __version__
from .._feature_fit import FitPlan, finalize, merge_stats
from .._ray import ensure_ray
from ..errors import DataError, RayloadError
from ..features import FittedFeatures
from ..hashing import digest
from ..paths import cache_lock, cache_root, exclusive, lock_file
from . import rebalance as rb
from ._batch import BatchPlan, filesystem, fit_pass, keys_pass, unpickle, write_pass
from .out_folder import OWN_ENTRIES, _reset, check_out  # noqa: F401  (OWN_ENTRIES: public here)
from ._row_counts import check_bad_fraction, check_split_rows, counts_of, with_moved
from .checks import check_files
from .fixed import check_fixed_columns, check_fixed_spec, fixed_features
from .sources import PATH_COLUMN, Inputs, read_dataset, resolve_inputs
from .split import SplitPlan
from .validate import Schema
# the result and its readers, re-exported: callers name them as data.pipeline's
from .result import SPLIT_NAMES, LocalShards, PreprocessResult, _in_entry, content_digest, load_result, read_concurrency  # noqa: F401

log = logging.getLogger(__name__)


def preprocess(spec, out: str | None = None, address: str | None = None, engine: str = "ray", on_stage=None) -> PreprocessResult:
    """engine="local" runs the same per-batch code in this process with plain pyarrow (the
    benchmark baseline, and a Ray-free path for tests); "ray" runs it as Ray Data tasks.
    `on_stage(text)` is called as each pass starts (the CLI shows it)."""
    on_stage = on_stage or (lambda text: log.info("%s", text))
    schema = Schema.from_spec(spec.data)
    fixed = fixed_features(spec)
    if fixed is not None:  # before any input is fetched or read
        check_fixed_columns(spec.data.resolved_columns(), fixed, f"train.init_from={spec.train.init_from!r}")
        check_fixed_spec(spec.features, spec.train.init_from, fixed)
    inputs = resolve_inputs(spec.data, cache_root())
    key = cache_key(spec, inputs, fixed)  # job_cache_key(spec), with the inputs and features kept for the run
    out_dir = out or os.path.join(cache_root(), "preprocessed", f"{spec.name}-{key}")
    if out is not None:
        check_out(out_dir, inputs)
    if engine == "ray":
        check_reachable(inputs, out_dir)
    # A cache entry has one writer: a second process that wants it waits, then reuses it. An
    # explicit `out` folder has one writer too (two mixed their shards under one summary), and a
    # second is refused. A finished entry is read without the lock (on a read-only cache the
    # lock file cannot be made).
    if out is None and (cached := load_result(out_dir, expect_key=key)) is not None:
        log.info("reusing preprocessed shards in %s (same spec and inputs)", out_dir)
        return cached
    with contextlib.ExitStack() as held:
        if out is None:
            try:
                held.enter_context(cache_lock(out_dir))
            except OSError as exc:  # a read-only or full cache: the traceback named the lock file only
                raise DataError(f"cannot write the preprocessed data to {out_dir} ({exc.strerror or exc}); point "
                                "RAYLOAD_CACHE at a writable folder") from None
        else:
            held.enter_context(exclusive(lock_file(out_dir), f"--out {out_dir} is being written by another process; wait "
                                                             "for it, or name another folder"))
        return _preprocess(spec, inputs, schema, key, out_dir, fixed, address, engine, on_stage)


def check_reachable(inputs: Inputs, out_dir: str) -> None:
    """On a cluster of several nodes, Ray Data's read and write tasks run on any of them: input
    files and the shard folder on this machine's own disk are refused before anything runs,
    with the fix (the embedded Ray, and a driver not connected yet, have one node)."""
    import ray

    from ..paths import local_path
    from ..train.resources import alive_nodes, is_shared

    if not ray.is_initialized():
        return
    nodes = len(alive_nodes())
    if nodes < 2:
        return
    local = list(inputs.paths) if isinstance(inputs.filesystem, pafs.LocalFileSystem) else []
    if "://" not in out_dir or out_dir.startswith("file://"):
        local.append(local_path(out_dir))
    unshared = [p for p in local if not is_shared(p)]
    if unshared:
        more = f" (and {len(unshared) - 2} more)" if len(unshared) > 2 else ""
        raise DataError(
            f"the cluster has {nodes} nodes, but {', '.join(unshared[:2])}{more} are on this machine's disk only: Ray Data "
            "tasks on the other nodes could not read the data or write the shards. Put RAYLOAD_CACHE (built-in sources, "
            "preprocessed shards) on a folder every node mounts (NFS, EFS; RAYLOAD_SHARED_PATHS declares mounts "
            "/proc/mounts cannot tell), and data.source on object storage (s3://...) or that mount.")


def _preprocess(spec, inputs: Inputs, schema: Schema, key: str, out_dir: str, fixed: FittedFeatures | None, address: str | None,
                engine: str, on_stage) -> PreprocessResult:
    cached = load_result(out_dir, expect_key=key)
    if cached is not None:
        log.info("reusing preprocessed shards in %s (same spec and inputs)", out_dir)
        return cached
    check_files(inputs, schema)
    split = SplitPlan.from_spec(spec.split, schema)
    plan = BatchPlan(inputs.fmt, schema, split, FitPlan.from_spec(spec.features, schema, split))
    ds = RayEngine(inputs, schema.names, address) if engine == "ray" else LocalEngine(inputs, schema.names)
    timings = {}
    on_stage(f"reading {len(inputs.paths)} {inputs.fmt} file(s)")
    if plan.split.needs_cutoffs:
        on_stage(f"{spec.split.kind} split: computing cut points")
        with _timed(timings, "split_keys"):
            keys = [k for part in _run(ds, keys_pass, plan) for k in part]
        plan = replace(plan, split=plan.split.with_cutoffs(keys))
    on_stage("validating rows and fitting the preprocessor on the training split")
    with _timed(timings, "fit"):
        parts = [r for part in _run(ds, fit_pass, plan) for r in part]
    counts = dict(counts_of(parts, inputs), seconds=timings)
    check_bad_fraction(counts, parts, spec.data.max_bad_fraction)
    check_split_rows(counts["split_rows"], spec.split)
    reb = rb.plan_rebalance(spec.rebalance.method, spec.rebalance.target_ratio, counts["train_labels"], spec.rebalance.seed)
    weights = {str(k): v for k, v in reb.class_weights} or None
    with _timed(timings, "fit"):
        features = finalize(merge_stats([p["stats"] for p in parts]), plan.fit, weights)
        if fixed is not None:  # the checkpoint's transforms; the label (and its weights) are this data's
            features = replace(fixed, label=features.label, fitted_here=False)
    features_json = _features_json(features)
    _reset(out_dir)
    plan = replace(plan, rebalance=reb, features=features, out_dir=out_dir)
    on_stage(f"transforming and writing shards to {out_dir}")
    with _timed(timings, "transform_write"):
        manifest = [row for part in _run(ds, write_pass, plan, raw=True) for row in part]
    return _finish(out_dir, key, features, features_json, counts, manifest, spec)


@contextlib.contextmanager
def _timed(timings: dict, name: str):
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _run(engine, fn, plan: BatchPlan, raw: bool = False) -> list:
    rows = engine.map(fn, plan)
    return [rows] if raw else unpickle(rows)


class RayEngine:
    """Each pass is a Ray Data map fused with the read: one task per block, on every CPU."""

    def __init__(self, inputs: Inputs, columns: list[str], address: str | None = None):
        ensure_ray(address)
        self.ds = read_dataset(inputs, columns)

    def map(self, fn, plan: BatchPlan) -> list[dict]:
        out = self.ds.map_batches(functools.partial(_guarded, fn), fn_kwargs={"plan": plan}, batch_format="pyarrow",
                                  batch_size=None, zero_copy_batch=True)
        # Each pass emits a few KB per block (statistics or a file manifest), so object-store
        # backpressure protects nothing here; its ramp-up left one of two CPUs idle for the
        # first second of every pass and cost 40% of the wall time (benchmarks/RESULTS.md).
        out.context.set_config("backpressure_policies.enabled", [])
        try:
            rows = out.take_all()
        except Exception as exc:
            error = user_error(exc)
            if error is None:
                raise
            raise error from None
        return raise_task_error(rows)


_ERROR_COLUMN = "__rayload_error__"


def _guarded(fn, batch: pa.Table, plan: BatchPlan) -> pa.Table:
    """A pass as a Ray task: a RayloadError (a DataError naming the file) comes back as a row.
    Raised, Ray Data would wrap it in a UserCodeException that loses it on its way back (only
    a traceback reaches the driver), and the user would get that instead of a clean error."""
    try:
        return fn(batch, plan)
    except RayloadError as exc:
        return pa.table({_ERROR_COLUMN: pa.array([pickle.dumps(exc)], pa.binary())})


def raise_task_error(rows: list[dict]) -> list[dict]:
    """The rows of a pass, or the first RayloadError one of its tasks returned, raised here."""
    for row in rows:
        if row.get(_ERROR_COLUMN) is not None:
            raise pickle.loads(row[_ERROR_COLUMN])
    return rows


def user_error(exc: BaseException) -> RayloadError | None:
    """The RayloadError that a Ray task failure wraps, where it is still attached, or None.
    Ray raises it as a RayTaskError (a traceback, whose dual class is also a RayloadError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        wrapper = any(c.__name__ == "RayTaskError" for c in type(exc).__mro__)
        if isinstance(exc, RayloadError) and not wrapper:
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return None


class LocalEngine:
    """The same passes in this process, one input file per batch, with plain pyarrow."""

    def __init__(self, inputs: Inputs, columns: list[str]):
        self.inputs, self.columns = inputs, columns

    def batches(self):
        fs = self.inputs.filesystem
        for path in self.inputs.paths:
            if self.inputs.fmt == "parquet":
                table = pq.read_table(path, columns=self.columns, filesystem=fs)
                yield table if PATH_COLUMN in self.columns else table.append_column(PATH_COLUMN, pa.array([path] * table.num_rows, pa.string()))
            else:
                with fs.open_input_stream(path) as f:
                    yield pa.table({"bytes": [f.read()], "path": [path]})

    def map(self, fn, plan: BatchPlan) -> list[dict]:
        return [row for batch in self.batches() for row in fn(batch, plan).to_pylist()]


def cache_key(spec, inputs: Inputs, fixed: FittedFeatures | None = None) -> str:
    sections = spec.model_dump(include={"data", "split", "rebalance", "features"}, mode="json")
    extra = {"fixed_features": digest(fixed.to_json())} if fixed is not None else {}
    if fixed is not None and fixed.target:  # "fixed_target_stats": training rows no longer encoded out of fold
        extra["fixed_target_stats"] = "all-rows"
    # Markers of changes to what preprocessing writes, so shards written before one are not reused:
    # "train_rows": how training shards are laid out (rows in a seeded order since the shuffled
    # write, _batch._row_order); "categorical_nan": a NaN in a float categorical column is a
    # missing value (validate.as_string), no longer the category "nan"; "csv_records": a quoted
    # newline is part of its value (readers._read_csv_records), no longer a split row, and a quote
    # opens a quoted value only at the start of a field (readers._opens_quote); "shard_names": a
    # quarantine shard's name hashes its rows' input files (_batch._quarantine_name: two files of
    # the same bad rows wrote one);
    # "rebalance_unit": rebalancing draws per row from all its columns, not per split key;
    # "split_keys": a row whose split key is missing is split by its own columns (split.row_unit: all
    # such rows were one key), a keyed stratified split leaves no asked-for split empty; "far_rows": a
    # val/test row scaled past what a model scores is quarantined (_batch._without_far_rows), not written as inf;
    # "feature_values": a categorical value's text is its own (validate.python_array: not the
    # type Arrow unifies a JSONL column to), a whole-number float is spelled as an integer
    # (hashing.value_text), a JSONL list or object where a column takes one value is quarantined
    # (validate.read_values: it was read as its JSON text), quantile buckets around an atom never
    # exceed the number asked (_moments._at_most), a raw-label target statistic's prior is the mean
    # over all training rows, those missing the value too (target_stats.finalize), a decimal or float32 is read through its text, a text
    # timestamp parses as it does alone, target statistics keep values ending in NUL apart (validate._as_float,
    # _parse_numbers; target_stats.finalize), a column constant in training transforms to 0, quantile buckets
    # give atoms their own bucket and leave none untrained, a training row's log count is its
    # value's full count, as serving's (target_stats.transform), and moments carry a pivot (_moments: z-score offsets
    # and divisors may differ in their last bits), a cut vocabulary's unseen share is Good-Turing's at its cut,
    # target-statistic folds hash every declared column; a stratified split gives each split a row of a rare
    # label; JSONL lines end at \n only and a CSV line "" is a row; a far epoch number is quarantined;
    # "parquet_reads": a column also named in a k=v folder keeps its own values on the ray engine.
    markers = {"train_rows": "seeded-order", "categorical_nan": "missing", "csv_records": "rfc4180,field-start-quotes",
               "shard_names": "per-source", "rebalance_unit": "row", "split_keys": "keyless-rows-own,no-empty-stratified,rare-label-each-split", "far_rows": "quarantined",
               "text_rows": "jsonl-newline-only,csv-quoted-empty-line", "timestamps": "far-quarantined,declared-unit",
               "feature_values": "own-text,int-floats,constant-zero,atom-buckets,full-logcount,pivot-moments,hashed-heavy-hitters,gt-unseen-at-cut,bag-lists,parquet-sources,lists-refused,buckets-at-most-asked,raw-prior-all-rows,decimal-text,stamps-alone,nul-target-values,exact-vocab-ties,noise-ulps,oof-folds-all-columns,target-spread,tie-balanced-edges,edges-by-largest-share,binary-spread-none,float32-text,float32-stamps-exact",
               "parquet_reads": "no-hive-partitions"}
    return digest({"rayload": __version__, "spec": sections, "inputs": inputs.fingerprint, **markers, **extra})


def job_cache_key(spec) -> str:
    """The key `preprocess(spec)` files its shards under, computed without preprocessing: the
    spec's data sections, its inputs' identity (paths, sizes, mtimes) and, for a job that starts
    from a checkpoint, that checkpoint's features."""
    return cache_key(spec, resolve_inputs(spec.data, cache_root()), fixed_features(spec))


def _features_json(features: FittedFeatures) -> str:
    """features.json, made before any shard is written: a fitted number JSON cannot hold (inf,
    NaN) was found only after every shard had been written."""
    try:
        return features.to_json()
    except ValueError:
        found = _non_finite(asdict(features))
        if found is None:
            raise
        path, value = found
        raise DataError(f"the fitted preprocessor holds {value} at {path} of features.json, which JSON cannot hold: the values "
                        "it was fitted on are too large for float64 statistics. Rescale them in the data (a numeric feature: "
                        "features.numeric.<column>.clip or .log); no shards were written.") from None


def _non_finite(obj, path: str = "") -> tuple[str, float] | None:
    """The path and value of the first inf or NaN in a JSON-like object."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return path, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = _non_finite(v, f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def _quarantined(out_dir: str, files: list[str], n: int = 3) -> list[dict]:
    """The first `n` rows of the quarantine shards just written (reason, row and source file), for an error
    that stops the run after the write pass: it showed none."""
    fs, base = filesystem(out_dir)
    out: list[dict] = []
    for path in files:
        table = pq.read_table(path if path.startswith(base) else f"{base}/{path}", filesystem=fs, columns=["reason", "row", "source"])
        out += table.slice(0, n - len(out)).to_pylist()
        if len(out) >= n:
            break
    return out


def _finish(out_dir: str, key: str, features: FittedFeatures, features_json: str, counts: dict, manifest: list[dict],
            spec=None) -> PreprocessResult:
    files: dict[str, list[str]] = {}
    for row in manifest:
        if row["rows"]:  # a shard whose every row went to the quarantine wrote no file
            files.setdefault(row["split"], []).append(row["path"])
    written = {s: sum(r["rows"] for r in manifest if r["split"] == s) for s in (*SPLIT_NAMES, "quarantine")}
    moved = with_moved(counts, manifest)
    if moved is not counts and spec is not None:  # rows the transform quarantined count as the others do
        check_bad_fraction(moved, [{"examples": _quarantined(out_dir, files.get("quarantine", []))}], spec.data.max_bad_fraction)
        check_split_rows(moved["split_rows"], spec.split)
    counts = moved
    if written["quarantine"] != counts["quarantined"]:
        raise RuntimeError(f"quarantine accounting broke: {written['quarantine']} written, {counts['quarantined']} counted")
    counts = dict(counts, written=written, train_labels={str(k): v for k, v in counts["train_labels"].items()})
    files = {s: sorted(v) for s, v in files.items()}
    fs, base = filesystem(out_dir)
    with fs.open_output_stream(f"{base}/features.json") as f:
        f.write(features_json.encode())
    data_hash = content_digest(out_dir, files, features_json)
    summary = {"cache_key": key, "counts": counts, "files": files, "data_hash": data_hash}
    with fs.open_output_stream(f"{base}/summary.json") as f:
        f.write(json.dumps(summary, indent=1).encode())
    with fs.open_output_stream(f"{base}/_SUCCESS") as f:
        f.write(key.encode())
    return PreprocessResult(out_dir, features, counts, key, cached=False, files=_in_entry(out_dir, files), data_hash=data_hash)


