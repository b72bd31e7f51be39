"""`--kfold K` cuts its folds the way the spec's split keeps rows together (train/kfold.py):
a group split becomes group k-fold, a temporal split is refused. No Ray: fit is replaced to
capture each fold's spec, whose split is then applied to a table."""

import numpy as np
import pyarrow as pa
import pytest

import helpers
from rayload.data.split import SplitPlan, assign
from rayload.data.validate import Schema
from rayload.errors import SpecError
from rayload.train import trainer

TRAIN, VAL, TEST = 0, 1, 2


@pytest.fixture
def folds(monkeypatch):
    seen = []

    def fit(spec, address=None, evaluate_test=True):
        seen.append((spec, evaluate_test))
        return trainer.TrainResult("x", "x", "x", {"val_auc": 0.5 + 0.1 * len(seen)})

    monkeypatch.setattr(trainer, "fit", fit)
    return seen


def codes(spec, df) -> np.ndarray:
    table = pa.table({c: pa.array(df[c].astype(str)) if c != "y" else pa.array(df[c]) for c in df.columns})
    return assign(table, SplitPlan.from_spec(spec.split, Schema.from_spec(spec.data)))


def test_a_group_split_becomes_group_k_fold(folds):
    df = helpers.frame(2000, 0)
    spec = helpers.job("/x.parquet", split={"kind": "group", "group": "user", "train": 0.8, "val": 0.1, "test": 0.1})
    result = trainer.kfold(spec, 3)
    assert len(result.folds) == 3 and result.mean["val_auc"] == pytest.approx(0.7)
    users = df["user"].to_numpy()
    validated = []
    for fold_spec, _ in folds:
        assert (fold_spec.split.kind, fold_spec.split.group) == ("kfold", "user")
        c = codes(fold_spec, df)
        parts = [set(users[c == code]) for code in (TRAIN, VAL, TEST)]
        assert not parts[0] & parts[1] and not parts[0] & parts[2] and not parts[1] & parts[2]  # a user in one part only
        validated.append(parts[1])
    assert set.union(*validated) | set(users[codes(folds[0][0], df) == TEST]) == set(users)  # every user validated once or held out
    assert sum(len(v) for v in validated) == len(set.union(*validated))


def test_a_random_split_keeps_its_key_and_a_fold_run_is_named_after_the_run(folds):
    spec = helpers.job("/x.parquet", split={"key": ["user", "item", "ts"]}, train={"run_name": "cv"})
    trainer.kfold(spec, 2)
    assert [(s.split.kind, s.split.key, s.split.group, s.train.run_name) for s, _ in folds] == [
        ("kfold", ["user", "item", "ts"], None, "cv-fold0"), ("kfold", ["user", "item", "ts"], None, "cv-fold1")]
    plan = SplitPlan.from_spec(folds[0][0].split, Schema.from_spec(spec.data))
    assert plan.key == ("user", "item", "ts")


def test_a_temporal_split_is_refused_before_any_fold_trains(folds):
    spec = helpers.job("/x.parquet", split={"kind": "temporal"})
    with pytest.raises(SpecError, match="split.kind: --kfold cuts folds by a hash .* train on rows later than the ones it validates on"):
        trainer.kfold(spec, 3)
    assert folds == []


def test_a_kfold_split_with_a_group_keys_its_folds_by_it():
    spec = helpers.job("/x.parquet", split={"kind": "kfold", "group": "user", "k": 4, "fold": 1})
    assert SplitPlan.from_spec(spec.split, Schema.from_spec(spec.data)).key == ("user",)


def test_a_kfold_group_that_is_not_a_column_is_refused_at_load(tmp_path):
    from rayload.spec import load_spec

    path = tmp_path / "j.yaml"
    path.write_text("name: t\ndata: {source: {kind: movielens}}\nsplit: {kind: kfold, group: nobody}\n")
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert [i.path for i in info.value.issues] == ["split.group"]


def test_each_fold_is_scored_on_the_held_out_test_rows_even_when_the_job_evaluates_val(folds):
    """eval.split: val made each fold's test_* figures its validation metrics again."""
    trainer.kfold(helpers.job("/x.parquet", eval={"split": "val"}, split={"train": 0.7, "test": 0.2}), 2)
    assert [(s.eval.split, evaluate_test) for s, evaluate_test in folds] == [("test", True), ("test", True)]
    folds.clear()
    trainer.kfold(helpers.job("/x.parquet", eval={"split": "val"}, split={"kind": "kfold", "test": 0.0}), 2)
    assert [evaluate_test for _, evaluate_test in folds] == [False, False]  # no test rows: no test_* figures


def test_a_failing_fold_is_named_with_the_run_name_that_resumes_the_finished_ones(monkeypatch, tmp_path):
    """A fold that failed raised its error alone: no fold number, and the generated run name a
    relaunch needs to keep the finished folds was never shown (a relaunch trained them all again)."""
    from typer.testing import CliRunner

    from rayload.cli import app
    from rayload.errors import DataError

    names = []

    def fit(spec, address=None, evaluate_test=True):
        names.append(spec.train.run_name)
        if len(names) == 3:
            raise DataError("the val split is empty")
        return trainer.TrainResult("x", "x", "x", {"val_auc": 0.6})

    monkeypatch.setattr(trainer, "fit", fit)
    with pytest.raises(DataError, match="the val split is empty") as info:
        trainer.kfold(helpers.job("/x.parquet"), 4)
    base = names[0].removesuffix("-fold0")
    assert info.value.__notes__ == [f"--kfold 4: fold 2 (run {base}-fold2) failed after 2 finished fold(s); relaunch with "
                                    f"--run-name {base} to keep the finished folds (a finished fold is not trained again)"]
    names.clear()
    path = tmp_path / "job.yaml"
    path.write_text("name: t\ndata: {source: {kind: movielens}}\n")
    out = CliRunner().invoke(app, ["train", str(path), "--kfold", "3", "--run-name", "cv"])
    assert out.exit_code == 2 and "the val split is empty" in out.output
    assert "fold 2 (run cv-fold2) failed after 2 finished fold(s); relaunch with --run-name cv" in " ".join(out.output.split())
