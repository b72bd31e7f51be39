"""A/B serving on a local Ray Serve over real HTTP: served scores equal offline predictions,
every kind of bad input is a 4xx (never a 5xx), sticky assignment, weights changed in place,
overload answered with 503, and a killed replica loses no acknowledged event."""

import concurrent.futures as cf
import os
import signal
import threading
import time

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from helpers import movielens_job, movielens_subset, pg_database

from rayload.ab_spec import ab_from_dict
from rayload.errors import SpecError
from rayload.serve import control
from rayload.serve.assign import Layout

pytestmark = pytest.mark.integration
PORT = 8765
URL = f"http://127.0.0.1:{PORT}"


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory):
    """Two tiny DeepFMs (1 and 3 epochs) on 6,000 MovieLens ratings behind the A/B router."""
    from rayload.train.trainer import fit

    folder = tmp_path_factory.mktemp("serve")
    old_home = os.environ.get("RAYLOAD_HOME")
    os.environ["RAYLOAD_HOME"] = str(folder / "runs")
    table = pq.read_table(movielens_subset(folder, 6000))
    ckpts = {}
    for arm, epochs in (("control", 1), ("challenger", 3)):
        job = movielens_job(str(folder / "subset.parquet"), "ml-serve", workers=1, epochs=epochs,
                            train={"batch_size": 256, "run_name": f"serve-{arm}"})
        ckpts[arm] = fit(job, evaluate_test=False).checkpoint
    spec = ab_from_dict({"name": "itest", "arms": [{"name": "control", "weight": 0.7, "checkpoint": ckpts["control"]},
                                                   {"name": "challenger", "weight": 0.3, "checkpoint": ckpts["challenger"]}],
                         "serving": {"port": PORT, "replicas": 2, "max_body_bytes": 4096},
                         "events": {"url": f"sqlite:///{folder / 'events.db'}"}})
    dep = control.start(spec)
    yield {"dep": dep, "rows": table.drop(["rating"]).to_pylist()[:200], "table": table.drop(["rating"]), "ckpts": ckpts, "spec": spec, "events": spec.events.url}
    from ray import serve

    serve.shutdown()
    if old_home is None:
        os.environ.pop("RAYLOAD_HOME", None)
    else:
        os.environ["RAYLOAD_HOME"] = old_home


def features(row: dict) -> dict:
    return {k: row[k] for k in ("userId", "movieId", "genres", "year")}


def predict(client, unit, row, **extra):
    return client.post(f"{URL}/predict", json={"unit_id": unit, "features": features(row), **extra})


def test_served_scores_equal_offline_predictions(served):
    import torch

    from rayload.train import checkpoint as ckpt
    from rayload.train.batch import Layout as Cols, collate

    layout = Layout.build(served["spec"].weights, "control", ["control", "challenger"])
    units = {arm: next(f"u{i}" for i in range(1000) if layout.assign("itest", f"u{i}") == arm) for arm in ("control", "challenger")}
    rows = served["rows"][:40]
    with httpx.Client(timeout=30) as client:
        for arm, unit in units.items():
            loaded = ckpt.load(served["ckpts"][arm])
            # Offline: the batch path that wrote the training shards (transform_table on an Arrow table).
            batch = collate(loaded.features.transform_table(served["table"].slice(0, len(rows))), Cols.from_features(loaded.features))
            with torch.no_grad():
                offline = torch.sigmoid(loaded.model(*batch.inputs()).float()).numpy()
            served_scores = []
            for r in rows:
                resp = predict(client, unit, r)
                assert resp.status_code == 200 and resp.json()["arm"] == arm, resp.text
                served_scores.append(resp.json()["score"])
            np.testing.assert_allclose(served_scores, offline, atol=1e-6)


def test_bad_input_gets_4xx_naming_the_field_and_never_5xx(served):
    row = features(served["rows"][0])
    cases = [
        ("post", "/predict", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 422, "malformed JSON"),
        ("post", "/predict", {"json": {"unit_id": "u1", "features": "x"}}, 422, "features"),
        ("post", "/predict", {"json": {"features": row}}, 422, "unit_id"),
        ("post", "/predict", {"json": {"unit_id": "u1", "features": row, "colour": 1}}, 422, "colour"),
        ("post", "/predict", {"json": {"unit_id": "u1", "features": {**row, "weather": 3}}}, 422, "weather"),
        ("post", "/predict", {"json": {"unit_id": "u1", "features": {**row, "year": "old"}}}, 422, "year"),
        ("post", "/predict", {"json": {"unit_id": "u1", "candidates": []}}, 422, "candidates"),
        ("post", "/predict", {"json": {"unit_id": "u1", "features": {**row, "genres": "x" * 5000}}}, 413, "limit"),
        ("get", "/predict", {}, 405, ""),
        ("post", "/nowhere", {"json": {}}, 404, ""),
        ("post", "/feedback", {"json": {"request_id": "nope", "event": "click"}}, 404, "unknown request_id"),
        ("post", "/feedback", {"json": {"request_id": "x", "event": "purchase"}}, 422, "event"),
        ("post", "/assign", {"json": {"unit_ids": []}}, 422, "unit_ids"),
        ("post", "/assign", {"json": {"unit_ids": [{"a": 1}]}}, 422, "unit_ids"),
        # Values no event store can keep: refused here, never a failed commit that takes a batch down
        ("post", "/predict", {"content": b'{"unit_id": "\\ud800", "features": {}}', "headers": {"content-type": "application/json"}},
         422, "unit_id"),
        ("post", "/predict", {"json": {"unit_id": "u" * 257, "features": row}}, 422, "at most 256 characters"),
        ("post", "/assign", {"content": b'{"unit_ids": ["ok", "\\udfff"]}', "headers": {"content-type": "application/json"}}, 422, "unit_ids"),
        ("post", "/feedback", {"content": b'{"request_id": "x", "event": "click", "value": NaN}', "headers": {"content-type": "application/json"}},
         422, "value"),
        ("post", "/predict", {"content": b"[" * 2000 + b"]" * 2000, "headers": {"content-type": "application/json"}}, 422, "nested"),
    ]
    with httpx.Client(timeout=30) as client:
        for method, path, kwargs, status, needle in cases:
            r = getattr(client, method)(f"{URL}{path}", **kwargs)
            assert r.status_code == status and needle in r.text, (path, kwargs, r.status_code, r.text)
        # The router still answers well-formed requests afterwards.
        assert predict(client, "u1", served["rows"][0]).status_code == 200


def test_ranking_and_feedback_are_logged_once(served):
    rows = [features(r) for r in served["rows"][:5]]
    with httpx.Client(timeout=30) as client:
        r = client.post(f"{URL}/predict", json={"unit_id": "ranker", "candidates": rows})
        assert r.status_code == 200
        body = r.json()
        assert sorted(body["ranking"]) == list(range(5)) and body["shown"] == body["ranking"][0]
        assert body["score"] == max(body["scores"])
        first = client.post(f"{URL}/feedback", json={"request_id": body["request_id"], "event": "click"})
        again = client.post(f"{URL}/feedback", json={"request_id": body["request_id"], "event": "click"})
        assert first.status_code == again.status_code == 200 and not first.json()["duplicate"] and again.json()["duplicate"]
    engine = sa.create_engine(served["events"])
    with engine.connect() as conn:
        n = conn.execute(sa.text("select count(*) from ab_outcomes where request_id = :r"), {"r": body["request_id"]}).scalar_one()
        exposure = conn.execute(sa.text("select arm, unit_id from ab_exposures where request_id = :r"), {"r": body["request_id"]}).one()
    engine.dispose()
    assert n == 1 and exposure.unit_id == "ranker" and exposure.arm == body["arm"]


def replica_pids(client, n=40) -> set:
    return {client.get(f"{URL}/healthz").json()["pid"] for _ in range(n)}


def test_sticky_assignment_and_weights_changed_in_place(served):
    dep = served["dep"]
    units = [f"sticky-{i}" for i in range(300)]
    with httpx.Client(timeout=30) as client:
        pids = replica_pids(client)
        before = {u: predict(client, u, served["rows"][1]).json()["arm"] for u in units}
        expected = Layout.build({"control": 0.7, "challenger": 0.3}, "control", ["control", "challenger"])
        assert before == {u: expected.assign("itest", u) for u in units}
        with pytest.raises(SpecError, match="sum to 1.0"):
            control.set_weights(dep.run_dir, {"control": 0.5, "challenger": 0.6})
        assert client.get(f"{URL}/healthz").json()["weights"] == {"control": 0.7, "challenger": 0.3}  # old weights kept
        control.set_weights(dep.run_dir, {"control": 0.4, "challenger": 0.6})
        try:
            assert all(client.get(f"{URL}/healthz").json()["weights"]["challenger"] == 0.6 for _ in range(10))
            after = {u: predict(client, u, served["rows"][1]).json()["arm"] for u in units}
            assert replica_pids(client) == pids  # reconfigured, not restarted
        finally:  # the module's later tests use the 0.7 / 0.3 layout: a failure here must not fail them too
            control.set_weights(dep.run_dir, {"control": 0.7, "challenger": 0.3})
    moved = {(before[u], after[u]) for u in units if before[u] != after[u]}
    assert moved == {("control", "challenger")}


def test_a_killed_replica_is_replaced_and_no_acknowledged_event_is_lost(served):
    acked, failures, stop = [], [], threading.Event()

    def load():
        with httpx.Client(timeout=30) as client:
            i = 0
            while not stop.is_set():
                try:
                    r = predict(client, f"load-{i}", served["rows"][i % 50])
                    (acked.append(r.json()["request_id"]) if r.status_code == 200 else failures.append(r.status_code))
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                i += 1

    with httpx.Client(timeout=30) as client:
        pids = replica_pids(client)
    assert len(pids) == 2
    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)
    os.kill(sorted(pids)[0], signal.SIGKILL)
    time.sleep(3)
    deadline = time.monotonic() + 90
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline and (len(replica_pids(client, 20) - {sorted(pids)[0]}) < 2):
            time.sleep(1)
        new = replica_pids(client, 30)
    stop.set()
    for t in threads:
        t.join()
    assert sorted(pids)[0] not in new and len(new) == 2  # a replacement came up
    assert len(acked) > 100 and len(failures) <= max(20, 0.05 * len(acked)), failures[:5]
    engine = sa.create_engine(served["events"])
    with engine.connect() as conn:
        stored = [r[0] for r in conn.execute(sa.text("select request_id from ab_exposures where unit_id like 'load-%'"))]
    engine.dispose()
    assert set(acked) <= set(stored) and len(stored) == len(set(stored))


def test_overload_is_refused_by_the_queue_bound_instead_of_queueing(served):
    spec = ab_from_dict({"name": "overload", "arms": [{"name": "control", "weight": 0.5, "checkpoint": served["ckpts"]["control"]},
                                                      {"name": "challenger", "weight": 0.5, "checkpoint": served["ckpts"]["challenger"]}],
                         "serving": {"port": PORT, "route_prefix": "/overload", "max_ongoing_requests": 1, "max_queued_requests": 1,
                                     "batch_wait_ms": 200, "max_batch_size": 1},
                         "events": {"url": served["events"]}})
    dep = control.start(spec)
    try:  # stopped here, not at the module's end: its replica shared the 2 CPUs with every later test
        with httpx.Client(timeout=30) as client:  # the first experiment keeps running beside the second
            assert predict(client, "still-there", served["rows"][0]).status_code == 200
        body = {"unit_id": "o", "features": features(served["rows"][0])}

        def call(_):
            r = httpx.post(f"{URL}/overload/predict", json=body, timeout=60)
            return r.status_code, r.text

        with cf.ThreadPoolExecutor(24) as pool:
            results = list(pool.map(call, range(24)))
    finally:
        control.stop(dep.run_dir)
    codes = [c for c, _ in results]
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
    # Refused by the queue bound, not queued until something timed out: Serve's backpressure
    # answer, naming the bound of this deployment. (This test compared finish times, a
    # wall-clock ordering a busy machine can break.)
    refused = [text for c, text in results if c == 503]
    assert all("Request dropped due to backpressure" in t and "max_queued_requests=1" in t for t in refused), refused[:3]


def test_separate_deployments_and_shadow_mode(served):
    """Separate mode (one deployment per arm) scores like combined mode; in shadow mode the
    champion answers every request and the challenger's score is logged beside it."""
    spec = ab_from_dict({"name": "shadowsep", "shadow": True,
                         "arms": [{"name": "control", "weight": 1.0, "checkpoint": served["ckpts"]["control"]},
                                  {"name": "challenger", "weight": 0.0, "checkpoint": served["ckpts"]["challenger"]}],
                         # Three replicas more on 2 CPUs already holding three: a tenth of a CPU each.
                         "serving": {"port": PORT, "route_prefix": "/sep", "mode": "separate", "cpus_per_replica": 0.1},
                         "events": {"url": served["events"]}})
    dep = control.start(spec)
    try:
        assert dep.args["mode"] == "separate"
        ids = []
        with httpx.Client(timeout=30) as client:
            for i, row in enumerate(served["rows"][:10]):
                sep = client.post(f"{URL}/sep/predict", json={"unit_id": f"s{i}", "features": features(row)})
                assert sep.status_code == 200 and sep.json()["arm"] == "control", sep.text
                ids.append(sep.json()["request_id"])
                unit = next(f"c{j}" for j in range(1000) if Layout.build(served["spec"].weights, "control", ["control", "challenger"]).assign("itest", f"c{j}") == "control")
                combined = predict(client, unit, row).json()
                assert sep.json()["score"] == pytest.approx(combined["score"], abs=1e-6)
            bad = client.post(f"{URL}/sep/predict", json={"unit_id": "s", "features": {**features(served["rows"][0]), "year": "old"}})
            assert bad.status_code == 422 and "year" in bad.text
        engine = sa.create_engine(served["events"])
        deadline = time.monotonic() + 15  # a shadow row is written after its request was answered
        while True:
            with engine.connect() as conn:
                shadow = conn.execute(sa.text("select request_id, arm, status from ab_shadow")).all()
            if {r.request_id for r in shadow} >= set(ids) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        engine.dispose()
    finally:
        control.stop(dep.run_dir)
    assert {r.request_id for r in shadow} >= set(ids) and {r.arm for r in shadow} == {"challenger"}
    assert {r.status for r in shadow} == {"ok"}


@pytest.fixture
def pg_url():
    with pg_database("rayload_serve") as url:
        yield url


def test_postgresql_event_store_behind_two_router_replicas(served, pg_url):
    """The multi-process case PostgreSQL is for: two router replicas write one PostgreSQL store;
    every acknowledged exposure and outcome is there once, and /experiment reads it back."""
    spec = ab_from_dict({"name": "pgtest", "arms": [{"name": "control", "weight": 0.5, "checkpoint": served["ckpts"]["control"]},
                                                    {"name": "challenger", "weight": 0.5, "checkpoint": served["ckpts"]["challenger"]}],
                         "serving": {"port": PORT, "route_prefix": "/pg", "replicas": 2, "cpus_per_replica": 0.1},
                         "events": {"url": pg_url}})
    dep = control.start(spec)
    try:
        rows = served["rows"]

        def healthz_pids(n: int) -> set:
            with httpx.Client(timeout=30) as client:
                return {client.get(f"{URL}/pg/healthz").json()["pid"] for _ in range(n)}

        # Serve's router keeps choosing a replica whose queue length it has cached and probes the
        # other only once that entry expires (10 s) or the first is full; a replica that missed its
        # first probe (100 ms deadline) on a busy machine waits for that. Both answer before the traffic.
        pids, deadline = healthz_pids(20), time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(11)
            pids |= healthz_pids(20)
        assert len(pids) == 2, f"only replica(s) {pids} answered within 60 s"

        def one(i):
            with httpx.Client(timeout=30) as client:
                r = client.post(f"{URL}/pg/predict", json={"unit_id": f"pg-{i % 40}", "features": features(rows[i % 50])})
                assert r.status_code == 200, r.text
                return r.json()

        with cf.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(one, range(120)))
        clicked = [a["request_id"] for a in answers[::3]]
        pids |= healthz_pids(40)
        with httpx.Client(timeout=30) as client:
            for rid in clicked:
                assert client.post(f"{URL}/pg/feedback", json={"request_id": rid, "event": "click"}).status_code == 200
            again = client.post(f"{URL}/pg/feedback", json={"request_id": clicked[0], "event": "click"})
            assert again.status_code == 200 and again.json()["duplicate"]
            live = client.get(f"{URL}/pg/experiment").json()
        assert len(pids) == 2  # both replicas are the same two, each with its own writer
        engine = sa.create_engine(pg_url)
        with engine.connect() as conn:
            stored = [r[0] for r in conn.execute(sa.text("select request_id from ab_exposures where experiment = 'pgtest'"))]
            outcomes = conn.execute(sa.text("select count(*) from ab_outcomes")).scalar_one()
        engine.dispose()
        assert sorted(stored) == sorted(a["request_id"] for a in answers)  # each acknowledged exposure, once
        assert outcomes == len(clicked)
        arms = live["arms"]
        assert sum(a["exposures"] for a in arms) == 120 and sum(a["clicks"] for a in arms) == len(clicked)
        assert sum(a["units"] for a in arms) == 40
    finally:
        control.stop(dep.run_dir)


def test_direct_ingress_on_a_proxy_serve_is_refused_before_anything_is_deployed(served):
    """This module's Ray runs Serve through its proxy; with an app running that shows in Serve's
    target groups, so `ingress: direct` is refused before its deploy could replace anything."""
    from ray import serve

    from rayload.errors import RayloadError

    spec = ab_from_dict({"name": "itest-direct", "arms": [{"name": "control", "weight": 0.5, "checkpoint": served["ckpts"]["control"]},
                                                          {"name": "challenger", "weight": 0.5, "checkpoint": served["ckpts"]["challenger"]}],
                         "serving": {"port": PORT, "ingress": "direct"}})
    with pytest.raises(RayloadError, match="without direct ingress.*RAY_SERVE_ENABLE_DIRECT_INGRESS=1.*serving.ingress: proxy") as err:
        control.start(spec)
    assert "removed again" not in str(err.value)  # refused before the deploy, not undone after it
    apps = serve.status().applications
    assert "itest-direct" not in apps and apps["itest"].status == "RUNNING"
    with httpx.Client(timeout=30) as client:
        assert predict(client, "u-direct", served["rows"][0]).status_code == 200


def assignments(client, units: list[str], chunk: int = 200) -> dict:
    out = {}
    for i in range(0, len(units), chunk):
        r = client.post(f"{URL}/assign", json={"unit_ids": units[i:i + chunk]})
        assert r.status_code == 200, r.text
        out.update(r.json()["arms"])
    return out


def wait_for_replicas(client, n: int, old: set, timeout: float = 120) -> set:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = replica_pids(client, 30)
        except httpx.HTTPError:
            pids = set()
        if len(pids) == n and not pids & old:
            return pids
        time.sleep(1)
    raise AssertionError(f"router replicas did not come back: wanted {n} new, last saw {pids}")


def test_a_restart_interrupted_after_its_deploy_leaves_the_running_experiment_up(served, monkeypatch):
    """`rayload serve SPEC` again on a running experiment, interrupted (Ctrl-C) in the ingress
    wait after its deploy, deleted the live experiment: the clean-up is for an app it created."""
    from ray import serve

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(control, "ingress_urls", interrupted)
    with pytest.raises(KeyboardInterrupt):
        control.start(served["spec"])
    assert serve.status().applications["itest"].status == "RUNNING"
    with httpx.Client(timeout=30) as client:
        assert predict(client, "u-restart", served["rows"][0]).status_code == 200


def test_sticky_assignment_survives_router_restarts_and_replica_counts(served):
    """10,000 units get the same arms from the deployed router before and after every router
    replica is killed, after a redeploy with one replica, and as computed in this process.
    (Last in the module: it restarts the shared router.)"""
    units = [f"user-{i}" for i in range(10_000)]
    expected = Layout.build(served["spec"].weights, "control", ["control", "challenger"])
    with httpx.Client(timeout=30) as client:
        before = assignments(client, units)
        assert before == {u: expected.assign("itest", u) for u in units}
        pids = replica_pids(client)
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_for_replicas(client, 2, pids)
        assert assignments(client, units) == before
        one = ab_from_dict({**served["spec"].model_dump(mode="json", exclude_none=True),
                            "serving": {**served["spec"].serving.model_dump(mode="json", exclude_none=True), "replicas": 1}})
        control.start(one)
        wait_for_replicas(client, 1, set())
        assert assignments(client, units) == before
    share = sum(arm == "challenger" for arm in before.values()) / len(units)
    assert abs(share - 0.3) < 0.02
