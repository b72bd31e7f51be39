"""Run folders under crashes and concurrent launches (review of the run folder's files)."""

import json
import os

import pytest

from helpers import job
from rayload.errors import RayloadError
from rayload.paths import exclusive, local_path
from rayload.train.local_session import LocalSession


def test_a_second_launch_of_a_training_run_is_refused_while_the_first_holds_it(tmp_path, monkeypatch):
    """Two `rayload train --run-name X` at once each took the other's checkpoints for their own:
    top-k removed one run's best, and its index named the other's metrics."""
    from rayload.train.trainer import fit, run_lock

    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path))
    spec = job(str(tmp_path / "data"), train={"run_name": "X"})
    with exclusive(run_lock(str(tmp_path / "train"), "X"), "held"):  # what the first launch holds while it trains
        with pytest.raises(RayloadError, match=r"run 'X' is being trained by another process"):
            fit(spec)
    assert not os.path.exists(tmp_path / "train")  # nothing written beside the runs
    assert run_lock(str(tmp_path / "train"), "X") != run_lock(str(tmp_path / "train"), "Y")


def _checkpoint(root, tag: str) -> str:
    folder = root / f"src-{tag}"
    folder.mkdir()
    (folder / "model.pt").write_text(tag)
    return str(folder)


def test_a_crash_while_top_k_retires_a_checkpoint_leaves_an_index_of_folders_that_exist(tmp_path):
    """The dropped folders were removed before the index was written: a crash in between left the
    index naming a deleted folder as the latest, and every relaunch failed to restore it."""
    run = str(tmp_path / "X")
    session = LocalSession({}, {}, run, 1, "val_auc", "max")  # keep 1 (and the newest)
    session.report({"epoch": 0, "val_auc": 0.90}, _checkpoint(tmp_path, "e0"), "epoch_0000")
    session.report({"epoch": 1, "val_auc": 0.80}, _checkpoint(tmp_path, "e1"), "epoch_0001")

    class Killed(BaseException):
        pass

    def killed(entries):
        raise Killed()

    session._write_index = killed  # the process dies writing the index of epoch 2
    with pytest.raises(Killed):
        session.report({"epoch": 2, "val_auc": 0.85}, _checkpoint(tmp_path, "e2"), "epoch_0002")
    relaunch = LocalSession({}, {}, run, 1, "val_auc", "max")
    assert [os.path.basename(e["path"]) for e in relaunch.index()] == ["epoch_0000", "epoch_0001"]
    assert all(os.path.isdir(e["path"]) for e in relaunch.index())
    with relaunch.latest_checkpoint() as path:
        assert open(os.path.join(path, "model.pt")).read() == "e1"


def test_a_truncated_shared_run_marker_starts_the_stage_afresh_and_markers_are_written_whole(tmp_path):
    """shared_run.json was written in place; a truncated one made every rerun of the train stage
    fail with a bare JSONDecodeError."""
    from rayload._stage_runners import _dump, _shared_run

    folder = tmp_path / "pipe" / "train"
    folder.mkdir(parents=True)
    (folder / "shared_run.json").write_text('{"shared": "/tmp/revi')
    run = _shared_run("s3://bucket/runs", str(folder), "train")
    assert run.startswith("s3://bucket/runs/pipelines/pipe/train-")
    assert json.loads((folder / "shared_run.json").read_text()) == {"shared": "s3://bucket/runs", "run": run}
    assert _shared_run("s3://bucket/runs", str(folder), "train") == run  # kept: an interrupted stage resumes its run
    assert sorted(os.listdir(folder)) == ["shared_run.json"]  # no temporary file left beside it
    with pytest.raises(TypeError):  # a value JSON cannot hold: the old file stays whole
        _dump(str(folder / "shared_run.json"), {1j: 1})
    assert json.loads((folder / "shared_run.json").read_text())["run"] == run


def test_a_file_uri_names_the_folder_pyarrow_reads_it_as():
    """file:///tmp/my%20runs is /tmp/my runs to pyarrow, so to Ray Train: read literally,
    rayload's records were looked for in another folder than Ray Train wrote them to."""
    import pyarrow.fs as pafs

    uri = "file:///tmp/my%20runs/caf%C3%A9"
    _, path = pafs.FileSystem.from_uri(uri)
    assert local_path(uri) == path == "/tmp/my runs/café"
    assert local_path("/tmp/my%20runs") == "/tmp/my%20runs"  # a plain path is taken as written


def test_the_run_lock_is_one_file_whatever_the_path_spelling_or_tmpdir(tmp_path, monkeypatch):
    """Keyed on the path's text under $TMPDIR, a launch through a symlink of the storage folder,
    or under another TMPDIR (job runners set one per job), took a second lock and trained at once."""
    from rayload.train.trainer import run_lock

    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    first = run_lock(str(tmp_path / "real"), "X")
    assert run_lock(str(tmp_path / "link"), "X") == first
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert run_lock(str(tmp_path / "real"), "X") == first


def test_a_json_file_rewritten_keeps_its_old_text_when_the_new_cannot_be_written(tmp_path):
    """evaluate --out opened its file for writing and then serialised: a value that failed
    (or an interrupt, or a full disk) left an empty file where a good one was."""
    from rayload.paths import write_json

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no text")

    out = tmp_path / "metrics.json"
    write_json(str(out), {"auc": 0.8})
    with pytest.raises(RuntimeError):
        write_json(str(out), {"auc": Unprintable()})
    assert json.loads(out.read_text()) == {"auc": 0.8}
    write_json(str(out), {"auc": 0.9}, durable=True)
    assert json.loads(out.read_text()) == {"auc": 0.9} and not (tmp_path / "metrics.json.tmp").exists()


def test_files_that_may_hold_a_database_password_are_readable_by_their_owner_alone(tmp_path):
    """serve.json and search.json hold the event store's and the study's URLs as given (0644 before)."""
    import stat

    from rayload.paths import write_json
    from rayload.serve.run_state import save_state

    from rayload._tune_runs import write_state

    from rayload._stage_runners import _dump

    _dump(str(tmp_path / "manifest.json"), {"specs": {"ab": {"events": {"url": "postgresql://ab:s3cret@db/ab"}}}})
    assert stat.S_IMODE(os.stat(tmp_path / "manifest.json").st_mode) == 0o600  # a pipeline's resolved specs
    save_state(str(tmp_path), {"config": {"events_url": "postgresql://ab:s3cret@db/ab"}})
    write_state(str(tmp_path), spec={"storage": "postgresql://optuna:s3cret@db/optuna"})
    assert stat.S_IMODE(os.stat(tmp_path / "serve.json").st_mode) == stat.S_IMODE(os.stat(tmp_path / "search.json").st_mode) == 0o600
    (tmp_path / "plain.json.tmp").write_text("a crash's leftover")
    os.chmod(tmp_path / "plain.json.tmp", 0o600)
    write_json(str(tmp_path / "plain.json"), {"a": 1})
    assert stat.S_IMODE(os.stat(tmp_path / "plain.json").st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_names_too_long_for_a_folder_are_refused_at_load_naming_the_field():
    """A 250-character job name validated, then failed making its cache folder (an OSError traceback)."""
    from pydantic import ValidationError

    from rayload.pipeline_spec import PipelineSpec
    from rayload.search_spec import SearchSpec
    from rayload.spec import JobSpec

    raw = job("x.parquet").model_dump(mode="json")
    for bad, most in (({**raw, "name": "a" * 201}, 200), ({**raw, "train": {**raw["train"], "run_name": "r" * 251}}, 250)):
        with pytest.raises(ValidationError, match=rf"(name|run_name)\n  String should have at most {most} characters"):
            JobSpec.model_validate(bad)
    longest = JobSpec.model_validate({**raw, "name": "a" * 200})
    assert JobSpec.model_validate({**raw, "train": {**raw["train"], "run_name": "r" * 250}}).train.run_name == "r" * 250
    # a k-fold run of the longest name: <name>-<stamp>-fold<k> still validates (a ValidationError traceback before)
    from rayload.errors import SpecError
    from rayload.train.kfold import fold_spec
    from rayload.train.trainer import run_name_for

    assert len(fold_spec(longest, 10, 9, run_name_for(longest)).train.run_name) <= 250
    with pytest.raises(SpecError, match=r"train.run_name: too long for its fold runs' names"):
        fold_spec(longest, 10, 9, "r" * 245)
    with pytest.raises(ValidationError, match=r"name\n  String should have at most 128 characters"):
        SearchSpec.model_validate({"name": "s" * 129, "base": "b.yaml", "space": {"train.lr": {"uniform": [0.1, 0.2]}}})
    with pytest.raises(ValidationError, match=r"String should have at most 128 characters"):
        PipelineSpec.model_validate({"name": "p", "stages": [{"name": "t" * 129, "kind": "train", "spec": "j.yaml"}]})
