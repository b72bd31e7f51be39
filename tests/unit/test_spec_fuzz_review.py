"""Spec fuzzing review (2026-11-27, later session): values that loaded silently (or as a
traceback) are refused at load, naming the field."""

import os

import pytest
import yaml

from rayload import load_spec
from rayload.ab_spec import load_ab_spec
from rayload.data.synthetic import SynthParams
from rayload.errors import SpecError
from rayload.pipeline_spec import load_pipeline_spec
from rayload.search_job import load_search_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPFM = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")
BAYES = os.path.join(ROOT, "tune", "movielens_bayes.yaml")


def _refused(load, path, sets) -> str:
    with pytest.raises(SpecError) as info:
        load(path, sets)
    return str(info.value)


@pytest.mark.parametrize("sets, said", [
    (["model.hidden=[true, 64]"], "model.hidden.0: a number, not true or false"),  # was hidden [1, 64]
    (["features.numeric.year.clip={quantiles: [false, true]}"], "features.numeric.year.clip.quantiles.0: a number, not true or false"),
    (["features.numeric.year.buckets={boundaries: [0.5, true]}"], "features.numeric.year.buckets.boundaries.1: a number, not true"),
    (["features.numeric.year.buckets={boundaries: []}"], "boundaries: give at least one boundary"),  # one bucket: a constant
    (["model.hidden.5=3"], "model.hidden.5: model.hidden has 2 item(s), indices 0-1; to change its length, set the whole list"),
])
def test_job_spec_values_that_loaded_silently_are_refused(sets, said):
    assert said in " ".join(_refused(load_spec, DEEPFM, sets).split())


@pytest.mark.parametrize("sets, said", [
    (["space.model.embedding_dim={int: [true, 64]}"], "space.model.embedding_dim.int.0: a number, not true or false"),
    (["space.model.embedding_dim={int: [8, 64], step: .inf}"], "space.model.embedding_dim.step: Input should be a finite number"),
    (["space.model.dropout={uniform: [0.0, 0.5], step: 1e10}"], "step 1e+10 is larger than the range [0, 0.5]: every trial would draw 0"),
    (["space.model.embedding_dim={int: [8, 64], step: 1000000000000}"], "is larger than the range [8, 64]"),
    (["scheduler.reduction_factor=.inf"], "scheduler.reduction_factor: Input should be a finite number"),
])
def test_search_spec_values_that_loaded_or_failed_late_are_refused(sets, said):
    assert said in " ".join(_refused(load_search_spec, BAYES, sets).split())


def test_a_bool_in_a_list_of_any_values_is_still_a_choice():
    spec = load_search_spec(BAYES, ["space.model.batch_norm={choice: [true, false]}"])
    assert spec.space["model.batch_norm"].choice == [True, False]


def test_ab_replica_cpus_follow_rays_precision():
    path = os.path.join(ROOT, "jobs", "ab_movielens.yaml")
    said = _refused(load_ab_spec, path, ["serving.cpus_per_replica=0.00001"])
    assert "serving.cpus_per_replica" in said and "steps of 0.0001" in said
    assert load_ab_spec(path, ["serving.cpus_per_replica=0.25"]).serving.cpus_per_replica == 0.25


def test_synthetic_zipf_must_be_finite():
    with pytest.raises(ValueError, match=r"zipf must be > 1 and finite, got zipf=inf"):
        SynthParams(rows=10, numeric=1, categorical=1, zipf=float("inf"))


def test_a_pipeline_file_cannot_set_its_internal_folder(tmp_path):
    raw = yaml.safe_load(open(os.path.join(ROOT, "jobs", "movielens_pipeline.yaml")))
    raw["folder"] = "/etc"
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    said = _refused(load_pipeline_spec, str(path), [])
    assert "folder: unknown field; allowed: name, stages" in said
