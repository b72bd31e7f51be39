"""`rayload run` re-runs the stages that use the outputs of a stage that ran again (`--force`),
and skips the unchanged ones; the stage runners are fakes that record what they were given."""

from rayload import _stage_runners as runners
from rayload import stages
from rayload.pipeline_spec import PipelineSpec

SPEC = PipelineSpec.model_validate({"name": "p", "stages": [
    {"name": "baseline", "kind": "train", "job": "x.yaml"}, {"name": "other", "kind": "train", "job": "y.yaml"},
    {"name": "ab", "kind": "ab", "spec": "ab.yaml", "champion": "baseline", "challenger": "other"},
    {"name": "decide", "kind": "decide", "experiment": "ab"}]})


def _outcomes(result):
    return {s.name: s.outcome for s in result.stages}


def test_a_forced_stage_reruns_the_stages_that_use_it_and_no_other(fake_runners):
    first = stages.run(SPEC, "p1")
    assert set(_outcomes(first).values()) == {"ok"}
    again = stages.run(SPEC, "p1")
    assert set(_outcomes(again).values()) == {"skipped"} and again.outputs("decide") == first.outputs("decide")
    forced = stages.run(SPEC, "p1", force=("baseline",))
    assert _outcomes(forced) == {"baseline": "ok", "other": "skipped", "ab": "ok", "decide": "ok"}
    assert forced.outputs("ab")["served"] == [forced.outputs("baseline")["checkpoint"], first.outputs("other")["checkpoint"]]
    assert forced.outputs("decide")["on"] == forced.outputs("ab")  # it recorded the old experiment's outputs
    forced = stages.run(SPEC, "p1", force=("ab",))
    assert _outcomes(forced) == {"baseline": "skipped", "other": "skipped", "ab": "ok", "decide": "ok"}
    assert forced.outputs("decide")["on"] == forced.outputs("ab")
    assert set(_outcomes(stages.run(SPEC, "p1")).values()) == {"skipped"}  # and then all unchanged again


def test_a_run_recorded_before_executions_were_kept_is_not_rerun(fake_runners, monkeypatch):
    """stage.json files from before executions were recorded (fingerprints from upstream
    fingerprints alone): an unchanged pipeline is still skipped."""
    import json
    import os

    with monkeypatch.context() as m:
        m.setattr(stages, "_upstream", lambda result: result.fingerprint)  # the fingerprints as they were computed then
        first = stages.run(SPEC, "p2")
    for s in first.stages:
        path = os.path.join(first.run_dir, s.name, "stage.json")
        record = json.load(open(path))
        del record["execution"]
        json.dump(record, open(path, "w"))
    assert set(_outcomes(stages.run(SPEC, "p2")).values()) == {"skipped"}
    assert _outcomes(stages.run(SPEC, "p2", force=("other",))) == {"baseline": "skipped", "other": "ok", "ab": "ok", "decide": "ok"}


def test_a_train_stage_starting_from_a_checkpoint_changes_when_the_checkpoint_there_is_replaced(tmp_path):
    """train.init_from hashed as a path only: new weights and features.json at the same path left
    the stage 'unchanged' (skipped), while preprocessing keyed its shards on those features."""
    import dataclasses
    import os

    import yaml

    from helpers import COLUMNS, frame
    from rayload.data.pipeline import cache_key, fixed_features
    from rayload.data.sources import resolve_inputs
    from rayload.paths import cache_root
    from rayload.spec import load_spec
    from _loop import features

    frame(200).to_parquet(tmp_path / "d.parquet")
    ckpt = tmp_path / "champion"
    ckpt.mkdir()

    def write_checkpoint(vocab: int, weights: bytes):
        base = features()
        cat = dataclasses.replace(base.categorical[0], vocab=[str(i) for i in range(vocab)])
        dataclasses.replace(base, categorical=[cat, base.categorical[1]]).save(str(ckpt / "features.json"))
        (ckpt / "model.pt").write_bytes(weights)

    job = {"name": "ft", "data": {"source": {"kind": "parquet", "path": str(tmp_path / "d.parquet")}, "columns": COLUMNS,
                                  "label": {"column": "y"}}, "train": {"init_from": str(ckpt), "epochs": 1}}
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(job))
    spec = PipelineSpec.model_validate({"name": "p", "folder": str(tmp_path), "stages": [{"name": "ft", "kind": "train", "job": "ft.yaml"}]})
    write_checkpoint(30, b"one")
    before = runners.plan_for(spec, spec.stages[0])
    loaded = load_spec(str(tmp_path / "ft.yaml"))
    assert before[2] == cache_key(loaded, resolve_inputs(loaded.data, cache_root()), fixed_features(loaded))  # preprocessing's key
    write_checkpoint(30, b"other weights")
    os.utime(ckpt / "model.pt", ns=(1, 1))
    weights_only = runners.plan_for(spec, spec.stages[0])
    assert weights_only[0] != before[0] and weights_only[2] == before[2]
    write_checkpoint(50, b"other weights")
    assert runners.plan_for(spec, spec.stages[0])[2] != before[2]
