"""`rayload run`'s bookkeeping (fake stage runners, no Ray): a --set that resolves to the same
spec skips, stage names with dots take --set, an unreadable stage.json re-runs its stage,
manifest.json's data hashes are content hashes and a prepare stage's seed is its split seed,
the git commit is rayload's own, and names that collide with the run folder's files or other
commands' folders are refused."""

import json
import os
import subprocess

import pytest
import yaml

from helpers import COLUMNS, frame
from rayload import _stage_runners as runners
from rayload import stages
from rayload.errors import RayloadError, SpecError
from rayload.pipeline_spec import PipelineSpec, load_pipeline, split_overrides


@pytest.fixture
def pipe(tmp_path, monkeypatch):
    """A one-train-stage pipeline file over a small parquet file, with the real plan (so the
    fingerprint is the resolved job spec's) and a fake train runner."""
    import itertools

    counter = itertools.count(1)
    monkeypatch.setattr(runners, "train", lambda spec, stage, folder, outputs, address, progress: {"checkpoint": f"ckpt-v{next(counter)}"})
    monkeypatch.setattr(stages, "_ray_for_direct_ingress", lambda spec, address: None)
    frame(200).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "j.yaml").write_text(yaml.safe_dump({"name": "j", "data": {"source": {"kind": "parquet", "path": str(tmp_path / "d.parquet")},
                                                                          "columns": COLUMNS, "label": {"column": "y"}},
                                                     "train": {"epochs": 2}}))
    (tmp_path / "pipe.yaml").write_text("name: p\nstages:\n  - {name: base, kind: train, job: j.yaml}\n")
    return str(tmp_path / "pipe.yaml")


def _outcomes(result) -> dict:
    return {s.name: s.outcome for s in result.stages}


def test_a_set_that_resolves_to_the_same_spec_is_skipped(pipe):
    """The fingerprint hashed the literal `set` list: --set of the value already in the file
    (as `rayload demo` sets the A/B port), or the same sets in another order, re-ran the stage
    and wiped its finished outputs."""
    assert _outcomes(stages.run(load_pipeline(pipe), "s")) == {"base": "ok"}
    again = stages.run(load_pipeline(pipe, ["base.train.epochs=2"]), "s")
    assert _outcomes(again) == {"base": "skipped"} and again.outputs("base")["checkpoint"] == "ckpt-v1"
    assert _outcomes(stages.run(load_pipeline(pipe, ["base.train.epochs=3", "base.train.lr=0.01"]), "s")) == {"base": "ok"}
    assert _outcomes(stages.run(load_pipeline(pipe, ["base.train.lr=0.01", "base.train.epochs=3"]), "s")) == {"base": "skipped"}
    assert _outcomes(stages.run(load_pipeline(pipe, ["base.train.epochs=4"]), "s")) == {"base": "ok"}  # a real change still runs


def test_an_unreadable_stage_json_runs_its_stage_again(pipe):
    """A zero-length stage.json (a crash before the disk had it) raised a bare JSONDecodeError
    naming no file, and the stage could not run until someone deleted it."""
    first = stages.run(load_pipeline(pipe), "c")
    with open(os.path.join(first.run_dir, "base", "stage.json"), "w"):
        pass
    assert _outcomes(stages.run(load_pipeline(pipe), "c")) == {"base": "ok"}
    assert _outcomes(stages.run(load_pipeline(pipe), "c")) == {"base": "skipped"}


def test_a_stage_name_with_dots_takes_its_sets():
    spec = PipelineSpec.model_validate({"name": "p", "stages": [{"name": "base", "kind": "train", "job": "a.yaml"},
                                                                {"name": "base.v2", "kind": "train", "job": "b.yaml"}]})
    assert split_overrides(spec, ["base.v2.train.epochs=3", "base.train.lr=0.1", "name=q"]) == (
        ["name=q"], {"base.v2": ["train.epochs=3"], "base": ["train.lr=0.1"]})


def test_manifest_records_content_hashes_and_the_seed_that_shaped_each_stage(tmp_path, monkeypatch):
    """data_hashes held the shard cache's key (input paths, sizes, mtimes): the same bytes at
    another path differed, a touch changed it. A prepare stage recorded train.seed, not the
    split seed that shaped its data."""
    monkeypatch.setattr(runners, "prepare", lambda spec, stage, folder, outputs, address, progress, force=False:
                        {"data_hash": "content-abc", "cache_key": "key"})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps({"data_hash": "content-abc"}))
    monkeypatch.setattr(runners, "train", lambda spec, stage, folder, outputs, address, progress: {"checkpoint": str(ckpt)})
    monkeypatch.setattr(stages, "_ray_for_direct_ingress", lambda spec, address: None)
    frame(200).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "j.yaml").write_text(yaml.safe_dump({"name": "j", "data": {"source": {"kind": "parquet", "path": str(tmp_path / "d.parquet")},
                                                                          "columns": COLUMNS, "label": {"column": "y"}},
                                                     "split": {"seed": 7}, "train": {"seed": 3}}))
    (tmp_path / "pipe.yaml").write_text("name: p\nstages:\n  - {name: prep, kind: prepare, job: j.yaml}\n"
                                        "  - {name: base, kind: train, job: j.yaml}\n")
    result = stages.run(load_pipeline(str(tmp_path / "pipe.yaml")), "m")
    with open(os.path.join(result.run_dir, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["data_hashes"] == {"prep": "content-abc", "base": "content-abc"}
    assert set(manifest["data_cache_keys"]) == {"prep", "base"} and manifest["data_cache_keys"]["prep"] != "content-abc"
    assert manifest["seeds"] == {"prep": 7, "base": 3}


def test_the_manifests_git_commit_is_rayloads_whatever_the_working_directory(tmp_path, monkeypatch):
    """`git rev-parse HEAD` ran in the working directory: from another repository its commit was
    recorded as rayload's code version, from outside any repository None."""
    from rayload.train.trainer import _git_commit

    package = os.path.dirname(os.path.dirname(os.path.abspath(runners.__file__)))
    own = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=package).stdout.strip()
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=other, check=True)
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"], cwd=other, check=True)
    monkeypatch.delenv("RAYLOAD_GIT_COMMIT", raising=False)
    monkeypatch.chdir(other)
    assert own and _git_commit() == own


@pytest.mark.parametrize("name", ["manifest.json", "report.html", "x.tmp"])
def test_a_stage_named_like_a_file_of_the_run_folder_is_refused(name):
    """A stage folder named manifest.json ran, then the manifest's write raised IsADirectoryError."""
    with pytest.raises(Exception, match="names a file of the run folder"):
        PipelineSpec.model_validate({"name": "p", "stages": [{"name": name, "kind": "train", "job": "a.yaml"}]})


@pytest.mark.parametrize("run_id, message", [("compressed", "is reserved"), ("retrain", "is reserved"),
                                             ("r" * 300, "at most 128 characters")])
def test_run_ids_of_other_commands_folders_or_past_a_file_name_are_refused(fake_runners, run_id, message):
    """runs/compressed/ holds compress's scratch copies, which a run with that id deleted as
    unknown stage folders; a 300-character id was an OSError traceback."""
    spec = PipelineSpec.model_validate({"name": "p", "stages": [{"name": "remote", "kind": "train", "job": "a.yaml"}]})
    with pytest.raises(RayloadError, match=message):
        stages.run(spec, run_id)
