"""A run folder's checkpoints, whichever training path wrote them.

Both paths keep a record in the run's folder (`<storage>/<run>`, local or on object storage):
- in-process (one worker, `LocalSession`): `checkpoints.json`, the kept checkpoints and their
  metrics (a local folder's entries name their paths, a storage's their folder names);
- Ray Train (`TorchTrainer`): `checkpoint_manager_snapshot.json`, Ray's checkpoint manager's
  state, which Ray itself reads when a run of the same name starts again.
A relaunch with another worker count takes the other path (`workers: 1` <-> `workers: 2`), so
both read the run's checkpoints here, merged and ordered by epoch. Each path takes over the
other's entries when it starts, so that a checkpoint folder is named by one record at a time:
the in-process path moves Ray's entries into its index (its top-k may then drop those folders,
which no snapshot names any more); the Ray path does the same when its snapshot is older than
the run's latest checkpoint, and tells the workers where to resume (`ray_resume_point`), since
Ray resumes from its own snapshot only.
"""

from __future__ import annotations

import json
import logging
import os

from ..paths import is_remote, join_uri, local_path, plain_name, read_text, write_text

log = logging.getLogger(__name__)

INDEX = "checkpoints.json"
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def epoch_of(entry: dict) -> int:
    return int(entry["metrics"].get("epoch", -1))


def _read_json(uri: str):
    try:
        return json.loads(read_text(uri))
    except FileNotFoundError:
        return None


def index_entries(home: str) -> list[dict]:
    """The in-process record: [{"name", "metrics"}] (a local folder's index names paths)."""
    return [{"name": e.get("name") or os.path.basename(e["path"]), "metrics": e["metrics"]}
            for e in _read_json(join_uri(home, INDEX)) or []]


def ray_entries(home: str) -> list[dict]:
    """Ray Train's record: the checkpoints its snapshot keeps and its latest, by epoch."""
    return _snapshot_entries(_read_json(join_uri(home, RAY_SNAPSHOT)) or {})


def _snapshot_entries(snapshot: dict) -> list[dict]:
    results = [*(snapshot.get("checkpoint_results") or []), *filter(None, [snapshot.get("latest_checkpoint_result")])]
    named = {r["checkpoint_dir_name"]: {"name": r["checkpoint_dir_name"], "metrics": r.get("metrics") or {}} for r in results}
    return sorted(named.values(), key=lambda e: (epoch_of(e), e["name"]))


def entries(home: str) -> list[dict]:
    """Every checkpoint either record names, oldest epoch first: [{"name", "path", "metrics"}].
    A name that is not one folder name (../x: the records may come from object storage) is left out."""
    named = {e["name"]: e for e in index_entries(home)}
    named.update({e["name"]: e for e in ray_entries(home)})  # a snapshot exists only while it is the newer record
    for name in [n for n in named if not plain_name(n)]:
        log.warning("%s: the checkpoint record names %r, which is not a folder name; left out", home, name)
        del named[name]
    return [dict(e, path=_path(join_uri(home, e["name"]))) for e in sorted(named.values(), key=lambda e: (epoch_of(e), e["name"]))]


def _path(uri: str) -> str:
    """A checkpoint as the rest of rayload names it: a URI on object storage, else a local path."""
    return uri if is_remote(uri) else local_path(uri)


def latest(home: str) -> dict | None:
    found = entries(home)
    return found[-1] if found else None


def adopt_ray_record(home: str) -> bool:
    """Move Ray's entries into the in-process index and remove Ray's snapshot (so Ray, started
    again, does not resume from a record older than the run); True when there was one."""
    snapshot = _read_json(join_uri(home, RAY_SNAPSHOT))
    if snapshot is None:
        return False
    ray = _snapshot_entries(snapshot)
    local = not is_remote(home)
    own = _read_json(join_uri(home, INDEX)) or []
    names = {e.get("name") or os.path.basename(e["path"]) for e in own}
    for e in ray:
        if e["name"] in names or (local and not os.path.isdir(os.path.join(local_path(home), e["name"]))):
            continue
        own.append({"path": os.path.join(local_path(home), e["name"]), "metrics": e["metrics"], "mirrored": False} if local
                   else {"name": e["name"], "metrics": e["metrics"]})
    own.sort(key=lambda e: (epoch_of(e), e.get("name") or os.path.basename(e["path"])))
    write_text(join_uri(home, INDEX), json.dumps(own, indent=1))
    remove_ray_snapshot(home)
    log.info("%s: Ray Train's checkpoints (%s) joined the run's index", home, ", ".join(e["name"] for e in ray) or "none")
    return True


def remove_ray_snapshot(home: str) -> None:
    path = join_uri(home, RAY_SNAPSHOT)
    if not is_remote(path):
        try:
            os.remove(local_path(path))
        except FileNotFoundError:
            pass
        return
    import pyarrow.fs as pafs

    fs, where = pafs.FileSystem.from_uri(path)
    if fs.get_file_info(where).type == pafs.FileType.File:
        fs.delete_file(where)


def ray_resume_point(home: str) -> str | None:
    """Where a Ray Train launch of the run at `home` resumes when Ray's own snapshot does not
    hold the run's latest checkpoint (the run went on in-process, or began there): that
    checkpoint, after Ray's older entries joined the index. None when Ray's snapshot holds the
    latest (Ray resumes from it) or the run has no checkpoint."""
    last = latest(home)
    if last is None:
        return None
    ray = ray_entries(home)
    if ray and ray[-1]["name"] == last["name"]:
        return None
    if ray:
        adopt_ray_record(home)
    log.info("%s: resuming from %s, written in-process (Ray Train's own record is older or absent)", home, last["name"])
    return last["path"]
