"""The trials table's order, search.json's mode and a failed search's run folder (no Ray cluster)."""

import json
import os

import optuna
import pytest
from _tune_plan import PlanReached
from optuna.trial import TrialState

from rayload import tuning
from rayload._study import SearchStopper, StudySearcher, make_sampler
from rayload._study_store import open_study
from rayload._tune_report import trial_rows
from rayload.search_spec import Param


@pytest.mark.parametrize("direction", ["maximize", "minimize"])
def test_trials_without_a_value_sort_last_in_either_mode(direction):
    study = optuna.create_study(direction=direction)
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for value in (None, -1.0, 2.0, None):
        trial = study.ask(dist)
        if value is not None:
            trial.set_user_attr("rayload", {"best_value": value})
        study.tell(trial, state=TrialState.PRUNED)
    values = [r["value"] for r in trial_rows(study)]
    assert values[2:] == [None, None] and values[:2] == ([2.0, -1.0] if direction == "maximize" else [-1.0, 2.0])


def spec(**fields):
    return tuning.SearchSpec(name="f", base="<python function>", space={"x": Param(uniform=(0, 1))}, strategy="random",
                             num_samples=2, metric="value", **fields)


def test_tune_function_stores_the_mode_the_search_ranks_by(tune_plan):
    with pytest.raises(PlanReached):
        tuning.tune_function(lambda c: c["x"], {"x": {"uniform": [0, 1]}}, metric="loss", mode=None, storage=f"sqlite:///{tune_plan['tmp']}/s.db")
    assert tune_plan["state_mode"] == tune_plan["score_mode"] == "min"  # mode=None: the metric's own


def test_a_search_tune_fails_leaves_its_trials_failed_and_search_json_failed(tmp_path, monkeypatch):
    """Tune's TuneError (a trial reported without the metric) used to leave search.json at
    running and the trial RUNNING in the study."""
    import ray.tune

    class Tuner:
        def __init__(self, trainable, tune_config, run_config):
            self.searcher = tune_config.search_alg

        def fit(self):
            self.searcher.suggest("t0")
            # Ray 2.60's own error (tune_controller's metric check); the real one is raised in
            # tests/integration/test_tune_ray.py's test_a_trial_reporting_without_the_metric_fails_the_search
            raise ValueError("Trial returned a result which did not include the specified metric(s) `value` that "
                             "`StudySearcher` expects. Make sure your calls to `tune.report()` include the metric")

    monkeypatch.setattr(ray.tune, "Tuner", Tuner)
    monkeypatch.setattr(ray.tune, "with_parameters", lambda trainable, **kw: trainable)
    monkeypatch.setattr(ray.tune, "with_resources", lambda trainable, resources: trainable)
    run_dir = str(tmp_path / "run")
    plan = tuning._Plan(spec(mode="min"), run_dir, f"sqlite:///{tmp_path}/s.db", {"CPU": 1}, 1, step_attr="training_iteration")
    tuning.write_state(run_dir, state="preparing", storage=plan.storage, study="f")
    with pytest.raises(tuning.SearchFailedError, match="did not include the specified metric"):
        tuning._run(plan, None, {}, resume=False)
    with open(os.path.join(run_dir, "search.json")) as f:
        state = json.load(f)
    assert state["state"] == "failed" and "did not include the specified metric" in state["ended"]
    trial = optuna.load_study(study_name="f", storage=plan.storage).get_trials()[0]
    assert trial.state == TrialState.FAIL and "the search failed" in trial.user_attrs["rayload"]["stopped"]


def test_cut_off_can_record_fail():
    study = open_study(None, "s", "max", lambda held: make_sampler("random", None, {"x": Param(uniform=(0, 1))}, 0, 3, False, held), True)
    s = StudySearcher(study, {"x": Param(uniform=(0, 1))}, 2, "v", "max")
    s.suggest("a")
    assert s.cut_off("boom", state=TrialState.FAIL) == 1 and study.get_trials()[0].state == TrialState.FAIL
    assert SearchStopper("v", "max", None, None, 0.0).ended(study, budget=True) is None


def test_a_point_whose_mapping_lists_a_choices_keys_in_another_order_runs_as_that_choice(tmp_path):
    """It passed the checks (the mappings are equal), then was enqueued as JSON that is not one of
    the choices: the first suggest raised and left a RUNNING trial without parameters."""
    from rayload.search_spec import SearchSpec, strategy_issues

    choices = [{"metric": "auc", "patience": 1}, {"metric": "auc", "patience": 3}]
    spec = SearchSpec(name="p", base="x", space={"es": {"choice": choices}, "x": {"uniform": [0, 1]}}, strategy="random",
                      num_samples=2, points_to_evaluate=[{"es": {"patience": 3, "metric": "auc"}, "x": 0.5}])
    assert strategy_issues(spec) == []
    storage = f"sqlite:///{tmp_path}/s.db"

    def searcher(create):
        study = open_study(storage, "p", "max", lambda held: make_sampler("random", None, spec.space, 0, 3, False, held), create)
        return StudySearcher(study, spec.space, 2, "v", "max", "training_iteration", spec.points_to_evaluate)

    first = searcher(create=True)
    assert first.suggest("t0") == {"number": 0, "params": {"es": {"metric": "auc", "patience": 3}, "x": 0.5}}
    first.on_trial_complete("t0", {"v": 1.0, "training_iteration": 1})
    again = searcher(create=False)  # resumed: the point ran already and is not enqueued twice
    assert again.suggest("t1")["number"] == 1 and again.suggest("t2") == again.FINISHED
    assert [t.state for t in again.study.get_trials()] == [TrialState.COMPLETE, TrialState.RUNNING]
    # the choices' JSON stays as written: a study made by earlier code holds these very strings,
    # and Optuna refuses other choices for the same parameter ("does not support dynamic value space")
    from rayload._study import decode, encode

    assert encode({"patience": 3, "metric": "auc"}) == 'json:{"patience": 3, "metric": "auc"}'
    assert decode('json:{"patience": 3, "metric": "auc"}') == decode('json:{"metric": "auc", "patience": 3}')


def test_plots_need_complete_trials_and_the_best_line_follows_complete_ones(tmp_path):
    """A search whose trials all failed wrote three blank PNGs (optuna only warns) and listed
    them; the report's best-so-far line took pruned trials' intermediate values, above the
    best trial it named."""
    from rayload._tune_report import write_plots
    from rayload.report import search_plot

    study = optuna.create_study(direction="maximize")
    for _ in range(3):
        study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, params={"x": 1.0},
                                                  distributions={"x": optuna.distributions.FloatDistribution(0, 2)}))
    assert write_plots(study, str(tmp_path / "a")) == [] and not os.listdir(tmp_path / "a")
    study.add_trial(optuna.trial.create_trial(value=0.7, params={"x": 1.0}, distributions={"x": optuna.distributions.FloatDistribution(0, 2)}))
    assert [os.path.basename(p) for p in write_plots(study, str(tmp_path / "b"))] == ["history.png", "parallel_coordinates.png"]
    trials = [{"number": 0, "state": "complete", "value": 0.70}, {"number": 1, "state": "pruned", "value": 0.75},
              {"number": 2, "state": "fail", "value": 0.2}]
    assert search_plot(trials, None, "val_auc") and search_plot(trials[1:], None, "val_auc")  # no complete trial: no line, no crash
    from rayload.report import best_line

    assert best_line(trials) == ([0], [0.70]) and best_line(trials[1:]) == ([], [])


def test_the_run_report_shows_a_failed_stages_error():
    """A failed stage read "failed" and nothing else (a search's "0 trials ({})")."""
    from rayload.report import render

    manifest = {"stages": [{"name": "prepare", "kind": "prepare", "outcome": "ok", "seconds": 1.0, "outputs": {}},
                           {"name": "search", "kind": "tune", "outcome": "failed", "seconds": 2.0, "outputs": {},
                            "error": "SpecError: space.train.lr: <bad>"}], "versions": {}, "run_id": "r", "pipeline": "p"}
    page = render(manifest)
    assert "<td>failed</td><td>2.0</td><td>SpecError: space.train.lr: &lt;bad&gt;</td>" in page


def test_a_running_trials_epochs_so_far_show_in_the_table():
    """A running trial showed '-' for its value and epochs: they came only from the summary its end writes."""
    study = optuna.create_study(direction="maximize")
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    for step, value in ((1, 0.70), (2, 0.74), (3, float("nan")), (4, 0.72)):
        trial.report(value, step)
    row = trial_rows(study)[0]
    assert (row["state"], row["value"], row["epochs"]) == ("running", 0.74, 4)


def test_tune_says_when_no_trial_finished_and_status_says_so_far_for_an_interrupted_search(monkeypatch):
    """`rayload tune` exited 0 with no best line and no word on the missing best.yaml; `tune status`
    called a dead driver's best final ("interrupted (driver gone; ...)" missed the "so far")."""
    from typer.testing import CliRunner

    from rayload import cli

    rows = [{"number": 0, "state": "fail", "value": None, "epochs": None, "seconds": 1.0, "params": {"x": 0.1}, "checkpoint": None},
            {"number": 1, "state": "pruned", "value": 0.7, "epochs": 2, "seconds": 1.0, "params": {"x": 0.2}, "checkpoint": None}]
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: tuning.TuneResult("r", "/tmp/r", "sqlite://", "val_auc", "max", rows, None, None,
                                                                          [], "all trials finished"))
    done = CliRunner().invoke(cli.app, ["tune", "x.yaml"])
    assert "no trial finished with a val_auc value: no best.yaml written; see trials.csv and Ray Tune's error files in /tmp/r" in \
        " ".join(done.output.split())
    assert done.exit_code == 1  # as a pipeline's tune stage fails on it: a script can tell
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: tuning.TuneResult("r", "/tmp/r", "sqlite://", "val_auc", "max", rows[1:], None,
                                                                          None, [], "time budget of 60 s spent"))
    done = CliRunner().invoke(cli.app, ["tune", "x.yaml"])
    assert "see trials.csv in /tmp/r (every trial was stopped before it finished)" in " ".join(done.output.split())
    printed = []
    monkeypatch.setattr(cli.console, "print", lambda text, *a, **k: printed.append(str(text)))
    cli.print_search_status({"run_dir": "/r", "state": "interrupted (driver gone; continue with --resume)", "total": 4, "metric": "v",
                             "trials": rows, "best": {"number": 1, "value": 0.7}})
    assert printed[-1].startswith("best so far: trial 1")
