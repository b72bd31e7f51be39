"""LocalSession's mirroring to a remote home, without Ray: the storage is a file:// folder
(pyarrow's local filesystem, the same calls as s3://), each "machine" its own run folder.

The remote index is the run's record. A folder that lags it (the run went on elsewhere) is
dropped for the storage's latest; one that leads it (an upload failed) uploads what the storage
lacks; the storage never names a checkpoint it does not hold."""

from __future__ import annotations

import json
import os

import pytest

from rayload import paths
from rayload.train import local_session as session_mod
from rayload.train.local_session import INDEX, LocalSession


def session(folder, remote: str, keep: int = 2) -> LocalSession:
    return LocalSession({}, {}, str(folder), keep, "val_auc", "max", remote=remote)


def checkpoint(tmp_path, tag: str) -> str:
    """A scratch checkpoint folder whose one file says who wrote it."""
    path = tmp_path / "scratch" / tag
    path.mkdir(parents=True)
    (path / "model.pt").write_text(tag)
    return str(path)


def train(s: LocalSession, tmp_path, epoch: int, auc: float, who: str) -> None:
    s.report({"epoch": epoch, "val_auc": auc}, checkpoint(tmp_path, f"{who}-{epoch}"), f"epoch_{epoch:04d}")


def remote_state(store) -> tuple[list[str], set[str], dict[str, str]]:
    """(index names in order, checkpoint folders present, who wrote each folder's model.pt)."""
    names = [e["name"] for e in json.loads((store / INDEX).read_text())]
    folders = {p.name for p in store.iterdir() if p.is_dir()}
    return names, folders, {f: (store / f / "model.pt").read_text() for f in folders}


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "bucket" / "run"
    return path


def test_a_machine_behind_the_storage_resumes_from_the_storage_not_from_its_own_older_folder(tmp_path, store):
    remote = f"file://{store}"
    a = session(tmp_path / "a", remote)
    for epoch, auc in enumerate([0.70, 0.72, 0.74]):
        train(a, tmp_path, epoch, auc, "A")
    b = session(tmp_path / "b", remote)  # another machine: fetches epoch 2, trains 3 (the best) and 4
    with b.latest_checkpoint() as path:
        assert path.endswith("epoch_0002") and open(os.path.join(path, "model.pt")).read() == "A-2"
    train(b, tmp_path, 3, 0.80, "B")
    train(b, tmp_path, 4, 0.78, "B")
    assert remote_state(store)[:2] == (["epoch_0003", "epoch_0004"], {"epoch_0003", "epoch_0004"})
    again = session(tmp_path / "a", remote)  # back on the first machine, whose folder stops at epoch 2
    with again.latest_checkpoint() as path:
        assert path.endswith("epoch_0004") and open(os.path.join(path, "model.pt")).read() == "B-4"
    assert not os.path.exists(tmp_path / "a" / "epoch_0002")  # its own older checkpoints are gone
    assert not os.path.exists(tmp_path / "a" / "epoch_0003")  # the best is on the storage only: read from there
    assert [e["metrics"]["epoch"] for e in again.index()] == [3, 4]
    train(again, tmp_path, 5, 0.79, "A")
    names, folders, writers = remote_state(store)
    assert names == ["epoch_0003", "epoch_0005"] and folders == set(names)
    assert writers["epoch_0003"] == "B-3"  # the run's best was not overwritten by a retrained epoch


def test_a_failed_upload_is_never_named_by_the_storage_and_goes_up_on_the_relaunch(tmp_path, store, monkeypatch):
    remote = f"file://{store}"
    a = session(tmp_path / "a", remote)
    train(a, tmp_path, 0, 0.70, "A")
    real, attempts = paths.upload_folder, []
    monkeypatch.setattr(session_mod.time, "sleep", lambda s: None)

    def failing_upload(*args):
        attempts.append(args)
        raise OSError("503 Slow Down")

    monkeypatch.setattr(paths, "upload_folder", failing_upload)
    with pytest.raises(OSError, match="503"):
        train(a, tmp_path, 1, 0.90, "A")  # the best epoch; its upload fails three times and the run ends
    assert len(attempts) == 3  # retried twice before giving up
    assert remote_state(store)[:2] == (["epoch_0000"], {"epoch_0000"})  # the storage still names only what it has
    assert [e["mirrored"] for e in a.index()] == [True, False]
    monkeypatch.setattr(paths, "upload_folder", real)
    relaunched = session(tmp_path / "a", remote)  # same machine: this folder leads, so it uploads first
    names, folders, writers = remote_state(store)
    assert names == ["epoch_0000", "epoch_0001"] and folders == set(names) and writers["epoch_0001"] == "A-1"
    assert all(e["mirrored"] for e in relaunched.index())
    with relaunched.latest_checkpoint() as path:
        assert path.endswith("epoch_0001")


def test_keep_checkpoints_holds_on_the_storage_and_the_index_matches_its_folders(tmp_path, store):
    remote = f"file://{store}"
    a = session(tmp_path / "a", remote, keep=1)
    for epoch, auc in enumerate([0.70, 0.75, 0.73, 0.74]):
        train(a, tmp_path, epoch, auc, "A")
        names, folders, _ = remote_state(store)
        assert folders == set(names) and len(names) <= 2
    assert remote_state(store)[0] == ["epoch_0001", "epoch_0003"]  # the best and the latest
    fresh = session(tmp_path / "elsewhere", remote)
    assert [os.path.basename(e["path"]) for e in fresh.index()] == ["epoch_0001", "epoch_0003"]
    assert sorted(n for n in os.listdir(tmp_path / "elsewhere") if n.startswith("epoch_")) == ["epoch_0003"]


def test_a_leftover_folder_named_like_a_storage_checkpoint_is_not_taken_for_it(tmp_path, store):
    remote = f"file://{store}"
    a = session(tmp_path / "a", remote)
    train(a, tmp_path, 0, 0.80, "A")
    train(a, tmp_path, 1, 0.70, "A")
    stale = tmp_path / "b" / "epoch_0000"  # an earlier interrupted attempt on machine b
    stale.mkdir(parents=True)
    (stale / "model.pt").write_text("stale")
    (tmp_path / "b" / "epoch_0001.tmp-1234").mkdir()  # a download cut off by a kill
    b = session(tmp_path / "b", remote)
    assert not stale.exists() and not (tmp_path / "b" / "epoch_0001.tmp-1234").exists()
    with b.latest_checkpoint() as path:
        assert open(os.path.join(path, "model.pt")).read() == "A-1"
