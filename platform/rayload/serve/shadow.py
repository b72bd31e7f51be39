"""Shadow mode of the A/B router (serve/app.py): the champion answers every request, and the
challengers score it after the champion's own call returned, in the background (in combined
mode outside the live batches, in a thread of their own: Models.score_alone), so the answer
and the champion's logged latency never wait for a challenger. Their scores (or a failure,
status error) go to `ab_shadow` when they come; at most `max_ongoing_requests` requests' shadows
are in flight per replica, and beyond that a request's shadows are skipped (counted), never
queued without bound. A shadow row is written after the answer: a killed replica can lose one
(serve/event_writer.py)."""

from __future__ import annotations

import asyncio
import logging
import time

DRAIN_S = 10.0  # how long a stopping replica waits for its shadows (within Serve's 20 s graceful shutdown)
log = logging.getLogger("rayload.serve.app")  # the router's log, where its shadows' warnings have always gone


class ShadowScoring:
    """Mixed into ABRouter, whose `order`, `writer`, `models` and `_score` it uses."""

    def _init_shadows(self, max_tasks: int) -> None:
        self.max_shadow_tasks = max_tasks
        self._shadow_tasks: set = set()  # in flight: held here, as the event loop keeps only weak references
        self.shadow_counts: dict[str, dict[str, int]] = {}  # this replica's: arm -> ok / error / skipped

    async def drain_shadows(self, timeout_s: float = DRAIN_S) -> None:
        """Wait for the shadows in flight (a stopping replica), at most `timeout_s`."""
        if self._shadow_tasks:
            await asyncio.wait(list(self._shadow_tasks), timeout=timeout_s)

    def _start_shadows(self, champion: str, request_id: str, rows: list[dict]) -> None:
        """The other arms score this request in the background, once the champion has answered."""
        arms = [a for a in self.order if a != champion]
        if len(self._shadow_tasks) >= self.max_shadow_tasks:  # shadows slower than traffic: drop, never queue without bound
            for arm in arms:
                self._count_shadow(arm, "skipped", None)
            return
        task = asyncio.ensure_future(self._score_shadows(arms, request_id, rows))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _score_shadows(self, arms: list[str], request_id: str, rows: list[dict]) -> None:
        results = await asyncio.gather(*(self._timed_score(arm, rows) for arm in arms))
        now, events = time.time(), []
        for arm, (result, latency) in zip(arms, results):
            if isinstance(result, BaseException):
                self._count_shadow(arm, "error", result)
                row = {"model_version": "error", "score": None, "status": "error"}
            else:
                self._count_shadow(arm, "ok", None)
                row = {"model_version": result[1], "score": max(result[0]), "status": "ok"}
            events.append(("shadow", {"request_id": request_id, "arm": arm, "latency_ms": latency, "ts": now, **row}))
        try:
            await self.writer.write(*events)
        except Exception:
            log.warning("the shadow scores of request %s could not be recorded", request_id, exc_info=True)

    async def _timed_score(self, arm: str, rows: list[dict]) -> tuple:
        start = time.perf_counter()
        try:  # combined mode: outside the live batches and off the event loop (Models.score_alone)
            result = await (self.models.score_alone(arm, rows) if self.models is not None else self._score(arm, rows))
        except Exception as exc:  # noqa: BLE001 - recorded as the shadow's error
            result = exc
        return result, (time.perf_counter() - start) * 1000

    def _count_shadow(self, arm: str, outcome: str, error: BaseException | None) -> None:
        """Count a shadow's outcome; a failure or a skip is logged as a warning at the 1st, 2nd,
        4th, 8th, ... of its kind per arm (a challenger failing every request does not flood the log)."""
        counts = self.shadow_counts.setdefault(arm, {"ok": 0, "error": 0, "skipped": 0})
        counts[outcome] += 1
        n = counts[outcome]
        if outcome != "ok" and n & (n - 1) == 0:
            what = f"failed: {error!r}" if outcome == "error" else f"skipped: {len(self._shadow_tasks)} requests' shadows in flight"
            log.warning("shadow arm %s %s (%d so far in this replica; the champion's answers are unaffected)", arm, what, n)
