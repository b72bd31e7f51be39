"""The A/B router without Ray, on two tiny real models: one arm's model failure (an exception
or a non-finite score) fails only that arm's requests; shadow challengers never hold up or fail
the champion's answer and their failures are recorded; a bad user_config is refused; an
exposure keeps the weights it was assigned under; concurrent repeated feedback is answered
duplicate once; GET /experiment reads only the current generation's exposures."""

import asyncio
import json
import logging
import time

import numpy as np
import pytest
import sqlalchemy as sa

from helpers import frame, prepared_features, tiny_checkpoint
from rayload.ab_spec import ab_from_dict
from rayload.errors import DataError, RayloadError
from rayload.serve.batch_scoring import score_grouped
from rayload.serve.serve_config import app_args


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two models on one features.json (A and B) and rows to score."""
    tmp = tmp_path_factory.mktemp("ab-review")
    features = prepared_features(tmp, 4)
    rows = frame(60, seed=9).drop(columns=["y"]).to_dict("records")
    return {"A": tiny_checkpoint(tmp / "A", features, 0), "B": tiny_checkpoint(tmp / "B", features, 1)}, rows


@pytest.fixture(scope="module")
def run():
    """Runs a coroutine on this module's one event loop: @serve.batch keeps one queue per
    decorated method for the whole process (a Serve replica has one router), bound to the loop
    it first ran on, so every router here must use that loop."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture
def no_replica(monkeypatch):
    import ray.serve.batching as batching

    # @serve.batch asks the replica for its max_ongoing_requests: there is no replica here
    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)


@pytest.fixture
def make_router(models, tmp_path, no_replica, run):
    """make_router(shadow=False, generation=None, weights=None) -> a combined-mode router on SQLite."""
    from rayload.serve.app import ABRouter

    made = []

    def make(shadow=False, generation=None, weights=None):
        checkpoints, _ = models
        weights = weights or ({"A": 1.0, "B": 0.0} if shadow else {"A": 0.5, "B": 0.5})
        spec = ab_from_dict({"name": "t", "shadow": shadow, "drift": {"enabled": False},
                             "arms": [{"name": a, "weight": w, "checkpoint": checkpoints[a]} for a, w in weights.items()],
                             "serving": {"mode": "combined"}})
        args = app_args(spec, checkpoints, str(tmp_path))
        if generation is not None:
            args["generation"] = generation
        cls = ABRouter.func_or_class.__mro__[1]  # the user class under Serve's ingress wrapper
        router = cls.__new__(cls)
        cls.__init__(router, args)
        made.append(router)
        return router

    yield make
    for router in made:
        router.writer.close()


def request(body: dict):
    from starlette.requests import Request

    raw = json.dumps(body).encode()
    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(1)
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/", "query_string": b"",
                    "headers": [(b"content-length", str(len(raw)).encode())]}, receive)


def get_experiment(router):
    """GET /experiment's handler (the instance's `experiment` attribute is the experiment's name)."""
    return type(router).experiment(router, request({}))


def answer(resp) -> tuple[int, dict]:
    if isinstance(resp, dict):
        return 200, resp
    return resp.status_code, json.loads(resp.body)


def rows_of(router, sql: str) -> list:
    engine = sa.create_engine(router.writer_url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).all()
    finally:
        engine.dispose()


def crash(*a, **k):
    raise RuntimeError("challenger crashed")


# ------------------------------------------------------------------ one arm's failure


def test_score_grouped_isolates_a_crashing_arm_and_a_non_finite_score_per_request(models):
    from rayload.serve.batch_scoring import ModelError
    from rayload.serve.scorer import Scorer

    checkpoints, rows = models
    scorers = {arm: Scorer.load(arm, path) for arm, path in checkpoints.items()}
    items = [("A", rows[0:2]), ("B", rows[2:3]), ("A", rows[3:4]), ("B", rows[4:6])]
    alone = [scorers[arm].score(r) for arm, r in items]
    scorers["B"].score_table = crash
    out = score_grouped(scorers, items)
    assert isinstance(out[1], ModelError) and isinstance(out[3], ModelError) and "arm B failed" in str(out[1])
    for i in (0, 2):
        np.testing.assert_allclose(out[i][0], alone[i], atol=1e-6)
    # A NaN for one request's row: that request is B's error, B's other request is answered
    del scorers["B"].score_table
    real = scorers["B"].score_table
    scorers["B"].score_table = lambda table, r, sizes: np.where(np.arange(len(r)) == 0, np.nan, real(table, r, sizes))
    out = score_grouped(scorers, items)
    assert isinstance(out[1], ModelError) and "nan" in str(out[1]) and "not a finite number" in str(out[1])
    np.testing.assert_allclose(out[3][0], alone[3], atol=1e-6)
    np.testing.assert_allclose(out[0][0], alone[0], atol=1e-6)


def test_a_crashing_arm_fails_only_its_own_requests_and_counts_as_its_errors(run, make_router, models):
    _, rows = models
    router = make_router()
    router.models.scorers["B"].score_table = crash

    async def main():
        return await asyncio.gather(*[router.predict(request({"unit_id": f"u{i}", "features": rows[i]})) for i in range(40)])

    outs = [answer(r) for r in run(main())]
    arms = [router.layout.assign(router.salt, f"u{i}") for i in range(40)]
    assert {"A", "B"} <= set(arms)
    for arm, (code, body) in zip(arms, outs):
        assert (code, arm) in (((200, "A")), (500, "B")), (arm, code, body)
        if code == 500:
            assert body["detail"] == "the model of arm B failed"
    stored = dict(((arm, status), n) for arm, status, n in rows_of(router, "select arm, status, count(*) from ab_exposures group by arm, status"))
    assert stored == {("A", "ok"): arms.count("A"), ("B", "error"): arms.count("B")}


def test_a_non_finite_score_is_its_arms_error_not_an_ok_exposure_and_a_500(run, make_router, models):
    _, rows = models
    router = make_router()
    real = router.models.scorers["B"].score_table
    router.models.scorers["B"].score_table = lambda *a, **k: real(*a, **k) * np.nan

    async def main():  # one event loop per router: its @serve.batch queue lives on the first it runs on
        return [answer(await router.predict(request({"unit_id": f"u{i}", "features": rows[i]}))) for i in range(12)]

    outs = run(main())
    arms = [router.layout.assign(router.salt, f"u{i}") for i in range(12)]
    for arm, (code, body) in zip(arms, outs):
        if arm == "B":
            assert code == 500 and "scored a row nan (not a finite number)" in body["detail"]
        else:
            assert code == 200 and np.isfinite(body["score"])
    stored = rows_of(router, "select arm, status, score from ab_exposures")
    assert {(a, s, sc is None) for a, s, sc in stored} == {("A", "ok", False), ("B", "error", True)}


def test_a_wrapped_data_error_is_a_422_with_its_message_and_a_failed_error_log_a_503(run, make_router, models):
    """Separate mode: Serve raises the model deployment's DataError wrapped (RayTaskError), whose
    text is the remote traceback: the client's 422 carried ANSI codes, a pid, an ip and server
    paths. An arm failing while the event store is down raised out of predict (a bare 500)."""
    from ray.exceptions import RayTaskError

    _, rows = models
    router = make_router()
    wrapped = RayTaskError("score", "Traceback (most recent call last):\n  File \"/srv/x.py\"", DataError("request row 0: price: cannot parse")
                           ).as_instanceof_cause()
    assert isinstance(wrapped, DataError) and "/srv/x.py" in str(wrapped)  # what the client was sent

    async def wrapped_answer(*a, **k):
        return wrapped

    router._score_or_error = wrapped_answer
    code, body = answer(run(router.predict(request({"unit_id": "u1", "features": rows[1]}))))
    assert code == 422 and body["detail"][0]["msg"] == "request row 0: price: cannot parse"

    async def crashed(*a, **k):
        return RuntimeError("model crashed")

    async def store_down(*a, **k):
        raise sa.exc.OperationalError("insert", {}, Exception("disk I/O error"))

    router._score_or_error, router._log = crashed, store_down
    code, body = answer(run(router.predict(request({"unit_id": "u2", "features": rows[2]}))))
    assert (code, body["detail"]) == (503, "the exposure could not be recorded; retry")


def test_a_separate_arm_deployment_raises_its_model_error(run, models, no_replica):
    from rayload.serve.batch_scoring import ModelDeployment, ModelError
    from rayload.serve.scorer import Scorer

    checkpoints, rows = models
    dep = object.__new__(ModelDeployment.func_or_class)
    dep.scorers = {"B": Scorer.load("B", checkpoints["B"])}
    real = dep.scorers["B"].score_table
    dep.scorers["B"].score_table = lambda *a, **k: real(*a, **k) * np.inf
    with pytest.raises(ModelError, match="not a finite number"):
        run(dep.score("B", rows[:1]))
    with pytest.raises(DataError):
        run(dep.score("B", [{**rows[0], "price": "cheap"}]))


# ------------------------------------------------------------------ shadow mode


def test_a_crashing_shadow_challenger_leaves_every_champion_answer_and_is_recorded(run, make_router, models, caplog):
    _, rows = models
    router = make_router(shadow=True)
    router.models.scorers["B"].score_table = crash

    async def main():
        outs = [answer(await router.predict(request({"unit_id": f"u{i}", "features": rows[i]}))) for i in range(5)]
        await asyncio.gather(*router._shadow_tasks)
        return outs

    with caplog.at_level(logging.WARNING, logger="rayload.serve.app"):
        outs = run(main())
    assert [(c, b["arm"]) for c, b in outs] == [(200, "A")] * 5
    assert rows_of(router, "select arm, status from ab_exposures") == [("A", "ok")] * 5
    assert rows_of(router, "select arm, status, score from ab_shadow") == [("B", "error", None)] * 5
    assert router.shadow_counts == {"B": {"ok": 0, "error": 5, "skipped": 0}}
    assert any("shadow arm B failed" in r.getMessage() for r in caplog.records)
    assert len([r for r in caplog.records if "shadow arm B" in r.getMessage()]) == 3  # the 1st, 2nd and 4th
    summary = run(get_experiment(router))["shadow_scores"]
    assert summary == {"B": {"requests": 5, "errors": 5, "error_rate": 1.0}}


def test_the_champion_answers_and_logs_its_latency_without_waiting_for_a_slow_shadow(run, make_router, models):
    """Ordering, not timing: the shadow scores only once the answer is back, and takes the
    champion's whole logged latency (committed before the answer) and more."""
    _, rows = models
    router = make_router(shadow=True)
    real = router.models.scorers["B"].score_table
    state = {"answered": False}

    def slow(*a, **k):
        state["scored_after_the_answer"] = state["answered"]
        [(champion_ms,)] = rows_of(router, "select latency_ms from ab_exposures")
        time.sleep(champion_ms / 1000 + 0.05)
        return real(*a, **k)

    router.models.scorers["B"].score_table = slow

    async def main():
        out = answer(await router.predict(request({"unit_id": "u1", "features": rows[0]})))
        state["answered"] = True
        await asyncio.gather(*router._shadow_tasks)
        return out

    code, body = run(main())
    assert code == 200 and body["arm"] == "A" and state["scored_after_the_answer"] is True
    [(latency,)] = rows_of(router, "select latency_ms from ab_exposures")
    [(status, shadow_latency, score)] = rows_of(router, "select status, latency_ms, score from ab_shadow")
    assert status == "ok" and 0 < score < 1
    assert shadow_latency > latency  # the champion's logged latency is its own call, not the shadow's


def test_shadows_beyond_the_in_flight_bound_are_skipped_not_queued(run, make_router, models):
    _, rows = models
    router = make_router(shadow=True)
    router.max_shadow_tasks = 2

    async def main():
        for i in range(5):  # the background tasks get no turn between these answers
            router._start_shadows("A", f"r{i}", rows[i:i + 1])
        await asyncio.gather(*router._shadow_tasks)

    run(main())
    assert router.shadow_counts["B"] == {"ok": 2, "error": 0, "skipped": 3}


# ------------------------------------------------------------------ run-time config, layout, feedback


@pytest.mark.parametrize("config, says", [
    ({"weights": {"A": 0.5, "B": 0.7}, "champion": "A"}, "must sum to 1.0"),
    ({"weights": {"A": 1.1, "B": -0.1}, "champion": "A"}, "every weight must be a number >= 0"),
    ({"weights": {"A": 1.0}, "champion": "A"}, "must name exactly the arms"),
    ({"weights": {"A": 0.5, "B": 0.5}, "champion": "Z"}, "user_config.champion: must be one of the arms"),
    ({"weights": {"A": 0.5, "B": 0.5}, "champion": "A", "shadow": True}, "in shadow mode"),
    ({"weights": [0.5, 0.5], "champion": "A"}, "must map each arm"),
    ({"weights": {"A": 1.0, "B": 0.0}, "champion": "A", "shadow": "false"}, "user_config.shadow: true or false"),  # turned shadow on
])
def test_reconfigure_refuses_a_bad_user_config_and_keeps_the_weights_in_force(run, make_router, config, says, caplog):
    router = make_router()
    state = lambda: (router.weights, router.champion, router.shadow, router.layout, router.layout_json)  # noqa: E731
    before = state()
    # At the replica's start (Serve's first call, before traffic) a bad config fails the replica
    with pytest.raises(RayloadError, match=says):
        router.reconfigure(config)
    assert state() == before
    router.reconfigure({"weights": {"A": 0.9, "B": 0.1}, "champion": "A"})  # a good one applies
    serving = state()
    assert router.weights == {"A": 0.9, "B": 0.1} and serving != before
    # On a serving replica it is refused without raising (Serve would stop the replica): the
    # weights in force stay, and the refusal is logged and reported
    with caplog.at_level(logging.ERROR, logger="rayload.serve.app"):
        router.reconfigure(config)
    assert state() == serving and says in router.config_refused
    assert any(says in r.getMessage() for r in caplog.records)
    health = run(type(router).healthz(router, request({})))
    assert says in health["config_refused"] and health["weights"] == {"A": 0.9, "B": 0.1}
    router.reconfigure({"weights": {"A": 0.8, "B": 0.2}, "champion": "A"})
    assert router.weights == {"A": 0.8, "B": 0.2} and router.config_refused is None


def test_an_exposure_keeps_the_weights_its_arm_was_assigned_under(run, make_router, models):
    _, rows = models
    router = make_router()
    router.models._batched.set_batch_wait_timeout_s(0.3)  # the batch waits: a reconfigure lands meanwhile

    async def main():
        task = asyncio.ensure_future(router.predict(request({"unit_id": "u1", "features": rows[0]})))
        await asyncio.sleep(0.05)
        router.reconfigure({"weights": {"A": 0.9, "B": 0.1}, "champion": "A"})
        return answer(await task)

    code, body = run(main())
    assert code == 200
    assert rows_of(router, "select layout from ab_exposures") == [(json.dumps({"A": 0.5, "B": 0.5}, sort_keys=True),)]


def test_concurrent_repeats_of_one_feedback_answer_duplicate_all_but_once(run, make_router, models):
    _, rows = models
    router = make_router()

    async def main():
        _, out = answer(await router.predict(request({"unit_id": "u1", "features": rows[0]})))
        body = {"request_id": out["request_id"], "event": "click"}
        first = await asyncio.gather(*[router.feedback(request(body)) for _ in range(6)])
        again = await router.feedback(request(body))
        return [answer(r) for r in first], answer(again)

    first, again = run(main())
    assert sorted(b["duplicate"] for _, b in first) == [False] + [True] * 5 and again[1]["duplicate"] is True
    assert rows_of(router, "select count(*) from ab_outcomes") == [(1,)]


# ------------------------------------------------------------------ generations


def test_get_experiment_reads_only_the_routers_generation(run, make_router, models):
    _, rows = models
    old = make_router(generation="g1")

    async def traffic():
        await asyncio.gather(*[old.predict(request({"unit_id": f"u{i}", "features": rows[i]})) for i in range(10)])

    run(traffic())
    new = make_router(generation="g2")
    run(new.predict(request({"unit_id": "v1", "features": rows[0]})))
    report = run(get_experiment(new))
    assert sum(a["exposures"] for a in report["arms"]) == 1
    assert rows_of(new, "select generation, count(*) from ab_exposures group by generation order by generation") == [("g1", 10), ("g2", 1)]
    legacy = make_router()  # a router of a run from before generations reads every exposure
    assert sum(a["exposures"] for a in run(get_experiment(legacy))["arms"]) == 11


# ------------------------------------------------------------------ client values that reached a 5xx


def test_extreme_or_unencodable_client_values_get_a_422_naming_the_field_and_count_against_no_arm(run, make_router, models):
    """Found by a review: a price of 1e308 (inf once scaled to float32) or 10**30 (the model's
    float32 layers overflow) scored NaN, a 500 counted as the arm's error (a guardrail could roll
    it back for a client's junk); a lone surrogate in a value or a feature name (JSON's \\ud800)
    raised while encoding; a NUL in unit_id or request_id failed PostgreSQL's insert."""
    router = make_router()
    _, rows = models
    row = rows[0]
    bad = [({"features": {**row, "price": 1e308}}, "price"), ({"features": {**row, "price": 10**30}}, "price"),
           ({"features": {**row, "user": "\ud800"}}, "user"), ({"features": {**row, "tags": ["a", "\ud800"]}}, "tags"),
           ({"features": {**row, "\ud800": 1}}, "\\ud800"), ({"candidates": [row, {**row, "\ud800": 1}]}, "\\ud800"),
           ({"candidates": [row, {**row, "price": 1e308}]}, "price")]

    async def go():
        out = [answer(await router.predict(request({"unit_id": "u1", **body}))) for body, _ in bad]
        out.append(answer(await router.predict(request({"unit_id": "a\x00b", "features": row}))))
        out.append(answer(await router.feedback(request({"request_id": "r\x00", "event": "click"}))))
        out.append(answer(await router.predict(request({"unit_id": "u1", "features": {**row, "price": 1e6}}))))
        return out

    out = run(go())
    for (code, body), (_, field) in zip(out, bad):
        assert code == 422 and field in json.dumps(body, ensure_ascii=False).replace("\\\\", "\\"), body
    assert out[-3][0] == 422 and out[-3][1]["detail"][0]["loc"] == ["body", "unit_id"] and "NUL" in out[-3][1]["detail"][0]["msg"]
    assert out[-2][0] == 422 and out[-2][1]["detail"][0]["loc"] == ["body", "request_id"]
    assert out[-1][0] == 200  # a large but ordinary value is scored
    assert rows_of(router, "select status, count(*) from ab_exposures group by status") == [("ok", 1)]


# ------------------------------------------------------------------ ambiguous or mistyped bodies


def test_features_with_candidates_and_a_non_number_feedback_value_are_422s_that_log_nothing(run, make_router, models):
    """Both features and candidates were scored as the candidates, the features dropped without a
    word; a feedback value sent as the string "2.5" or as true was stored as 2.5 or 1.0."""
    router = make_router()
    _, rows = models

    async def go():
        both = answer(await router.predict(request({"unit_id": "u1", "features": rows[0], "candidates": [rows[1], rows[2]]})))
        _, ok = answer(await router.predict(request({"unit_id": "u1", "features": rows[0]})))
        typed = [answer(await router.feedback(request({"request_id": ok["request_id"], "event": "click", "value": v})))
                 for v in ("2.5", True, None)]
        good = answer(await router.feedback(request({"request_id": ok["request_id"], "event": "click", "value": 2})))
        return both, typed, good

    both, typed, good = run(go())
    assert both[0] == 422 and "not both" in both[1]["detail"][0]["msg"], both
    for code, body in typed:
        assert code == 422 and body["detail"][0]["loc"] == ["body", "value"], body
    assert good[0] == 200
    assert rows_of(router, "select count(*) from ab_exposures") == [(1,)]
    assert rows_of(router, "select value from ab_outcomes") == [(2.0,)]


# ------------------------------------------------------------------ reconfigure beside requests


def test_an_exposure_is_logged_under_the_config_it_was_assigned_under_while_reconfigure_runs_on_a_thread(run, make_router, models):
    """Serve runs a sync reconfigure on a thread beside the requests; with the config's fields set
    one by one, a request was assigned under one config and logged under the other's weights."""
    import sys
    import threading

    _, rows = models
    router = make_router(weights={"A": 1.0, "B": 0.0})
    router.reconfigure({"weights": {"A": 1.0, "B": 0.0}, "champion": "A"})
    stop, interval = threading.Event(), sys.getswitchinterval()

    def flip():
        i = 0
        while not stop.is_set():
            router.reconfigure({"weights": {"A": 1.0, "B": 0.0} if i % 2 else {"A": 0.0, "B": 1.0}, "champion": "A"})
            i += 1

    async def traffic():
        for k in range(12):
            await asyncio.gather(*[router.predict(request({"unit_id": f"u{k}-{i}", "features": rows[i % 60]})) for i in range(50)])

    sys.setswitchinterval(1e-6)  # threads switch often: the window between two field writes is hit
    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        run(traffic())
    finally:
        stop.set()
        flipper.join()
        sys.setswitchinterval(interval)
    logged = rows_of(router, "select arm, layout from ab_exposures")
    assert len(logged) == 600
    assert [(arm, layout) for arm, layout in logged if json.loads(layout)[arm] == 0.0] == []


def test_a_malformed_final_decision_in_a_user_config_is_refused_and_the_experiment_still_answers(run, make_router):
    router = make_router()
    router.reconfigure({"weights": {"A": 0.5, "B": 0.5}, "champion": "A"})
    for final in ({"decision": "promote"}, "promote", {"decision": "keep", "reason": "x", "time": 1.0}):
        router.reconfigure({"weights": {"A": 0.5, "B": 0.5}, "champion": "A", "final": final})
        assert router.config_refused and "user_config.final" in router.config_refused and router.final is None
        assert answer(run(get_experiment(router)))[0] == 200
    router.reconfigure({"weights": {"A": 0.0, "B": 1.0}, "champion": "B", "final": {"decision": "promote", "reason": "won", "time": 1.0}})
    assert router.config_refused is None and router.final["decision"] == "promote"
    code, report = answer(run(get_experiment(router)))
    assert code == 200 and report["decision"] == "promote"


def test_a_nested_value_in_a_column_the_model_does_not_read_is_a_422_that_fails_no_other_request(run, make_router, models):
    """A timestamp column is a known feature name the model need not read, so its value went
    unchecked into the exposure's logged JSON: nested 1,000 deep, the JSON failed, and with it
    every request of the batch (500s logged as both arms' errors); a unit_id nested so deep
    failed the 422's own message (RecursionError, a 500)."""
    router = make_router()
    _, rows = models
    row = rows[0]
    assert "ts" in row and "ts" in router.feature_names

    def deep(depth: int):
        return json.loads("[" * depth + "]" * depth)

    async def go():
        both = await asyncio.gather(router.predict(request({"unit_id": "x", "features": row})),
                                    router.predict(request({"unit_id": "u", "features": {**row, "ts": deep(900)}})))
        alone = [await router.predict(request({"unit_id": "u", "features": {**row, "ts": value}}))
                 for value in (deep(3), {"not": "a timestamp"})]
        unit = await router.predict(request({"unit_id": deep(900), "features": row}))
        return [answer(r) for r in (*both, *alone, unit)]

    good, *bad, unit = run(go())
    assert good[0] == 200
    for code, body in bad:
        assert code == 422 and body["detail"][0]["msg"].startswith("request row 0: ts: "), body
    assert unit[0] == 422 and unit[1]["detail"][0]["loc"] == ["body", "unit_id"] and "got list [[[" in unit[1]["detail"][0]["msg"]
    assert rows_of(router, "select unit_id, status from ab_exposures") == [("x", "ok")]


def test_the_api_docs_routes_are_not_served():
    """/docs, /redoc and /openapi.json answered 200 without the API key every route needs."""
    import httpx

    from rayload.serve.app import api

    assert (api.docs_url, api.redoc_url, api.openapi_url) == (None, None, None)

    async def get(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://router") as client:
            return (await client.get(path)).status_code

    assert [asyncio.run(get(path)) for path in ("/docs", "/redoc", "/openapi.json")] == [404, 404, 404]


@pytest.mark.parametrize("key", ["clé", " padded ", "tab\tinside"])
def test_an_api_key_no_header_can_carry_is_refused_before_serving(models, tmp_path, monkeypatch, key):
    """A key with 'é' never matched: clients send it as UTF-8, Starlette reads headers as Latin-1."""
    from rayload.errors import RayloadError

    checkpoints, _ = models
    spec = ab_from_dict({"name": "t", "arms": [{"name": a, "weight": 0.5, "checkpoint": checkpoints[a]} for a in ("A", "B")],
                         "serving": {"mode": "combined", "api_key_env": "AB_TEST_KEY"}})
    monkeypatch.setenv("AB_TEST_KEY", key)
    with pytest.raises(RayloadError, match=r"the API key in AB_TEST_KEY must be printable ASCII"):
        app_args(spec, checkpoints, str(tmp_path))
    monkeypatch.setenv("AB_TEST_KEY", "k3y-Of.ascii~!")
    assert app_args(spec, checkpoints, str(tmp_path))["api_key_sha256"]


def _slow_challenger(router, seconds: float):
    """`router` with its challenger B's model taking `seconds` more per call."""
    real = router.models.scorers["B"].score_table

    def slow(*a, **k):
        time.sleep(seconds)
        return real(*a, **k)

    router.models.scorers["B"].score_table = slow
    return router


def test_a_slow_shadow_holds_up_no_later_request(run, make_router, models):
    """The shadow's call shared the live batch queue and ran on the event loop: a request sent
    right after a shadowed one waited out the challenger's model (507 ms, logged as the
    champion's latency)."""
    _, rows = models
    router = _slow_challenger(make_router(shadow=True), 1.0)

    async def main():
        first = answer(await router.predict(request({"unit_id": "u1", "features": rows[0]})))
        start = time.perf_counter()
        second = answer(await router.predict(request({"unit_id": "u2", "features": rows[1]})))
        waited = time.perf_counter() - start
        await asyncio.gather(*router._shadow_tasks)
        return first, second, waited

    first, second, waited = run(main())
    assert first[0] == second[0] == 200 and waited < 0.5
    latencies = [ms for (ms,) in rows_of(router, "select latency_ms from ab_exposures")]
    assert len(latencies) == 2 and max(latencies) < 500
    assert rows_of(router, "select arm, status from ab_shadow") == [("B", "ok")] * 2


def test_a_stopping_replica_lets_its_shadows_finish_before_closing_the_writer(run, make_router, models):
    """Serve drains a stopping replica's requests, not its shadows: __del__ closed the writer at
    once and the shadows still in flight lost their rows (37 of 64 stored)."""
    _, rows = models
    router = _slow_challenger(make_router(shadow=True), 0.02)

    async def main():
        for i in range(20):
            assert answer(await router.predict(request({"unit_id": f"u{i}", "features": rows[i % len(rows)]})))[0] == 200
        in_flight = len(router._shadow_tasks)
        from rayload.serve.app import ABRouter

        await ABRouter.func_or_class.__del__(router)  # Serve's ingress wrapper, as call_destructor awaits it
        return in_flight

    assert run(main()) > 0
    assert rows_of(router, "select count(*) from ab_shadow") == [(20,)]
    assert router._stopped and router.writer._closed  # closed by the stop, once


def test_feedback_while_the_store_cannot_be_read_is_a_503_to_retry(run, make_router, models):
    import sqlalchemy as sa

    _, rows = models
    router = make_router()

    def down(request_id):
        raise sa.exc.OperationalError("select", {}, ConnectionRefusedError("the database is down"))

    async def main():
        _, body = answer(await router.predict(request({"unit_id": "u1", "features": rows[0]})))
        router.reader.exposure_exists = down
        return answer(await router.feedback(request({"request_id": body["request_id"], "event": "click"})))

    code, body = run(main())
    assert code == 503 and "retry" in str(body)


def test_serve_build_writes_its_config_for_its_owner_alone_and_starts_no_ray(models, tmp_path, monkeypatch):
    """The Serve config holds events_url, password and all (0644 before); an existing file kept its
    mode. Checking whether the app runs must not start a Ray of its own in a process without one."""
    import os
    import stat

    import ray
    import yaml
    from typer.testing import CliRunner

    from _ops import cli_app
    from rayload.serve.control import _app_running

    __import__("importlib").import_module("rayload._cli_ab")  # registers `serve`

    checkpoints, _ = models
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    spec = tmp_path / "ab.yaml"
    spec.write_text("# rayload serve ab.yaml\n" + yaml.safe_dump({
        "name": "t", "arms": [{"name": a, "weight": 0.5, "checkpoint": checkpoints[a]} for a in ("A", "B")],
        "events": {"url": "postgresql://ab:s3cret@127.0.0.1:5432/test"}}))
    out = tmp_path / "serve_config.yaml"
    out.write_text("old")
    os.chmod(out, 0o644)
    r = CliRunner().invoke(cli_app(), ["serve", "build", str(spec), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600 and "s3cret" in out.read_text()
    had_ray = ray.is_initialized()  # (another test file in this process may have started one)
    assert _app_running("t") is False and ray.is_initialized() == had_ray
