"""`rayload retrain`'s job and gate: the gate scores champion and retrained model on a held-out
test split of the events (not the validation split that picked the best epoch), and a
compressed champion warm-starts the retrain from the checkpoint it was compressed from."""

import importlib
import json
import os
import shutil

import numpy as np
import pytest

from rayload.errors import DataError, RayloadError
from rayload.retrain_gate import GATE_SPLIT, MIN_GATE_CLASS, gate_aucs, gate_from_scores
from rayload.retraining import RetrainResult, job_for, warm_start
from rayload.spec import JobSpec
from _retrain import PLACEHOLDER_COLUMNS, placeholder_checkpoint

evaluate = importlib.import_module("rayload.evaluate")  # the module: `rayload.evaluate` is the SDK function


@pytest.fixture()
def champions(tmp_path):
    source = placeholder_checkpoint(tmp_path / "run" / "epoch_0003")
    int8 = placeholder_checkpoint(tmp_path / "run" / "epoch_0003-int8", {"method": "int8", "source": source})
    return source, int8


class _Pre:
    def __init__(self, splits):
        self.files = {s: [f"{s}.parquet"] for s in splits}

    def batches(self, split):
        return f"{split} rows"


def test_the_gate_needs_a_held_out_test_split():
    assert GATE_SPLIT == "test"
    with pytest.raises(DataError, match="no held-out test split"):
        gate_aucs(_Pre(["train", "val"]), "new", "champion", None)
    result = RetrainResult("r", "e", "champion", "new", 100, 10, 0.6, 0.7, 0.0, None)
    assert result.to_dict()["gate_split"] == "test"


def _scores(n, seed, edge):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.3).astype(np.float32)
    champion = y * 0.5 + rng.normal(size=n)
    return y, champion, champion + edge * y + 0.3 * rng.normal(size=n)


def test_the_gate_gives_the_paired_gain_with_its_interval():
    y, champion, new = _scores(600, 0, 0.8)
    gate = gate_from_scores(y, new, champion)
    assert gate.auc_new == pytest.approx(evaluate.auc(y, new)) and gate.auc_champion == pytest.approx(evaluate.auc(y, champion))
    assert gate.rows == 600 and gate.positives == int(y.sum())
    assert gate.gain_ci[0] < gate.auc_new - gate.auc_champion < gate.gain_ci[1] and gate.gain_ci[0] > 0 and gate.gain_p < 1e-3
    # no real gain on a small split: the interval spans zero, whatever the point estimate's sign
    y, champion, new = _scores(120, 1, 0.0)
    gate = gate_from_scores(y, new, champion)
    assert gate.gain_ci[0] < 0 < gate.gain_ci[1] and gate.gain_p > 0.05


def test_the_gate_refuses_a_split_with_too_few_rows_of_a_class():
    y, champion, new = _scores(50, 2, 0.5)
    y[:] = 0
    y[:MIN_GATE_CLASS - 1] = 1
    with pytest.raises(DataError, match=f"{MIN_GATE_CLASS - 1} positive and .* the gate needs {MIN_GATE_CLASS} of each"):
        gate_from_scores(y, new, champion)


@pytest.mark.parametrize("ties", [False, True])
def test_delong_paired_difference_matches_its_definition(ties):
    """The O(n log n) form against the structural components computed pair by pair, and a
    bootstrap of the same rows for the spread."""
    y, a, b = _scores(300, 3, 0.4)
    if ties:
        a, b = np.round(a, 1), np.round(b, 1)
    diff, (low, high), p = evaluate.paired_auc_difference(y, a, b)
    pos, neg = y > 0.5, y < 0.5

    def components(s):
        psi = (s[pos][:, None] > s[neg][None, :]) + 0.5 * (s[pos][:, None] == s[neg][None, :])
        return psi.mean(1), psi.mean(0)

    (va, wa), (vb, wb) = components(a), components(b)
    assert diff == pytest.approx(vb.mean() - va.mean(), abs=1e-12) == pytest.approx(evaluate.auc(y, b) - evaluate.auc(y, a))
    se = np.sqrt(np.var(vb - va, ddof=1) / pos.sum() + np.var(wb - wa, ddof=1) / neg.sum())
    assert (high - low) / 2 == pytest.approx(1.959964 * se, rel=1e-6)
    rng = np.random.default_rng(0)
    boot = [evaluate.auc(y[i], b[i]) - evaluate.auc(y[i], a[i]) for i in (rng.integers(0, len(y), len(y)) for _ in range(400))]
    assert np.std(boot) == pytest.approx(se, rel=0.15)
    same = evaluate.paired_auc_difference(y, a, a)
    assert same == (0.0, (0.0, 0.0), 1.0)


def test_the_retrain_job_holds_out_a_test_split_and_warm_starts_from_the_champion(champions, tmp_path):
    source, _ = champions
    spec = JobSpec.model_validate({"name": "x", "data": {"source": {"kind": "movielens"}}})
    job = job_for(spec, source, str(tmp_path / "events.parquet"), "y", "retrain-x")
    assert job.split.test > 0 and job.split.val > 0
    assert job.train.init_from == os.path.abspath(source)


def test_exposures_of_the_same_features_never_land_in_two_splits(champions, tmp_path):
    """The retrain split was keyed by request_id: a user shown the same item twice (the rehearsal
    world's usual case) had one copy in train and one in the gate's test rows, so the gate scored
    rows the retrained model had trained on exact copies of, and the champion had not."""
    import pyarrow as pa

    from rayload.data.split import SplitPlan, assign
    from rayload.data.validate import Schema

    source, _ = champions
    job = job_for(JobSpec.model_validate({"name": "x", "data": {"source": {"kind": "movielens"}}}), source,
                  str(tmp_path / "events.parquet"), "y", "retrain-x")
    assert job.split.key == ["x", "c"]
    rng = np.random.default_rng(0)
    pairs = rng.integers(0, 40, 3000)  # 40 distinct rows, each logged ~75 times under its own request_id
    table = pa.table({"x": (pairs % 8).astype(float), "c": [str(p // 8) for p in pairs], "y": (pairs % 3 == 0).astype(float),
                      "request_id": [f"r{i}" for i in range(len(pairs))]})
    codes = assign(table, SplitPlan.from_spec(job.split, Schema.from_spec(job.data)))
    splits_of = {p: set(codes[pairs == p]) for p in np.unique(pairs)}
    assert all(len(s) == 1 for s in splits_of.values())
    assert {c for s in splits_of.values() for c in s} == {0, 1, 2}  # every split still gets rows


def test_a_compressed_champion_warm_starts_from_its_source(champions, tmp_path):
    source, int8 = champions
    assert warm_start(source) == os.path.abspath(source)
    assert warm_start(int8) == source
    spec = JobSpec.model_validate({"name": "x", "data": {"source": {"kind": "movielens"}}})
    assert job_for(spec, int8, str(tmp_path / "events.parquet"), "y", "retrain-x").train.init_from == source


def test_a_compressed_champion_whose_source_is_gone_or_changed_is_refused_naming_it(champions):
    source, int8 = champions
    with open(os.path.join(source, "features.json")) as f:
        fitted = json.load(f)
    with open(os.path.join(source, "features.json"), "w") as f:
        json.dump({**fitted, "columns": PLACEHOLDER_COLUMNS[1:]}, f)
    with pytest.raises(RayloadError, match="features.json has changed"):
        warm_start(int8)
    shutil.rmtree(source)
    with pytest.raises(RayloadError, match=f"compression.source: '{source}'.*is gone"):
        warm_start(int8)


@pytest.mark.parametrize("which, name", [("new", "the retrained model"), ("champion", "the champion")])
def test_a_model_scoring_nan_is_named_by_the_gate(which, name):
    """A NaN logit made the paired test NaN and auc() raise a bare ValueError naming neither model."""
    rng = np.random.default_rng(0)
    labels = (rng.random(200) < 0.5).astype(np.float32)
    scores = {"new": rng.normal(size=200), "champion": rng.normal(size=200)}
    scores[which][7] = np.nan
    with pytest.raises(DataError, match=rf"{name} scored 1 of the 200 held-out {GATE_SPLIT} rows NaN or infinite"):
        gate_from_scores(labels, scores["new"], scores["champion"])


def test_a_timestamp_a_derived_feature_reads_is_left_out_of_the_retrain_split_key(tmp_path):
    """Nearly unique per exposure, a raw timestamp in the key split showings the model reads
    alike (same user, item and hour) between train and the gate's rows."""
    import dataclasses

    from _loop import features

    folder = placeholder_checkpoint(tmp_path / "ck")
    path = os.path.join(folder, "features.json")
    loaded = features()
    dataclasses.replace(loaded, columns=[*PLACEHOLDER_COLUMNS[:2], {"name": "ts", "role": "timestamp"}, PLACEHOLDER_COLUMNS[2]],
                        derived={"hour": {"source": "ts", "part": "hour"}}).save(path)
    job = job_for(JobSpec.model_validate({"name": "x", "data": {"source": {"kind": "movielens"}}}), folder,
                  str(tmp_path / "events.parquet"), "y", "retrain-x")
    assert [c.name for c in job.data.columns if c.role == "timestamp"] == ["ts"]  # still read: the hour is derived from it
    assert job.split.key == ["x", "c"]
