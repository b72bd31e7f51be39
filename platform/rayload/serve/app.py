"""The Serve application: an A/B router (FastAPI ingress) in front of the arms' models.

`build_app(args)` is the Serve application builder (import path
`rayload.serve.app:build_app`), so `rayload serve`, `serve deploy` of the config that
`rayload serve build` writes, and tests all deploy the same thing. The router's
`user_config` holds what changes at run time (weights, champion, shadow, and a final promote or
rollback, which `GET /experiment` then reports as its decision): Serve applies a new
one to the running replicas through `reconfigure`, without restarting them.

Serving mode (see benchmarks/bench_serve.py): `combined` keeps every arm's model inside the
router replica and batches there (no extra hop: the A/B path then costs what one deployment
costs); `separate` puts each arm in its own deployment for models too large to share a replica.
"""


import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray import serve

from ..errors import DataError
from .assign import Layout
from .batch_scoring import ModelDeployment, Models, drift_flusher, monitor_args
from .event_writer import is_row_error
from .http_io import (AssignBody, FeedbackBody, PredictBody, RequestIds, _features_json, _loads, _ok, _problem,  # noqa: F401
                      _validation_detail)

log = logging.getLogger(__name__)
api = FastAPI(title="rayload A/B router")


class EventStoreError(RuntimeError):
    """The exposures of a batch could not be committed: its requests answer 5xx, not 2xx."""


def _top(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


@serve.deployment
@serve.ingress(api)
class ABRouter:
    def __init__(self, args: dict, **handles):
        from .event_writer import EventWriter
        from .events import EventReader

        self.experiment, self.salt, self.order = args["experiment"], args["salt"], args["arms"]
        serving = args["serving"]
        self.max_body, self.max_candidates = serving["max_body_bytes"], serving["max_candidates"]
        self.api_key_sha256 = args.get("api_key_sha256")  # the key itself is never written anywhere
        self.handles = handles  # separate mode: arm -> DeploymentHandle
        monitor = monitor_args(args)
        self.models = None if handles else Models(args["checkpoints"], drift=monitor is not None, torchscript=serving.get("torchscript", True))
        self.flusher = drift_flusher(monitor, self.models.scorers) if self.models else None
        self.log_features = args["events"].get("log_features", True)
        self.checkpoints = args["checkpoints"]
        if self.models:
            self.models._batched.set_max_batch_size(serving["max_batch_size"])
            self.models._batched.set_batch_wait_timeout_s(serving["batch_wait_ms"] / 1000.0)
            self.feature_names = set().union(*(s.feature_names for s in self.models.scorers.values()))
        else:
            self.feature_names = set(args["feature_names"])
        events = args["events"]
        self.writer = EventWriter(args["events_url"], events["flush_ms"], events["max_batch"], events.get("sync", "normal"),
                                  events.get("fsync_s", 1.0))
        if self.models is not None and self.writer.inline:
            self.models.log = self._log_batch  # exposures commit with their batch (serve/event_writer.py)
        self.writer_url = args["events_url"]
        self.reader = EventReader(args["events_url"])
        self.spec_raw = args["spec"]
        self.request_ids = RequestIds()
        self.reconfigure({"weights": args["weights"], "champion": args["champion"], "shadow": args["shadow"]})

    def reconfigure(self, config: dict) -> None:
        """Serve calls this with a new user_config: weights change without a restart."""
        self.weights, self.champion, self.shadow = dict(config["weights"]), config["champion"], bool(config.get("shadow", False))
        self.final = config.get("final")  # a promote or rollback (decision, reason, time) that ended the automatic steps
        self.layout = Layout.build(self.weights, self.champion, self.order)
        self.layout_json = json.dumps(self.weights, sort_keys=True)

    # ------------------------------------------------------------ HTTP

    def _denied(self, request: Request) -> JSONResponse | None:
        if self.api_key_sha256:
            given = hashlib.sha256(request.headers.get("x-api-key", "").encode()).hexdigest()
            if not hmac.compare_digest(given, self.api_key_sha256):
                return _problem(401, "missing or wrong x-api-key header")
        return None

    async def _json_body(self, request: Request):
        """The body as JSON, refusing a body over the limit before reading it whole."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return _problem(413, f"body of {length} bytes is over the limit of {self.max_body}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                return _problem(413, f"body is over the limit of {self.max_body} bytes")
        try:
            return _loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return _problem(422, [{"loc": ["body"], "msg": f"malformed JSON: {exc}", "type": "json_invalid"}])
        except RecursionError:  # thousands of nested [ or { fit in the size limit
            return _problem(422, [{"loc": ["body"], "msg": "JSON nested too deeply", "type": "json_invalid"}])

    async def _parse(self, request: Request, model: type[BaseModel]):
        """(the request's body as `model`, whether orjson read it: see _loads), or the
        401/413/422 answer that refuses it."""
        if denied := self._denied(request):
            return denied
        raw = await self._json_body(request)
        if isinstance(raw, JSONResponse):
            return raw
        raw, by_orjson = raw
        try:
            return model.model_validate(raw), by_orjson
        except ValidationError as exc:
            return _problem(422, _validation_detail(exc))

    @api.post("/predict")
    async def predict(self, request: Request):
        start = time.perf_counter()
        parsed = await self._parse(request, PredictBody)
        if isinstance(parsed, JSONResponse):
            return parsed
        body, fast = parsed
        rows = body.candidates if body.candidates is not None else ([body.features] if body.features is not None else None)
        if problem := self._rows_problem(rows, body.candidates is not None):
            return problem
        unit = str(body.unit_id)
        # Shadow mode: the champion answers every request and the other arms score beside it
        # (their weights are 0: ab_spec.weight_issues; a config written by hand cannot change that).
        arm = self.champion if self.shadow else self.layout.assign(self.salt, unit)
        request_id = self.request_ids.next()
        shadows = [a for a in self.order if a != arm] if self.shadow else []
        # combined mode on SQLite without shadows: the batch commits this exposure before the call returns
        batch_logs = not shadows and self.models is not None and self.models.log is not None
        if shadows:
            results = await asyncio.gather(*[self._score(a, rows) for a in [arm, *shadows]], return_exceptions=True)
        else:  # the usual case: no task per request for gather to wrap the one call in
            results = [await self._score_or_error(arm, rows, (request_id, unit, start, fast) if batch_logs else None)]
        answer = results[0]
        if isinstance(answer, DataError):
            return _problem(422, [{"loc": ["body", "candidates" if body.candidates is not None else "features"], "msg": str(answer), "type": "value_error"}])
        if isinstance(answer, EventStoreError):
            return _problem(503, "the exposure could not be recorded; retry")
        latency = (time.perf_counter() - start) * 1000
        if isinstance(answer, BaseException):
            log.error("arm %s failed: %r", arm, answer)
            await self._log("exposure", request_id, unit, arm, "error", None, "error", latency)
            return _problem(500, f"model of arm {arm} failed")
        scores, version = answer
        top = _top(scores)
        if not batch_logs:
            await self._log("exposure", request_id, unit, arm, version, scores[top], "ok", latency,
                            shadows=[(a, r) for a, r in zip(shadows, results[1:]) if not isinstance(r, BaseException)],
                            features=_features_json(rows[top], fast) if self.log_features else None)
        out = {"request_id": request_id, "arm": arm, "model_version": version, "score": scores[top]}
        if body.candidates is not None:
            out.update(ranking=sorted(range(len(scores)), key=lambda i: -scores[i]), scores=scores, shown=top)
            return _ok(out, all(map(math.isfinite, scores)))
        return _ok(out, math.isfinite(scores[top]))

    def _rows_problem(self, rows, ranking: bool) -> JSONResponse | None:
        field = "candidates" if ranking else "features"
        if not rows:
            return _problem(422, [{"loc": ["body", field], "msg": "give features (one item) or a non-empty candidates list", "type": "missing"}])
        if len(rows) > self.max_candidates:
            return _problem(422, [{"loc": ["body", "candidates"], "msg": f"at most {self.max_candidates} candidates", "type": "too_long"}])
        for i, row in enumerate(rows):
            unknown = sorted(set(row) - self.feature_names)
            if unknown:
                loc = ["body", "candidates", i, unknown[0]] if ranking else ["body", "features", unknown[0]]
                return _problem(422, [{"loc": loc, "msg": f"unknown feature {unknown[0]!r}; known: {sorted(self.feature_names)}", "type": "extra_forbidden"}])
        return None

    async def _score(self, arm: str, rows: list[dict], exposure: tuple | None = None):
        if self.models is not None:
            result = await self.models.score(arm, rows, exposure)
            if isinstance(result, Exception):
                raise result
            return result
        return await self.handles[arm].score.remote(arm, rows)

    async def _score_or_error(self, arm: str, rows: list[dict], exposure: tuple | None = None):
        try:
            return await self._score(arm, rows, exposure)
        except Exception as exc:  # as gather(return_exceptions=True) would hand it back
            return exc

    def _exposure_row(self, request_id, unit, arm, version, score, status, latency, now, features) -> dict:
        return {"request_id": request_id, "experiment": self.experiment, "unit_id": unit, "arm": arm, "model_version": version,
                "score": score, "status": status, "latency_ms": latency, "layout": self.layout_json, "ts": now, "features": features}

    async def _log_batch(self, items: list, results: list) -> list:
        """A scored batch's exposures (those of callers that passed one), committed together
        before any caller resumes; if the commit fails, those callers get EventStoreError. The
        commit runs in this thread unless another connection holds the database's write lock;
        then the writer thread commits them and this coroutine awaits it, so the event loop never
        waits on the lock (serve/event_writer.py)."""
        now, perf = time.time(), time.perf_counter()
        events, logged = [], []
        for i, ((arm, rows, exposure), result) in enumerate(zip(items, results)):
            if exposure is None or isinstance(result, BaseException):
                continue
            request_id, unit, start, fast = exposure
            scores, version = result
            top = _top(scores)
            features = _features_json(rows[top], fast) if self.log_features else None
            events.append(("exposure", self._exposure_row(request_id, unit, arm, version, scores[top], "ok", (perf - start) * 1000,
                                                          now, features)))
            logged.append(i)
        try:
            if not self.writer.write_now(events):
                await self.writer.write(*events)
            return results
        except Exception as exc:
            if not (is_row_error(exc) and len(events) > 1):
                log.exception("committing a batch's exposures failed")
                errors = [exc] * len(events)
            else:  # one request's bad row failed the batch's transaction: each on its own, so only that one fails
                errors = await asyncio.gather(*(self.writer.write(event) for event in events), return_exceptions=True)
        results = list(results)
        for i, error in zip(logged, errors):
            if error is not None:
                results[i] = EventStoreError(f"event commit failed: {error!r}")
        return results

    async def _log(self, kind, request_id, unit, arm, version, score, status, latency, shadows=(), features=None) -> None:
        now = time.time()
        events = [(kind, self._exposure_row(request_id, unit, arm, version, score, status, latency, now, features))]
        events += [("shadow", {"request_id": request_id, "arm": shadow_arm, "model_version": version_s, "score": max(scores), "ts": now})
                   for shadow_arm, (scores, version_s) in shadows]
        # The answer waits for the commit: a 2xx means the event is committed (serve/event_writer.py).
        await self.writer.write(*events)

    @api.post("/feedback")
    async def feedback(self, request: Request):
        parsed = await self._parse(request, FeedbackBody)
        if isinstance(parsed, JSONResponse):
            return parsed
        body, _ = parsed
        if not await asyncio.to_thread(self.reader.exposure_exists, body.request_id):
            return _problem(404, f"unknown request_id {body.request_id!r}")
        duplicate = await asyncio.to_thread(self.reader.outcome_exists, body.request_id, body.event)
        if not duplicate:
            try:
                await self.writer.write(("outcome", {"request_id": body.request_id, "event": body.event, "value": body.value, "ts": time.time()}))
            except Exception:
                log.exception("committing an outcome failed")
                return _problem(503, "the outcome could not be recorded; retry")
        return {"request_id": body.request_id, "event": body.event, "duplicate": duplicate}

    @api.post("/assign")
    async def assign(self, request: Request):
        """Which arm each unit is in under the live weights: a lookup, not an exposure (nothing is
        logged), for support questions ("what does user X see?") and for checking stickiness."""
        parsed = await self._parse(request, AssignBody)
        if isinstance(parsed, JSONResponse):
            return parsed
        body, _ = parsed
        return {"arms": {str(u): self.layout.assign(self.salt, str(u)) for u in body.unit_ids}, "weights": self.weights,
                "champion": self.champion}

    @api.get("/experiment")
    async def experiment(self, request: Request):
        from ..ab_spec import ABSpec
        from .analysis import analyze, final_reasons

        if denied := self._denied(request):
            return denied
        spec = ABSpec.model_validate(self.spec_raw)
        frame = await asyncio.to_thread(self.reader.frame, self.experiment, spec.analysis.event)
        result = await asyncio.to_thread(analyze, frame, spec, self.weights, self.champion)
        if final := self.final:  # as control.analysis_for: the statistics after it no longer steer anything
            result.decision, result.reasons = final["decision"], final_reasons(final)
        if spec.drift.enabled:
            from .monitor import report_for

            result.drift = await asyncio.to_thread(report_for, self.writer_url, self.experiment, self.checkpoints, spec.drift)
        return {**result.to_dict(), "shadow": self.shadow}

    @api.get("/healthz")
    async def healthz(self, request: Request):
        if denied := self._denied(request):
            return denied
        return {"ok": True, "experiment": self.experiment, "weights": self.weights, "champion": self.champion, "pid": os.getpid()}

    def __del__(self):
        if getattr(self, "flusher", None) is not None:
            self.flusher.close()
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.close()


def build_app(args: dict):
    """Serve application builder. `args` comes from `serve.serve_config.app_args` (JSON-able)."""
    serving = args["serving"]
    options = dict(num_replicas=serving["replicas"], max_ongoing_requests=serving["max_ongoing_requests"],
                   max_queued_requests=serving["max_queued_requests"], ray_actor_options={"num_cpus": serving["cpus_per_replica"]},
                   user_config={"weights": args["weights"], "champion": args["champion"], "shadow": args["shadow"]})
    handles = {}
    if args["mode"] == "separate":
        for arm, path in args["checkpoints"].items():
            handles[arm] = ModelDeployment.options(name=f"model_{arm}", num_replicas=serving["replicas"],
                                                   max_ongoing_requests=serving["max_ongoing_requests"],
                                                   ray_actor_options={"num_cpus": serving["cpus_per_replica"]}).bind(
                arm, path, serving["max_batch_size"], serving["batch_wait_ms"], monitor_args(args), serving.get("torchscript", True))
    return ABRouter.options(**options).bind(args, **handles)
