"""An explicit preprocessing output folder (`rayload preprocess --out`, a pipeline's prepare
stage): what may be written into it, and clearing what an earlier write of ours left there."""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from ..errors import DataError
from ._batch import filesystem
from .result import SPLIT_NAMES
from .sources import Inputs


# What preprocessing writes into its folder, and all that _reset removes before writing again.
OWN_ENTRIES = (*SPLIT_NAMES, "quarantine", "features.json", "summary.json", "summary.json.tmp", "_SUCCESS")


def check_out(out_dir: str, inputs: Inputs) -> None:
    """An explicit output folder is new, empty, or an earlier preprocessing output: it was emptied
    whole before the write, so `--out .` or `--out data` deleted the input files (and anything
    else there) and then failed reading them."""
    fs, base = filesystem(out_dir)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        return
    if info.type != pafs.FileType.Directory:
        raise DataError(f"--out {out_dir}: exists and is not a folder")
    if isinstance(inputs.filesystem, pafs.LocalFileSystem) and isinstance(fs, pafs.LocalFileSystem):
        inside = [p for p in inputs.paths if os.path.commonpath([os.path.abspath(base), os.path.abspath(p)]) == os.path.abspath(base)]
        if inside:
            raise DataError(f"--out {out_dir}: holds the input file {inside[0]}; preprocessing writes its shards into that folder "
                            "and replaces what it wrote before there: name another folder")
    entries = fs.get_file_info(pafs.FileSelector(base))
    other = sorted(i.base_name for i in entries if i.base_name not in OWN_ENTRIES)
    # An earlier write holds only part-*.parquet in its split folders: a dataset laid out as
    # train/ val/ test/ (its own files inside) passed by its folder names and was deleted whole
    shards = False
    for i in entries:
        if i.base_name in (*SPLIT_NAMES, "quarantine"):
            inside = [f for f in fs.get_file_info(pafs.FileSelector(i.path, recursive=True))] if i.type == pafs.FileType.Directory else [i]
            files = [f for f in inside if f.type != pafs.FileType.Directory and not f.base_name.startswith(".")]  # .DS_Store, .nfsXXXX
            other += [os.path.relpath(f.path, base) for f in files if not _shard_name(f.base_name)]
            shards = shards or any(_shard_name(f.base_name) for f in files)
    if not other and not shards and any(i.base_name == "features.json" for i in entries) and \
            not any(i.base_name in ("_SUCCESS", "summary.json") for i in entries):
        other = ["features.json"]  # only a features.json: someone's own, not a write of ours
    if other:
        raise DataError(f"--out {out_dir}: not empty and not a preprocessing output (it holds {', '.join(sorted(other)[:3])}"
                        f"{', ...' if len(other) > 3 else ''}); name a new or empty folder")


def _shard_name(name: str) -> bool:
    return name.startswith("part-") and name.endswith(".parquet")


def _reset(out_dir: str) -> None:
    """Remove what an earlier write of this folder left (only preprocessing's own entries)."""
    fs, base = filesystem(out_dir)
    fs.create_dir(base, recursive=True)
    for info in fs.get_file_info(pafs.FileSelector(base)):
        if info.base_name in OWN_ENTRIES:
            if info.type == pafs.FileType.Directory:
                fs.delete_dir(info.path)
            else:
                fs.delete_file(info.path)
