"""What preprocessing leaves behind and how it is read: the result (`PreprocessResult`: the
folder, its fitted features, counts and shard files), its splits as Ray Datasets or as local
Parquet shards read in this process (`LocalShards`), and a finished folder loaded again
(`load_result`). `data.pipeline` writes them and re-exports these names."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field, replace

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import DataError
from ..features import FittedFeatures
from ..paths import is_remote
from ._batch import filesystem
from .sources import read_parquet

log = logging.getLogger(__name__)


SPLIT_NAMES = ("train", "val", "test")


def read_concurrency() -> int:
    """How many zero-CPU read tasks feed training at once: one per CPU of the cluster, at least
    2 (reading and decoding Parquet is CPU work; more at once only holds more blocks in memory)."""
    import ray

    cpus = 0
    if ray.is_initialized():
        cpus = int(ray.cluster_resources().get("CPU", 0))
    return max(2, cpus or (os.cpu_count() or 2))


@dataclass
class PreprocessResult:
    out_dir: str
    features: FittedFeatures
    counts: dict  # input, good, quarantined, reasons, rows per split (train after rebalancing)
    cache_key: str  # the cache entry's key: the spec's sections and the inputs' paths, sizes and times
    cached: bool = False
    files: dict[str, list[str]] = field(default_factory=dict)
    data_hash: str | None = None  # sha256 of the prepared data's bytes (content_digest): what a run trained on

    def dataset(self, split: str, for_training: bool = False):
        """The preprocessed split as a lazy Ray Dataset (what Ray Train workers stream).

        for_training: read tasks ask for no CPU. Training workers hold the CPUs and wait on
        this light read; a read that asked for a CPU would wait forever on a cluster whose
        workers hold every CPU (2 workers on 2 CPUs here). Tasks that ask for no CPU are not
        bounded by the CPUs either, so their concurrency is (`read_concurrency`): unbounded,
        Ray Data started one read task (one worker process) per block at once, 190 for an 80M-row
        split on this 2-core node, and ran the node out of memory (benchmarks/RESULTS.md).
        """
        if not self.files.get(split):
            raise DataError(f"split '{split}' has no rows in {self.out_dir}")
        extra = {"num_cpus": 0, "concurrency": read_concurrency()} if for_training else {}
        if is_remote(self.out_dir):  # Ray takes one file system from the first URI and kept its query in the later keys
            fs, base = filesystem(self.out_dir)
            names = [uri.split("?", 1)[0].rsplit("/", 1)[-1] for uri in self.files[split]]
            return read_parquet([f"{base}/{split}/{name}" for name in names], filesystem=fs, **extra)
        return read_parquet(self.files[split], **extra)

    def batches(self, split: str):
        """The split for reading batches in this process: the shards straight from Parquet when
        they are local files, the Ray Dataset otherwise. Local shards are on this machine's disk
        whatever Ray runs, so no Ray read tasks are scheduled for them: `rayload evaluate` and
        `compress` on cached shards start no Ray at all, and the test metrics at the end of
        `fit`, the retraining gate and the pipeline's search stage skip a Ray Data read."""
        if not self.files.get(split):
            raise DataError(f"split '{split}' has no rows in {self.out_dir}")
        if any("://" in f for f in self.files[split]):
            return self.dataset(split)
        return LocalShards(self.files[split])

    @property
    def datasets(self) -> dict:
        return {s: self.dataset(s) for s in SPLIT_NAMES if self.files.get(s)}


@dataclass
class LocalShards:
    """Preprocessed Parquet shards read with pyarrow, file by file in order: the part of a Ray
    Dataset's interface that in-process readers (evaluation, the compression gate) use."""

    files: list[str]
    columns: list[str] | None = None  # None: all

    def select_columns(self, columns: list[str]) -> "LocalShards":
        return replace(self, columns=list(columns))

    def iter_batches(self, batch_size: int = 8192, batch_format: str = "pyarrow"):
        if batch_format != "pyarrow":
            raise ValueError(f"LocalShards yields pyarrow tables only, got batch_format={batch_format!r}")
        for path in self.files:
            for record_batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=self.columns):
                yield pa.Table.from_batches([record_batch])

    def exact_batches(self, batch_size: int):
        """Tables of exactly batch_size rows across file boundaries (the last may be short):
        the batches Ray Data's iter_batches gives over the same files in order."""
        return exact_tables(self.iter_batches(batch_size), batch_size)

    @classmethod
    def on_this_machine(cls, files: list[str] | None) -> "LocalShards | None":
        """The shards, when every one is a file this process can open; None otherwise (remote
        storage, or a node that does not share the disk the driver wrote them to)."""
        if not files or any("://" in f or not os.path.isfile(f) for f in files):
            return None
        return cls(list(files))


def exact_tables(tables, batch_size: int):
    """The rows of `tables` re-cut into tables of exactly batch_size rows (the last may be short)."""
    pending = None
    for table in tables:
        pending = table if pending is None else pa.concat_tables([pending, table])
        while pending.num_rows >= batch_size:
            yield pending.slice(0, batch_size)
            pending = pending.slice(batch_size)
    if pending is not None and pending.num_rows:
        yield pending


def content_digest(out_dir: str, files: dict[str, list[str]], features_json: str) -> str:
    """sha256 over the prepared data: features.json, then each split's shards (train, val, test;
    by file name) as split/name and their bytes. The shards are named by their rows' content and
    written in a seeded order, so the same rows and preprocessing give the same bytes wherever the
    input lies and whenever it was touched; the cache key (paths, sizes, times) does not. Computed
    once, when the cache entry is written, and kept in its summary.json."""
    fs, _ = filesystem(out_dir)
    h = hashlib.sha256(b"features.json\0" + features_json.encode())
    for split in SPLIT_NAMES:
        for path in sorted(files.get(split, []), key=lambda p: p.rsplit("/", 1)[-1]):
            h.update(f"\0{split}/{path.rsplit('/', 1)[-1]}\0".encode())
            shard_fs, where = pafs.FileSystem.from_uri(path) if "://" in path else (fs, path)
            with shard_fs.open_input_stream(where) as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


def load_result(out_dir: str, expect_key: str | None = None) -> PreprocessResult | None:
    """A finished preprocessing folder, or None (unfinished, absent, or another key). A folder
    written before summary.json kept the data's content digest gets it now, once."""
    fs, base = filesystem(out_dir)
    try:
        with fs.open_input_stream(f"{base}/_SUCCESS") as f:
            key = f.read().decode()
        if expect_key is not None and key != expect_key:
            return None
        with fs.open_input_stream(f"{base}/summary.json") as f:
            summary = json.loads(f.read())
        with fs.open_input_stream(f"{base}/features.json") as f:
            features_json = f.read().decode()
        features = FittedFeatures.from_json(features_json)
        files, counts = _in_entry(out_dir, summary["files"]), dict(summary["counts"])
        where = summary["files"] if is_remote(out_dir) else files  # as the entry's file system names them
        missing = _gone(fs, base, [p for split in where.values() for p in split])
    except FileNotFoundError:
        return None
    except OSError as exc:  # the storage could not be read now: not a reason to write a good entry again
        raise DataError(f"cannot read the preprocessed output {out_dir}: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError, DataError) as exc:  # damaged after it was finished
        log.warning("%s: a damaged preprocessing output (%s); it is written again", out_dir, exc)
        return None
    if missing:  # a shard removed since: the summary's counts would be read off rows that are gone
        log.warning("%s: %d shard(s) it lists are gone (%s); it is written again", out_dir, len(missing), missing[0])
        return None
    if not summary.get("data_hash"):
        summary["data_hash"] = content_digest(out_dir, summary["files"], features_json)
        try:  # whole or not at all: a reader never sees half a summary
            with fs.open_output_stream(f"{base}/summary.json.tmp") as f:
                f.write(json.dumps(summary, indent=1).encode())
            fs.move(f"{base}/summary.json.tmp", f"{base}/summary.json")
        except OSError as exc:  # a read-only cache: the digest is computed again next time
            log.warning("could not keep the data's content digest in %s/summary.json: %s", out_dir, exc)
    return PreprocessResult(out_dir, features, counts, key, cached=True, files=files, data_hash=summary["data_hash"])


def _gone(fs: pafs.FileSystem, base: str, paths: list[str]) -> list[str]:
    """The shards among `paths` that are not there: one listing of the entry's folder (one
    request per shard took minutes on object storage for thousands of shards), a look of its
    own for a shard elsewhere."""
    there = {i.path for i in fs.get_file_info(pafs.FileSelector(base, recursive=True)) if i.type == pafs.FileType.File}
    inside = base.rstrip("/") + "/"
    return [p for p in paths if (p not in there if p.startswith(inside) else fs.get_file_info(p).type != pafs.FileType.File)]


def _in_entry(out_dir: str, files: dict[str, list[str]]) -> dict[str, list[str]]:
    """The shards of a local entry in the folder it was found in: summary.json keeps the paths
    they were written at, and an entry moved (RAYLOAD_CACHE pointed elsewhere, a shared cache
    mounted at another path, a copied RAYLOAD_HOME) handed back the old ones, failing or reading
    the old copy. Every shard is <entry>/<split>/<name>. A remote entry's shards are URIs under
    it (written, they were named as its file system does, without the scheme, and read back as
    local files)."""
    from ..paths import join_uri, local_path

    if is_remote(out_dir):
        return {split: [join_uri(out_dir, split, path.rsplit("/", 1)[-1]) for path in paths] for split, paths in files.items()}
    root = os.path.abspath(local_path(out_dir))
    return {split: [os.path.join(root, split, path.rsplit("/", 1)[-1]) for path in paths] for split, paths in files.items()}
