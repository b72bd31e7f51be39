"""Guardrails: an arm's clear breaches of the error-rate and p99-latency limits, and whether a
breaching challenger is worse than the champion on the same requests (a rollback is final, so
a breach both arms share, an incident, must not cause one)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..ab_spec import Guardrails
from . import stats


def breaches(errors: int, requests: int, recent: np.ndarray, g: Guardrails) -> dict[str, str]:
    """An arm's clear guardrail breaches by kind ("errors", "latency"), each with its reason.
    Each must be statistically clear under continuous looking, not a point estimate over its
    limit:

    - errors: over the arm's whole history (`requests` with `errors` not ok), the anytime-valid
      test of "error rate <= max_error_rate" rejects at g.alpha (stats.rate_above_p): the rate's
      anytime-valid lower confidence bound is above the limit. However often it is looked at,
      an arm just at the limit is reported with probability at most g.alpha.
    - latency: over the arm's last g.latency_window requests (`recent`, any status), p99 above
      max_p99_ms means more than 1% of them slower than it; the same test on that share against
      1%. A window sees a late regression that a whole history dilutes, and a few slow warm-up
      requests age out. A window is a fresh sample every latency_window requests, so the k-th
      (k = requests / latency_window, rounded up) is tested at g.alpha * 6 / (pi^2 k^2): these
      sum to g.alpha, which keeps the chance of a false breach over the whole experiment near
      g.alpha; a later window asks for a little more evidence (log(1/level) grows as 2 log k).

    Neither is judged before the arm (and its window) has g.min_requests requests."""
    out = {}
    if requests >= g.min_requests:
        p = stats.rate_above_p(errors, requests, g.max_error_rate)
        if p <= g.alpha:
            out["errors"] = (f"error rate {errors / requests:.3%} over {requests} requests is clearly above {g.max_error_rate:.3%} "
                             f"(anytime-valid p={p:.2g} <= {g.alpha})")
    if len(recent) >= g.min_requests:
        slow = int((recent > g.max_p99_ms).sum())
        p = stats.rate_above_p(slow, len(recent), 0.01)
        level = g.alpha * 6 / (math.pi**2 * math.ceil(max(requests, len(recent)) / g.latency_window) ** 2)
        if p <= level:
            out["latency"] = (f"p99 latency {stats.p99(recent):.1f} ms > {g.max_p99_ms:.1f} ms over the last {len(recent)} requests: "
                              f"{slow / len(recent):.1%} of them slower, clearly more than 1% (p={p:.2g} <= {level:.2g})")
    return out


def guardrail_breaches(errors: int, requests: int, recent: np.ndarray, g: Guardrails) -> list[str]:
    """The reasons of `breaches`."""
    return list(breaches(errors, requests, recent, g).values())


def recent_rows(rows, window: int):
    """An arm's last `window` requests (any status), in time order."""
    order = np.argsort(rows["ts"].to_numpy(), kind="stable")
    return rows.iloc[order[-window:]]


def versus_champion(frame, champion: str, challenger: str, breached: dict[str, str], champion_breached: dict[str, str],
                    g: Guardrails) -> dict[str, dict]:
    """Per guardrail the challenger breaches: its reason, whether the champion breaches it too,
    and p, the anytime-valid p-value that the challenger fails more often than the champion on
    the same requests (stats.failures_above_p); None when the champion has fewer than
    g.min_requests of them (nothing to compare with: the breach alone decides).

    The same requests: for errors both arms' whole history, as the breach is judged; for
    latency every request of the two arms since the first of the challenger's window (the
    champion's own window, at a larger share, covers a shorter and later time). Rolling back
    needs the breach AND p <= g.alpha, so a challenger no worse than the champion is rolled back
    with probability at most g.alpha, whatever the platform does to both."""
    both = frame[frame["arm"].isin([champion, challenger])]
    out = {}
    for kind, reason in breached.items():
        rows = both
        if kind == "latency" and len(both):
            rows = both[both["ts"] >= recent_rows(both[both["arm"] == challenger], g.latency_window)["ts"].min()]
        failed = (rows["status"] != "ok") if kind == "errors" else (rows["latency_ms"] > g.max_p99_ms)
        out[kind] = {"reason": reason, "champion_breaches": kind in champion_breached,
                     "p": _worse_p(rows, failed.to_numpy(dtype=bool), challenger, g)}
    return out


def _worse_p(rows, failed: np.ndarray, challenger: str, g: Guardrails) -> float | None:
    is_challenger = rows["arm"].to_numpy() == challenger
    if int((~is_challenger).sum()) < g.min_requests:
        return None
    period = pd.factorize(rows["layout"].to_numpy())[0]
    share = np.bincount(period, weights=is_challenger) / np.bincount(period)
    return stats.failures_above_p(is_challenger[failed], share[period[failed]])
