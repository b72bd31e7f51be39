"""Fixtures shared by unit test files: Ray's edges of `fit` replaced, `rayload run`'s stage
runners replaced by fakes, and a stub Ray job API over real HTTP."""

import http.server
import itertools
import json
import threading

import pytest
from helpers import JsonReplies


@pytest.fixture
def no_ray(monkeypatch):
    """`fit` without Ray: no address, no cluster, resources that always fit (a test patches
    `trainer.check_resources` to refuse), and preprocessing fails the test (the checks under
    test come before it; a test that gets that far patches `trainer.preprocess` itself)."""
    from rayload.train import trainer

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(trainer, "ensure_ray", lambda address=None: None)
    monkeypatch.setattr(trainer, "check_resources", lambda *a, **k: None)
    monkeypatch.setattr(trainer, "preprocess", lambda *a, **k: pytest.fail("preprocessed before the cheap checks"))


@pytest.fixture
def tune_before_ray(monkeypatch, tmp_path):
    """tune_function up to Ray: runs under tmp_path (RAYLOAD_HOME), and starting Ray fails the
    call with AssertionError("Ray was started"), so a test sees its checks ran first."""
    from rayload import tuning

    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path))

    def ensure_ray(address):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(tuning, "ensure_ray", ensure_ray)
    return tmp_path


@pytest.fixture
def tune_plan(monkeypatch, tmp_path):
    """tune_function up to the search itself: Ray is not started, the cluster checks pass, and
    `tuning._run`, which opens the study and runs Tune with `plan.spec.score_mode`, records the
    plan's direction and search.json's, then raises PlanReached. Returns the record (a dict)."""
    from _tune_plan import PlanReached
    from rayload import tuning

    seen = {}
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "ensure_ray", lambda address: None)
    monkeypatch.setattr(tuning, "_check_shape", lambda *a, **k: None)
    monkeypatch.setattr(tuning, "_concurrency", lambda *a: 1)

    def run(plan, *a, **k):
        seen.update(score_mode=plan.spec.score_mode, state_mode=tuning.read_state(plan.run_dir)["mode"], run_dir=plan.run_dir)
        raise PlanReached()

    monkeypatch.setattr(tuning, "_run", run)
    seen["tmp"] = tmp_path
    return seen


@pytest.fixture()
def fake_runners(monkeypatch):
    """`rayload run`'s stage runners as fakes that record what they were given (no Ray): a train
    stage's checkpoint is "ckpt-v<n>" (n counts the runner calls), an A/B stage serves its
    champion's and challenger's checkpoints, a decide stage returns its experiment's outputs."""
    from rayload import _stage_runners as runners
    from rayload import stages

    counter = itertools.count(1)
    monkeypatch.setattr(runners, "plan_for", lambda spec, stage: (stage.model_dump(mode="json"), None, None))
    monkeypatch.setattr(runners, "train", lambda spec, stage, folder, outputs, address, progress: {"checkpoint": f"ckpt-v{next(counter)}"})
    monkeypatch.setattr(runners, "ab", lambda spec, stage, folder, outputs, address, progress:
                        {"run_dir": folder, "served": [runners._checkpoint_of(outputs, stage.champion),
                                                       runners._checkpoint_of(outputs, stage.challenger)],
                         "n": next(counter)})
    monkeypatch.setattr(runners, "decide", lambda spec, stage, folder, outputs, address, progress: {"on": outputs[stage.experiment]})
    monkeypatch.setattr(stages, "_ray_for_direct_ingress", lambda spec, address: None)


@pytest.fixture
def job_api():
    """A stub Ray job API: `make(auth=False)` answers like a cluster without token auth,
    `make(auth=True)` refuses requests without a token (401) as Ray's dashboard does, and with
    `token=` a request with any other token (403). It answers
    the version and job-list calls, accepts the upload and the submission (job "raysubmit_stub"),
    and returns (url, hits, submitted): each request that reached it as (method, path,
    Authorization header), and each submission's JSON body."""
    servers = []

    def make(auth: bool = False, token: str | None = None):
        """`token`: with auth, the only token accepted; any other is refused (403) as Ray's dashboard does."""
        hits, submitted = [], []

        class Handler(JsonReplies, http.server.BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(n) if n else b""  # an upload's bytes: read, not kept
                hits.append((self.command, self.path, self.headers.get("Authorization")))
                if auth and not self.headers.get("Authorization"):
                    return self._send(401, b"Unauthorized: Missing authentication token")
                if auth and token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                    return self._send(403, b"Forbidden: Invalid authentication token")
                if self.path.startswith("/api/version"):
                    return self._send(200, json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}).encode())
                if self.path.startswith("/api/jobs/") and self.command == "GET":
                    return self._send(200, b"[]")
                if self.path.startswith("/api/packages/"):  # not there yet (GET), then uploaded (PUT)
                    return self._send(404 if self.command == "GET" else 200)
                if self.path.startswith("/api/jobs/") and self.command == "POST":
                    submitted.append(json.loads(data))
                    return self._send(200, json.dumps({"job_id": "raysubmit_stub", "submission_id": "raysubmit_stub"}).encode())
                self._send(500)

            do_GET = do_POST = do_PUT = _any

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", hits, submitted

    yield make
    for server in servers:
        server.shutdown()
