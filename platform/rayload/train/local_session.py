"""One worker in this process: the session of in-process runs (one-worker `rayload train`,
tuning trials), with its checkpoints and their index in a run folder, mirrored to object
storage when the run's home is there."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time

import torch

from . import record
from .record import INDEX  # noqa: F401  (a local run's checkpoints and their metrics, best kept)
from ..paths import write_json
from .session import Session, cpu_fallback_device

log = logging.getLogger(__name__)


class LocalSession(Session):
    """One worker in this process; checkpoints kept under `run_dir`, top-k by the metric.

    With `remote` (a URI on object storage: the run's home when the cluster's storage is
    shared) every checkpoint is uploaded there as it is written, with the index
    (`checkpoints.json`: names and metrics), and what train.keep_checkpoints drops is removed
    there too. The remote index is the run's record; this machine's folder may lag it (the run
    went on on another node or machine), match it, or lead it (an upload that failed or was
    cut off). On start the session reconciles the two: lagging or diverged, it drops its own
    checkpoints, downloads the remote latest and resumes from it; leading, it uploads what the
    storage lacks before training on. A local entry is marked `mirrored` only after the remote
    index that names it is written, so a crash between the two is repaired on the next start.

    Checkpoints a Ray Train launch of the same run wrote (`record`: another worker count) count
    as the run's own: their entries join the index when the session starts, and Ray's snapshot,
    which no longer names them all, goes."""

    def __init__(self, loader: dict, datasets: dict, run_dir: str, keep: int, score: str, mode: str, remote: str | None = None):
        super().__init__(loader)
        self.datasets, self.run_dir, self.keep, self.score, self.mode = datasets, run_dir, keep, score, mode
        self.remote = remote
        self.device = _device(loader)
        os.makedirs(run_dir, exist_ok=True)
        self._remote_names: set[str] = set()  # the checkpoint folders the storage holds, by the last index written
        self._ray_snapshot = False  # whether the storage still holds a Ray Train snapshot to retire
        if remote:
            self._reconcile()
        else:
            record.adopt_ray_record(run_dir)

    def _reconcile(self) -> None:
        # [] for a new run, or one whose first upload never finished; Ray Train's entries too
        remote = record.entries(self.remote)
        self._ray_snapshot = bool(record.ray_entries(self.remote))
        self._remote_names = {e["name"] for e in remote}
        local = self.index()
        if remote and (not local or _epoch(remote[-1]) > _epoch(local[-1])
                       or (_epoch(remote[-1]) == _epoch(local[-1]) and remote[-1]["metrics"] != local[-1]["metrics"])):
            self._adopt_remote(remote, local)
            return
        # this folder matches the storage or leads it: what the storage lacks goes up now (a
        # relaunch with nothing left to train reports no new checkpoint that would carry it)
        on_storage = {e["name"]: e["metrics"] for e in remote}
        for e in local:
            e["mirrored"] = on_storage.get(os.path.basename(e["path"])) == e["metrics"]
        if local and (not all(e["mirrored"] for e in local) or set(on_storage) != {os.path.basename(e["path"]) for e in local}):
            log.info("%s leads %s: uploading what the storage lacks", self.run_dir, self.remote)
            self._mirror(local)

    def _adopt_remote(self, remote: list[dict], local: list[dict]) -> None:
        from ..paths import download_folder, join_uri

        latest = remote[-1]["name"]
        # None of this folder's own checkpoints is kept: they are older than the run's record, or
        # another attempt's; a same-named folder must not pass for the storage's copy later (the
        # test evaluation reads a local copy when there is one). Nor are interrupted downloads.
        stale = {e["path"] for e in local} | {os.path.join(self.run_dir, e["name"]) for e in remote}
        stale |= {os.path.join(self.run_dir, n) for n in os.listdir(self.run_dir) if ".tmp-" in n}
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        dest = os.path.join(self.run_dir, latest)
        download_folder(join_uri(self.remote, latest), dest)
        # every entry keeps its metrics (the best may be an earlier one); only the latest is fetched
        self._write_index([{"path": os.path.join(self.run_dir, e["name"]), "metrics": e["metrics"], "mirrored": True} for e in remote])
        log.info("%s: fetched %s from %s to resume (the storage's record is ahead of this folder's)", self.run_dir, latest, self.remote)

    def _mirror(self, entries: list[dict]) -> None:
        """Bring the storage to `entries`: the checkpoints it lacks first, then the index that
        names them, then the folders the index no longer names; then mark them mirrored here."""
        from ..paths import join_uri, remove_folder, upload_folder, write_text
        from .checkpoint import MODEL

        missing = [e for e in entries if not e.get("mirrored") and not os.path.isdir(e["path"])]
        if missing:  # never name on the storage a folder that cannot be uploaded
            log.warning("%s: not on this disk, left out of the index: %s", self.run_dir, [e["path"] for e in missing])
            entries = [e for e in entries if e not in missing]
        for e in entries:
            if not e.get("mirrored"):
                _retried(upload_folder, e["path"], join_uri(self.remote, os.path.basename(e["path"])), (MODEL,))
        names = [os.path.basename(e["path"]) for e in entries]
        _retried(write_text, join_uri(self.remote, INDEX),
                 json.dumps([{"name": n, "metrics": e["metrics"]} for n, e in zip(names, entries)], indent=1))
        for name in sorted(self._remote_names - set(names)):
            _retried(remove_folder, join_uri(self.remote, name))
        if self._ray_snapshot:  # the index names what the run keeps; Ray's snapshot may name what it dropped
            _retried(record.remove_ray_snapshot, self.remote)
            self._ray_snapshot = False
        self._remote_names = set(names)
        self._write_index([{**e, "mirrored": True} for e in entries])

    def uri(self, name: str) -> str:
        """Where checkpoint `name` lives for everyone else: its URI when mirrored, else its folder."""
        from ..paths import join_uri

        return join_uri(self.remote, name) if self.remote else os.path.join(self.run_dir, name)

    def _train_source(self):
        return self.datasets["train"]

    def _val_source(self):
        return self.datasets["val"]

    @property
    def _index_path(self) -> str:
        return os.path.join(self.run_dir, INDEX)

    def index(self) -> list[dict]:
        if not os.path.exists(self._index_path):
            return []
        with open(self._index_path) as f:
            return json.load(f)

    @contextlib.contextmanager
    def latest_checkpoint(self):
        entries = self.index()
        yield entries[-1]["path"] if entries else None

    def report(self, metrics: dict, checkpoint_dir: str | None, name: str) -> None:
        if checkpoint_dir is None:
            return
        dest = os.path.join(self.run_dir, name)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(checkpoint_dir, dest)
        entries = [e for e in self.index() if e["path"] != dest] + [{"path": dest, "metrics": metrics, "mirrored": False}]
        keep = set(e["path"] for e in best_of(entries, self.score, self.mode)[: self.keep]) | {dest}
        dropped = [e["path"] for e in entries if e["path"] not in keep]
        entries = [e for e in entries if e["path"] in keep]
        # The index first, then the removals: removed first, a crash in between left an index naming
        # a deleted folder as the latest checkpoint, and every relaunch failed to restore it.
        self._write_index(entries)  # the new entry unmirrored: a crash before the upload is repaired on restart
        for path in dropped:
            shutil.rmtree(path, ignore_errors=True)
        if self.remote:
            self._mirror(entries)

    def _write_index(self, entries: list[dict]) -> None:
        write_json(self._index_path, entries)  # the index never points at a half-written list


def _device(loader: dict) -> torch.device:
    """The GPU when the job asks for one (resources.gpus_per_worker) and CUDA sees it; without
    CUDA, the rule a Ray Train worker follows: an error, or the CPU with a warning when
    resources.cpu_fallback allows it (it trained on the CPU without a word)."""
    if not loader.get("use_gpu"):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return cpu_fallback_device(loader.get("cpu_fallback", False), 0)


def _epoch(entry: dict) -> int:
    return int(entry["metrics"].get("epoch", -1))


def _retried(fn, *args, attempts: int = 3, wait_s: float = 1.0):
    """`fn(*args)` again after 1 s and 2 s when object storage fails (OSError: what pyarrow's
    filesystems raise); the last failure propagates and ends the run, whose relaunch uploads
    whatever the storage still lacks."""
    for attempt in range(attempts):
        try:
            return fn(*args)
        except FileNotFoundError:  # nothing to retry: a local folder that is gone
            raise
        except OSError as exc:
            if attempt == attempts - 1:
                raise
            log.warning("object storage: %s failed (%s); retrying in %.0f s", fn.__name__, exc, wait_s * 2**attempt)
            time.sleep(wait_s * 2**attempt)


def best_of(entries: list[dict], score: str, mode: str) -> list[dict]:
    sign = -1 if mode == "max" else 1
    # NaN compares False both ways: in a sort it put a diverged epoch's checkpoint among the
    # kept ones and the best one out (deleted)
    scored = [e for e in entries if e["metrics"].get(score) is not None and math.isfinite(e["metrics"][score])]
    return sorted(scored, key=lambda e: sign * e["metrics"][score])
