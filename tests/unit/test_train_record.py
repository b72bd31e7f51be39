"""One record of a run's checkpoints for both training paths (train/record.py): a relaunch with
another worker count takes the other path and resumes from the checkpoint the first one wrote.
Ray Train's snapshot is written here with Ray's own state classes, as its checkpoint manager does."""

from __future__ import annotations

import json
import os
import shutil

from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState, _TrainingResultState

from rayload.train import record
from rayload.train.local_session import INDEX, LocalSession


def ray_run(home, epochs_aucs: list[tuple[int, float]], keep: int = 2) -> None:
    """What a Ray Train launch leaves: epoch folders and Ray's snapshot (its top-k by val_auc, and the latest)."""
    os.makedirs(home, exist_ok=True)
    results = []
    for epoch, auc in epochs_aucs:
        name = f"epoch_{epoch:04d}"
        os.makedirs(os.path.join(home, name))
        open(os.path.join(home, name, "model.pt"), "w").write(f"ray-{epoch}")
        results.append(_TrainingResultState(checkpoint_dir_name=name, metrics={"epoch": epoch, "val_auc": auc}))
    kept = sorted(results, key=lambda r: r.metrics["val_auc"])[-keep:]
    for r in results:  # Ray deletes what it does not keep, except the latest
        if r not in kept and r is not results[-1]:
            shutil.rmtree(os.path.join(home, r.checkpoint_dir_name))
    state = _CheckpointManagerState(checkpoint_results=kept, checkpoint_report_indices=list(range(len(kept))),
                                    latest_checkpoint_result=results[-1], pending_training_results=[],
                                    pending_validation_specs=[], current_report_index=len(results),
                                    validated_checkpoint_dir_names=[], timed_out_validation_checkpoint_dir_names=[],
                                    failed_validation_checkpoint_dir_names=[])
    open(os.path.join(home, record.RAY_SNAPSHOT), "w").write(state.model_dump_json())


def scratch(tmp_path, tag: str) -> str:
    path = tmp_path / "scratch" / tag
    path.mkdir(parents=True)
    (path / "model.pt").write_text(tag)
    return str(path)


def session(folder, keep: int = 2, remote: str | None = None) -> LocalSession:
    return LocalSession({}, {}, str(folder), keep, "val_auc", "max", remote=remote)


def test_an_in_process_relaunch_resumes_from_the_ray_launchs_latest_and_keeps_one_top_k(tmp_path):
    home = tmp_path / "run"
    ray_run(str(home), [(0, 0.70), (1, 0.75), (2, 0.72)])  # Ray kept epochs 1 and 2 (the latest)
    s = session(home)
    with s.latest_checkpoint() as path:
        assert path == str(home / "epoch_0002") and open(os.path.join(path, "model.pt")).read() == "ray-2"
    assert not (home / record.RAY_SNAPSHOT).exists()  # a later Ray launch must not resume from it
    assert [os.path.basename(e["path"]) for e in s.index()] == ["epoch_0001", "epoch_0002"]
    s.report({"epoch": 3, "val_auc": 0.80}, scratch(tmp_path, "local-3"), "epoch_0003")
    assert sorted(p.name for p in home.iterdir() if p.is_dir()) == ["epoch_0001", "epoch_0003"]  # top-2 over both paths
    assert [e["name"] for e in record.entries(str(home))] == ["epoch_0001", "epoch_0003"]


def test_a_ray_launch_resumes_from_an_in_process_checkpoint_newer_than_its_snapshot(tmp_path):
    home = tmp_path / "run"
    assert record.ray_resume_point(str(home)) is None  # a new run
    s = session(home)
    s.report({"epoch": 0, "val_auc": 0.7}, scratch(tmp_path, "local-0"), "epoch_0000")
    assert record.ray_resume_point(str(home)) == str(home / "epoch_0000")  # no snapshot: Ray would start afresh

    ray_run(str(home), [(1, 0.74)])  # Ray went on from it: its snapshot holds the latest, Ray resumes by itself
    assert record.ray_resume_point(str(home)) is None
    assert [e["name"] for e in record.entries(str(home))] == ["epoch_0000", "epoch_0001"]

    s2 = session(home)  # in-process again: Ray's entries join the index, its snapshot goes
    with s2.latest_checkpoint() as path:
        assert path == str(home / "epoch_0001")
    s2.report({"epoch": 2, "val_auc": 0.73}, scratch(tmp_path, "local-2"), "epoch_0002")
    assert record.ray_resume_point(str(home)) == str(home / "epoch_0002")  # and Ray, launched again, resumes from it


def test_a_stale_ray_snapshot_joins_the_index_and_the_run_resumes_from_its_latest(tmp_path):
    home = tmp_path / "run"
    ray_run(str(home), [(0, 0.70)])
    # an in-process launch that did not start through LocalSession's adoption (a run folder from before it)
    (home / "epoch_0001").mkdir()
    (home / INDEX).write_text(json.dumps([{"path": str(home / "epoch_0001"), "metrics": {"epoch": 1, "val_auc": 0.71}, "mirrored": False}]))
    assert record.latest(str(home))["name"] == "epoch_0001"
    assert record.ray_resume_point(str(home)) == str(home / "epoch_0001")
    assert not (home / record.RAY_SNAPSHOT).exists()
    assert [os.path.basename(e["path"]) for e in json.loads((home / INDEX).read_text())] == ["epoch_0000", "epoch_0001"]


def test_a_ray_record_on_the_storage_is_the_runs_record_for_a_mirrored_in_process_launch(tmp_path):
    store = tmp_path / "bucket" / "run"
    ray_run(str(store), [(0, 0.70), (1, 0.72)])
    s = session(tmp_path / "machine", remote=f"file://{store}")
    with s.latest_checkpoint() as path:
        assert open(os.path.join(path, "model.pt")).read() == "ray-1"
    s.report({"epoch": 2, "val_auc": 0.71}, scratch(tmp_path, "local-2"), "epoch_0002")
    assert [e["name"] for e in json.loads((store / INDEX).read_text())] == ["epoch_0001", "epoch_0002"]
    assert not (store / record.RAY_SNAPSHOT).exists() and not (store / "epoch_0000").exists()
