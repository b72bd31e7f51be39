"""The traffic simulator against a real HTTP router stub on loopback (no Ray): reproducible
draws whatever the answer order, a click's feedback retried until the router records it, a
keyed router's refusals stopping the run, one unit per held-out MovieLens user, and the pipeline's
A/B stage sending the key as `ab simulate` does."""

import hashlib
import json
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from helpers import JsonReplies

from rayload.data.synthetic import SynthParams
from rayload.errors import RayloadError
from rayload.serve import control
from rayload.serve import simulate as sim

PARAMS = SynthParams(rows=1000, numeric=3, categorical=3, cardinalities=(10, 50, 200), seed=7)


class Router:
    """/predict ranks the candidates by a hash of each row, after a random delay (so concurrent
    answers come back in varying order); /feedback records the click, answering 503 to a
    request's first `fail_first` attempts; with `key`, a request without it gets 401."""

    def __init__(self, key=None, fail_first=0, jitter=0.01):
        self.exposures, self.clicks, self.attempts = {}, [], Counter()
        lock, ids, rnd, router = threading.Lock(), iter(range(10**9)), random.Random(), self

        class Handler(JsonReplies, BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if key and self.headers.get("x-api-key") != key:
                    return self._send(401, json.dumps({"detail": "missing or wrong x-api-key header"}).encode())
                time.sleep(rnd.random() * jitter)
                with lock:
                    if self.path == "/predict":
                        rows = body["candidates"]
                        scores = [int(hashlib.md5(json.dumps(r, sort_keys=True).encode()).hexdigest(), 16) % 997 for r in rows]
                        shown, rid = scores.index(max(scores)), f"r{next(ids)}"
                        router.exposures[rid] = (body["unit_id"], json.dumps(rows, sort_keys=True))
                        return self._send(200, json.dumps({"request_id": rid, "shown": shown, "arm": "a", "score": 0.5}).encode())
                    router.attempts[body["request_id"]] += 1
                    if router.attempts[body["request_id"]] <= fail_first:
                        return self._send(503, json.dumps({"detail": "the outcome could not be recorded; retry"}).encode())
                    router.clicks.append(body["request_id"])
                    return self._send(200, json.dumps({"request_id": body["request_id"], "duplicate": False}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def seen(self):
        """What the traffic was: (unit, candidates, clicked) of every exposure, as a multiset."""
        clicked = set(self.clicks)
        return Counter((unit, rows, rid in clicked) for rid, (unit, rows) in self.exposures.items())

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _run(concurrency, **router):
    r = Router(**router)
    try:
        out = sim.simulate(r.url, sim.SyntheticWorld(PARAMS, seed=1, pool_rows=2000), users=50, requests=150, concurrency=concurrency, seed=3)
    finally:
        r.close()
    return out, r


def test_the_same_seeds_give_the_same_traffic_whatever_order_answers_come_back_in():
    """One generator served every request's candidates and clicks, so with concurrent requests
    the draws followed the router's timing: two runs with the same seeds differed."""
    (a, ra), (b, rb) = _run(8), _run(8)
    assert ra.seen() == rb.seen() and a.clicks == b.clicks == len(ra.clicks) > 0
    assert _run(1)[1].seen() == ra.seen()  # and the same traffic one request at a time


def test_a_clicks_feedback_is_retried_until_the_router_records_it():
    """A 503 ("retry") on /feedback was counted as a click the server never recorded: the
    analysis read it as a non-click."""
    out, r = _run(4, fail_first=2)
    assert out.clicks == len(r.clicks) == len(set(r.clicks)) > 0
    assert out.feedback == {200: out.clicks} and out.status == {200: 150}  # predict and feedback statuses apart
    assert all(r.attempts[rid] == 3 for rid in r.clicks)


def test_a_run_whose_requests_all_fail_stops_naming_the_statuses(monkeypatch):
    r = Router(key="secret")
    monkeypatch.setattr(control, "step", lambda run_dir: ("continue", []))
    try:
        world = sim.SyntheticWorld(PARAMS, seed=1, pool_rows=2000)
        with pytest.raises(RayloadError, match=r"none of 10 simulated requests was answered with 200 \(status counts \{401: 10\}.*API key"):
            sim.simulate_and_decide("run", r.url, world, users=20, requests=40, concurrency=2, chunks=4)
        out = sim.simulate_and_decide("run", r.url, world, users=20, requests=40, concurrency=2, chunks=4, api_key="secret")
        assert out.status == {200: 40} and len(r.exposures) == 40
    finally:
        r.close()


def test_one_unit_is_one_held_out_movielens_user():
    """With more units asked than held-out users, unit u668 replayed the same user as u0 (units
    wrapped around), counting one person as several independent units."""
    rows = [{"userId": u, "movieId": m, "year": 2000, "rating": float(1 + (u + m) % 5)} for u in range(30) for m in range(3)]
    world = sim.MovieLensWorld(rows, ["userId", "movieId", "year"], seed=0)
    r = Router()
    try:
        out = sim.simulate(r.url, world, users=500, requests=200, concurrency=4)
    finally:
        r.close()
    assert out.units == 30 and out.ok == 200
    user_of = {}
    for unit, candidates in r.exposures.values():
        user_of.setdefault(unit, set()).update(c["userId"] for c in json.loads(candidates))
    assert len(user_of) <= 30 and all(len(users) == 1 for users in user_of.values())
    assert len({next(iter(users)) for users in user_of.values()}) == len(user_of)  # no two units share a user


def test_the_pipelines_ab_stage_sends_the_routers_api_key(monkeypatch, tmp_path):
    """The stage called simulate_and_decide without the key: a keyed router answered every
    request 401 and the stage reported `continue`."""
    from rayload import _stage_runners as runners
    from rayload.serve import world as world_module

    monkeypatch.setenv("AB_KEY", "secret")
    template = {"name": "exp", "arms": [{"name": "a", "weight": 0.5, "checkpoint": "x"}, {"name": "b", "weight": 0.5, "checkpoint": "y"}],
                "serving": {"api_key_env": "AB_KEY"}}
    monkeypatch.setattr(runners, "_ab_template", lambda spec, stage: template)
    monkeypatch.setattr(control, "start", lambda exp, address=None, run_dir=None: SimpleNamespace(run_dir=run_dir, url="u", args={"checkpoints": {}}))
    monkeypatch.setattr(control, "stop", lambda folder: None)
    monkeypatch.setattr(world_module, "world_for", lambda exp, args: None)
    sent = {}

    def decide(run_dir, url, world, users, requests, concurrency, seed, api_key=None, **kw):
        sent["key"] = api_key
        return sim.Outcome(requests, {200: requests}, "continue", [])

    monkeypatch.setattr(sim, "simulate_and_decide", decide)
    stage = SimpleNamespace(champion=None, challenger=None, traffic="simulate", keep_serving=False)
    runners.ab(None, stage, str(tmp_path), {}, None, lambda f: None)
    assert sent["key"] == "secret"


def test_a_unit_id_names_the_same_movielens_user_whatever_the_simulate_seed():
    """The unit id was an index into the user order a seed shuffles: u0 was another person in a
    run with another seed, into the same event store."""
    rows = [{"userId": u, "movieId": m, "year": 2000, "rating": float(1 + (u + m) % 5)} for u in range(30) for m in range(3)]
    seen = {}
    for seed in (0, 1):
        world = sim.MovieLensWorld(rows, ["userId", "movieId", "year"], seed=seed)
        r = Router()
        try:
            sim.simulate(r.url, world, users=30, requests=60, concurrency=2, seed=seed)
        finally:
            r.close()
        for unit, candidates in r.exposures.values():
            seen.setdefault(unit, set()).update(c["userId"] for c in json.loads(candidates))
    assert all(len(users) == 1 and unit == f"u{next(iter(users))}" for unit, users in seen.items())


def test_a_world_without_users_is_named_and_an_unreadable_200_is_counted_once():
    with pytest.raises(RayloadError, match="the simulated MovieLens world has no user"):
        sim.MovieLensWorld([{"userId": 1, "movieId": 2, "year": 2000, "rating": 5.0}], ["userId", "movieId", "year"])

    class Html(JsonReplies, BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            return self._send(200, b"<html>not json</html>")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = sim.simulate(f"http://127.0.0.1:{server.server_address[1]}", sim.SyntheticWorld(PARAMS, seed=1, pool_rows=2000),
                           users=5, requests=10, concurrency=2)
    except RayloadError:
        out = None
    finally:
        server.shutdown()
        server.server_close()
    assert out is None or sum(out.status.values()) == 10


def test_the_synthetic_pool_starts_past_every_arm_of_the_same_seed_and_candidates_fit_the_router():
    from rayload.serve.world import _pool_start

    champion = SynthParams(rows=2000, missing_rate=0.05, seed=3)
    from rayload.spec import SyntheticSource

    source = SyntheticSource(kind="synthetic-ctr", rows=20_000, missing_rate=0.06, seed=3)
    challenger = SimpleNamespace(data=SimpleNamespace(source=source))
    assert _pool_start(champion, [challenger]) == 20_000  # was 2,000: 95% of the pool were the challenger's training rows
    world = sim.SyntheticWorld(PARAMS, candidates=5, seed=1, pool_rows=2000)
    rows, _ = world.request(0, sim.request_rng(1, 0, 0))
    assert len(rows) == 5


@pytest.mark.parametrize("auto", [True, False])
def test_the_pipelines_ab_stage_ramps_and_decides_only_when_the_spec_says_ramp_auto(monkeypatch, tmp_path, auto):
    """The stage always ramped, promoted and rolled back (simulate_and_decide's default, and
    control.step when watching live traffic) although the spec said ramp.auto: false, which
    `rayload serve` and `ab simulate` honour; a later decide stage with act: false then could not
    stop a promote that had already happened."""
    from rayload import _stage_runners as runners
    from rayload.serve import world as world_module

    template = {"name": "exp", "arms": [{"name": "a", "weight": 0.5, "checkpoint": "x"}, {"name": "b", "weight": 0.5, "checkpoint": "y"}],
                "ramp": {"auto": auto}}
    monkeypatch.setattr(runners, "_ab_template", lambda spec, stage: template)
    monkeypatch.setattr(control, "start", lambda exp, address=None, run_dir=None: SimpleNamespace(run_dir=run_dir, url="u", args={"checkpoints": {}}))
    monkeypatch.setattr(control, "stop", lambda folder: None)
    monkeypatch.setattr(world_module, "world_for", lambda exp, args: None)
    calls = []
    monkeypatch.setattr(sim, "simulate_and_decide", lambda *a, auto=True, **kw: calls.append(("simulate", auto)) or
                        sim.Outcome(10, {200: 10}, "continue", []))
    monkeypatch.setattr(control, "step", lambda folder: calls.append("step") or ("promote", ["won"]))
    monkeypatch.setattr(control, "analysis_for", lambda folder: calls.append("analysis") or SimpleNamespace(decision="promote", reasons=["won"]))
    runners.ab(None, SimpleNamespace(champion=None, challenger=None, traffic="simulate", keep_serving=False), str(tmp_path), {}, None,
               lambda f: None)
    live = SimpleNamespace(champion=None, challenger=None, traffic="live", keep_serving=False, max_minutes=1, interval_s=0.01)
    assert runners.ab(None, live, str(tmp_path), {}, None, lambda f: None)["decision"] == "promote"
    assert calls == [("simulate", auto), "step" if auto else "analysis"]
