"""Search specs: every bad input is refused before a trial runs, with the field named."""

import os

import pytest
import yaml

from rayload import load_search_spec
from rayload.errors import SpecError
from rayload.search_job import known_paths
from rayload.search_spec import grid_size, trials_wanted

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")


def write(tmp_path, **fields):
    raw = {"name": "s", "base": BASE, "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}, **fields}
    path = tmp_path / "search.yaml"
    path.write_text("# rayload tune search.yaml\n" + yaml.safe_dump(raw))
    return str(path)


def problems(tmp_path, **fields) -> str:
    with pytest.raises(SpecError) as info:
        load_search_spec(write(tmp_path, **fields))
    return str(info.value)


def test_the_shipped_bayes_spec_loads_with_defaults():
    spec = load_search_spec(os.path.join(ROOT, "tune", "movielens_bayes.yaml"))
    assert spec.strategy == "bayes" and spec.sampler == "tpe" and spec.score_mode == "max"
    assert spec.scheduler.kind == "asha" and spec.scheduler.max_epochs == 12
    assert trials_wanted(spec) == 16


def test_a_relative_base_is_pinned_to_the_spec_folder_whatever_the_working_directory(tmp_path, monkeypatch):
    # The demo and the SDK hand the loaded object on; its base must not depend on the cwd.
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "job.yaml").write_text(open(BASE).read())
    (tmp_path / "tune").mkdir()
    path = tmp_path / "tune" / "s.yaml"
    path.write_text("# rayload tune s.yaml\n" + yaml.safe_dump({"name": "s", "base": "../jobs/job.yaml", "space": {"train.lr": [0.1, 0.2]},
                                                               "strategy": "grid"}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load_search_spec(str(path))
    assert spec.base == str(tmp_path / "jobs" / "job.yaml")
    from rayload.search_job import base_raw, job_issues

    assert base_raw(spec, None)["data"]["source"]["kind"] == "movielens"
    assert job_issues(spec, None) == []


def test_grid_size_is_the_product_and_num_samples_defaults_to_it():
    spec = load_search_spec(os.path.join(ROOT, "tune", "movielens_grid.yaml"))
    assert grid_size(spec) == 9 and trials_wanted(spec) == 9


def test_unknown_path_is_named_with_valid_paths_near_it(tmp_path):
    msg = problems(tmp_path, space={"train.lrr": {"uniform": [0.001, 0.01]}, "modle.dropout": {"uniform": [0, 0.5]}})
    assert "space.train.lrr" in msg and "train.lr" in msg and "train.lr_decay" in msg
    assert "space.modle.dropout" in msg and "model.dropout" in msg


def test_bounds_log_scale_and_empty_choice(tmp_path):
    msg = problems(tmp_path, space={"train.lr": {"uniform": [0.1, 0.01]}, "train.embedding_l2": {"loguniform": [0, 0.1]},
                                    "model.embedding_dim": {"choice": []}})
    assert "space.train.lr: low > high (0.1 > 0.01)" in msg
    assert "space.train.embedding_l2: a log scale needs low > 0" in msg
    assert "space.model.embedding_dim: choice needs at least one value" in msg


def test_grid_list_with_a_sampling_strategy_and_ranges_with_grid(tmp_path):
    msg = problems(tmp_path, strategy="bayes", sampler="gp", space={"train.lr": [0.001, 0.01]})
    assert "space.train.lr" in msg and "strategy: grid" in msg and "gp" in msg
    msg = problems(tmp_path, strategy="grid", space={"train.lr": {"loguniform": [1e-4, 1e-2]}})
    assert "grid search needs a list of values" in msg
    msg = problems(tmp_path, strategy="random", sampler="tpe")
    assert "sampler is for strategy: bayes" in msg


def test_a_value_that_makes_the_job_invalid_is_refused(tmp_path):
    msg = problems(tmp_path, space={"model.dropout": {"uniform": [0.0, 1.5]}})
    assert "space.model.dropout" in msg and "1.5" in msg


def test_preprocessing_parameters_must_be_discrete(tmp_path):
    msg = problems(tmp_path, space={"features.categorical.userId.min_count": {"int": [1, 50]}})
    assert "must be a choice or grid list" in msg


def test_data_and_split_cannot_be_searched_and_preprocessing_choices_can(tmp_path):
    """space.split.seed / split.kind were accepted: each variant had its own validation rows, so
    the search ranked partitions (or a random split against a temporal one), not settings."""
    msg = problems(tmp_path, space={"split.seed": {"choice": [0, 1, 2]}, "split.kind": {"choice": ["random", "temporal"]},
                                    "data.label.threshold": {"choice": [3.5, 4.0]}})
    for path in ("space.split.seed", "space.split.kind", "space.data.label.threshold"):
        assert f"{path}: trials would be ranked on different validation rows; set it in fixed:" in msg
    ok = load_search_spec(write(tmp_path, space={"rebalance.method": {"choice": ["none", "downsample"]}}))
    assert ok.space["rebalance.method"].values == ["none", "downsample"]


def test_unknown_keys_and_bad_storage_url(tmp_path):
    msg = problems(tmp_path, strategyy="grid", storage="redis://x")
    assert "strategyy" in msg and "did you mean 'strategy'" in msg and "storage" in msg


def test_known_paths_include_unset_sections_and_list_items():
    from rayload import load_spec

    paths = known_paths(load_spec(BASE))
    assert {"train.lr", "model.hidden.0", "resources.workers", "features.categorical.userId.min_count"} <= paths


def test_target_and_time_budget(tmp_path):
    spec = load_search_spec(write(tmp_path, target=0.81, time_budget_s=600))
    assert spec.target == 0.81 and spec.time_budget_s == 600
    msg = problems(tmp_path, target=float("nan"), time_budget_s=0)
    assert "target" in msg and "time_budget_s" in msg


def test_fixed_epochs_that_the_scheduler_would_override_are_refused(tmp_path):
    """Under a scheduler every trial runs scheduler.max_epochs epochs; a different fixed
    train.epochs would be ignored without a word, so it is an error naming both."""
    asha = {"kind": "asha", "grace_period": 1, "max_epochs": 12}
    msg = problems(tmp_path, fixed={"train.epochs": 10}, scheduler=asha)
    assert "fixed.train.epochs" in msg and "scheduler.max_epochs (12)" in msg
    assert load_search_spec(write(tmp_path, fixed={"train.epochs": 12}, scheduler=asha)).fixed == {"train.epochs": 12}
    assert load_search_spec(write(tmp_path, fixed={"train.epochs": 10}, scheduler={"kind": "asha"})).scheduler.max_epochs is None


def test_a_grid_with_points_first_a_fractional_int_step_and_a_log_uniform(tmp_path):
    from rayload._study import distribution

    msg = problems(tmp_path, strategy="grid", space={"model.embedding_dim": [8, 16]}, points_to_evaluate=[{"model.embedding_dim": 8}])
    assert "points_to_evaluate" in msg and "exactly once" in msg  # it would run twice and push a grid point out
    msg = problems(tmp_path, space={"model.embedding_dim": {"int": [4, 16], "step": 0.5}})
    assert "space.model.embedding_dim: an int range steps by a whole number (got step=0.5)" in msg
    spec = load_search_spec(write(tmp_path, space={"train.lr": {"uniform": [1e-4, 1e-2], "log": True}}))
    assert distribution(spec.space["train.lr"]).log  # sampled on the log scale it asks for


def test_a_metric_the_epochs_do_not_report_is_refused_with_the_ones_they_do(tmp_path):
    msg = problems(tmp_path, metric="val_aucc")
    assert "metric: a binary job's epochs report val_auc, val_logloss" in msg and "train_loss" in msg
    assert load_search_spec(write(tmp_path, metric="val_logloss")).score_mode == "min"


def test_a_float_range_on_an_integer_field_is_refused_at_load_suggesting_int(tmp_path):
    """Both ends (8.0, 64.0) pass an int field; a drawn 23.7 would fail every trial."""
    for kind in ("uniform", "loguniform"):
        msg = problems(tmp_path, space={"model.embedding_dim": {kind: [8, 64]}})
        assert f"space.model.embedding_dim: a {kind} range draws values such as" in msg
        assert "{int: [8, 64]} or a choice list" in msg
    # a float field, and a step that keeps every drawn value whole, still load
    assert load_search_spec(write(tmp_path, space={"model.dropout": {"uniform": [0.0, 0.5]}})).space
    assert load_search_spec(write(tmp_path, space={"model.embedding_dim": {"uniform": [8, 64], "step": 8}})).space


def test_step_and_log_where_they_would_be_ignored_are_refused(tmp_path):
    msg = problems(tmp_path, space={"train.lr": {"loguniform": [1e-4, 1e-2], "step": 0.001},
                                    "model.embedding_dim": {"choice": [8, 16], "step": 8}, "model.dropout": {"choice": [0.1], "log": True}})
    assert "space.train.lr: loguniform and step cannot be combined" in msg
    assert "space.model.embedding_dim: step is for uniform and int ranges" in msg
    assert "space.model.dropout: log is for uniform and int ranges" in msg
    msg = problems(tmp_path, strategy="grid", space={"model.embedding_dim": {"grid": [8, 16], "step": 8}})
    assert "space.model.embedding_dim: step is for uniform and int ranges; a grid list" in msg


def test_points_to_evaluate_are_checked_against_the_space_the_job_spec_and_num_samples(tmp_path):
    """A point outside a choice crashed after the study was made (a rerun then hit
    StudyExistsError); one outside a range ran and could become the best trial."""
    space = {"model.embedding_dim": {"choice": [8, 16]}, "train.lr": {"uniform": [1e-4, 1e-2], "step": 1e-4},
             "model.dropout": {"uniform": [0.0, 0.9]}, "train.batch_size": {"int": [64, 512], "step": 64}}
    msg = problems(tmp_path, space=space, num_samples=4, points_to_evaluate=[
        {"model.embedding_dim": 32, "train.lr": 0.5, "train.batch_size": 100},
        {"model.embedding_dim": True, "train.lr": 0.00015, "train.batch_size": 128.0, "model.dropout": "x"}])
    assert "points_to_evaluate.0.model.embedding_dim: not one of the choice values [8, 16] (got 32)" in msg
    assert "points_to_evaluate.0.train.lr: outside the uniform range [0.0001, 0.01] (got 0.5)" in msg
    assert "points_to_evaluate.0.train.batch_size: not on the range's steps (64, 128, ... by 64) (got 100)" in msg
    assert "points_to_evaluate.1.model.embedding_dim: not one of the choice values" in msg  # True is not 1
    assert "points_to_evaluate.1.train.lr: not on the range's steps" in msg
    assert "points_to_evaluate.1.train.batch_size: an int range takes whole numbers" in msg
    assert "points_to_evaluate.1.model.dropout: not a number in the uniform range" in msg
    # inside the space but not a valid job: named as the point's value
    msg = problems(tmp_path, space={"model.dropout": {"choice": [0.1, 1.5]}}, points_to_evaluate=[{"model.dropout": 1.5}])
    assert "points_to_evaluate.0.model.dropout: makes the job spec invalid" in msg
    msg = problems(tmp_path, num_samples=1, points_to_evaluate=[{"train.lr": 1e-3}, {"train.lr": 2e-3}])
    assert "points_to_evaluate: 2 points but only 1 trials (num_samples)" in msg
    ok = load_search_spec(write(tmp_path, space=space, num_samples=2, points_to_evaluate=[
        {"model.embedding_dim": 16, "train.lr": 0.0002, "train.batch_size": 128, "model.dropout": 0.5}]))
    assert ok.points_to_evaluate[0]["train.batch_size"] == 128


def test_tune_function_refuses_a_bad_point_before_anything_runs(monkeypatch):
    from rayload import tuning

    monkeypatch.setattr(tuning, "ensure_ray", lambda address: pytest.fail("reached Ray"))
    with pytest.raises(SpecError, match=r"points_to_evaluate.0.k: not one of the choice values \[1, 2\] \(got 5\)"):
        tuning.tune_function(lambda c: c["k"], {"k": {"choice": [1, 2]}}, points_to_evaluate=[{"k": 5}])
    with pytest.raises(SpecError, match=r"points_to_evaluate.0.x: outside the uniform range \[0, 1\] \(got 7.0\)"):
        tuning.tune_function(lambda c: c["x"], {"x": {"uniform": [0, 1]}}, points_to_evaluate=[{"x": 7.0}])


def test_every_reported_metric_has_its_direction_and_one_without_needs_mode(tmp_path):
    """train_loss and val_ece were maximised when mode was left out (only logloss and rmse were
    known to be lower-is-better); calibration, mean_prediction and observed_rate have no better
    direction, so a search on them must say which way it goes."""
    from rayload.search_job import _reported_metrics
    from rayload.search_spec import METRIC_MODES, metric_mode

    for task in ("binary", "regression"):
        for metric in _reported_metrics(task):
            assert metric.removeprefix("val_").removeprefix("train_") in METRIC_MODES, metric
    expected = {"train_loss": "min", "val_logloss": "min", "val_ece": "min", "val_auc": "max", "val_calibration": None}
    assert {m: metric_mode(m) for m in expected} == expected
    for metric, mode in [("train_loss", "min"), ("val_ece", "min"), ("val_logloss", "min"), ("val_auc", "max")]:
        assert load_search_spec(write(tmp_path, metric=metric)).score_mode == mode
    for metric in ("val_calibration", "val_mean_prediction", "val_observed_rate"):
        msg = problems(tmp_path, metric=metric)
        assert f"mode: {metric} has no better direction" in msg and "set mode: max or min" in msg
        assert load_search_spec(write(tmp_path, metric=metric, mode="min")).score_mode == "min"
    assert load_search_spec(write(tmp_path, metric="train_loss", mode="max")).score_mode == "max"  # an explicit mode wins


def test_fields_of_unset_sections_and_items_of_default_lists_can_be_searched(tmp_path):
    """train.early_stopping.patience was 'not a field' on a base without early_stopping (an
    Optional section was not looked into); model.hidden.0 on a base that leaves hidden at its
    default made hidden {'0': 8}, 'not a valid list'."""
    from rayload.search_job import base_raw, job_from

    raw = yaml.safe_load(open(BASE))
    del raw["train"]["early_stopping"], raw["model"]["hidden"]
    base = tmp_path / "job.yaml"
    base.write_text("# rayload train job.yaml\n" + yaml.safe_dump(raw))
    path = write(tmp_path, base=str(base), space={"train.early_stopping.patience": {"int": [1, 3]}, "model.hidden.0": {"choice": [8, 16]}},
                 fixed={"model.bottom.0": 32})
    spec = load_search_spec(path)
    job = job_from(base_raw(spec, path), {"train.early_stopping.patience": 3, "model.hidden.0": 16})
    assert job.train.early_stopping.patience == 3 and job.model.hidden == [16, 128] and job.model.bottom == [32]  # defaults [256, 128], [64]
    msg = problems(tmp_path, base=str(base), space={"train.early_stopping.patiance": {"int": [1, 3]}})
    assert "space.train.early_stopping.patiance: not a field" in msg and "train.early_stopping.patience" in msg


def test_a_stepped_float_range_with_fractional_steps_on_an_integer_field_is_refused(tmp_path):
    """step 0.5 from 8 was accepted because the one value probed (31.0) is whole; the sampler
    then draws 8.5, 31.5, ... and those trials fail."""
    for step in (0.5, 0.25, 3.5, 0.35):  # each divides 64 - 8 (one that does not is refused as such: test_search_spec_review)
        msg = problems(tmp_path, space={"model.embedding_dim": {"uniform": [8, 64], "step": step}})
        assert f"space.model.embedding_dim: a uniform range with step {step:g} draws values such as" in msg, msg
        assert "integer" in msg and "{int: [8, 64]} or a choice list" in msg and "a step and low on it must be whole" in msg
    msg = problems(tmp_path, space={"model.embedding_dim": {"uniform": [8.5, 63.5], "step": 1}})
    assert "space.model.embedding_dim: value 8.5 makes the job spec invalid" in msg
    for step in (1, 4.0):  # whole steps from a whole low draw whole values only
        assert load_search_spec(write(tmp_path, space={"model.embedding_dim": {"uniform": [8, 64], "step": step}})).space
    assert load_search_spec(write(tmp_path, space={"model.dropout": {"uniform": [0.0, 0.5], "step": 0.5}})).space  # a float field


@pytest.mark.parametrize("param", [{}, {"uniform": [0, 1], "choice": [1]}])
def test_a_parameter_of_no_kind_or_two_is_refused_by_name(tmp_path, param):
    """`space.train.lr={}` raised AttributeError: 'Param' object has no attribute ''."""
    msg = problems(tmp_path, space={"train.lr": param})
    assert "space.train.lr" in msg and "give exactly one of" in msg
