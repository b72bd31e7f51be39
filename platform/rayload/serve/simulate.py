"""Traffic simulator: users send ranking requests to the live HTTP endpoint and click by a
ground truth the models never saw.

- synthetic-ctr: each request ranks `candidates` fresh generator rows (beyond any training
  rows); the shown item is clicked with the generator's true probability.
- movielens: replays held-out ratings. A request from a held-out user ranks that user's
  held-out rated movies; the top one is shown and clicked when its rating is >= 4.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import RayloadError

log = logging.getLogger(__name__)


@dataclass
class SimResult:
    requests: int
    ok: int
    clicks: int  # clicks the server acknowledged
    status: dict[int, int] = field(default_factory=dict)  # /predict answers by status code (-1: no answer)
    seconds: float = 0.0
    feedback: dict[int, int] = field(default_factory=dict)  # /feedback answers by status code, after retries
    units: int = 0  # the units (users) drawn from: a MovieLens world has as many as it has held-out users


FEEDBACK_TRIES = 4  # a click's /feedback is sent again on a 5xx or no answer, or the click would be lost


def request_rng(world_seed: int, seed: int, index: int) -> np.random.Generator:
    """The draws of one request (its candidates and its click), from the world's seed, the run's
    and the request's index: the same whatever order concurrent requests are answered in (one
    shared generator handed out draws by the servers' timing)."""
    return np.random.default_rng([world_seed, seed, index])


class SyntheticWorld:
    """Candidates from synthetic-ctr with their true click probabilities."""

    def __init__(self, params, candidates: int = 10, seed: int = 0, pool_rows: int = 20_000, drift_seed: int | None = None,
                 start: int | None = None):
        import dataclasses

        from ..data.synthetic import generate_table_with_truth

        self.k, self.seed, self.pool_rows = candidates, seed, pool_rows
        self.max_units = None  # any number of simulated users
        # Rows past the data set's end (`start`: past every arm's, world.world_for): fresh draws from
        # the same planted model (the row count does not change the model), so no training row is
        # ever shown. `drift_seed`: the same items, clicked by a changed ground truth (the world
        # the models were trained on is gone).
        self.start = start = params.rows if start is None else start  # the first generator row of the pool
        table, self.truth = generate_table_with_truth(dataclasses.replace(params, rows=start + pool_rows), start, start + pool_rows,
                                                      drift_seed)
        self.rows = table.drop(["label"]).to_pylist()

    def request(self, user: int, rng: np.random.Generator) -> tuple[list[dict], list[float]]:
        idx = rng.choice(self.pool_rows, self.k, replace=False)
        return [self.rows[i] for i in idx], [float(self.truth[i]) for i in idx]

    def click(self, truth: float, rng: np.random.Generator) -> bool:
        return bool(rng.random() < truth)


class MovieLensWorld:
    """Held-out users and their held-out ratings (the `test` split of the A/B's data)."""

    def __init__(self, rows: list[dict], features: list[str], label_column: str = "rating", threshold: float = 4.0, seed: int = 0,
                 max_candidates: int = 20):
        self.seed, self.threshold, self.label, self.features = seed, threshold, label_column, features
        by_user: dict = {}
        for r in rows:
            by_user.setdefault(r["userId"], []).append(r)
        users = [u for u, items in by_user.items() if len(items) >= 2]
        # a seeded order: a run with fewer units than users replays a sample of them, not the first in the file
        self.users = [users[i] for i in np.random.default_rng(seed).permutation(len(users))]
        self.by_user, self.max_candidates = by_user, max_candidates
        self.max_units = len(self.users)  # one unit is one held-out user: never two units for one user
        if not self.users:  # rng.integers(0, 0) failed with "high <= 0"
            raise RayloadError("the simulated MovieLens world has no user: none of the champion's held-out (test split) users has 2 "
                               "or more held-out ratings to rank; give the champion's job a test split (split.test > 0)")

    def unit_id(self, unit: int) -> str:
        """The unit the router assigns: the user's own id (an index into the seeded order stood for
        another user in a run with another seed, merging two people into one unit)."""
        return f"u{self.users[unit]}"

    def request(self, user: int, rng: np.random.Generator) -> tuple[list[dict], list[float]]:
        items = self.by_user[self.users[user]]
        if len(items) > self.max_candidates:
            items = [items[i] for i in rng.choice(len(items), self.max_candidates, replace=False)]
        truth = [1.0 if r[self.label] >= self.threshold else 0.0 for r in items]
        return [{k: r[k] for k in self.features} for r in items], truth

    def click(self, truth: float, rng: np.random.Generator) -> bool:
        return truth >= 1.0


async def _one(client, url: str, world, unit: int, rng: np.random.Generator, headers: dict, result: SimResult,
               event: str = "click") -> None:
    rows, truth = world.request(unit, rng)
    unit_id = world.unit_id(unit) if hasattr(world, "unit_id") else f"u{unit}"
    r = await client.post(f"{url}/predict", json={"unit_id": unit_id, "candidates": rows}, headers=headers)
    if r.status_code != 200:
        result.status[r.status_code] = result.status.get(r.status_code, 0) + 1
        return
    body = r.json()  # before counting the 200: an unreadable one was counted twice (200 and -1)
    shown = truth[body["shown"]]
    result.status[200] = result.status.get(200, 0) + 1
    result.ok += 1
    if world.click(shown, rng):
        code = await _feedback(client, url, body["request_id"], headers, event)
        result.feedback[code] = result.feedback.get(code, 0) + 1
        if 200 <= code < 300:
            result.clicks += 1


async def _feedback(client, url: str, request_id: str, headers: dict, event: str = "click") -> int:
    """A click's /feedback, sent again after a 5xx or no answer (feedback is idempotent by
    request_id): a lost click would read as a non-click in the analysis. The last status (-1:
    no answer). `event`: the outcome the experiment's analysis counts (analysis.event; clicks
    sent to a conversion experiment were accepted and never counted)."""
    code = -1
    for attempt in range(FEEDBACK_TRIES):
        try:
            code = (await client.post(f"{url}/feedback", json={"request_id": request_id, "event": event}, headers=headers)).status_code
        except Exception as exc:  # noqa: BLE001 - a timeout or refused connection: try again
            code = -1
            log.debug("feedback for %s failed: %r", request_id, exc)
        if 0 <= code < 500:
            return code
        await asyncio.sleep(0.05 * 2**attempt)
    log.warning("a click's feedback for %s was not recorded after %d tries (last status %s)", request_id, FEEDBACK_TRIES, code)
    return code


async def _drive(url: str | list[str], world, users: int, requests: int, concurrency: int, seed: int, api_key: str | None,
                 on_progress=None, event: str = "click") -> SimResult:
    import httpx

    if world.max_units is not None and users > world.max_units:
        log.info("simulating %d users, as many as the world holds (%d asked)", world.max_units, users)
        users = world.max_units
    rng = np.random.default_rng(seed)
    units = rng.integers(0, users, size=requests)
    result = SimResult(requests, 0, 0, units=users)
    headers = {"x-api-key": api_key} if api_key else {}
    start = time.perf_counter()
    queue: asyncio.Queue = asyncio.Queue()
    for i, u in enumerate(units):
        queue.put_nowait((i, int(u)))

    urls = [url] if isinstance(url, str) else list(url)  # several router replicas (direct ingress): spread the workers

    async def worker(client, url):
        while not queue.empty():
            index, unit = queue.get_nowait()
            try:
                await _one(client, url, world, unit, request_rng(world.seed, seed, index), headers, result, event)
            except Exception as exc:  # a refused connection counts as a failure, the run goes on
                result.status[-1] = result.status.get(-1, 0) + 1
                log.debug("request failed: %r", exc)
            if on_progress:
                on_progress(1)

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*[worker(client, urls[i % len(urls)]) for i in range(concurrency)])
    result.seconds = time.perf_counter() - start
    return result


def simulate(url: str | list[str], world, users: int, requests: int, concurrency: int = 8, seed: int = 0, api_key: str | None = None,
             on_progress=None, event: str = "click") -> SimResult:
    return asyncio.run(_drive(url, world, users, requests, concurrency, seed, api_key, on_progress, event))


@dataclass
class Outcome:
    requests: int
    status: dict[int, int]
    decision: str
    reasons: list[str]
    steps: list[dict] = field(default_factory=list)  # what the controller did after each chunk
    feedback: dict[int, int] = field(default_factory=dict)  # /feedback answers by status code


def _outcome_event(run_dir: str) -> str:
    """The outcome the experiment's analysis counts (analysis.event), which its simulated users post."""
    from . import control

    try:
        return control.parts(control.load_state(run_dir)[1]["config"])[0]["spec"]["analysis"]["event"]
    except (RayloadError, KeyError, TypeError):  # no readable run: its first analysis names that; clicks meanwhile
        return "click"


def simulate_and_decide(run_dir: str, url: str | list[str] | Callable[[], str | list[str]], world, users: int, requests: int,
                        concurrency: int = 8, seed: int = 0, api_key: str | None = None, auto: bool = True, chunks: int = 10,
                        on_chunk=None) -> Outcome:
    """Traffic in `chunks` slices; after each, the automatic controller looks once (ramp,
    promote, rollback). Stops at the first promote or rollback. `url`: the router's URL(s), or
    a function that gives them, asked before each slice (with direct ingress a router replica
    that Serve replaced answers at a new port: control.live_urls reads them again)."""
    from . import control

    event = _outcome_event(run_dir)
    done, status, feedback, steps = 0, {}, {}, []
    decision, reasons = "continue", []
    size = max(1, -(-requests // chunks))
    while done < requests:
        n = min(size, requests - done)
        out = simulate(url() if callable(url) else url, world, users, n, concurrency, seed + done, api_key, event=event)
        done += n
        for code, count in out.status.items():
            status[code] = status.get(code, 0) + count
        for code, count in out.feedback.items():
            feedback[code] = feedback.get(code, 0) + count
        if not out.ok:  # nothing reached a model: deciding on it would only read an empty experiment
            raise RayloadError(f"none of {n} simulated requests was answered with 200 (status counts {out.status}, -1: no answer)"
                               + ("; 401: the router wants its API key (serving.api_key_env)" if 401 in out.status else ""))
        if auto:
            decision, reasons = control.step(run_dir)
            steps.append({"requests": done, "decision": decision, "reasons": reasons})
        if on_chunk:
            on_chunk(done, status)
        if decision != "continue":
            break
    if not auto:
        result = control.analysis_for(run_dir)
        decision, reasons = result.decision, result.reasons
    return Outcome(done, status, decision, reasons, steps, feedback)
