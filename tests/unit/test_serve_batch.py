"""The A/B router's batch path without Ray: arms that share a features.json share one
transform of a mixed batch and score exactly what each model scores alone; a bad request in a
mixed batch is isolated; request IDs are unique, unguessable and time-ordered."""

import asyncio
import json
import re
import time

import numpy as np
import pytest

from helpers import frame, prepared_features, tiny_checkpoint
from rayload.errors import DataError
from rayload.features import FittedFeatures
from rayload.serve.app import RequestIds
from rayload.serve.batch_scoring import score_grouped
from rayload.serve.scorer import Scorer


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
    """Two models on the same prepared data (one features.json) and one on other data."""
    tmp = tmp_path_factory.mktemp("serve-batch")
    out = {}
    for name, data_seed in (("shared", 4), ("other", 5)):
        out[name] = prepared_features(tmp, data_seed, name)
    rows = frame(60, seed=9).drop(columns=["y"]).to_dict("records")
    scorers = {"a": Scorer.load("a", tiny_checkpoint(tmp / "a", out["shared"], 0)),
               "b": Scorer.load("b", tiny_checkpoint(tmp / "b", out["shared"], 1)),
               "c": Scorer.load("c", tiny_checkpoint(tmp / "c", out["other"], 2))}
    return scorers, rows


def test_arms_with_one_features_json_share_one_transform_and_score_as_alone(arms, monkeypatch):
    scorers, rows = arms
    assert scorers["a"].transform_key == scorers["b"].transform_key != scorers["c"].transform_key
    items = [("a", rows[0:3]), ("b", rows[3:4]), ("c", rows[4:6]), ("a", rows[6:7]), ("b", rows[7:12]), ("c", rows[12:13])]
    alone = [scorers[arm].score(r) for arm, r in items]
    calls = []
    real = FittedFeatures.transform_rows
    monkeypatch.setattr(FittedFeatures, "transform_rows", lambda self, r: (calls.append(len(r)), real(self, r))[1])
    out = score_grouped(scorers, items)
    assert sorted(calls) == [3, 10]  # one transform for arms a and b together (10 rows), one for c
    for (arm, _), got, want in zip(items, out, alone):
        scores, version = got
        assert version == scorers[arm].version
        np.testing.assert_allclose(scores, want, atol=1e-6)
    # The two models differ, so sharing the transform did not share the scores.
    assert not np.allclose(scorers["a"].score(rows[:5]), scorers["b"].score(rows[:5]))


def test_a_bad_request_in_a_mixed_batch_gets_its_own_error(arms):
    scorers, rows = arms
    bad = {**rows[1], "price": "cheap"}
    items = [("a", rows[0:1]), ("b", [bad]), ("a", rows[2:4]), ("b", rows[4:5])]
    out = score_grouped(scorers, items)
    assert isinstance(out[1], DataError) and "price" in str(out[1])
    for i in (0, 2, 3):
        arm, r = items[i]
        np.testing.assert_allclose(out[i][0], scorers[arm].score(r), atol=1e-6)


def test_request_ids_are_unique_hex_and_time_ordered():
    ids = RequestIds()
    before = time.time_ns() // 1_000_000
    drawn = [ids.next() for _ in range(3 * RequestIds.BLOCK + 7)]  # across several random blocks
    after = time.time_ns() // 1_000_000
    assert len(set(drawn)) == len(drawn)
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in drawn)
    stamps = [int(i[:12], 16) for i in drawn]
    assert before <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= after
    assert len({i[12:] for i in drawn}) == len(drawn)  # the random parts differ too


def bare_router():
    """An A/B router with only what its batch logging reads (no Serve, no models)."""
    from rayload.serve.app import ABRouter

    router = object.__new__(ABRouter.func_or_class)
    router.experiment, router.order, router.log_features = "e", ["a", "b"], True
    router._apply({"weights": {"a": 0.5, "b": 0.5}, "champion": "a"})  # layout_json '{"a": 0.5, "b": 0.5}'
    return router


def test_a_batch_whose_exposures_cannot_be_committed_answers_none_of_them_as_logged(arms, tmp_path):
    """The combined-mode router commits a batch's exposures before any caller resumes; when
    the commit fails, every request whose exposure it held gets EventStoreError (answered 503),
    a request that failed on its own keeps its own error, and a commit that works stores one
    exposure per request with the score that was answered."""
    from rayload.serve.app import EventStoreError
    from rayload.serve.event_writer import EventWriter
    from rayload.serve.events import EventReader

    scorers, rows = arms
    router = bare_router()
    items = [("a", rows[0:2], ("r1", "u1", time.perf_counter(), True)), ("b", [{**rows[2], "price": "cheap"}], ("r2", "u2", 0.0, True)),
             ("b", rows[3:4], ("r3", "u3", time.perf_counter(), True))]
    results = score_grouped(scorers, [(arm, r) for arm, r, _ in items])

    class Broken:
        def write_now(self, events):
            raise OSError("disk full")

    router.writer = Broken()
    failed = asyncio.run(router._log_batch(items, list(results)))
    assert isinstance(failed[0], EventStoreError) and isinstance(failed[2], EventStoreError) and "disk full" in str(failed[0])
    assert isinstance(failed[1], DataError)

    router.writer = EventWriter(f"sqlite:///{tmp_path / 'events.db'}")
    assert asyncio.run(router._log_batch(items, results)) is results
    router.writer.close()
    frame = EventReader(f"sqlite:///{tmp_path / 'events.db'}").frame("e").set_index("request_id")
    assert sorted(frame.index) == ["r1", "r3"]  # the bad request (422) is not an exposure
    assert frame.loc["r1", "score"] == max(results[0][0]) and frame.loc["r3", "arm"] == "b"


def test_a_batch_commit_never_waits_on_the_event_loop_for_a_locked_database(arms, tmp_path):
    """While another connection holds SQLite's write lock (another replica on the same file),
    the batch's exposures go to the writer thread instead of blocking the replica's event loop
    on the lock: other coroutines keep running, the batch resumes once the lock is released,
    and every exposure is stored once. Without the lock the commit is inline (write_now)."""
    import sqlite3

    from rayload.serve.event_writer import EventWriter
    from rayload.serve.events import EventReader

    scorers, rows = arms
    url = f"sqlite:///{tmp_path / 'events.db'}"
    router = bare_router()
    router.writer = EventWriter(url)
    items = [("a", rows[0:2], ("r1", "u1", time.perf_counter(), True)), ("b", rows[3:4], ("r2", "u2", time.perf_counter(), True))]
    results = score_grouped(scorers, [(arm, r) for arm, r, _ in items])

    assert router.writer.write_now([]) is True
    other = sqlite3.connect(tmp_path / "events.db", isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # the write lock, held
    assert router.writer.write_now([("exposure", {"request_id": "x", "experiment": "e", "unit_id": "u", "arm": "a",
                                                  "model_version": "v", "score": 0.5, "status": "ok", "latency_ms": 1.0,
                                                  "layout": "{}", "ts": time.time()})]) is False  # refused, not waited

    handed = []  # the batches the router handed to the writer thread
    write = router.writer.write
    router.writer.write = lambda *events: (handed.append(len(events)), write(*events))[1]
    released = []

    async def main():
        async def release():  # only a running event loop can release the lock
            await asyncio.sleep(0.05)
            other.execute("COMMIT")
            released.append(True)

        releaser = asyncio.create_task(release())
        # A loop blocked on the lock (write_now waiting out SQLite's busy timeout) never runs
        # release() while the batch is pending, and this times out instead.
        out = await asyncio.wait_for(router._log_batch(items, results), 10)
        done = bool(released)  # the batch resumed only after the loop released the lock
        await releaser
        return out, done

    out, done = asyncio.run(main())
    assert out is results and done and handed == [2]  # refused inline, committed by the writer thread
    router.writer.close()
    other.close()
    reader = EventReader(url)
    frame = reader.frame("e")
    assert sorted(frame["request_id"]) == ["r1", "r2"]  # the refused write_now wrote nothing
    reader.close()


def _parse(raw: bytes, model, length: bytes | None = None):
    """The router's body parsing (size limit, JSON, the model) on a raw body, as a request would reach it."""
    from fastapi.responses import JSONResponse
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    router = bare_router()
    router.max_body, router.api_key_sha256 = 65_536, None
    length = str(len(raw)).encode() if length is None else length
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", length)]}, receive)
    answer = asyncio.run(router._parse(request, model))
    return answer if isinstance(answer, JSONResponse) else answer[0]  # a parsed body comes with how it was read


@pytest.mark.parametrize("raw, field", [
    (b'{"unit_id": "\\ud800", "features": {}}', "unit_id"),
    (b'{"unit_id": "' + b"u" * 257 + b'", "features": {}}', "unit_id"),
    (b'{"unit_id": ' + b"9" * 300 + b', "features": {}}', "unit_id"),
    (b'{"request_id": "r", "event": "click", "value": NaN}', "value"),
    (b'{"request_id": "r", "event": "click", "value": Infinity}', "value"),
    (b'{"request_id": "\\udc00", "event": "click"}', "request_id"),
    (b'{"unit_ids": ["fine", "\\udfff"]}', "unit_ids"),
    (b"[" * 30_000 + b"]" * 30_000, None),
    (b'{"unit_id": "", "features": {}}', "unit_id"),  # a lost user ID: all such traffic was one sticky unit in one arm
    (b'{"unit_id": "   ", "features": {}}', "unit_id"),
], ids=["surrogate-unit", "long-unit", "long-int-unit", "nan-value", "inf-value", "surrogate-request", "surrogate-assign", "deep-json",
        "empty-unit", "blank-unit"])
def test_values_the_event_store_cannot_keep_are_refused_with_422_naming_the_field(raw, field):
    from fastapi.responses import JSONResponse

    from rayload.serve.app import AssignBody, FeedbackBody, PredictBody

    model = PredictBody if b"unit_id\"" in raw else FeedbackBody if b"request_id" in raw else AssignBody
    answer = _parse(raw, model)
    assert isinstance(answer, JSONResponse) and answer.status_code == 422
    detail = json.loads(answer.body)["detail"]
    assert detail[0]["loc"][:2] == (["body", field] if field else ["body"]), detail
    assert isinstance(_parse(b'{"unit_id": "' + "é".encode() * 256 + b'", "features": {}}', PredictBody), PredictBody)


def test_a_content_length_of_a_non_ascii_digit_is_not_a_server_error():
    """'²' is a digit to str.isdigit but not to int(): a ValueError (500) before the body was read."""
    from rayload.serve.app import PredictBody

    raw = b'{"unit_id": "u", "features": {}}'
    assert isinstance(_parse(raw, PredictBody, "²".encode("latin-1")), PredictBody)


def test_one_unstorable_exposure_in_a_batch_fails_only_its_own_request(arms, tmp_path):
    """A batch's inline commit fails on one row: the others are committed one by one and
    answer as logged; only the request that brought the row gets EventStoreError (503)."""
    from rayload.serve.app import EventStoreError
    from rayload.serve.event_writer import EventWriter
    from rayload.serve.events import EventReader

    scorers, rows = arms
    router = bare_router()
    url = f"sqlite:///{tmp_path / 'events.db'}"
    router.writer = EventWriter(url)
    items = [("a", rows[0:1], ("r1", "alice", time.perf_counter(), True)), ("b", rows[1:2], ("r2", "\ud800", time.perf_counter(), True)),
             ("a", rows[2:3], ("r3", "bob", time.perf_counter(), True))]
    results = score_grouped(scorers, [(arm, r) for arm, r, _ in items])
    out = asyncio.run(router._log_batch(items, results))
    router.writer.close()
    assert isinstance(out[1], EventStoreError) and out[0] == results[0] and out[2] == results[2]
    reader = EventReader(url)
    assert sorted(reader.frame("e")["request_id"]) == ["r1", "r3"]
    reader.close()


def test_a_rows_score_does_not_depend_on_the_types_its_batch_neighbours_send(arms):
    """"item" is categorical: 7.0 from one client (a pandas row) and "12" from another in the
    same batch used to turn the whole column into Python's text ("7.0"), so the first row's ID
    went out of vocabulary only when batched. An integer past int64 failed the whole batch."""
    scorers, rows = arms
    row = dict(rows[0], item=7)
    alone = scorers["a"].score([row])[0]
    items = [("a", [dict(row, item=7.0)]), ("a", [dict(rows[1], item="12")]), ("a", [dict(rows[2], age=10**22)])]
    out = score_grouped(scorers, items)
    assert out[0][0][0] == pytest.approx(alone, abs=1e-6)
    assert not isinstance(out[1], Exception)
    # the huge age is read as a number (no longer a failed batch); z-scored without a clip it is
    # ~1e21, past what any model scores: that request alone is refused, naming the feature
    assert isinstance(out[2], DataError) and str(out[2]).startswith("request row 0: age: the value 10000000000000000000000 is ")


BODIES = [
    b'{"unit_id": "u1", "features": {"user": 12, "item": "a|b", "price": 3.25, "new": true, "gone": null}}',
    b'{"unit_id": 7, "features": {"id": 9223372036854775807, "neg": -9223372036854775808, "u64": 18446744073709551615}}',
    b'{"unit_id": "u", "features": {"big": 123456789012345678901234567890, "edge": 1234567890123456789}}',
    b'{"unit_id": "u", "features": {"f": 0.1, "g": 1e-320, "h": 1.7976931348623157e308, "e": 5E3, "z": -0.0}}',
    b'{"unit_id": "u", "features": {"nan": NaN, "inf": -Infinity, "huge": 1e400}}',
    b'{"unit_id": "u", "features": {"s": "caf\\u00e9 \\u2603 \\ud83d\\ude00 \\"q\\" \\\\ \\n", "raw": "\xc3\xa9\xe2\x98\x83"}}',
    b'{"unit_id": "u", "features": {"lone": "\\ud800x"}}',
    b'{"unit_id": "u", "unit_id": "v", "features": {"a": 1, "a": 2}}',
    b'  {"unit_id":"u","candidates":[{"a":[1,2,{"b":{}}]},{"a":[]}]}  ',
]


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_the_router_reads_a_body_as_json_loads_does_and_logs_its_rows_as_json_dumps_would(body):
    """_loads takes orjson's fast path only where orjson reads what json.loads reads (huge
    integers, NaN, lone surrogates go to json.loads), and an exposure's features JSON, written
    by orjson for such rows, reads back as json.dumps's would."""
    from rayload.serve.app import _features_json, _loads

    value, fast = _loads(body)
    expected = json.loads(body)
    assert json.dumps(value) == json.dumps(expected)  # NaN-proof equality, int vs float exact
    assert all(type(a) is type(b) for a, b in zip(_leaves(value), _leaves(expected)))
    rows = value.get("candidates") or [value["features"]]
    for row in rows:
        assert json.dumps(json.loads(_features_json(row, fast))) == json.dumps(row)
    long_int = any(len(run) >= 19 for run in re.findall(rb"[0-9]+", body))
    assert fast == (b"NaN" not in body and b"lone" not in body and not long_int)


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def test_features_json_falls_back_to_json_dumps_for_what_orjson_cannot_write():
    from rayload.serve.app import _features_json

    row = {"big": 10**30, "s": "\ud800"}
    assert json.loads(_features_json(row, True)) == row
