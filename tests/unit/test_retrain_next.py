"""The experiment `rayload retrain` registers next: its arms, its challenger's weight, and the
checks it passes before any training (the fine-tune itself is replaced by a stub here)."""

import os

import pytest
import yaml

from helpers import job
from rayload import retraining
from rayload.errors import DataError
from rayload.retraining import next_ab_spec, retrain
from _retrain import NOW, ab_run, guarded_run, placeholder_checkpoint, stub_fit

@pytest.fixture()
def second_round(tmp_path):
    """The experiment a first retrain wrote, after its `retrained` arm was promoted."""
    first, retrained = placeholder_checkpoint(tmp_path / "first"), placeholder_checkpoint(tmp_path / "retrained")
    spec = {"name": "exp-r1", "champion": "control", "arms": [{"name": "control", "weight": 0.9, "checkpoint": first},
                                                              {"name": "retrained", "weight": 0.1, "checkpoint": retrained}]}
    return ab_run(tmp_path, spec, "retrained"), retrained


def test_a_second_round_after_a_promote_names_its_challenger_apart_from_the_champion(second_round, tmp_path, monkeypatch):
    run, champion = second_round
    calls = []
    new = stub_fit(monkeypatch, tmp_path, calls)
    result = retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    assert calls == [champion] and result.passed
    spec = yaml.safe_load(open(result.ab_spec))
    assert spec["champion"] == "retrained"
    assert [(a["name"], a["weight"], a["checkpoint"]) for a in spec["arms"]] == [("retrained", 0.9, champion), ("retrained-2", 0.1, new)]


def test_the_next_spec_is_checked_before_the_fine_tune(second_round, tmp_path, monkeypatch):
    """An arm-name clash (as the second round had) is refused before anything is trained."""
    run, _ = second_round
    calls = []
    stub_fit(monkeypatch, tmp_path, calls)
    monkeypatch.setattr(retraining, "challenger_arm", lambda champion_arm: champion_arm)
    with pytest.raises(retraining.RayloadError, match="arm names must be unique"):
        retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    assert calls == []


def test_a_first_round_challenger_is_named_retrained(tmp_path):
    args = {"spec": {"name": "exp", "arms": [{"name": "a", "weight": 0.5, "checkpoint": "x"}, {"name": "b", "weight": 0.5, "checkpoint": "y"}]}}
    spec = next_ab_spec(args, "a", str(tmp_path / "x"), str(tmp_path / "new"), "exp-r1", None)
    assert [a["name"] for a in spec["arms"]] == ["a", "retrained"]


def test_the_challenger_weight_comes_from_the_prior_challenger_when_the_champion_is_the_first_arm_by_default(tmp_path):
    """The prior spec names no `champion:` (the first arm is): the weight was read from the
    first arm all the same, giving the new model the champion's 0.9."""
    args = {"spec": {"name": "exp", "arms": [{"name": "control", "weight": 0.9, "checkpoint": "a"},
                                             {"name": "treatment", "weight": 0.1, "checkpoint": "b"}], "ramp": {"auto": False}}}
    spec = next_ab_spec(args, "control", str(tmp_path / "a"), str(tmp_path / "new"), "exp-r1", None)
    assert {a["name"]: a["weight"] for a in spec["arms"]} == {"control": 0.9, "retrained": 0.1}


@pytest.mark.parametrize("weight, message", [(1.5, r"--weight: the challenger's share of the traffic must be in \[0, 1\] \(got 1.5\)"),
                                             (0.12345, r"--weight: a weight is a whole number of 1/\d+ buckets \(got 0.12345\)")])
def test_a_weight_the_next_experiment_would_refuse_is_named_before_anything_is_trained(second_round, tmp_path, monkeypatch, weight, message):
    run, _ = second_round
    calls = []
    stub_fit(monkeypatch, tmp_path, calls)
    monkeypatch.setattr(retraining, "training_rows", lambda *a, **k: calls.append("rows"))
    with pytest.raises(retraining.RayloadError, match=message):
        retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", challenger_weight=weight, now=NOW)
    assert calls == []


@pytest.mark.parametrize("window, attribution, message", [
    ("0d", "30m", r"--window and --attribution must be durations above 0 \(or 'all'\); got --window 0d --attribution 30m"),
    ("7d", "0s", r"must be durations above 0"),
    ("1h", "2h", r"--window 1h must be longer than --attribution 2h: only exposures older than the attribution"),
])
def test_windows_that_can_label_no_exposure_are_refused_before_the_events_are_read(tmp_path, monkeypatch, window, attribution, message):
    """They were taken: the events were read and written, then "too few rows; widen --window, wait
    for more traffic" (which cannot help), and each try left a retrain folder behind."""
    champion, other = placeholder_checkpoint(tmp_path / "champion"), placeholder_checkpoint(tmp_path / "b")
    run = ab_run(tmp_path, {"name": "exp", "champion": "a", "arms": [{"name": "a", "weight": 0.9, "checkpoint": champion},
                                                                     {"name": "b", "weight": 0.1, "checkpoint": other}]}, "a")
    calls = []
    monkeypatch.setattr(retraining, "training_rows", lambda *a, **k: calls.append("rows"))
    with pytest.raises(retraining.RayloadError, match=message):
        retrain(job(str(tmp_path / "unused.parquet")), run, window=window, attribution=attribution, now=NOW)
    assert calls == []


def test_a_retrain_with_too_few_rows_leaves_no_folder(tmp_path, monkeypatch):
    champion, other = placeholder_checkpoint(tmp_path / "champion"), placeholder_checkpoint(tmp_path / "b")
    run = ab_run(tmp_path, {"name": "exp", "champion": "a", "arms": [{"name": "a", "weight": 0.9, "checkpoint": champion},
                                                                     {"name": "b", "weight": 0.1, "checkpoint": other}]}, "a")
    stub_fit(monkeypatch, tmp_path, [])
    with pytest.raises(DataError, match="too few, or one class only"):  # 80 exposures two hours old, none in a 1h window
        retrain(job(str(tmp_path / "unused.parquet")), run, window="1h", attribution="30m", now=NOW)
    assert not os.listdir(os.path.join(os.environ["RAYLOAD_HOME"], "retrain"))


def test_a_prior_challenger_at_weight_zero_asks_for_a_weight_instead_of_half_the_traffic(tmp_path):
    """A live challenger at weight 0 (no ramp, no shadow) made the next experiment's default 0.5:
    half of all traffic to a model no one had tested."""
    args = {"spec": {"name": "exp", "arms": [{"name": "control", "weight": 1.0, "checkpoint": "a"},
                                             {"name": "treatment", "weight": 0.0, "checkpoint": "b"}]}}
    from rayload.errors import SpecError

    with pytest.raises(SpecError, match="--weight: the prior experiment's challenger had weight 0"):
        next_ab_spec(args, "control", str(tmp_path / "a"), str(tmp_path / "new"), "exp-r1", None)
    spec = next_ab_spec(args, "control", str(tmp_path / "a"), str(tmp_path / "new"), "exp-r1", 0.05)
    assert {a["name"]: a["weight"] for a in spec["arms"]} == {"control": 0.95, "retrained": 0.05}


def test_a_gain_equal_to_the_minimum_passes_the_gate():
    """0.7 - 0.6 is 0.09999999999999998 in floats: a gain of exactly --min-auc-gain 0.1 was refused
    while the CLI printed "gain +0.1000"."""
    one = retraining.RetrainResult("o", "e", "c", "n", 100, 50, 0.6, 0.7, 0.1, None)
    assert one.passed and not retraining.RetrainResult("o", "e", "c", "n", 100, 50, 0.6, 0.6999, 0.1, None).passed


def test_a_champion_with_a_regression_label_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    """It was fine-tuned as a binary classifier on the events, then refused by the gate."""
    import dataclasses

    from rayload.features import FittedFeatures

    first = placeholder_checkpoint(tmp_path / "first")
    path = os.path.join(first, "features.json")
    loaded = FittedFeatures.load(path)
    dataclasses.replace(loaded, label=dataclasses.replace(loaded.label, task="regression")).save(path)
    run, calls = guarded_run(tmp_path, monkeypatch, first, "control")
    with pytest.raises(DataError, match=r"arm 'control'\) has a regression label; a retrain labels exposures 0/1"):
        retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    assert calls == [] and not os.path.exists(os.path.join(tmp_path, "runs", "retrain"))


def test_the_default_attribution_is_the_experiments_own(tmp_path, monkeypatch):
    """retrain labelled with 30 minutes whatever the experiment declared: a conversion experiment
    with analysis.attribution_s 7200 had the conversions of its second hour labelled negative,
    and exposures an hour old, whose outcomes the experiment does not yet treat as final, taken."""
    from rayload.retrain_rows import experiment_attribution

    champion, other = placeholder_checkpoint(tmp_path / "champion"), placeholder_checkpoint(tmp_path / "b")
    arms = [{"name": "a", "weight": 0.9, "checkpoint": champion}, {"name": "b", "weight": 0.1, "checkpoint": other}]
    run = ab_run(tmp_path, {"name": "exp", "champion": "a", "arms": arms, "analysis": {"event": "conversion", "attribution_s": 7200}}, "a")
    calls = []
    monkeypatch.setattr(retraining, "training_rows", lambda *a, **k: calls.append("rows"))
    with pytest.raises(retraining.RayloadError, match=r"--window 90m must be longer than --attribution 7200s: .* \(--attribution 7200s "
                                                      r"is the default: the experiment's analysis.attribution_s; pass a longer --window"):
        retrain(job(str(tmp_path / "unused.parquet")), run, window="90m", now=NOW)
    assert calls == []
    assert experiment_attribution({"spec": {"analysis": {"attribution_s": 90.5}}}) == "90.500000s"
    assert experiment_attribution({"spec": {"analysis": {"event": "click"}}}) == experiment_attribution({"spec": {}}) == "30m"
