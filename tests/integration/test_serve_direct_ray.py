"""`serving.ingress: direct` on a real local Ray Serve over real HTTP: each router replica
answers at a port of its own (no proxy hop), rayload finds those ports in Serve's target
groups, and a cluster whose Serve runs without direct ingress is refused with the fix.

This module manages its own Ray: direct ingress must be switched on when Ray starts."""

import os

import httpx
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from helpers import movielens_subset

from rayload.ab_spec import ab_from_dict
from rayload.errors import RayloadError
from rayload.serve import control
from rayload.spec import JobSpec

pytestmark = pytest.mark.integration
PORT = 8768


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DeepFM on 3,000 MovieLens ratings, trained on a plain local Ray (no direct ingress)."""
    import ray

    from rayload.train.trainer import fit

    folder = tmp_path_factory.mktemp("direct")
    old_home = os.environ.get("RAYLOAD_HOME")
    os.environ["RAYLOAD_HOME"] = str(folder / "runs")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    table = pq.read_table(movielens_subset(folder, 3000))
    job = JobSpec.model_validate({
        "name": "ml-direct",
        "data": {"source": {"kind": "parquet", "path": str(folder / "subset.parquet")},
                 "columns": [{"name": "userId", "role": "categorical"}, {"name": "movieId", "role": "categorical"},
                             {"name": "year", "role": "numeric"}],
                 "label": {"column": "rating", "threshold": 4.0}},
        "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [8]}, "train": {"epochs": 1, "batch_size": 256}})
    yield {"folder": folder, "ckpt": fit(job, evaluate_test=False).checkpoint,
           "rows": [{k: r[k] for k in ("userId", "movieId", "year")} for r in table.slice(0, 20).to_pylist()],
           "rated": [{k: r[k] for k in ("userId", "movieId", "year", "rating")} for r in table.slice(0, 600).to_pylist()]}
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    if old_home is None:
        os.environ.pop("RAYLOAD_HOME", None)
    else:
        os.environ["RAYLOAD_HOME"] = old_home


def spec(trained, name: str, replicas: int = 1):
    return ab_from_dict({"name": name, "arms": [{"name": "control", "weight": 0.5, "checkpoint": trained["ckpt"]},
                                                {"name": "challenger", "weight": 0.5, "checkpoint": trained["ckpt"]}],
                         "serving": {"port": PORT, "replicas": replicas, "ingress": "direct"},
                         "events": {"url": f"sqlite:///{trained['folder'] / (name + '.db')}"}})


def test_direct_ingress_on_a_ray_started_without_it_is_refused_and_removed(trained):
    from ray import serve

    with pytest.raises(RayloadError, match="RAY_SERVE_ENABLE_DIRECT_INGRESS=1.*removed again") as err:
        control.start(spec(trained, "no-direct"))
    assert "serving.ingress: direct" in str(err.value) and "serving.ingress: proxy" in str(err.value)
    assert "no-direct" not in serve.status().applications  # nothing half-deployed stays behind
    serve.shutdown()


def test_each_router_replica_answers_at_its_own_port(trained):
    import ray
    from ray import serve

    ray.shutdown()  # the next start is rayload's own, with direct ingress switched on
    ab = spec(trained, "direct", replicas=2)
    dep = control.start(ab)
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in os.environ  # set for Ray's processes only, not left in ours
    assert len(dep.urls) == 2 and dep.url == dep.urls[0]
    ports = {int(u.split(":")[2].split("/")[0]) for u in dep.urls}
    assert len(ports) == 2 and PORT not in ports
    groups = serve.context._get_global_client().get_serve_details()["target_groups"]
    replica_targets = {t["port"] for g in groups if g["app_name"] == "direct" for t in g["targets"]}
    assert replica_targets == ports
    assert control.live_urls(dep.run_dir) == dep.urls  # what `rayload ab simulate` asks for at its start
    with httpx.Client(timeout=30) as client:
        pids = {client.get(f"{u}/healthz").json()["pid"] for u in dep.urls}
        assert len(pids) == 2  # two replicas, each behind its own port
        ids = []
        for i, row in enumerate(trained["rows"]):
            r = client.post(f"{dep.urls[i % 2]}/predict", json={"unit_id": f"u{i}", "features": row})
            assert r.status_code == 200, r.text
            assert r.json()["arm"] in ("control", "challenger") and 0 < r.json()["score"] < 1
            ids.append(r.json()["request_id"])
        bad = client.post(f"{dep.url}/predict", json={"unit_id": "u", "features": {**trained["rows"][0], "year": "old"}})
        assert bad.status_code == 422 and "year" in bad.text
        # Serve's proxy on the head node still answers at serving.host:port.
        assert client.post(f"http://127.0.0.1:{PORT}/predict", json={"unit_id": "p", "features": trained["rows"][0]}).status_code == 200
        control.set_weights(dep.run_dir, {"control": 0.2, "challenger": 0.8})
        assert {client.get(f"{u}/healthz").json()["pid"] for u in dep.urls} == pids  # reconfigured in place
        assert all(client.get(f"{u}/healthz").json()["weights"]["challenger"] == 0.8 for u in dep.urls)
    # Simulated users spread over both replicas' URLs, as `rayload ab simulate` sends them.
    from rayload.serve.simulate import MovieLensWorld, simulate

    world = MovieLensWorld(trained["rated"], ["userId", "movieId", "year"], "rating", 4.0, seed=0)
    sim = simulate(dep.urls, world, users=50, requests=40, concurrency=4)
    assert set(sim.status) == {200} and sim.status[200] >= 40, sim.status  # 40 predictions and their clicks, all answered
    engine = sa.create_engine(ab.events.url)
    with engine.connect() as conn:
        logged = set(conn.execute(sa.text("select request_id from ab_exposures")).scalars())
    engine.dispose()
    assert set(ids) <= logged  # every acknowledged exposure through either port is on disk
    assert len(logged) >= len(ids) + 1 + 40  # and the proxy's and the simulation's
    control.stop(dep.run_dir)
    assert "direct" not in serve.status().applications
