"""Preprocessing cache and inputs review fixes (2026-11-27), in one process without Ray: an
explicit --out folder that is not a preprocessing output is refused (it was emptied whole, inputs
included); a glob's * stays within one folder and skips hidden names, and a data folder holding
runs/ does not read the cache's shards; a moved cache entry reads its shards where it is now; a
path with [ that exists is read as written."""

import os
import shutil

import pytest

from helpers import frame, job
from rayload.data.pipeline import preprocess
from rayload.data.sources import _expand
from rayload.errors import DataError


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    monkeypatch.delenv("RAYLOAD_CACHE", raising=False)
    return tmp_path / "runs"


def _csv(path, rows=300, seed=1):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    frame(rows, seed=seed).to_csv(path, index=False)
    return str(path)


def test_an_out_folder_that_is_not_a_preprocessing_output_is_refused_and_left_as_it_was(tmp_path, home):
    data = tmp_path / "data"
    source = _csv(data / "events.csv")
    (data / "NOTES.txt").write_text("mine")
    with pytest.raises(DataError, match=r"--out .*/data: holds the input file .*events.csv"):
        preprocess(job(str(data), "csv"), out=str(data), engine="local")
    other = tmp_path / "other"
    other.mkdir()
    (other / "NOTES.txt").write_text("mine")
    with pytest.raises(DataError, match=r"--out .*/other: not empty and not a preprocessing output \(it holds NOTES.txt\)"):
        preprocess(job(source, "csv"), out=str(other), engine="local")
    assert sorted(os.listdir(data)) == ["NOTES.txt", "events.csv"] and os.listdir(other) == ["NOTES.txt"]
    out = tmp_path / "shards"
    first = preprocess(job(source, "csv"), out=str(out), engine="local")  # new: written
    again = preprocess(job(source, "csv", split={"seed": 3}), out=str(out), engine="local")  # its own output: replaced
    assert first.counts["good"] == again.counts["good"] == 300 and set(os.listdir(out)) <= {"train", "val", "test", "quarantine",
                                                                                           "features.json", "summary.json", "_SUCCESS"}


def test_a_dataset_laid_out_as_train_val_test_is_not_taken_for_an_earlier_output(tmp_path, home):
    """Folder names alone passed the check: --out mydata (train/ val/ test/ of the user's own
    files, a features.json of theirs) deleted every file in them and overwrote features.json."""
    source = _csv(tmp_path / "in" / "events.csv")
    mine = tmp_path / "mydata"
    for name in ("train/raw-2024.csv", "train/README.txt", "val/raw.csv"):
        (mine / name).parent.mkdir(parents=True, exist_ok=True)
        (mine / name).write_text("a,b\n")
    (mine / "features.json").write_text('{"mine": 1}')
    with pytest.raises(DataError, match=r"--out .*/mydata: not empty and not a preprocessing output \(it holds train/README.txt, "
                                         r"train/raw-2024.csv, val/raw.csv\)"):
        preprocess(job(source, "csv"), out=str(mine), engine="local")
    only = tmp_path / "only"
    only.mkdir()
    (only / "features.json").write_text('{"mine": 1}')
    with pytest.raises(DataError, match=r"not a preprocessing output \(it holds features.json\)"):
        preprocess(job(source, "csv"), out=str(only), engine="local")
    assert (mine / "train" / "README.txt").exists() and (mine / "features.json").read_text() == '{"mine": 1}'
    assert (only / "features.json").read_text() == '{"mine": 1}'


def test_a_glob_star_stays_in_its_folder_and_skips_hidden_names(tmp_path, home):
    d = tmp_path / "d"
    for name in ("a.csv", "old/b.csv", ".a.csv", "_c.csv"):
        _csv(d / name)
    assert [os.path.relpath(p, d) for p in _expand(str(d / "*.csv"), "csv")[1]] == ["a.csv"]
    assert sorted(os.path.relpath(p, d) for p in _expand(str(d / "**" / "*.csv"), "csv")[1]) == ["a.csv", "old/b.csv"]
    assert [os.path.relpath(p, d) for p in _expand(str(d / ".*.csv"), "csv")[1]] == [".a.csv"]  # asked for by name


def test_a_data_folder_holding_runs_does_not_read_the_caches_shards_on_the_next_run(tmp_path, monkeypatch):
    project = tmp_path / "project"
    _csv(project / "events.csv")
    monkeypatch.chdir(project)
    monkeypatch.delenv("RAYLOAD_HOME", raising=False)
    monkeypatch.delenv("RAYLOAD_CACHE", raising=False)
    (project / "runs" / "cache" / "x").mkdir(parents=True)
    _csv(project / "runs" / "cache" / "x" / "stale.csv")
    (project / ".venv").mkdir()
    _csv(project / ".venv" / "lib.csv")
    for item in (str(project), str(project / "*.csv"), str(project / "**" / "*.csv")):
        assert [os.path.basename(p) for p in _expand(item, "csv")[1]] == ["events.csv"], item
    assert [os.path.basename(p) for p in _expand(str(project / "runs" / "cache" / "x"), "csv")[1]] == ["stale.csv"]  # named: read


def test_a_moved_cache_entry_reads_its_shards_where_it_is_now(tmp_path, monkeypatch):
    source = _csv(tmp_path / "in" / "events.csv")
    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache1"))
    first = preprocess(job(source, "csv"), engine="local")
    shutil.move(str(tmp_path / "cache1"), str(tmp_path / "cache2"))
    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache2"))
    moved = preprocess(job(source, "csv"), engine="local")
    assert moved.cached and moved.out_dir.startswith(str(tmp_path / "cache2"))
    assert all(p.startswith(str(tmp_path / "cache2")) and os.path.isfile(p) for paths in moved.files.values() for p in paths)
    assert sum(1 for _ in moved.batches("train").iter_batches(batch_size=64)) > 0 and moved.data_hash == first.data_hash


def test_a_path_with_glob_characters_that_exists_is_read_as_written(tmp_path):
    path = _csv(tmp_path / "exports[2024]" / "events.csv")
    assert _expand(path, "csv")[1] == [path]


def test_a_glob_naming_folders_reads_their_files_as_a_folder_source_does(tmp_path):
    events = tmp_path / "events"
    for day in ("dt=2024-06-01", "dt=2024-06-02", "dt=2024-07-01"):
        _csv(events / day / "part-0.csv")
        (events / day / "_SUCCESS").write_text("")
    _csv(events / "dt=2024-06-01" / ".hidden" / "x.csv")
    found = [os.path.relpath(p, events) for p in _expand(str(events / "dt=2024-06-*"), "csv")[1]]
    assert sorted(found) == ["dt=2024-06-01/part-0.csv", "dt=2024-06-02/part-0.csv"]


@pytest.mark.parametrize("damage", ["shard", "summary", "summary-keys", "features"])
def test_a_cache_entry_damaged_after_it_was_finished_is_written_again(tmp_path, home, damage):
    """A removed shard was reused (its rows counted, then a FileNotFoundError traceback when read);
    a truncated summary.json or features.json failed every later run with a traceback."""
    import glob
    import json

    spec = job(_csv(tmp_path / "in" / "events.csv"), "csv")
    first = preprocess(spec, engine="local")
    if damage == "shard":
        os.remove(first.files["val"][0])
    elif damage == "summary":
        with open(os.path.join(first.out_dir, "summary.json"), "r+") as f:
            f.truncate(20)
    elif damage == "summary-keys":
        with open(os.path.join(first.out_dir, "summary.json"), "w") as f:
            json.dump({}, f)
    else:
        with open(os.path.join(first.out_dir, "features.json"), "r+") as f:
            f.truncate(20)
    again = preprocess(spec, engine="local")
    assert not again.cached and again.out_dir == first.out_dir and again.counts["split_rows"] == first.counts["split_rows"]
    assert all(os.path.exists(p) for split in again.files.values() for p in split)
    assert preprocess(spec, engine="local").cached  # whole again: reused
    assert len(glob.glob(os.path.join(first.out_dir, "val", "*.parquet"))) == len(again.files["val"])


def test_a_finished_entry_in_a_cache_that_cannot_be_written_is_read_and_a_new_one_is_refused_by_folder(tmp_path, home, monkeypatch):
    """The entry's lock file was opened for writing before the finished entry was looked at: a
    read-only cache could not even be reused (an OSError traceback naming the lock file)."""
    import errno

    from rayload.data import pipeline

    spec = job(_csv(tmp_path / "in" / "events.csv"), "csv")
    first = preprocess(spec, engine="local")

    def read_only(entry):
        raise OSError(errno.EROFS, "Read-only file system", f"{entry}.lock")

    monkeypatch.setattr(pipeline, "cache_lock", read_only)
    assert preprocess(spec, engine="local").out_dir == first.out_dir  # finished: read without the lock
    with pytest.raises(DataError, match=r"cannot write the preprocessed data to .*preprocessed/t-[0-9a-f]+ \(Read-only file "
                                        r"system\); point RAYLOAD_CACHE at a writable folder"):
        preprocess(job(str(tmp_path / "in" / "events.csv"), "csv", split={"seed": 5}), engine="local")


def test_a_second_writer_of_one_out_folder_is_refused(tmp_path, home):
    """Two processes writing one --out at once mixed their shards under one summary."""
    from rayload.paths import exclusive, lock_file

    source = _csv(tmp_path / "in" / "events.csv")
    out = tmp_path / "shards"
    with exclusive(lock_file(str(out)), "held"):  # as another process writing it would hold it
        with pytest.raises(Exception, match=r"--out .*/shards is being written by another process"):
            preprocess(job(source, "csv"), out=str(out), engine="local")
    assert preprocess(job(source, "csv"), out=str(out), engine="local").counts["good"] == 300


def test_a_process_waiting_for_a_cache_entry_says_so(tmp_path, caplog):
    """It sat silent for as long as the other process's preprocessing took."""
    import fcntl
    import logging
    import threading

    from rayload.paths import cache_lock

    entry = str(tmp_path / "preprocessed" / "t-0123")
    (tmp_path / "preprocessed").mkdir()
    holder = open(f"{entry}.lock", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(0.3, lambda: (fcntl.flock(holder, fcntl.LOCK_UN), holder.close())).start()
    with caplog.at_level(logging.WARNING, logger="rayload.data"):
        with cache_lock(entry):
            pass
    assert f"waiting for another process writing {entry}" in caplog.text


def test_a_full_disk_is_named_with_the_folder(tmp_path, home, monkeypatch):
    """Arrow's 'No space left on device' reached the user as a traceback naming no folder."""
    from rayload.data import _batch

    def full(*args, **kwargs):
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(_batch.pq, "write_table", full)
    with pytest.raises(DataError, match=r"cannot write the preprocessed shards to .*/shards \(.*No space left on device\); "
                                        r"free space there"):
        preprocess(job(_csv(tmp_path / "in" / "events.csv"), "csv"), out=str(tmp_path / "shards"), engine="local")


def test_an_earlier_output_with_a_hidden_file_is_ours_and_empty_split_folders_are_not(tmp_path, home):
    """Review of the --out check: a .DS_Store Finder left in train/ made an earlier output
    foreign; empty train/ val/ test/ folders beside someone's features.json passed as ours."""
    source = _csv(tmp_path / "in" / "events.csv")
    out = tmp_path / "shards"
    preprocess(job(source, "csv"), out=str(out), engine="local")
    (out / "train" / ".DS_Store").write_text("finder")
    assert preprocess(job(source, "csv", split={"seed": 4}), out=str(out), engine="local").counts["good"] == 300
    mine = tmp_path / "mine"
    for split in ("train", "val", "test"):
        (mine / split).mkdir(parents=True)
    (mine / "features.json").write_text('{"mine": 1}')
    with pytest.raises(DataError, match=r"not a preprocessing output \(it holds features.json\)"):
        preprocess(job(source, "csv"), out=str(mine), engine="local")
    assert (mine / "features.json").read_text() == '{"mine": 1}'
