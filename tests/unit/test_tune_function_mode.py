"""tune_function with mode=None: a metric of no known direction ("value", "error") used to be
maximised silently (SearchSpec.score_mode's fallback); it is refused before Ray starts. A metric
whose direction rayload knows keeps it. No Ray."""

import pytest
from _tune_plan import PlanReached

from rayload import tuning
from rayload.errors import SpecError

SPACE = {"x": {"uniform": [0, 1]}}


@pytest.mark.parametrize("metric", ["value", "error", "val_calibration"])
def test_mode_none_with_a_metric_of_no_known_direction_is_refused_before_ray(tune_before_ray, metric):
    with pytest.raises(SpecError) as exc:
        tuning.tune_function(lambda c: c["x"], SPACE, metric=metric, mode=None, storage=f"sqlite:///{tune_before_ray}/s.db")
    text = str(exc.value)
    assert text.startswith("1 problem(s):") and "mode:" in text and repr(metric) in text
    assert "mode='min' or mode='max'" in text and "(got None)" in text
    assert not (tune_before_ray / "tune").exists()  # no run folder was made either


@pytest.mark.parametrize("metric, mode", [("val_auc", "max"), ("loss", "min"), ("train_loss", "min"), ("val_rmse", "min")])
def test_mode_none_with_a_known_metric_takes_its_direction(tune_plan, metric, mode):
    """The direction the search runs in (the plan's, which opens the study and ranks trials) and
    the one search.json records. (This test checked a separately built SearchSpec, so a
    tune_function that searched the wrong way passed it.)"""
    with pytest.raises(PlanReached):
        tuning.tune_function(lambda c: c["x"], SPACE, metric=metric, mode=None, storage=f"sqlite:///{tune_plan['tmp']}/s.db")
    assert tune_plan["score_mode"] == tune_plan["state_mode"] == mode


@pytest.mark.parametrize("metric", ["value", "val_auc", "loss"])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_an_explicit_mode_is_used_whatever_the_metric(tune_plan, mode, metric):
    with pytest.raises(PlanReached):
        tuning.tune_function(lambda c: c["x"], SPACE, metric=metric, mode=mode, storage=f"sqlite:///{tune_plan['tmp']}/s.db")
    assert tune_plan["score_mode"] == tune_plan["state_mode"] == mode


@pytest.mark.parametrize("metric, mode", [("val_auc", "max"), ("value", "min"), ("loss", "min")])
def test_mode_left_out_is_the_metrics_own_and_value_is_minimised(tune_plan, metric, mode):
    with pytest.raises(PlanReached):
        tuning.tune_function(lambda c: c["x"], SPACE, metric=metric, storage=f"sqlite:///{tune_plan['tmp']}/s.db")
    assert tune_plan["score_mode"] == tune_plan["state_mode"] == mode


def test_a_search_started_before_the_check_resumes_in_the_direction_its_study_was_made_with(tune_before_ray):
    from rayload._tune_runs import write_state

    run = tune_before_ray / "old-run"
    spec = tuning.SearchSpec(name="function", base="<python function>", space=SPACE, strategy="random", num_samples=3,
                             metric="value", mode=None, max_failures=0)
    write_state(str(run), kind="function", spec=spec.model_dump(mode="json"), mode=spec.score_mode)
    with pytest.raises(AssertionError, match="Ray was started"):
        tuning.tune_function(lambda c: c["x"], SPACE, strategy="random", num_samples=3, mode=None, resume=str(run))


def test_mode_left_out_with_a_metric_of_no_known_direction_is_refused(tune_before_ray):
    with pytest.raises(SpecError, match="mode"):
        tuning.tune_function(lambda c: c["x"], SPACE, metric="accuracy")
