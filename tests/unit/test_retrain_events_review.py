"""Retrain review fixes (2026-11-27), without Ray: only the experiment's current generation is
read (an earlier start's exposures, served by other models, reached the rows and the gate); a
missing event store is named, not created; exposures logged without features are counted; two
retrains of one second get two folders; a long experiment name still gets a default next name."""

import json
import os

import pytest

from _retrain import NOW, ab_run, placeholder_checkpoint, stub_fit
from helpers import job
from rayload import retraining
from rayload.ab_spec import MAX_NAME
from rayload.errors import RayloadError
from rayload.retraining import next_name, retrain
from rayload.serve import event_writer


def _spec(tmp_path):
    champion = placeholder_checkpoint(tmp_path / "champion")
    return {"name": "exp", "champion": "a", "arms": [{"name": "a", "weight": 0.9, "checkpoint": champion},
                                                     {"name": "b", "weight": 0.1, "checkpoint": placeholder_checkpoint(tmp_path / "b")}]}


def _with_generation(run: str, generation: str) -> None:
    path = os.path.join(run, "serve.json")
    state = json.load(open(path))
    state["config"]["applications"][0]["args"]["generation"] = generation
    json.dump(state, open(path, "w"))


def test_only_the_current_generation_and_logged_features_become_rows(tmp_path, monkeypatch):
    run = ab_run(tmp_path, _spec(tmp_path), "a")  # 80 exposures without a generation
    url = json.load(open(os.path.join(run, "serve.json")))["config"]["applications"][0]["args"]["events_url"]
    writer = event_writer.EventWriter(url, flush_ms=1)
    for i in range(60):  # the current start's: 60 with features (every third clicked), 7 logged without
        writer.submit("exposure", {"request_id": f"n{i}", "experiment": "exp", "unit_id": f"v{i}", "arm": "a", "model_version": "v2",
                                   "score": 0.5, "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": NOW - 7200 - i,
                                   "features": json.dumps({"x": float(i), "c": str(i % 5)}), "generation": "g-new"}).result()
        if i % 3 == 0:
            writer.submit("outcome", {"request_id": f"n{i}", "event": "click", "value": 1.0, "ts": NOW - 7200 - i + 5}).result()
    for i in range(7):
        writer.submit("exposure", {"request_id": f"q{i}", "experiment": "exp", "unit_id": f"w{i}", "arm": "a", "model_version": "v2",
                                   "score": 0.5, "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": NOW - 7200 - i,
                                   "features": None, "generation": "g-new"}).result()
    writer.close()
    _with_generation(run, "g-new")
    stub_fit(monkeypatch, tmp_path, [])
    result = retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    assert (result.rows, result.positives, result.unlogged) == (60, 20, 7)  # was 140 rows, the old start's 80 with them
    assert json.load(open(os.path.join(result.run_dir, "retrain.json")))["unlogged"] == 7


def test_a_missing_event_store_is_named_and_not_created(tmp_path, monkeypatch):
    run = ab_run(tmp_path, _spec(tmp_path), "a")
    os.remove(tmp_path / "events.db")
    stub_fit(monkeypatch, tmp_path, [])
    with pytest.raises(RayloadError, match=r"the event store .*events.db does not exist"):
        retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    assert not (tmp_path / "events.db").exists()


def test_two_retrains_of_one_second_get_two_folders_and_a_long_name_gets_a_default_next_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    run = ab_run(tmp_path, _spec(tmp_path), "a")
    stub_fit(monkeypatch, tmp_path, [])
    first = retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    second = retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    assert first.run_dir != second.run_dir and second.run_dir == first.run_dir + "-2"
    assert os.path.basename(first.run_dir).endswith("20270115-080000")  # UTC, whatever the machine's zone
    long = "e" * MAX_NAME
    named = next_name(long, "20270115-080000")
    assert len(named) == MAX_NAME and named.endswith("-r20270115-080000")
    assert retraining._STAMP.sub("", named) == long[: MAX_NAME - 17]


def test_the_second_retrain_of_a_second_trains_its_own_run_under_its_own_next_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    run = ab_run(tmp_path, _spec(tmp_path), "a")
    runs = []
    stub_fit(monkeypatch, tmp_path, [])
    real = retraining.job_for
    monkeypatch.setattr(retraining, "job_for", lambda *a: runs.append(a[-1]) or real(*a))
    import yaml

    names = [yaml.safe_load(open(retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW).ab_spec))["name"]
             for _ in range(2)]
    assert runs == ["retrain-exp-20270115-080000", "retrain-exp-20270115-080000-2"]
    assert names == ["exp-r20270115-080000", "exp-r20270115-080000-2"]
    assert next_name(names[1], "20270116-080000") == "exp-r20270116-080000"  # a later round replaces the whole stamp


def test_a_next_spec_refused_leaves_no_retrain_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    run = ab_run(tmp_path, _spec(tmp_path), "a")
    stub_fit(monkeypatch, tmp_path, [])

    def refused(*a, **k):
        raise RayloadError("the next experiment's spec is refused")

    monkeypatch.setattr(retraining, "next_ab_spec", refused)
    with pytest.raises(RayloadError, match="refused"):
        retrain(job(str(tmp_path / "unused.parquet")), run, attribution="30m", now=NOW)
    assert os.listdir(tmp_path / "runs" / "retrain") == []
