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

Shadow mode (serve/shadow.py): the champion answers every request; the challengers score it in
the background after the answer.
"""


import asyncio
import hashlib
import hmac
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray import serve

from ..errors import DataError, RayloadError
from .batch_scoring import ModelDeployment, ModelError, Models, drift_flusher, monitor_args
from .event_writer import is_row_error
from .http_io import (AssignBody, FeedbackBody, PredictBody, RequestIds, _features_json, _loads, _ok, _problem,  # noqa: F401
                      _validation_detail, rows_problem)
from .router_config import RouterConfig, config_issues
from .shadow import ShadowScoring

log = logging.getLogger(__name__)
# No /docs, /redoc or /openapi.json: they answered without the API key that every route needs
api = FastAPI(title="rayload A/B router", docs_url=None, redoc_url=None, openapi_url=None)


class EventStoreError(RuntimeError):
    """The exposures of a batch could not be committed: its requests answer 5xx, not 2xx."""


def _top(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


def _failure_detail(arm: str, error: BaseException) -> str:
    """The 500 answer's text: a ModelError's own (it says what failed, and holds nothing
    internal), also where Ray wraps one raised in a separate deployment; otherwise generic."""
    cause = error if type(error) is ModelError else getattr(error, "cause", None)
    return str(cause) if isinstance(cause, ModelError) else f"the model of arm {arm} failed"


@serve.deployment
@serve.ingress(api)
class ABRouter(ShadowScoring):
    generation: str | None = None  # the experiment's generation its exposures carry (serve/control.py); None: before generations

    def __init__(self, args: dict, **handles):
        from .event_writer import EventWriter
        from .events import EventReader

        self.experiment, self.salt, self.order = args["experiment"], args["salt"], args["arms"]
        self.generation = args.get("generation")
        serving = args["serving"]
        self._init_shadows(serving["max_ongoing_requests"])
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
        self.config_refused: str | None = None  # the last user_config refused while serving (GET /healthz says it)
        self.started = False  # Serve's first reconfigure (the deployment's user_config, before any traffic) sets it
        initial = {"weights": args["weights"], "champion": args["champion"], "shadow": args["shadow"]}
        if issues := config_issues(initial, self.order):  # the spec's own: checked at spec load already
            raise RayloadError("the router's weights are refused: " + "; ".join(issues))
        self._apply(initial)

    def reconfigure(self, config: dict) -> None:
        """Serve calls this with the user_config when the replica starts, and with a new one:
        weights change without a restart. A config that breaks the spec's rules (weights not
        naming every arm, negative, or not summing to 1, an unknown champion, a challenger's
        weight in shadow mode) is refused with what must hold, and nothing changes here. At the
        start that fails the replica (Serve reports the deploy failed; replicas already serving
        go on). On a serving replica it keeps the config in force, logs the refusal as an error
        and reports it in GET /healthz and /experiment (`config_refused`): raising there would
        not keep the old config, since Serve (2.60) stops a replica whose reconfigure fails, and
        with one replica the experiment would go down. `rayload ab set-weights` checks the same
        rules before it deploys: this catches a config edited by hand."""
        issues = config_issues(config, self.order)
        if issues:
            message = "refused a new router user_config (the weights in force stay): " + "; ".join(issues)
            if not self.started:
                raise RayloadError(message)
            log.error("%s", message)
            self.config_refused = message
            return
        self._apply(config)
        self.started, self.config_refused = True, None

    def _apply(self, config: dict) -> None:
        self.config = RouterConfig.of(config, self.order)

    # the config in force, for callers that read one field (a request reads self.config once)
    weights = property(lambda self: self.config.weights)
    champion = property(lambda self: self.config.champion)
    shadow = property(lambda self: self.config.shadow)
    layout = property(lambda self: self.config.layout)
    layout_json = property(lambda self: self.config.layout_json)
    final = property(lambda self: self.config.final)

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
        if length is not None and length.isascii() and length.isdigit() and int(length) > self.max_body:  # "²" is a digit to isdigit
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
        if problem := rows_problem(rows, body.candidates is not None, self.max_candidates, self.feature_names):
            return problem
        unit = str(body.unit_id)
        # Shadow mode: the champion answers every request and the other arms score it after
        # (their weights are 0: ab_spec.weight_issues; reconfigure refuses a config that is not so).
        config = self.config  # one config for the whole request, whatever a reconfigure does meanwhile
        shadow = config.shadow
        arm = config.champion if shadow else config.layout.assign(self.salt, unit)
        layout = config.layout_json  # the weights the arm was assigned under
        request_id = self.request_ids.next()
        # combined mode on SQLite: the batch commits this exposure before the call returns
        batch_logs = self.models is not None and self.models.log is not None
        answer = await self._score_or_error(arm, rows, (request_id, unit, start, fast, layout) if batch_logs else None)
        if isinstance(getattr(answer, "cause", None), DataError):
            # separate mode: Serve raises the model deployment's DataError wrapped (RayTaskError), whose
            # text is the remote traceback (ANSI codes, pid, ip, file paths); the client gets the message
            answer = answer.cause
        if isinstance(answer, DataError):
            return _problem(422, [{"loc": ["body", "candidates" if body.candidates is not None else "features"], "msg": str(answer), "type": "value_error"}])
        if isinstance(answer, EventStoreError):
            return _problem(503, "the exposure could not be recorded; retry")
        latency = (time.perf_counter() - start) * 1000  # the answering arm's own call: no shadow has started yet
        if isinstance(answer, BaseException):
            log.error("arm %s failed: %r", arm, answer)
            try:
                await self._log(request_id, unit, arm, "error", None, "error", latency, layout)
            except Exception as exc:  # noqa: BLE001 - the store is down too: answered as the ok path does, not raised
                log.error("error exposure %s not recorded: %r", request_id, exc)
                return _problem(503, "the exposure could not be recorded; retry")
            return _problem(500, _failure_detail(arm, answer))
        scores, version = answer
        top = _top(scores)
        if not batch_logs:
            try:
                await self._log(request_id, unit, arm, version, scores[top], "ok", latency, layout,
                                features=_features_json(rows[top], fast) if self.log_features else None)
            except Exception as exc:  # noqa: BLE001 - the store refused the row or is down: no 2xx without the event
                log.error("exposure %s not recorded: %r", request_id, exc)
                return _problem(503, "the exposure could not be recorded; retry")
        if shadow:
            self._start_shadows(arm, request_id, rows)
        out = {"request_id": request_id, "arm": arm, "model_version": version, "score": scores[top]}
        if body.candidates is not None:
            out.update(ranking=sorted(range(len(scores)), key=lambda i: -scores[i]), scores=scores, shown=top)
        return _ok(out)  # scores are finite: score_grouped turns a non-finite one into its arm's ModelError

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

    def _exposure_row(self, request_id, unit, arm, version, score, status, latency, now, features, layout) -> dict:
        return {"request_id": request_id, "experiment": self.experiment, "unit_id": unit, "arm": arm, "model_version": version,
                "score": score, "status": status, "latency_ms": latency, "layout": layout, "ts": now, "features": features,
                "generation": self.generation}

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
            request_id, unit, start, fast = exposure[:4]
            layout = exposure[4] if len(exposure) > 4 else self.layout_json  # as assigned (predict passes it)
            scores, version = result
            top = _top(scores)
            try:
                features = _features_json(rows[top], fast) if self.log_features else None
            except (TypeError, ValueError, RecursionError) as exc:  # its own failure, not the batch's
                results = list(results)
                results[i] = EventStoreError(f"the exposure's features cannot be written as JSON: {exc!r}")
                continue
            events.append(("exposure", self._exposure_row(request_id, unit, arm, version, scores[top], "ok", (perf - start) * 1000,
                                                          now, features, layout)))
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

    async def _log(self, request_id, unit, arm, version, score, status, latency, layout, features=None) -> None:
        row = self._exposure_row(request_id, unit, arm, version, score, status, latency, time.time(), features, layout)
        # The answer waits for the commit: a 2xx means the event is committed (serve/event_writer.py).
        await self.writer.write(("exposure", row))

    @api.post("/feedback")
    async def feedback(self, request: Request):
        parsed = await self._parse(request, FeedbackBody)
        if isinstance(parsed, JSONResponse):
            return parsed
        body, _ = parsed
        try:
            known = await asyncio.to_thread(self.reader.exposure_exists, body.request_id)
        except Exception:  # the store is down: a bare 500 said nothing of retrying
            log.exception("looking up an exposure failed")
            return _problem(503, "the outcome could not be recorded; retry")
        if not known:
            return _problem(404, f"unknown request_id {body.request_id!r}")
        try:  # the insert says whether it stored the row: concurrent repeats cannot all see it absent first
            inserted = await self.writer.write(("outcome", {"request_id": body.request_id, "event": body.event, "value": body.value,
                                                            "ts": time.time()}))
        except Exception:
            log.exception("committing an outcome failed")
            return _problem(503, "the outcome could not be recorded; retry")
        return {"request_id": body.request_id, "event": body.event, "duplicate": not inserted}

    @api.post("/assign")
    async def assign(self, request: Request):
        """Which arm each unit is in under the live weights: a lookup, not an exposure (nothing is
        logged), for support questions ("what does user X see?") and for checking stickiness."""
        parsed = await self._parse(request, AssignBody)
        if isinstance(parsed, JSONResponse):
            return parsed
        body, _ = parsed
        config = self.config
        return {"arms": {str(u): config.layout.assign(self.salt, str(u)) for u in body.unit_ids}, "weights": config.weights,
                "champion": config.champion}

    @api.get("/experiment")
    async def experiment(self, request: Request):
        from ..ab_spec import ABSpec
        from .analysis import analyze, decided_champion, final_reasons

        if denied := self._denied(request):
            return denied
        spec = ABSpec.model_validate(self.spec_raw)
        frame = await asyncio.to_thread(self.reader.frame, self.experiment, spec.analysis.event, self.generation)
        config = self.config
        champion = decided_champion(list(config.weights), config.champion, config.final)  # as control.analysis_for
        result = await asyncio.to_thread(analyze, frame, spec, config.weights, champion)
        result.live_champion = config.champion if champion != config.champion else None
        if config.shadow:
            result.shadow_scores = await asyncio.to_thread(self.reader.shadow_summary, self.experiment, self.generation)
        if final := config.final:  # as control.analysis_for: the statistics after it no longer steer anything
            result.decision, result.reasons = final["decision"], final_reasons(final)
        if spec.drift.enabled:
            from .monitor import report_for

            result.drift = await asyncio.to_thread(report_for, self.writer_url, self.experiment, self.checkpoints, spec.drift)
        return {**result.to_dict(), "shadow": config.shadow, **({"config_refused": self.config_refused} if self.config_refused else {})}

    @api.get("/healthz")
    async def healthz(self, request: Request):
        if denied := self._denied(request):
            return denied
        config = self.config
        return {"ok": True, "experiment": self.experiment, "weights": config.weights, "champion": config.champion, "pid": os.getpid(),
                **({"shadow_counts": self.shadow_counts} if self.shadow_counts else {}),
                **({"config_refused": self.config_refused} if self.config_refused else {})}

    async def __del__(self):
        """Serve's ingress wrapper awaits it (a coroutine function) once the replica routes no
        more requests (a shutdown, Ctrl-C, a new generation's rolling update): the shadows in
        flight finish first (ShadowScoring.drain_shadows; a closed writer refused their rows),
        then the flusher and the writer close in a thread, off the loop."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        await self.drain_shadows()
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        for part in (getattr(self, "flusher", None), getattr(self, "writer", None), getattr(self, "models", None)):
            if part is not None:
                part.close()


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
