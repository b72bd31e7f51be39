"""Spec-bounds review fixes (2026-11-27): values that were accepted and failed (or did nothing)
later are refused at load, naming the field; a warm-up longer than the run is said."""

import logging
import os
import shutil

import pytest
import yaml

from helpers import job
from rayload._spec_checks import check_job
from rayload.ab_spec import ab_from_dict, load_ab_spec
from rayload.errors import SpecError
from rayload.search_spec import SearchSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPFM = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")
ARMS = [{"name": "A", "weight": 0.9, "checkpoint": "/x"}, {"name": "B", "weight": 0.1, "checkpoint": "/y"}]


def _issues(**sections) -> str:
    return "\n".join(i.render() for i in check_job(job("/no/data", "csv", **sections)))


def test_an_ab_arms_job_spec_is_checked_at_load_and_a_checkpoint_arm_takes_no_set(tmp_path):
    shutil.copy(DEEPFM, tmp_path / "job.yaml")
    (tmp_path / "ab.yaml").write_text(yaml.safe_dump({"name": "ab", "arms": [
        {"name": "A", "weight": 0.9, "job": "job.yaml"}, {"name": "B", "weight": 0.1, "job": "job.yaml", "set": ["train.epochz=3"]}]}))
    with pytest.raises(SpecError, match=r"arms.1.job: job.yaml: train.epochz: unknown field"):
        load_ab_spec(str(tmp_path / "ab.yaml"))
    with pytest.raises(SpecError, match="set overrides a job spec; a checkpoint arm takes none"):
        ab_from_dict({"name": "ab", "arms": [ARMS[0], {**ARMS[1], "set": ["train.epochs=1"]}]})


@pytest.mark.parametrize("field, value, message", [
    ("ramp", {"interval_s": float("inf")}, "ramp.interval_s: Input should be a finite number"),
    ("analysis", {"mde": float("nan")}, "analysis.mde: Input should be a finite number"),
    ("serving", {"replicas": True}, "serving.replicas: a number, not true or false"),
    ("simulate", {"seed": -1}, "simulate.seed: Input should be greater than or equal to 0"),
    ("serving", {"route_prefix": "api"}, "serving.route_prefix: String should match pattern"),
    ("serving", {"route_prefix": "/api/"}, "serving.route_prefix: String should match pattern"),
])
def test_ab_spec_numbers_and_the_route_prefix_are_checked_as_a_job_specs(field, value, message):
    with pytest.raises(SpecError, match=message):
        ab_from_dict({"name": "ab", "arms": ARMS, field: value})
    assert ab_from_dict({"name": "ab", "arms": ARMS, "serving": {"route_prefix": "/api/v1"}}).serving.route_prefix == "/api/v1"


def test_crosses_whose_names_collide_or_repeat_and_a_job_without_features_are_refused():
    msg = _issues(features={"crosses": [{"columns": ["user", "item"]}, {"columns": ["item", "user"]}]})
    assert "features.crosses.1: crosses the same columns as features.crosses.0" in msg
    msg = _issues(features={"crosses": [{"columns": ["user", "user"]}]})
    assert "features.crosses.0.columns: names a column twice" in msg
    columns = [{"name": "a_b", "role": "categorical"}, {"name": "c", "role": "categorical"}, {"name": "a", "role": "categorical"},
               {"name": "b_c", "role": "categorical"}]
    spec = job("/no/data", "csv", features={"crosses": [{"columns": ["a_b", "c"]}, {"columns": ["a", "b_c"]}]})
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"columns": [*[type(spec.data.columns[0])(**c) for c in columns]]})})
    assert any("features.crosses.1: its feature name 'x_a_b_c' is that of features.crosses.0" in i.render() for i in check_job(spec))
    bare = job("/no/data", "csv")
    bare = bare.model_copy(update={"data": bare.data.model_copy(update={"columns": []})})
    assert any(i.path == "data.columns" and "no feature column" in i.render() for i in check_job(bare))


def test_freeze_of_a_part_the_model_lacks_and_sparse_settings_without_sparse_tables_are_refused():
    msg = _issues(model={"name": "deepfm"}, train={"init_from": "/x", "freeze": ["bottom"]})
    assert "train.freeze: model deepfm has no 'bottom' part" in msg and "'embeddings'" in msg
    assert "train.freeze" not in _issues(model={"name": "dlrm"}, train={"init_from": "/x", "freeze": ["bottom", "top"]})
    msg = _issues(train={"sparse_lr": 0.5, "sparse_lr_schedule": "constant"})
    assert "train.sparse_lr: applies only to sparse embedding tables" in msg and "train.sparse_lr_schedule: applies only" in msg
    assert "train.sparse_lr" not in _issues(model={"sparse_embeddings": True}, train={"sparse_lr": 0.5})


def test_a_search_seed_outside_optunas_range_and_true_for_a_count_are_refused():
    from pydantic import ValidationError

    base = {"name": "s", "base": "-", "space": {"x": {"uniform": [0, 1]}}}
    for fields, where in (({"seed": -1}, "seed"), ({"seed": 2**32}, "seed"), ({"num_samples": True}, "num_samples")):
        with pytest.raises(ValidationError, match=where):
            SearchSpec.model_validate({**base, **fields})


def test_a_warmup_longer_than_the_run_is_said(tmp_path, caplog):
    from _loop import MemorySession, features, job as loop_job, table
    from rayload.train.loop import run

    session = MemorySession(table(256, 0), table(64, 1), str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="rayload.train.loop"):
        run(loop_job(epochs=1, warmup_steps=50), features(), session, {"train_rows": 256, "manifest": {}})
    assert "train.warmup_steps (50) is at least the run's 1 optimizer steps" in caplog.text
