"""Searches on a local Ray with a tiny DeepFM: every strategy, ASHA, failures, PostgreSQL."""

import itertools
import math
import os

import optuna
import pytest
import yaml
from helpers import MOVIELENS_COLUMNS, movielens_subset

import rayload
from rayload.errors import RayloadError

pytestmark = pytest.mark.integration
PG = os.environ.get("RAYLOAD_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="module")
def base_job(ray_local, tmp_path_factory):
    """A job spec over the first 6,000 MovieLens ratings with a tiny DeepFM."""
    folder = tmp_path_factory.mktemp("tune")
    movielens_subset(folder, 6000)
    raw = {"name": "ml-tiny",
           "data": {"source": {"kind": "parquet", "path": str(folder / "subset.parquet")},
                    "columns": MOVIELENS_COLUMNS,
                    "label": {"column": "rating", "threshold": 4.0}},
           "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16]},
           "train": {"epochs": 2, "batch_size": 256, "lr": 0.005}}
    path = folder / "job.yaml"
    path.write_text("# rayload train job.yaml\n" + yaml.safe_dump(raw))
    return str(path)


def search(base: str, tmp_path, **fields) -> str:
    raw = {"name": "s", "base": base, "space": {"train.lr": {"loguniform": [1e-3, 3e-2]}, "model.embedding_dim": {"choice": [4, 8]}},
           "num_samples": 3, "max_concurrent": 2, **fields}
    path = tmp_path / "search.yaml"
    path.write_text("# rayload tune search.yaml\n" + yaml.safe_dump(raw))
    return str(path)


def test_random_search_table_best_yaml_plots_and_best_yaml_trains(base_job, tmp_path):
    """With the per-ID embedding prior: trials get the ID counts the search took once per data
    variant, `rayload train` counts them itself, and both train the same model."""
    res = rayload.tune(search(base_job, tmp_path, strategy="random", fixed={"train.embedding_prior": 1.0}))
    assert res.counts() == {"complete": 3}
    values = [r["value"] for r in res.trials]
    assert values == sorted(values, reverse=True) and res.best_value == values[0] > 0.5
    assert {os.path.basename(p) for p in res.plots} == {"history.png", "importances.png", "parallel_coordinates.png"}
    assert all(os.path.getsize(p) > 10_000 for p in res.plots)
    assert os.path.isdir(res.best["checkpoint"])
    best = rayload.load_spec(res.best_spec)
    assert best.train.lr == pytest.approx(res.best_params["train.lr"]) and best.model.embedding_dim == res.best_params["model.embedding_dim"]
    assert best.train.embedding_prior == 1.0
    trained = rayload.train(best, evaluate_test=False)
    assert trained.metrics["val_auc"] == pytest.approx(res.best_value, abs=1e-6)  # same seed, same data: the same model
    assert open(os.path.join(res.run_dir, "trials.csv")).read().count("\n") == 4


def test_grid_visits_exactly_the_grid(base_job, tmp_path):
    res = rayload.tune(search(base_job, tmp_path, strategy="grid", num_samples=None, fixed={"train.epochs": 1},
                              space={"train.lr": [0.002, 0.02], "model.embedding_dim": [4, 8]}))
    seen = sorted((r["params"]["train.lr"], r["params"]["model.embedding_dim"]) for r in res.trials)
    assert seen == sorted(itertools.product([0.002, 0.02], [4, 8]))
    assert res.counts() == {"complete": 4}  # a failed trial keeps its params: the grid must also have run


def test_tpe_with_a_seed_proposes_the_same_configurations(base_job, tmp_path):
    """One random start-up trial, then two TPE proposals, one trial at a time (so each proposal
    has every earlier result): two searches with one seed propose the same trials, and those
    are the ones Optuna's TPESampler with that seed proposes from the same results (a seeded
    RandomSampler, or a TPE still in its start-up trials, proposes others)."""
    spec = search(base_job, tmp_path, strategy="bayes", sampler="tpe", seed=7, startup_trials=1, max_concurrent=1,
                  fixed={"train.epochs": 1})
    first, second = rayload.tune(spec), rayload.tune(spec)
    params = lambda res: sorted((r["number"], tuple(sorted(r["params"].items()))) for r in res.trials)
    assert first.counts() == {"complete": 3} and params(first) == params(second)
    study = optuna.load_study(study_name="s", storage=first.storage)
    replay = optuna.create_study(direction=study.direction,
                                 sampler=optuna.samplers.TPESampler(seed=7, n_startup_trials=1, multivariate=True))
    for trial in sorted(study.trials, key=lambda t: t.number):
        proposed = replay.ask(trial.distributions)
        assert proposed.params == trial.params, trial.number
        replay.tell(proposed, trial.value)


def test_asha_stops_a_bad_trial_early(base_job, tmp_path):
    # Two good learning rates first, then a useless one; one trial at a time so the rung is full.
    res = rayload.tune(search(base_job, tmp_path, strategy="random", max_concurrent=1, num_samples=3,
                              space={"train.lr": {"loguniform": [1e-7, 3e-2]}},
                              points_to_evaluate=[{"train.lr": 0.01}, {"train.lr": 0.02}, {"train.lr": 1e-7}],
                              scheduler={"kind": "asha", "grace_period": 1, "reduction_factor": 2, "max_epochs": 3}))
    by_lr = {r["params"]["train.lr"]: r for r in res.trials}
    assert by_lr[1e-7]["state"] == "pruned" and by_lr[1e-7]["epochs"] == 1
    assert by_lr[0.01]["state"] == "complete" and by_lr[0.01]["epochs"] == 3  # first at every rung: never stopped
    assert by_lr[0.02]["epochs"] >= 2 and res.best["params"]["train.lr"] in (0.01, 0.02)


def branin(c):
    x, y = c["x"], c["y"]
    return (y - 5.1 / (4 * math.pi**2) * x * x + 5 / math.pi * x - 6) ** 2 + 10 * (1 - 1 / (8 * math.pi)) * math.cos(x) + 10


BRANIN = {"x": {"uniform": [-5, 10]}, "y": {"uniform": [0, 15]}}


def test_tune_function_finds_branins_minimum_region_with_tpe(ray_local):
    res = rayload.tune_function(branin, BRANIN, strategy="bayes", sampler="tpe", num_samples=60, seed=0, max_concurrent=1)
    assert res.best_value < 0.397887 + 0.1
    minima = [(-math.pi, 12.275), (math.pi, 2.275), (9.42478, 2.475)]
    x, y = res.best_params["x"], res.best_params["y"]
    assert min(math.hypot(x - a, y - b) for a, b in minima) < 0.5


def test_gp_sampler_runs(ray_local):
    res = rayload.tune_function(branin, BRANIN, strategy="bayes", sampler="gp", num_samples=4, startup_trials=2, seed=0)
    assert res.counts() == {"complete": 4}


def test_a_failing_trial_is_retried_then_recorded_failed_and_the_search_goes_on(ray_local, tmp_path):
    attempts = tmp_path / "attempts"
    attempts.mkdir()

    def objective(c):
        if c["k"] == 2:
            (attempts / f"try{len(list(attempts.iterdir()))}").touch()
            raise RuntimeError("k=2 is broken")
        return float(c["k"])

    res = rayload.tune_function(objective, {"k": [1, 2, 3]}, strategy="grid", max_failures=1, mode="max")
    states = {r["params"]["k"]: r["state"] for r in res.trials}
    assert states == {1: "complete", 2: "fail", 3: "complete"}
    assert len(list(attempts.iterdir())) == 2  # the first run and one retry
    assert res.best_params == {"k": 3}


def test_a_target_ends_the_search_with_the_trial_that_reached_it(ray_local):
    res = rayload.tune_function(lambda c: c["x"], {"x": {"uniform": [0, 10]}}, strategy="random", num_samples=60, mode="max",
                                seed=0, target=9.0, max_concurrent=1)
    assert res.ended == "target value >= 9 reached"
    hits = [r for r in res.trials if r["value"] is not None and r["value"] >= 9]
    assert len(hits) == 1 and hits[0]["state"] == "complete" and res.best == hits[0]
    assert len(res.trials) < 60  # the search did not go on to num_samples
    later = [r for r in res.trials if r["number"] > hits[0]["number"]]
    assert all(r["state"] == "pruned" and r["value"] is None for r in later)  # at most a pending trial, cut before it ran
    assert rayload.tuning.status(res.run_dir)["ended"] == res.ended


def stepping(c):
    import time

    import ray.tune

    # A minute a trial, against an 8 s budget: every trial is still running when the budget is
    # spent, however late it started. Reports first: a trial cut early still has a value. (A
    # stopped trial's thread exits at its next report.)
    for _ in range(300):
        ray.tune.report({"value": c["x"]})
        time.sleep(0.2)


def test_a_time_budget_stops_running_trials_and_a_resume_does_not_spend_it_twice(ray_local):
    res = rayload.tune_function(stepping, {"x": {"uniform": [0, 1]}}, strategy="random", num_samples=50, mode="max",
                                max_concurrent=2, time_budget_s=8, name="budget")
    assert res.ended == "time budget of 8 s spent"
    study = optuna.load_study(study_name="budget", storage=res.storage)
    assert study.trials and len(study.trials) == len(res.trials)
    # No trial can finish in the budget: every one it started was cut, none is left running.
    assert all(t.state == optuna.trial.TrialState.PRUNED and t.user_attrs["rayload"]["stopped"] == res.ended for t in study.trials)
    assert any(t.user_attrs["rayload"]["best_value"] is not None for t in study.trials)  # stopped mid-trial: their values so far
    state = rayload.tuning.status(res.run_dir)
    assert state["ended"] == res.ended and state["spent_s"] >= 8
    again = rayload.tune_function(stepping, {"x": {"uniform": [0, 1]}}, strategy="random", num_samples=50, mode="max",
                                  max_concurrent=2, time_budget_s=8, name="budget", resume=res.run_dir)
    assert again.ended == res.ended and len(again.trials) == len(res.trials)  # nothing left of the budget: no new trial


def reports_without_the_metric(c):
    import ray.tune

    ray.tune.report({"other": c["x"]})


def test_a_trial_reporting_without_the_metric_fails_the_search_with_tunes_reason(ray_local):
    """Tune's controller raises when a result lacks the searcher's metric (its strict metric
    check); the search fails with that reason, its running trial is FAIL in the study, and
    search.json says failed."""
    from rayload import tuning

    with pytest.raises(tuning.SearchFailedError, match=r"ValueError: .*did not include the specified metric") as info:
        rayload.tune_function(reports_without_the_metric, {"x": {"uniform": [0, 1]}}, strategy="random", num_samples=2,
                              mode="max", max_concurrent=1, name="nometric")
    run_dir = str(info.value).split("(", 1)[1].split(")", 1)[0]
    state = tuning.read_state(run_dir)
    assert state["state"] == "failed" and "did not include the specified metric" in state["ended"]
    trials = optuna.load_study(study_name="nometric", storage=state["storage"]).get_trials()
    assert trials and trials[0].state == optuna.trial.TrialState.FAIL
    assert "the search failed" in trials[0].user_attrs["rayload"]["stopped"]


def _pg_tables() -> set[str]:
    import sqlalchemy as sa

    engine = sa.create_engine(PG)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_study_in_postgresql(ray_local):
    name = f"rayload-test-{os.getpid()}"
    before = _pg_tables()  # optuna's schema, made in the shared `test` database by this test, goes with it
    try:
        res = rayload.tune_function(branin, BRANIN, strategy="random", num_samples=3, storage=PG, name=name)
        study = optuna.load_study(study_name=name, storage=PG)
        assert len(study.trials) == 3 and study.best_value == pytest.approx(res.best_value)
        assert rayload.tuning.status(res.run_dir)["state"] == "finished"
        with pytest.raises(RayloadError, match=f"a study named '{name}' already exists"):
            rayload.tune_function(branin, BRANIN, strategy="random", num_samples=3, storage=PG, name=name)
        assert len(optuna.load_study(study_name=name, storage=PG).trials) == 3  # refused before a trial ran
    finally:
        optuna.delete_study(study_name=name, storage=PG)
        assert name not in [s.study_name for s in optuna.get_all_study_summaries(storage=PG)]
        if made := _pg_tables() - before:  # the tables optuna created here (none when they were there before: kept)
            import sqlalchemy as sa

            engine = sa.create_engine(PG)
            with engine.begin() as conn:
                conn.execute(sa.text("DROP TABLE IF EXISTS " + ", ".join(f'"{t}"' for t in sorted(made)) + " CASCADE"))
            engine.dispose()
    assert _pg_tables() == before


def test_a_two_worker_trial_that_leaves_no_room_for_its_own_driver_is_refused(base_job, tmp_path):
    """2 workers x 1 CPU fill this 2-CPU Ray; the trial that drives them holds 0.01 CPU too, so
    the group could never be placed: refused before the search, with the numbers."""
    from rayload.tuning import SearchResourceError

    with pytest.raises(SearchResourceError, match=r"2 worker\(s\) with CPU=1 each, plus CPU=0.01 for the process that drives them.*CPU=2"):
        rayload.tune(search(base_job, tmp_path, strategy="random", num_samples=1, trial_resources={"workers": 2, "cpus_per_worker": 1.0}))


def test_a_trial_keeps_the_checkpoint_of_its_best_epoch_by_the_searchs_metric(base_job, tmp_path):
    """The job ranks its kept checkpoints by val_auc; a search by val_logloss records the best
    epoch by logloss, which the trial must keep (keep_checkpoints 1: that one and the latest)."""
    # lr fixed, not searched (with train.lr in the space too, the searched value silently replaced the 0.05)
    res = rayload.tune(search(base_job, tmp_path, strategy="random", num_samples=1, metric="val_logloss",
                              space={"model.embedding_dim": {"choice": [4, 8]}},
                              fixed={"train.epochs": 4, "train.keep_checkpoints": 1, "train.lr": 0.05}))
    (trial,) = res.trials
    assert trial["value"] == pytest.approx(min(v for v in optuna.load_study(study_name="s", storage=res.storage).trials[0].intermediate_values.values()))
    assert os.path.exists(os.path.join(res.best["checkpoint"], "model.pt"))


def test_a_two_worker_trial_runs_a_torch_trainer(base_job, tmp_path):
    res = rayload.tune(search(base_job, tmp_path, strategy="random", num_samples=1, trial_resources={"workers": 2, "cpus_per_worker": 0.9},
                              fixed={"train.epochs": 2}))
    assert res.counts() == {"complete": 1} and res.trials[0]["epochs"] == 2
    trial = os.path.join(res.run_dir, "trials", "trial_0000")
    assert os.path.exists(os.path.join(trial, "checkpoint_manager_snapshot.json"))  # Ray Train's run folder
    checkpoint = res.best["checkpoint"]
    assert checkpoint.startswith(trial) and os.path.exists(os.path.join(checkpoint, "model.pt"))
