"""Pipeline review fixes (2026-11-27), without Ray: a second `rayload run` of a run id in use is
refused (it re-ran the first one's running stage in the same folder); a stage folder without
stage.json is emptied before the stage runs; a checkpoint named by a file:// URI is
fingerprinted by its model.pt; `rayload submit` refuses a stage file the upload would leave out."""

import os
import threading

import pytest
import yaml

from _ops import JOB
from rayload import _stage_runners as runners
from rayload import ops, stages
from rayload.errors import RayloadError, SpecError
from rayload.pipeline_spec import PipelineSpec

SPEC = PipelineSpec.model_validate({"name": "p", "stages": [{"name": "baseline", "kind": "train", "job": "x.yaml"}]})


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    return tmp_path / "runs"


def test_a_second_run_of_a_run_id_in_use_is_refused_while_the_first_runs(fake_runners, home, monkeypatch):
    inside, release, seen = threading.Event(), threading.Event(), []

    def slow(spec, stage, folder, outputs, address, progress):
        seen.append(folder)
        inside.set()
        release.wait(10)
        return {"checkpoint": "ckpt"}

    monkeypatch.setattr(runners, "train", slow)
    first = threading.Thread(target=lambda: stages.run(SPEC, "same"))
    first.start()
    assert inside.wait(10)
    try:
        with pytest.raises(RayloadError, match=r"run 'same' .* is being run by another process"):
            stages.run(SPEC, "same")
    finally:
        release.set()
        first.join(10)
    assert len(seen) == 1
    assert [s.outcome for s in stages.run(SPEC, "same").stages] == ["skipped"]  # free again once the first ended


def test_a_stage_folder_without_stage_json_is_emptied_before_the_stage_runs(fake_runners, home, monkeypatch):
    found = []
    monkeypatch.setattr(runners, "train", lambda spec, stage, folder, outputs, address, progress:
                        found.append(sorted(os.listdir(folder))) or {"checkpoint": "ckpt"})
    folder = home / "r" / "baseline"
    (folder / "run").mkdir(parents=True)
    (folder / "run" / "old-checkpoint").write_text("from other inputs")
    stages.run(SPEC, "r")
    assert found == [["stage.json"]] and not [n for n in os.listdir(home / "r") if ".old-" in n]


def test_a_file_uri_checkpoint_is_fingerprinted_by_its_model(tmp_path):
    ck = tmp_path / "champion"
    ck.mkdir()
    (ck / "model.pt").write_bytes(b"v1")
    before = runners._arm_identity({"checkpoint": f"file://{ck}"})
    assert before == runners._arm_identity({"checkpoint": str(ck)}) and "missing" not in before
    (ck / "model.pt").write_bytes(b"version 2")
    assert runners._arm_identity({"checkpoint": f"file://{ck}"}) != before


def test_submit_refuses_stage_files_the_upload_would_leave_out(tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    (work / "runs").mkdir()
    (tmp_path / "shared").mkdir()
    for path in (work / "jobs" / "job.yaml", work / "runs" / "job2.yaml", tmp_path / "shared" / "job.yaml"):
        path.write_text(JOB)
    pipeline = {"name": "p", "stages": [{"name": "a", "kind": "train", "job": "../../shared/job.yaml"},
                                        {"name": "b", "kind": "train", "job": "../runs/job2.yaml"},
                                        {"name": "c", "kind": "train", "job": "job.yaml"},
                                        {"name": "d", "kind": "train", "job": str(tmp_path / "shared" / "job.yaml")}]}
    (work / "jobs" / "p.yaml").write_text(yaml.safe_dump(pipeline))
    monkeypatch.chdir(work)
    with pytest.raises(SpecError) as info:
        ops.check_spec("jobs/p.yaml", (), ".")
    msg = str(info.value)
    assert "stages.0 (a).job: outside the working directory: it would not be uploaded" in msg
    assert "stages.1 (b).job: in an excluded folder (runs/)" in msg
    assert "(c)" not in msg and "(d)" not in msg  # uploaded; an absolute path may be on storage the cluster shares
    ops.check_spec("jobs/p.yaml")  # without a working dir (`rayload run` here): only that it loads


def test_a_tune_stage_on_a_named_storage_gives_each_new_search_its_own_study(tmp_path, monkeypatch):
    """The study's name was the search spec's: a rerun of the stage (--force, changed inputs) on a
    storage that outlives the stage folder was refused as a study that already exists."""
    from rayload import tuning

    base = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "jobs", "movielens_deepfm.yaml")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"name": "s", "base": base, "storage": f"sqlite:///{tmp_path / 'shared.db'}",
                                                     "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}}))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "p", "stages": [{"name": "hpo", "kind": "tune", "search": "s.yaml"}]}))
    from rayload.pipeline_spec import load_pipeline

    pipeline = load_pipeline(str(tmp_path / "p.yaml"))
    names = []

    class Stop(Exception):
        pass

    def tune(search, resume=None, address=None, run_dir=None):
        names.append((search.name, resume))
        raise Stop

    monkeypatch.setattr(tuning, "tune", tune)
    for _ in range(2):
        with pytest.raises(Stop):
            runners.tune(pipeline, pipeline.stages[0], str(tmp_path / "runs" / "r1" / "hpo"), {}, None, None)
    assert names[0][0] != names[1][0] and all(n.startswith("s-r1-hpo-") for n, _ in names)


def test_an_interrupted_tune_stage_on_a_named_storage_resumes_the_search_it_started(tmp_path, monkeypatch):
    """The new search's name had the stage's suffix; the resume handed the spec's own name, which
    the run refused as another spec, so the stage failed on every rerun."""
    from rayload import tuning
    from rayload.pipeline_spec import load_pipeline

    base = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "jobs", "movielens_deepfm.yaml")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"name": "s", "base": base, "storage": f"sqlite:///{tmp_path / 'shared.db'}",
                                                     "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}}))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "p", "stages": [{"name": "hpo", "kind": "tune", "search": "s.yaml"}]}))
    pipeline = load_pipeline(str(tmp_path / "p.yaml"))
    folder = tmp_path / "runs" / "r1" / "hpo"
    (folder / "search").mkdir(parents=True)
    (folder / "search" / "search.json").write_text("{}")  # a search that was started here
    given = []

    class Stop(Exception):
        pass

    def tune(search, resume=None, address=None, run_dir=None):
        given.append((search, resume))
        raise Stop

    monkeypatch.setattr(tuning, "tune", tune)
    with pytest.raises(Stop):
        runners.tune(pipeline, pipeline.stages[0], str(folder), {}, None, None)
    assert given == [(None, str(folder / "search"))]  # the stored spec, its own name included
