"""An A/B arm given as a job spec trains under a run named by what it trains (the resolved job
and its data's identity): the same arm finds its finished run again, an edited job or new data
gets a run of its own instead of relaunching the old one (which training refuses)."""

import importlib
import os
import types

import yaml
from helpers import COLUMNS, frame

from rayload.ab_spec import ab_from_dict
from rayload.serve import serve_config


def _setup(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "home"))
    data = tmp_path / "d.parquet"
    frame(300).to_parquet(data)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "j", "data": {"source": {"kind": "parquet", "path": str(data)}, "columns": COLUMNS,
                                                           "label": {"column": "y"}}}))
    names = []

    def fit(spec, address=None, evaluate_test=True):
        names.append(spec.train.run_name)
        return types.SimpleNamespace(checkpoint=str(tmp_path / spec.train.run_name / "epoch_0000"))

    monkeypatch.setattr(importlib.import_module("rayload.train.trainer"), "fit", fit)  # rayload.train is the SDK's function
    return data, job, names


def _spec(job, challenger_set=()):
    return ab_from_dict({"name": "exp", "arms": [{"name": "base", "weight": 0.5, "job": str(job)},
                                                 {"name": "new", "weight": 0.5, "job": str(job), "set": list(challenger_set)}]})


def test_an_arm_run_is_named_by_its_job_and_data(tmp_path, monkeypatch):
    data, job, names = _setup(tmp_path, monkeypatch)
    first = serve_config.resolve_checkpoints(_spec(job, ["train.lr=0.01"]))
    assert [n.rsplit("-", 1)[0] for n in names] == ["ab-exp-base", "ab-exp-new"]
    assert serve_config.resolve_checkpoints(_spec(job, ["train.lr=0.01"])) == first  # unchanged: the same runs

    names.clear()
    edited = serve_config.resolve_checkpoints(_spec(job, ["train.lr=0.02"]))
    assert edited["base"] == first["base"] and edited["new"] != first["new"]  # only the edited arm gets a new run

    names.clear()
    frame(301).to_parquet(data)  # new data under the same path
    os.utime(data, (1, 1))
    moved = serve_config.resolve_checkpoints(_spec(job, ["train.lr=0.02"]))
    assert moved["base"] != first["base"] and moved["new"] != edited["new"]


def test_two_arms_with_the_same_job_train_it_once(tmp_path, monkeypatch):
    _, job, names = _setup(tmp_path, monkeypatch)
    out = serve_config.resolve_checkpoints(_spec(job))
    assert len(names) == 1 and out["base"] == out["new"]
