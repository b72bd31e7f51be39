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

log = logging.getLogger(__name__)


@dataclass
class SimResult:
    requests: int
    ok: int
    clicks: int
    status: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0


class SyntheticWorld:
    """Candidates from synthetic-ctr with their true click probabilities."""

    def __init__(self, params, candidates: int = 10, seed: int = 0, pool_rows: int = 20_000, drift_seed: int | None = None):
        import dataclasses

        from ..data.synthetic import generate_table_with_truth

        self.k, self.rng, self.pool_rows = candidates, np.random.default_rng(seed), pool_rows
        # Rows past the data set's end: fresh draws from the same planted model (the row count
        # does not change the model), so no training row is ever shown. `drift_seed`: the same
        # items, clicked by a changed ground truth (the world the models were trained on is gone).
        start = params.rows
        table, self.truth = generate_table_with_truth(dataclasses.replace(params, rows=start + pool_rows), start, start + pool_rows,
                                                      drift_seed)
        self.rows = table.drop(["label"]).to_pylist()

    def request(self, user: int) -> tuple[list[dict], list[float]]:
        idx = self.rng.choice(self.pool_rows, self.k, replace=False)
        return [self.rows[i] for i in idx], [float(self.truth[i]) for i in idx]

    def click(self, truth: float) -> bool:
        return bool(self.rng.random() < truth)


class MovieLensWorld:
    """Held-out users and their held-out ratings (the `test` split of the A/B's data)."""

    def __init__(self, rows: list[dict], features: list[str], label_column: str = "rating", threshold: float = 4.0, seed: int = 0,
                 max_candidates: int = 20):
        self.rng, self.threshold, self.label, self.features = np.random.default_rng(seed), threshold, label_column, features
        by_user: dict = {}
        for r in rows:
            by_user.setdefault(r["userId"], []).append(r)
        self.users = [u for u, items in by_user.items() if len(items) >= 2]
        self.by_user, self.max_candidates = by_user, max_candidates

    def request(self, user: int) -> tuple[list[dict], list[float]]:
        items = self.by_user[self.users[user % len(self.users)]]
        if len(items) > self.max_candidates:
            items = [items[i] for i in self.rng.choice(len(items), self.max_candidates, replace=False)]
        truth = [1.0 if r[self.label] >= self.threshold else 0.0 for r in items]
        return [{k: r[k] for k in self.features} for r in items], truth

    def click(self, truth: float) -> bool:
        return truth >= 1.0


async def _one(client, url: str, world, unit: int, headers: dict, result: SimResult) -> None:
    rows, truth = world.request(unit)
    unit_id = f"u{unit}"
    r = await client.post(f"{url}/predict", json={"unit_id": unit_id, "candidates": rows}, headers=headers)
    result.status[r.status_code] = result.status.get(r.status_code, 0) + 1
    if r.status_code != 200:
        return
    body = r.json()
    result.ok += 1
    if world.click(truth[body["shown"]]):
        result.clicks += 1
        fb = await client.post(f"{url}/feedback", json={"request_id": body["request_id"], "event": "click"}, headers=headers)
        result.status[fb.status_code] = result.status.get(fb.status_code, 0) + 1


async def _drive(url: str | list[str], world, users: int, requests: int, concurrency: int, seed: int, api_key: str | None,
                 on_progress=None) -> SimResult:
    import httpx

    rng = np.random.default_rng(seed)
    units = rng.integers(0, users, size=requests)
    result = SimResult(requests, 0, 0)
    headers = {"x-api-key": api_key} if api_key else {}
    start = time.perf_counter()
    queue: asyncio.Queue = asyncio.Queue()
    for u in units:
        queue.put_nowait(int(u))

    urls = [url] if isinstance(url, str) else list(url)  # several router replicas (direct ingress): spread the workers

    async def worker(client, url):
        while not queue.empty():
            unit = queue.get_nowait()
            try:
                await _one(client, url, world, unit, headers, result)
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
             on_progress=None) -> SimResult:
    return asyncio.run(_drive(url, world, users, requests, concurrency, seed, api_key, on_progress))


@dataclass
class Outcome:
    requests: int
    status: dict[int, int]
    decision: str
    reasons: list[str]
    steps: list[dict] = field(default_factory=list)  # what the controller did after each chunk


def simulate_and_decide(run_dir: str, url: str | list[str] | Callable[[], str | list[str]], world, users: int, requests: int,
                        concurrency: int = 8, seed: int = 0, api_key: str | None = None, auto: bool = True, chunks: int = 10,
                        on_chunk=None) -> Outcome:
    """Traffic in `chunks` slices; after each, the automatic controller looks once (ramp,
    promote, rollback). Stops at the first promote or rollback. `url`: the router's URL(s), or
    a function that gives them, asked before each slice (with direct ingress a router replica
    that Serve replaced answers at a new port: control.live_urls reads them again)."""
    from . import control

    done, status, steps = 0, {}, []
    decision, reasons = "continue", []
    size = max(1, -(-requests // chunks))
    while done < requests:
        n = min(size, requests - done)
        out = simulate(url() if callable(url) else url, world, users, n, concurrency, seed + done, api_key)
        done += n
        for code, count in out.status.items():
            status[code] = status.get(code, 0) + count
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
    return Outcome(done, status, decision, reasons, steps)
