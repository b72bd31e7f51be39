"""Batch scoring for the A/B app: every arm's model scored in Serve dynamic batches, inside the
router replica (`Models`, combined mode) or in one deployment per arm (`ModelDeployment`,
separate mode), both through `score_grouped`; and the drift flusher each replica runs."""

import logging

import numpy as np
from ray import serve

from ..errors import DataError

log = logging.getLogger(__name__)


class ModelError(RuntimeError):
    """An arm's model failed on a request (it raised, or gave a score that is not a finite
    number): that request answers 500 and counts as the arm's error; other arms' requests in
    the same batch are answered as usual."""


class Models:
    """Every arm's model in this replica, scored in dynamic batches (combined mode).

    `log`, when the router sets it, turns a scored batch's results into its exposures and
    commits them before any of the batch's callers resumes (one commit per batch, in this
    thread unless the database is locked: see EventWriter.write_now)."""

    def __init__(self, checkpoints: dict[str, str], drift: bool = False, torchscript: bool = True):
        from .scorer import Scorer

        self.scorers = {arm: Scorer.load(arm, path, drift, torchscript) for arm, path in checkpoints.items()}
        self.log = None
        self._alone = None  # the shadows' thread (score_alone), made at the first shadow

    def close(self) -> None:
        if self._alone is not None:
            self._alone.shutdown(wait=False, cancel_futures=True)

    async def score_alone(self, arm: str, rows: list[dict]) -> tuple[list[float], str]:
        """One request scored outside the live batches, in a thread of its own (serve/shadow.py):
        a shadow challenger's call that shared a batch with live requests held up their answers,
        and, run on the event loop, every request that arrived while it scored. One thread per
        replica: the shadows (bounded in number) score one after another."""
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        if self._alone is None:
            self._alone = ThreadPoolExecutor(1, thread_name_prefix="rayload-shadow")
        [result] = await asyncio.get_running_loop().run_in_executor(self._alone, score_grouped, self.scorers, [(arm, rows)])
        if isinstance(result, Exception):
            raise result
        return result

    async def score(self, arm: str, rows: list[dict], exposure: tuple | None = None) -> tuple[list[float], str]:
        return await self._batched((arm, rows, exposure))

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
    async def _batched(self, items: list[tuple[str, list[dict], tuple | None]]) -> list:
        out = score_grouped(self.scorers, [(arm, rows) for arm, rows, _ in items])
        return out if self.log is None else await self.log(items, out)


def score_grouped(scorers: dict, items: list[tuple[str, list[dict]]]) -> list:
    """Score a batch of requests with one model call per arm; a request with bad rows gets its
    own DataError back, the others their scores. An arm whose model fails (raises, or scores a
    row NaN or infinite) fails only its own requests, with a ModelError: one challenger's crash
    must not fail the champion's answers batched beside it.

    Arms whose models share a features.json (the usual A/B: two models trained on the same
    prepared data) share one transform of all their rows: the transform's fixed cost per call
    is most of a small batch's cost, and the A/B split would otherwise pay it once per arm."""
    out: list = [None] * len(items)
    by_arm: dict[str, list[int]] = {}
    for i, (arm, _) in enumerate(items):
        by_arm.setdefault(arm, []).append(i)
    groups: dict = {}  # transform key (or the scorer's id when it has none) -> arms
    for arm in by_arm:
        groups.setdefault(scorers[arm].transform_key or id(scorers[arm]), []).append(arm)
    for arms in groups.values():
        rows = {arm: [r for i in by_arm[arm] for r in items[i][1]] for arm in arms}
        try:
            table = scorers[arms[0]].features.transform_rows([r for arm in arms for r in rows[arm]])
        except Exception:  # a DataError (or a transform bug) on some request: find it, score the rest
            for arm in arms:
                _score_one_by_one(scorers[arm], items, by_arm[arm], out)
            continue
        offset = 0
        for arm in arms:
            scorer, n = scorers[arm], len(rows[arm])
            part, offset = table.slice(offset, n), offset + n
            try:
                scores = scorer.score_table(part, rows[arm], [len(items[i][1]) for i in by_arm[arm]])
            except DataError:
                _score_one_by_one(scorer, items, by_arm[arm], out)
                continue
            except Exception as exc:
                log.error("the model of arm %s failed on a batch of %d requests: %r", arm, len(by_arm[arm]), exc)
                error = ModelError(f"the model of arm {arm} failed")
                for i in by_arm[arm]:
                    out[i] = error
                continue
            finite = bool(np.isfinite(scores).all())  # one check per arm and batch; per request only when one failed
            pos = 0
            for i in by_arm[arm]:
                k = len(items[i][1])
                out[i] = (scores[pos:pos + k].tolist(), scorer.version) if finite else \
                    _finite_or_error(scorer, scores[pos:pos + k])
                pos += k
    return out


def _finite_or_error(scorer, scores: np.ndarray):
    """A score that is not a finite number is the model's failure (a 500): inputs beyond what
    any model was trained on are refused before it, by `transform_rows` (a 422)."""
    if np.isfinite(scores).all():
        return scores.tolist(), scorer.version
    bad = scores[~np.isfinite(scores)][0]
    log.error("the model of arm %s scored a row %s", scorer.arm, bad)
    return ModelError(f"the model of arm {scorer.arm} scored a row {bad} (not a finite number)")


def _score_one_by_one(scorer, items: list, idx: list[int], out: list) -> None:
    for i in idx:
        try:
            rows = items[i][1]
            table = scorer.features.transform_rows(rows)
            out[i] = _finite_or_error(scorer, scorer.score_table(table, rows, [len(rows)]))
        except DataError as exc:
            out[i] = exc
        except Exception as exc:
            log.error("the model of arm %s failed on a request: %r", scorer.arm, exc)
            out[i] = ModelError(f"the model of arm {scorer.arm} failed")


@serve.deployment
class ModelDeployment:
    """One arm's model (separate mode), batched the same way."""

    def __init__(self, arm: str, checkpoint: str, max_batch_size: int = 32, batch_wait_ms: float = 2.0, monitor: dict | None = None,
                 torchscript: bool = True):
        from .scorer import Scorer

        self.scorers = {arm: Scorer.load(arm, checkpoint, drift=monitor is not None, torchscript=torchscript)}
        self._batched.set_max_batch_size(max_batch_size)
        self._batched.set_batch_wait_timeout_s(batch_wait_ms / 1000.0)
        self.flusher = drift_flusher(monitor, self.scorers)

    async def score(self, arm: str, rows: list[dict]):
        result = await self._batched((arm, rows))
        if isinstance(result, Exception):  # DataError (the router answers 422) or ModelError (500)
            raise result
        return result

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
    async def _batched(self, items):
        return score_grouped(self.scorers, items)

    def feature_names(self) -> list[str]:
        return sorted(next(iter(self.scorers.values())).feature_names)

    def __del__(self):
        if getattr(self, "flusher", None) is not None:
            self.flusher.close()


def monitor_args(args: dict) -> dict | None:
    """What a replica needs to write drift counts, or None when drift monitoring is off."""
    from ..ab_spec import Drift

    cfg = Drift.model_validate(args["spec"].get("drift") or {})  # the spec's defaults, not copies of them
    if not cfg.enabled:
        return None
    return {"url": args["events_url"], "experiment": args["experiment"],
            "cfg": cfg.model_dump(include={"threshold", "min_rows", "flush_s", "window_s"})}


def drift_flusher(monitor: dict | None, scorers: dict):
    if monitor is None:
        return None
    from .monitor import DriftFlusher

    return DriftFlusher(monitor["url"], monitor["experiment"], scorers, monitor["cfg"])
