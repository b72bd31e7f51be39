"""The spec's `drift.threshold` (and `min_rows`) reach the merged drift report that the
controller and GET /experiment read (serve/monitor.py `report_for`): replica counts stored in
a real event store, a real features.json, the spec's Drift section."""

import json
import time

import pytest

from rayload.ab_spec import Drift
from rayload.data.pipeline import preprocess
from rayload.data.synthetic import SynthParams, generate_table
from rayload.serve import drift, monitor
from rayload.serve.events import EventReader, engine_for, upsert_drift
from rayload.serve.scorer import model_version
from rayload.spec import JobSpec

SOURCE = {"kind": "synthetic-ctr", "rows": 4000, "numeric": 2, "categorical": 1, "cardinalities": [20], "seed": 5}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """An arm's checkpoint folder (features.json, model.pt) and an event store holding one
    replica's counts of traffic whose I1 is shifted far from the training data."""
    folder = tmp_path_factory.mktemp("monitor-threshold")
    spec = JobSpec.model_validate({"name": "drift", "data": {"source": SOURCE}})
    features = preprocess(spec, out=str(folder / "pre"), engine="local").features
    checkpoint = folder / "run" / "checkpoint_000000"
    checkpoint.mkdir(parents=True)
    features.save(str(checkpoint / "features.json"))
    (checkpoint / "model.pt").write_bytes(b"weights")  # only hashed into the model version here
    params = SynthParams(rows=1_000_000, numeric=2, categorical=1, cardinalities=(20,), seed=5)
    rows = generate_table(params, 100_000, 102_000).drop(["label"]).to_pylist()  # fresh draws of the training distribution
    for r in rows:
        if r["I1"] is not None:
            r["I1"] = r["I1"] * 3 + 5
    counter = drift.DriftCounter(features)
    counter.observe(rows)
    snap = counter.snapshot()
    url = f"sqlite:///{folder / 'events.db'}"
    EventReader(url).close()  # the schema
    engine = engine_for(url)
    upsert_drift(engine, [{"experiment": "e", "arm": "a", "replica": "r1", "model_version": model_version(str(checkpoint)),
                           "rows": snap["rows"], "counts": json.dumps(snap["counts"]), "ts": time.time()}])
    engine.dispose()
    return url, {"a": str(checkpoint)}


def by_feature(report: list[dict]) -> dict:
    return {r["feature"]: r for r in report}


def test_the_specs_threshold_decides_what_the_merged_report_flags(store):
    url, checkpoints = store
    default = by_feature(monitor.report_for(url, "e", checkpoints, Drift()))
    psi = default["I1"]["psi"]
    assert default["I1"]["flagged"] and default["I1"]["rows"] == 2000 and psi > 0.2  # the shifted feature, at 0.2
    assert not any(r["flagged"] for name, r in default.items() if name != "I1"), default
    high = by_feature(monitor.report_for(url, "e", checkpoints, Drift(threshold=5.0)))
    assert high["I1"]["psi"] == psi and not any(r["flagged"] for r in high.values()), high
    # on either side of the measured PSI: the comparison uses the spec's figure, not a fixed one
    assert not by_feature(monitor.report_for(url, "e", checkpoints, Drift(threshold=psi + 0.01)))["I1"]["flagged"]
    assert by_feature(monitor.report_for(url, "e", checkpoints, Drift(threshold=psi - 0.01)))["I1"]["flagged"]
    # and min_rows: 2000 rows counted are not enough for a spec that asks 2001
    assert not any(r["flagged"] for r in monitor.report_for(url, "e", checkpoints, Drift(min_rows=2001)))
