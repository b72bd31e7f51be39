"""Pipeline specs: stage references and referenced files checked at load, `--set STAGE.x=v` routing."""

import os
import shutil

import pytest
import yaml

from rayload.errors import SpecError
from rayload.pipeline_spec import load_pipeline, load_pipeline_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPELINE = os.path.join(ROOT, "jobs", "movielens_pipeline.yaml")


def _copy(tmp_path, edit):
    """The demo pipeline next to copies of the specs it names, edited."""
    for name in ("movielens_deepfm.yaml", "ab_movielens.yaml"):
        shutil.copy(os.path.join(ROOT, "jobs", name), tmp_path / name)
    (tmp_path / "tune").mkdir()
    shutil.copy(os.path.join(ROOT, "tune", "movielens_bayes.yaml"), tmp_path / "tune" / "movielens_bayes.yaml")
    raw = yaml.safe_load(open(PIPELINE))
    raw["stages"][2]["search"] = "tune/movielens_bayes.yaml"
    text = (tmp_path / "tune" / "movielens_bayes.yaml").read_text().replace("../jobs/", "../")
    (tmp_path / "tune" / "movielens_bayes.yaml").write_text(text)
    edit(raw)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_demo_pipeline_loads_with_paths_next_to_it():
    spec = load_pipeline_spec(PIPELINE)
    assert [s.kind for s in spec.stages] == ["prepare", "train", "tune", "ab", "decide"]
    assert spec.path(spec.stage("search").search) == os.path.join(ROOT, "tune", "movielens_bayes.yaml")


def test_missing_spec_file_is_named_with_its_stage(tmp_path):
    path = _copy(tmp_path, lambda raw: raw["stages"][1].update(job="nope.yaml"))
    with pytest.raises(SpecError) as err:
        load_pipeline_spec(path)
    assert "stages.1.job" in str(err.value) and "nope.yaml" in str(err.value)


def test_references_to_later_unknown_or_wrong_kind_stages_fail_at_load(tmp_path):
    def edit(raw):
        raw["stages"][3]["champion"] = "decide"        # a later stage
        raw["stages"][3]["challenger"] = "prepare"     # not a train or tune stage
        raw["stages"][4]["experiment"] = "abx"         # no such stage

    with pytest.raises(SpecError) as err:
        load_pipeline_spec(_copy(tmp_path, edit))
    text = str(err.value)
    assert "stages.3.champion: names a later stage" in text
    assert "stages.3.challenger: must name a train or tune stage, not a prepare stage" in text
    assert "stages.4.experiment: no stage of that name before it" in text


def test_a_bad_override_inside_a_stage_fails_at_load_with_the_stage_and_field():
    with pytest.raises(SpecError) as err:
        load_pipeline(PIPELINE, ["baseline.train.epochz=3"])
    assert "stages.1.job" in str(err.value) and "epochz" in str(err.value)


def test_set_routes_stage_fields_and_pipeline_fields():
    spec = load_pipeline(PIPELINE, ["search.num_samples=3", "name=other"])
    assert spec.name == "other"
    assert spec.stage("search").set[-1] == "num_samples=3"
    # a stage's own field its spec does not have is the stage's (it was "takes no overrides" for
    # decide.act, and "traffic: unknown field" of the A/B spec for ab.traffic)
    spec = load_pipeline(PIPELINE, ["decide.act=false", "ab.traffic=live", "ab.simulate.requests=10"])
    assert spec.stage("decide").act is False and spec.stage("ab").traffic == "live"
    assert spec.stage("ab").set[-1] == "simulate.requests=10"
    with pytest.raises(SpecError, match=r"--set decide: a decide stage has no spec of its own to override; its fields \(experiment, act\)"):
        load_pipeline(PIPELINE, ["decide.analysis.alpha=0.1"])


def test_set_items_of_a_renamed_stage_and_a_missing_stage_are_named():
    """Routed by the names in the file, a stage renamed by the same call lost its items silently,
    and could take none under its new name."""
    renamed = load_pipeline(PIPELINE, ["stages.1.name=b2", "stages.3.champion=b2", "b2.train.epochs=2"])
    assert renamed.stage("b2").set[-1] == "train.epochs=2"
    with pytest.raises(SpecError, match=r"--set: the first part names a stage of the pipeline \(prepare, b2, search, ab, decide\)"):
        load_pipeline(PIPELINE, ["stages.1.name=b2", "stages.3.champion=b2", "baseline.train.epochs=2"])
    spec = load_pipeline(PIPELINE)
    with pytest.raises(KeyError, match="no stage named 'Search'; the stages are prepare, baseline, search, ab, decide"):
        spec.stage("Search")


def test_a_single_job_run_takes_the_jobs_own_paths():
    """`rayload run jobs/x.yaml --set train.epochs=3` was read as stage `train`, field `epochs`."""
    job = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")
    assert load_pipeline(job, ["train.epochs=3"]).stages[0].set == ["train.epochs=3"]
    assert load_pipeline(job, ["train.train.epochs=3"]).stages[0].set == ["train.epochs=3"]
    assert load_pipeline(job, ["train.model.embedding_dim=8"]).stages[0].set == ["model.embedding_dim=8"]
    assert load_pipeline(job, ["data.max_bad_fraction=0.2", "model.embedding_dim=8"]).stages[0].set == [
        "data.max_bad_fraction=0.2", "model.embedding_dim=8"]
    ab = load_pipeline(os.path.join(ROOT, "jobs", "ab_movielens.yaml"), ["simulate.requests=10", "decide.act=false"])
    assert ab.stage("ab").set == ["simulate.requests=10"] and ab.stage("decide").act is False
    with pytest.raises(SpecError, match="the first part names a stage"):  # a pipeline file keeps STAGE.field
        load_pipeline(PIPELINE, ["data.max_bad_fraction=0.2"])


@pytest.mark.parametrize("name, kinds", [("movielens_deepfm.yaml", ["train"]), ("ab_movielens.yaml", ["ab", "decide"])])
def test_any_spec_in_jobs_runs_as_its_own_stages(name, kinds):
    spec = load_pipeline(os.path.join(ROOT, "jobs", name))
    assert [s.kind for s in spec.stages] == kinds


def test_search_spec_runs_as_a_tune_stage():
    spec = load_pipeline(os.path.join(ROOT, "tune", "movielens_bayes.yaml"), ["tune.num_samples=2"])
    assert [s.kind for s in spec.stages] == ["tune"] and spec.stages[0].set == ["num_samples=2"]


def test_asha_grace_period_longer_than_max_epochs_is_a_spec_error():
    with pytest.raises(SpecError, match="grace_period"):
        load_pipeline(PIPELINE, ["search.scheduler.max_epochs=1"])


def test_a_pipeline_whose_ab_stage_asks_for_direct_ingress_starts_ray_with_it_first(monkeypatch):
    """Serve's direct ingress is switched on only when Ray starts, and the prepare and train
    stages would start Ray first: so the pipeline starts it before any stage, with the switch."""
    import rayload._ray
    from rayload import stages

    calls = []
    monkeypatch.setattr(rayload._ray, "ensure_ray", lambda address=None, num_cpus=None, env=None: calls.append((address, env)))
    stages._ray_for_direct_ingress(load_pipeline(PIPELINE), None)
    assert calls == []  # the shipped A/B spec answers through the proxy: Ray starts when a stage needs it
    stages._ray_for_direct_ingress(load_pipeline(PIPELINE, ["ab.serving.ingress=direct"]), "ray://head:10001")
    assert calls == [("ray://head:10001", {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"})]


def test_an_ab_stage_filled_from_earlier_stages_needs_an_ab_spec_of_two_arms(tmp_path):
    def edit(raw):
        ab = yaml.safe_load((tmp_path / "ab_movielens.yaml").read_text())
        ab["arms"].append({"name": "third", "weight": 0.0, "checkpoint": str(tmp_path)})
        ab.setdefault("ramp", {})["auto"] = False  # (automatic decisions refuse three arms themselves)
        (tmp_path / "ab_movielens.yaml").write_text(yaml.safe_dump(ab))

    with pytest.raises(SpecError, match=r"stages\.3.spec: champion and challenger fill the A/B spec's arms, which must then be two; it has 3"):
        load_pipeline_spec(_copy(tmp_path, edit))


def test_the_ab_specs_champion_arm_serves_the_pipelines_champion(monkeypatch, tmp_path):
    """The champion stage's checkpoint went to the first arm whatever the A/B spec's `champion`
    said: a spec listing the challenger first gave the new model the champion's traffic."""
    from rayload import _stage_runners as runners
    from rayload.pipeline_spec import ABStage

    template = {"arms": [{"name": "new", "weight": 0.05, "checkpoint": "x"}, {"name": "base", "weight": 0.95, "checkpoint": "y"}],
                "champion": "base"}
    seen = {}
    monkeypatch.setattr(runners, "_ab_template", lambda spec, stage: dict(template))
    monkeypatch.setattr(runners, "_checkpoint_of", lambda outputs, name: f"ckpt-of-{name}")

    def stop(d):
        seen.update(d)
        raise RuntimeError("stop here")

    monkeypatch.setattr("rayload.ab_spec.ab_from_dict", stop)
    stage = ABStage(name="ab", kind="ab", spec="ab.yaml", champion="baseline", challenger="search")
    with pytest.raises(RuntimeError, match="stop here"):
        runners.ab(None, stage, str(tmp_path), {}, None, lambda f: None)
    arms = {a["name"]: (a["weight"], a["checkpoint"]) for a in seen["arms"]}
    assert arms == {"new": (0.05, "ckpt-of-search"), "base": (0.95, "ckpt-of-baseline")} and seen["champion"] == "base"


def test_an_ab_stage_fingerprint_reads_its_arms_job_specs_and_checkpoints(tmp_path):
    from rayload import _stage_runners as runners

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.pt").write_bytes(b"one")
    before = runners._arm_identity({"checkpoint": str(ckpt)})
    os.utime(ckpt / "model.pt", ns=(1, 1))
    (ckpt / "model.pt").write_bytes(b"other weights")
    assert runners._arm_identity({"checkpoint": str(ckpt)}) != before  # retrained in place: a new fingerprint
    job = tmp_path / "job.yaml"
    shutil.copy(os.path.join(ROOT, "jobs", "movielens_deepfm.yaml"), job)
    one = runners._arm_identity({"job": str(job), "set": []})
    assert runners._arm_identity({"job": str(job), "set": ["train.epochs=3"]}) != one


def test_sdk_and_loader_edges_name_the_problem(tmp_path):
    """An empty file was read as a job spec lacking name and data; a stage naming itself was
    told it "names a later stage"; PipelineResult.outputs of a stage that did not run raised a
    bare StopIteration; rayload.run(force="ab") forced stages 'a' and 'b'."""
    import rayload
    from rayload.stages import PipelineResult

    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(SpecError, match="the file is empty"):
        load_pipeline(str(empty))
    with pytest.raises(SpecError, match=r"stages\.4\.experiment: names this stage itself"):
        load_pipeline(PIPELINE, ["stages.4.experiment=decide"])
    with pytest.raises(KeyError, match="no stage named 'search' in run r1; its stages: prepare"):
        PipelineResult("r1", str(tmp_path), [type("S", (), {"name": "prepare", "outputs": {}})()]).outputs("search")
    from rayload.errors import RayloadError

    with pytest.raises(RayloadError, match=r"names no stage: \['nosuch'\]"):
        rayload.run(os.path.join(ROOT, "jobs", "movielens_deepfm.yaml"), force="nosuch")
