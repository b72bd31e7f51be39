"""Finding input files (paths, directories, globs; local or any pyarrow URI) and reading them.

The file list and each file's size and modification time form the input fingerprint that
keys the preprocessed-shard cache: re-hashing every byte of a multi-GB source on each run
would cost as much as preprocessing it, and size plus mtime change on any rewrite.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from ..errors import DataError
from .builtin import materialize

_EXTENSIONS = {"parquet": (".parquet", ".pq"), "csv": (".csv",), "jsonl": (".jsonl", ".json", ".ndjson")}
# Text files compressed whole: both engines open them through pyarrow, which decompresses by
# the file's extension (a folder's part-1.csv.gz was skipped without a word, read when named)
_COMPRESSED = (".gz", ".bz2", ".zst")


def _is_data(name: str, fmt: str) -> bool:
    """A file of `fmt` by its name (P6.CSV too; csv.gz and the like for the text formats)."""
    name = name.lower()
    if fmt != "parquet" and name.endswith(_COMPRESSED):
        name = name.rsplit(".", 1)[0]
    return name.endswith(_EXTENSIONS[fmt])
_GLOB = set("*?[")
_OPEN_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, ValueError)


@dataclass(frozen=True)
class Inputs:
    fmt: str
    paths: tuple[str, ...]  # as the filesystem sees them (no scheme)
    filesystem: pafs.FileSystem
    fingerprint: tuple[tuple[str, int, int], ...]


def resolve_inputs(data_spec, cache_root: str) -> Inputs:
    source = data_spec.source
    if source.kind in ("movielens", "synthetic-ctr"):
        return _local("parquet", materialize(source, cache_root))
    raw = [source.path] if isinstance(source.path, str) else list(source.path)
    fs, found = None, []
    for item in raw:
        item_fs, paths = _expand(item, source.kind)
        if fs is not None and type(item_fs) is not type(fs):
            raise DataError(f"data.source.path mixes filesystems ({item!r}); use one scheme for all paths")
        fs = item_fs
        found += paths
    return _describe(source.kind, fs, sorted(set(found)))


def _local(fmt: str, paths: list[str]) -> Inputs:
    return _describe(fmt, pafs.LocalFileSystem(), [os.path.abspath(p) for p in paths])


def _describe(fmt: str, fs: pafs.FileSystem, paths: list[str]) -> Inputs:
    infos = fs.get_file_info(paths)
    fingerprint = tuple((i.path, int(i.size or 0), int(i.mtime_ns or 0)) for i in infos)
    return Inputs(fmt, tuple(paths), fs, fingerprint)


def _expand(item: str, fmt: str) -> tuple[pafs.FileSystem, list[str]]:
    if "://" in item:
        try:
            fs, path = pafs.FileSystem.from_uri(item if not _GLOB & set(item) else _glob_base(item))
        except _OPEN_ERRORS as exc:
            raise DataError(f"data.source.path: cannot open {item!r}: {exc}") from None
        if _GLOB & set(item):
            path = path.rstrip("/") + "/" + item.split(_glob_base(item), 1)[1].lstrip("/")
    else:
        fs, path = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(item))
    # a path that exists as written is that path, glob characters or not (exports[2024]/events.csv)
    globbed = _GLOB & set(path) and fs.get_file_info(path).type == pafs.FileType.NotFound
    paths = _glob(fs, path, fmt) if globbed else _walk(fs, path, item, fmt)
    if not paths:
        raise DataError(f"data.source.path: no {fmt} files match {item!r}")
    return fs, paths


def _glob_base(path: str) -> str:
    """The longest leading directory without a glob character."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if _GLOB & set(part):
            return "/".join(parts[:i])
    return path


def _glob(fs: pafs.FileSystem, pattern: str, fmt: str) -> list[str]:
    """Shell-style: `*`, `?` and `[...]` match within one path component, `**` any number of
    folders; names starting with . or _ only where the pattern's part starts so too. (Matching
    the whole path with fnmatch let `*` cross folders: `data/*.csv` read data/old/b.csv and
    data/.a.csv, and `*.parquet` in a project folder read the cache's own shards on the next run.)
    A folder the pattern matches is read as a folder source is (`events/dt=2024-06-*`: each
    partition's files of the format, hidden names skipped)."""
    base = _glob_base(pattern)
    wanted = pattern[len(base):].strip("/").split("/")
    infos = fs.get_file_info(pafs.FileSelector(base or "/", recursive=True, allow_not_found=True))
    out = []
    for i in infos:
        if i.type != pafs.FileType.File or _ours(fs, base, i.path):
            continue
        parts = i.path[len(base):].strip("/").split("/")
        if _match(parts, wanted):
            out.append(i.path)
        elif _is_data(i.base_name, fmt) and any(
                _match(parts[:k], wanted) and not any(p.startswith((".", "_")) for p in parts[k:]) for k in range(1, len(parts))):
            out.append(i.path)  # inside a folder the pattern names
    return out


def _match(parts: list[str], wanted: list[str]) -> bool:
    if not wanted:
        return not parts
    if wanted[0] == "**":
        return _match(parts, wanted[1:]) or (bool(parts) and not parts[0].startswith((".", "_")) and _match(parts[1:], wanted))
    if not parts or (parts[0].startswith((".", "_")) and not wanted[0].startswith(parts[0][0])):
        return False
    return fnmatch.fnmatchcase(parts[0], wanted[0]) and _match(parts[1:], wanted[1:])


def _ours(fs: pafs.FileSystem, base: str, path: str) -> bool:
    """A file of rayload's own run and cache folders (preprocessed shards, checkpoints), reached
    from a folder above them: a data folder that holds runs/ read the cache's shards as input.
    Named directly (a base inside them), they are read."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return False
    from ..paths import cache_root, runs_root

    for root in {os.path.abspath(cache_root()), os.path.abspath(runs_root())}:
        if _inside(path, root) and not _inside(base, root):
            return True
    return False


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _walk(fs: pafs.FileSystem, path: str, item: str, fmt: str) -> list[str]:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"data.source.path: {item!r} does not exist")
    if info.type == pafs.FileType.File:
        return [path]
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return [
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and _is_data(i.base_name, fmt)
        # hidden or _ names at any depth below the folder (.git/, _temporary/), and runs/ and the cache
        and not any(part.startswith((".", "_")) for part in i.path[len(path):].strip("/").split("/"))
        and not _ours(fs, path, i.path)
    ]


PATH_COLUMN = "path"  # the input file of a row, as Ray Data's include_paths names it


def read_dataset(inputs: Inputs, columns: list[str]):
    """A lazy Ray Dataset over the inputs, one read task per file; text files arrive whole."""
    import ray.data

    blocks = len(inputs.paths)
    if inputs.fmt == "parquet":
        # Each row's file (a `path` column, unless the data has its own), which quarantine records name
        return read_parquet(list(inputs.paths), filesystem=inputs.filesystem, columns=columns, override_num_blocks=blocks,
                            include_paths=PATH_COLUMN not in columns)
    return ray.data.read_binary_files(list(inputs.paths), filesystem=inputs.filesystem, include_paths=True, override_num_blocks=blocks)


def read_parquet(paths: list[str], **kwargs):
    """Ray Data's V1 Parquet reader.

    The DataSource V2 path of Ray 2.60 packed a 16-file source into one read task (one busy
    CPU), and its separate file-listing task always asks for a CPU, which a training job
    whose workers hold every CPU never gets. V1 honours override_num_blocks and num_cpus.

    No partitioning: Ray's default (hive) replaced the values of a column also named in a
    folder (dt=2024-06-01/) with the folder's text, while the local engine, the schema checks
    and serving read the file's own values.
    """
    import ray.data

    ctx = ray.data.DataContext.get_current()
    previous, ctx.use_datasource_v2 = ctx.use_datasource_v2, False
    try:
        return ray.data.read_parquet(paths, file_extensions=None, partitioning=None, **kwargs)
    finally:
        ctx.use_datasource_v2 = previous
