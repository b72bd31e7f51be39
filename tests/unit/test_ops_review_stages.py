"""`rayload run` stages with fake runners (no Ray): a search without a result fails its stage,
a user's error exits 2 as it does from the other commands, `--force prepare` preprocesses
again, and the report and the demo summary read the search's own metric and mode."""

import types

import pytest
from typer.testing import CliRunner

from rayload import _stage_runners as runners
from rayload import stages
from rayload.errors import DataError, RayloadError
from rayload.pipeline_spec import PipelineSpec

SPEC = PipelineSpec.model_validate({"name": "p", "stages": [
    {"name": "baseline", "kind": "train", "job": "x.yaml"}, {"name": "search", "kind": "tune", "search": "s.yaml"},
    {"name": "ab", "kind": "ab", "spec": "ab.yaml", "champion": "baseline", "challenger": "search"}]})


def _failed_search(monkeypatch, tmp_path):
    """The search runner's inputs: every trial of the search failed (tune() returns best None)."""
    import rayload.tuning

    trials = [{"number": n, "state": "fail", "value": None} for n in (2, 0, 1)]
    found = types.SimpleNamespace(run_dir=str(tmp_path / "search"), metric="val_auc", mode="max", trials=trials, best=None,
                                  counts=lambda: {"fail": 3})
    monkeypatch.setattr(runners, "_search", lambda spec, stage: types.SimpleNamespace(storage=None))  # a study in the run folder
    monkeypatch.setattr(rayload.tuning, "tune", lambda *a, **kw: found)


def test_a_search_whose_trials_all_failed_fails_its_stage_on_every_run(fake_runners, monkeypatch, tmp_path):
    """It was recorded `ok` with no best trial, skipped on every rerun, and the A/B stage after
    it failed instead, naming the wrong stage."""
    _failed_search(monkeypatch, tmp_path)
    with pytest.raises(RayloadError, match=r"stage 'search': no trial of the search finished .*fail: trials 0, 1, 2"):
        runners.tune(SPEC, SPEC.stage("search"), str(tmp_path), {}, None, lambda f: None)
    for _ in range(2):
        result = stages.run(SPEC, "p")
        assert [(s.name, s.outcome) for s in result.stages] == [("baseline", "ok" if _ == 0 else "skipped"), ("search", "failed")]
        failed = result.stages[-1]
        assert failed.user_error and "stage 'search'" in failed.error and "--force search" in failed.error


def test_run_exits_2_for_a_users_error_in_a_stage_and_1_for_a_bug(fake_runners, monkeypatch):
    """`rayload train` exits 2 for a RayloadError; `rayload run` exited 1 for the same one."""
    import rayload._cli_ops  # noqa: F401  (registers `run`)
    import rayload.pipeline_spec
    from rayload.cli import app

    monkeypatch.setattr(rayload.pipeline_spec, "load_pipeline", lambda path, sets: SPEC)

    def user_error(*a):
        raise DataError("data.source: no files match /no/such/*.csv")

    monkeypatch.setattr(runners, "train", user_error)
    r = CliRunner().invoke(app, ["run", "p.yaml", "--run-id", "r1"])
    assert r.exit_code == 2 and "no files match" in r.output, r.output

    def bug(*a):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(runners, "train", bug)
    r = CliRunner().invoke(app, ["run", "p.yaml", "--run-id", "r2"])
    assert r.exit_code == 1, r.output
    assert stages.run(SPEC, "r3").stages[0].user_error is False


def test_force_prepare_preprocesses_again_instead_of_reusing_the_cache(monkeypatch, tmp_path):
    import rayload.data.pipeline

    calls = []

    class Features:
        def save(self, path):
            open(path, "w").write("{}")

    def preprocess(job, out=None, address=None):
        calls.append(out)
        counts = {"input": 3, "good": 3, "quarantined": 0}
        return types.SimpleNamespace(features=Features(), counts=counts, out_dir=out or "cache/entry", cached=out is None and len(calls) > 1,
                                     cache_key="k", data_hash="h")

    monkeypatch.setattr(rayload.data.pipeline, "preprocess", preprocess)
    monkeypatch.setattr(runners, "_job", lambda spec, stage: None)
    monkeypatch.setattr(runners, "plan_for", lambda spec, stage: (stage.model_dump(mode="json"), None, None))
    monkeypatch.setattr(stages, "_ray_for_direct_ingress", lambda spec, address: None)
    spec = PipelineSpec.model_validate({"name": "p", "stages": [{"name": "prep", "kind": "prepare", "job": "x.yaml"}]})
    first = stages.run(spec, "p")
    assert calls == [None] and first.stages[0].outcome == "ok"
    assert stages.run(spec, "p").stages[0].outcome == "skipped" and calls == [None]
    forced = stages.run(spec, "p", force=("prep",))
    folder = tmp_path / "runs" / "p" / "prep"
    assert calls == [None, str(folder / "shards")]  # not the cache entry: preprocessed again
    assert forced.stages[0].outputs["cached"] is False and forced.stages[0].outputs["shards"] == str(folder / "shards")


def test_the_reports_best_so_far_follows_the_searchs_mode(monkeypatch):
    from rayload import report

    assert report.best_so_far([0.5, 0.4, 0.6, 0.3], "min") == [0.5, 0.4, 0.4, 0.3]
    assert report.best_so_far([0.5, 0.4, 0.6, 0.3], "max") == [0.5, 0.5, 0.6, 0.6]
    seen = {}
    monkeypatch.setattr(report, "search_plot", lambda trials, baseline, metric, mode="max": seen.update(
        baseline=baseline, metric=metric, mode=mode))
    monkeypatch.setattr(report, "training_plot", lambda curves: None)
    monkeypatch.setattr(report, "_best_trial_history", lambda best: [])
    tune = {"metric": "val_logloss", "mode": "min", "trials": 2, "history": [], "best": {"number": 1, "value": 0.41}}
    base = {"val": {"val_auc": 0.7, "val_logloss": 0.45}}
    manifest = {"run_id": "r", "pipeline": "p", "stages": [
        {"name": "b", "kind": "train", "outcome": "ok", "seconds": 1.0, "outputs": base},
        {"name": "s", "kind": "tune", "outcome": "ok", "seconds": 1.0, "outputs": tune}]}
    page = report.render(manifest)
    assert seen == {"baseline": 0.45, "metric": "val_logloss", "mode": "min"} and "val_logloss 0.4100" in page
    del tune["mode"]  # a run recorded before stages kept the mode: the metric's own direction
    report.render(manifest)
    assert seen["mode"] == "min"


def test_the_demo_summary_names_the_searchs_metric(monkeypatch):
    from rayload import _cli_ops

    out = []
    monkeypatch.setattr(_cli_ops.console, "print", lambda text, *a, **kw: out.append(str(text)))
    monkeypatch.setattr(_cli_ops.console, "rule", lambda *a, **kw: None)
    search = {"metric": "val_logloss", "trials": 4, "best": {"number": 2, "value": 0.4123, "test": {"auc": 0.7}, "spec": "best.yaml"}}
    result = types.SimpleNamespace(stages=[types.SimpleNamespace(name="s", kind="tune", outcome="ok", outputs=search)])
    _cli_ops.print_summary(result, "report.html")
    line = next(line for line in out if line.startswith("best tuned"))
    assert "val_logloss 0.4123" in line and "val AUC" not in line



def test_the_report_and_the_summary_take_the_first_train_stage_as_the_baseline_and_plot_every_one(monkeypatch):
    """With two train stages (a champion and a challenger) the last was called the baseline, and
    the other was left out of the training curves."""
    from rayload import _cli_ops, report

    curves = {}
    monkeypatch.setattr(report, "training_plot", lambda c: curves.update(c))
    monkeypatch.setattr(report, "_history", lambda outputs: [{"epoch": 0, "val_auc": outputs["val"]["val_auc"]}])
    monkeypatch.setattr(report, "_best_trial_history", lambda best: [])
    stages = [{"name": "champion", "kind": "train", "outcome": "skipped", "seconds": 0.0,
               "outputs": {"val": {"val_auc": 0.55}, "test": {"auc": 0.3178}}},
              {"name": "second", "kind": "train", "outcome": "ok", "seconds": 1.0, "outputs": {"val": {"val_auc": 0.42}, "test": {"auc": 0.527}}}]
    page = report.render({"run_id": "r", "pipeline": "p", "stages": stages})
    assert 'baseline (champion) test AUC <b id="baseline-auc">0.3178</b>' in page
    assert set(curves) == {"champion", "second", "best trial None"}
    named = [dict(s, name="baseline") if s["name"] == "second" else s for s in stages]  # a stage named baseline is the baseline
    assert 'baseline test AUC <b id="baseline-auc">0.5270</b>' in report.render({"run_id": "r", "pipeline": "p", "stages": named})
    out = []
    monkeypatch.setattr(_cli_ops.console, "print", lambda text, *a, **kw: out.append(str(text)))
    monkeypatch.setattr(_cli_ops.console, "rule", lambda *a, **kw: None)
    _cli_ops.print_summary(types.SimpleNamespace(stages=[types.SimpleNamespace(**s) for s in stages]), "report.html")
    assert any(line.startswith("baseline (champion): val AUC") and "test AUC 0.3178" in line for line in out), out
