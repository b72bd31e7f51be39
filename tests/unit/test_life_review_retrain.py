"""`rayload retrain`: a shadow experiment's successor stays in shadow, default names stop
growing, a champion from before `model.align` keeps its shapes, and a deleted champion is
named before anything is read or trained."""

import json
import shutil

import pytest

from helpers import job
from rayload import retraining
from rayload.errors import RayloadError
from rayload.models import InputShape, build_model
from rayload.retraining import _model_section, next_ab_spec, next_name, retrain
from rayload.spec import ModelSpec
from _retrain import NOW, ab_run, guarded_run, placeholder_checkpoint, stub_fit

SHADOW = {"name": "exp", "champion": "a", "shadow": True,
          "arms": [{"name": "a", "weight": 1.0, "checkpoint": "/x/a"}, {"name": "b", "weight": 0.0, "checkpoint": "/x/b"}]}


def test_a_shadow_experiments_successor_stays_in_shadow_unless_given_a_weight(tmp_path):
    """It used to drop `shadow` and fall back to a live 50/50 split."""
    spec = next_ab_spec({"spec": SHADOW}, "a", "/x/a", "/x/new", "exp-r1", None)
    assert spec["shadow"] is True and [(a["name"], a["weight"]) for a in spec["arms"]] == [("a", 1.0), ("retrained", 0.0)]
    live = next_ab_spec({"spec": SHADOW}, "a", "/x/a", "/x/new", "exp-r1", 0.1)
    assert "shadow" not in live and [a["weight"] for a in live["arms"]] == [0.9, 0.1]
    plain = next_ab_spec({"spec": {**SHADOW, "shadow": False, "arms": [{**SHADOW["arms"][0], "weight": 0.8},
                                                                      {**SHADOW["arms"][1], "weight": 0.2}]}}, "a", "/x/a", "/x/new", "e", None)
    assert "shadow" not in plain and [a["weight"] for a in plain["arms"]] == [0.8, 0.2]


def test_default_names_replace_the_earlier_retrain_stamp_instead_of_growing():
    """Each round appended 17 characters, past the event tables' 128 after about 7 rounds."""
    name = "ab_movielens"
    for day in range(20):
        name = next_name(name, f"202611{day + 10:02d}-120000")
        spec = next_ab_spec({"spec": {**SHADOW, "shadow": False}}, "a", "/x/a", "/x/new", name, 0.1)
    assert spec["name"] == name == "ab_movielens-r20261129-120000"
    assert next_name("exp-r2", "20261110-120000") == "exp-r2-r20261110-120000"  # not a stamp: kept


def test_a_champion_from_before_align_is_rebuilt_unpadded(tmp_path):
    """model.json without `align` was copied as is, ModelSpec defaulted it to 8 and the warm start
    failed on shape mismatches; the loader rebuilds such a checkpoint with align 1."""
    old = {"name": "mlp", "embedding_dim": 4, "hidden": [16], "bottom": [8], "dropout": 0.0, "batch_norm": False, "sparse_embeddings": False}
    (tmp_path / "model.json").write_text(json.dumps({"config": old}))
    section = _model_section(str(tmp_path))
    assert section["align"] == 1
    shape = InputShape(dense=3, sparse=(50, 9), bags=())
    rebuilt = build_model(ModelSpec.model_validate(section).model_dump(), shape).state_dict()
    saved = build_model(old, shape).state_dict()
    assert {k: v.shape for k, v in rebuilt.items()} == {k: v.shape for k, v in saved.items()}
    (tmp_path / "model.json").write_text(json.dumps({"config": {**old, "align": 8}}))
    assert _model_section(str(tmp_path))["align"] == 8


def test_a_deleted_champion_is_named_before_anything_is_read_or_trained(tmp_path, monkeypatch):
    champion = placeholder_checkpoint(tmp_path / "champion")
    run, calls = guarded_run(tmp_path, monkeypatch, champion)
    shutil.rmtree(champion)
    with pytest.raises(RayloadError, match=rf"the champion of A/B run {run} \(arm 'a'.*\), {champion}, does not exist: a checkpoint "
                                           r"folder holds model.pt, model.json and features.json.*restore it"):
        retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    assert calls == []


def test_retrain_writes_the_next_shadow_experiment_under_a_name_that_does_not_grow(tmp_path, monkeypatch):
    import yaml

    champion, other = placeholder_checkpoint(tmp_path / "champion"), placeholder_checkpoint(tmp_path / "b")
    prior = {**SHADOW, "name": "exp-r20260101-000000", "arms": [{**SHADOW["arms"][0], "checkpoint": champion},
                                                                {**SHADOW["arms"][1], "checkpoint": other}]}
    stub_fit(monkeypatch, tmp_path, [])
    result = retrain(job(str(tmp_path / "unused.parquet")), ab_run(tmp_path, prior, "a"), attribution="30m", now=NOW)
    spec = yaml.safe_load(open(result.ab_spec))
    assert spec["name"] == next_name("exp", retraining._dt.datetime.fromtimestamp(NOW, retraining._dt.timezone.utc).strftime("%Y%m%d-%H%M%S"))
    assert spec["shadow"] is True and [a["weight"] for a in spec["arms"]] == [1.0, 0.0]
