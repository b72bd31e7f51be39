"""`--set` on search specs' dotted keys and on text fields (`--run-name 20240601`), and the
SDK's train and preprocess taking spec paths."""

import os

import pytest
import yaml
from typer.testing import CliRunner

from rayload import load_search_spec
from rayload.errors import RayloadError, SpecError
from rayload.spec import load_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")
RANDOM = os.path.join(ROOT, "tune", "movielens_random.yaml")  # fixed: {train.epochs: 10}, space: {train.lr: ..., ...}


# ---------------------------------------------------------------- --set on a search spec's fixed and space


def test_set_on_fixed_sets_one_dotted_key_and_keeps_the_others():
    """`fixed.train.lr_decay=cosine` replaced the whole `fixed` section with {train: {lr_decay: cosine}}."""
    plain = load_search_spec(RANDOM)
    spec = load_search_spec(RANDOM, ["fixed.train.lr_decay=cosine"])
    assert spec.fixed == {**plain.fixed, "train.lr_decay": "cosine"} and spec.space == plain.space
    assert load_search_spec(RANDOM, ["fixed.train.epochs=3"]).fixed == {**plain.fixed, "train.epochs": 3}
    assert load_search_spec(RANDOM, ["fixed.model.hidden.0=77"]).fixed["model.hidden.0"] == 77  # a list item of the job spec
    assert load_search_spec(RANDOM, ["fixed.train.run_name=20240601"]).fixed["train.run_name"] == "20240601"  # a text field of the job
    with pytest.raises(SpecError, match="train.lr_decay"):
        load_search_spec(RANDOM, ["fixed.train.lr_decay=sometimes"])


def test_set_on_space_replaces_or_edits_one_parameter():
    plain = load_search_spec(RANDOM)
    spec = load_search_spec(RANDOM, ["space.train.lr={loguniform: [0.001, 0.01]}"])
    assert spec.space["train.lr"].loguniform == (0.001, 0.01) and set(spec.space) == set(plain.space)
    spec = load_search_spec(RANDOM, ["space.train.lr.loguniform=[0.002, 0.004]"])  # a field of the existing parameter
    assert spec.space["train.lr"].loguniform == (0.002, 0.004)
    spec = load_search_spec(RANDOM, ["space.train.weight_decay={choice: [0.0, 0.0001]}"])  # a new parameter
    assert spec.space["train.weight_decay"].choice == [0.0, 0.0001] and set(spec.space) == set(plain.space) | {"train.weight_decay"}


def test_a_fixed_key_naming_a_section_is_refused(tmp_path):
    with pytest.raises(SpecError, match=r"fixed.train: names a section of the job spec.*set its fields one by one: fixed.train\."):
        load_search_spec(RANDOM, ["fixed.train={lr_decay: cosine}"])
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": JOB, "space": {"train.lr": [0.1, 0.2]}, "strategy": "grid",
                                    "fixed": {"model": {"embedding_dim": 8}}}))
    with pytest.raises(SpecError, match="fixed.model: names a section"):
        load_search_spec(str(path))


# ---------------------------------------------------------------- --set / --run-name on text fields


@pytest.mark.parametrize("name", ["20240601", "2024-06-01", "yes", "1e3", "007"])
def test_a_text_field_takes_the_text_as_given(name):
    assert load_spec(JOB, [f"train.run_name={name}"]).train.run_name == name


def test_numbers_lists_and_null_are_still_parsed():
    job = load_spec(JOB, ["train.lr=0.01", "model.hidden=[16, 8]", "train.epochs=2", "train.run_name=null", "train.lr_decay=cosine"])
    assert job.train.lr == 0.01 and isinstance(job.train.lr, float) and job.model.hidden == [16, 8] and job.train.epochs == 2
    assert job.train.run_name is None and job.train.lr_decay == "cosine"


def test_train_run_name_option_is_passed_as_text(monkeypatch):
    from rayload.train import trainer

    seen = {}

    def fit(job, address=None):
        seen["run_name"] = job.train.run_name
        raise RayloadError("stop here")

    monkeypatch.setattr(trainer, "fit", fit)  # the real module's: `from .train.trainer import fit` reads it at call time
    from rayload.cli import app

    r = CliRunner().invoke(app, ["train", JOB, "--run-name", "2024-06-01"])
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    assert seen["run_name"] == "2024-06-01"


# ---------------------------------------------------------------- SDK: paths


def test_sdk_train_and_preprocess_take_a_spec_path(monkeypatch):
    import rayload
    import rayload.data.pipeline
    from rayload.train import trainer

    seen = []
    monkeypatch.setattr(trainer, "fit", lambda job, address=None, evaluate_test=True: seen.append(("fit", job.name, job.train.epochs)))
    monkeypatch.setattr(rayload.data.pipeline, "preprocess", lambda job, **kw: seen.append(("preprocess", job.name, kw["out"])))
    rayload.train(JOB)
    rayload.train(JOB, overrides=["train.epochs=2"])
    rayload.preprocess(JOB, out="x")
    job = load_spec(JOB)
    rayload.preprocess(job)
    assert seen == [("fit", job.name, job.train.epochs), ("fit", job.name, 2), ("preprocess", job.name, "x"), ("preprocess", job.name, None)]
