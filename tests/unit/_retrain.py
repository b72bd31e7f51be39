"""`rayload retrain`'s test helpers (no Ray): placeholder checkpoints, an A/B run folder with
logged events, and a stub in place of the fine-tune and its gate."""

import dataclasses
import json
import os

from _loop import features
from rayload import retraining
from rayload.retrain_gate import Gate
from rayload.serve import event_writer

NOW = 1_800_000_000.0
PLACEHOLDER_COLUMNS = [{"name": "x", "role": "numeric"}, {"name": "c", "role": "categorical"}, {"name": "y", "role": "label"}]


def placeholder_checkpoint(folder, compression=None) -> str:
    """A checkpoint folder with real features.json and model.json (`compression` recorded when
    given) and an empty model.pt: enough for what reads a checkpoint without loading its weights."""
    os.makedirs(folder)
    dataclasses.replace(features(), columns=PLACEHOLDER_COLUMNS).save(os.path.join(folder, "features.json"))
    with open(os.path.join(folder, "model.json"), "w") as f:
        json.dump({"config": {"name": "mlp", "hidden": [8]}, **({"compression": compression} if compression else {})}, f)
    open(os.path.join(folder, "model.pt"), "wb").close()
    return str(folder)


def ab_run(tmp_path, spec: dict, champion_arm: str) -> str:
    """An A/B run folder (serve.json) with 80 logged exposures, every other one clicked."""
    url = f"sqlite:///{tmp_path / 'events.db'}"
    writer = event_writer.EventWriter(url, flush_ms=1)
    for i in range(80):
        writer.submit("exposure", {"request_id": f"r{i}", "experiment": spec["name"], "unit_id": f"u{i}", "arm": "a", "model_version": "v",
                                   "score": 0.5, "status": "ok", "latency_ms": 1.0, "layout": "{}", "ts": NOW - 7200 - i,
                                   "features": json.dumps({"x": float(i), "c": str(i % 5)})}).result()
        if i % 2:
            writer.submit("outcome", {"request_id": f"r{i}", "event": "click", "value": 1.0, "ts": NOW - 7200 - i + 5}).result()
    writer.close()
    run = tmp_path / "ab-run"
    run.mkdir()
    args = {"experiment": spec["name"], "spec": spec, "events_url": url, "checkpoints": {a["name"]: a["checkpoint"] for a in spec["arms"]}}
    (run / "serve.json").write_text(json.dumps({"config": {"applications": [{"args": args, "deployments": [
        {"user_config": {"champion": champion_arm}}]}]}}))
    return str(run)


def stub_fit(monkeypatch, tmp_path, calls: list):
    """The fine-tune and its gate replaced: each call records its job's init_from in `calls` and
    passes the gate with a new placeholder checkpoint, whose path is returned."""
    new = placeholder_checkpoint(tmp_path / "retrained-again")

    def fit_and_gate(job_, champion, address):
        calls.append(job_.train.init_from)
        return Gate(0.7, 0.6, 100, 50, (0.05, 0.15), 0.01), new

    monkeypatch.setattr(retraining, "_fit_and_gate", fit_and_gate)
    return new


def guarded_run(tmp_path, monkeypatch, champion: str, arm: str = "a") -> tuple[str, list]:
    """An A/B run whose champion (arm `arm`) is the checkpoint `champion`, with the fine-tune and
    the read of the events replaced by recorders: a check made before both leaves `calls` empty."""
    spec = {"name": "exp", "champion": arm, "arms": [{"name": arm, "weight": 0.9, "checkpoint": champion},
                                                     {"name": "b", "weight": 0.1, "checkpoint": placeholder_checkpoint(tmp_path / "b")}]}
    run = ab_run(tmp_path, spec, arm)
    calls: list = []
    stub_fit(monkeypatch, tmp_path, calls)
    monkeypatch.setattr(retraining, "training_rows", lambda *a, **k: calls.append("rows"))
    return run, calls
