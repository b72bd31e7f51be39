"""The always-valid sequential test (mSPRT) that decides: the compared rows in time order, the
grid of looks fixed in advance, and the looks taken so far (serve/analysis.py reports them).

A look is final when first taken. Its rows are the first r in time order (the grid fixes r),
and it is taken only once every one of them is older than the attribution window: by then
their outcomes are in, so every later analysis takes it again on the same rows and outcomes
and the always-valid p-value (the running minimum of 1/Lambda over the looks) only falls as
data arrives. Looks that a late outcome could still change would be extra looks that Ville's
bound does not cover: with clicks arriving a mean of 6,000 exposures after theirs, an A/A
test checked every 200 exposures was "significant" in 7% of runs at alpha 5%."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from . import stats

# The first look after 100 compared rows, then one each time the rows grow by 5% (look_rows).
LOOK_FIRST, LOOK_GROWTH = 100, 1.05


@dataclass(frozen=True)
class Pairs:
    """The compared arms' ok rows in time order, each coded by its (unit, weight period, arm)
    cell member: what stats.stratified compares. The period is the row's `layout` (the weights
    in force when it was served)."""

    row_pair: np.ndarray  # per row: its pair, numbered in order of first appearance
    clicked: np.ndarray  # per row
    unit: np.ndarray  # per pair: unit code
    period: np.ndarray  # per pair: period code
    treated: np.ndarray  # per pair: challenger?
    ts: np.ndarray  # per row, ascending

    @classmethod
    def of(cls, ok, champion: str, challenger: str) -> "Pairs":
        rows = ok[ok["arm"].isin([champion, challenger])]
        order = np.argsort(rows["ts"].to_numpy(), kind="stable")
        unit = pd.factorize(rows["unit_id"].to_numpy()[order])[0].astype(np.int64)
        period, layouts = pd.factorize(rows["layout"].to_numpy()[order])
        treated = rows["arm"].to_numpy()[order] == challenger
        row_pair, keys = pd.factorize((unit * max(len(layouts), 1) + period) * 2 + treated)
        keys = keys.astype(np.int64)
        return cls(row_pair, rows["clicked"].to_numpy(dtype=float)[order], keys // 2 // max(len(layouts), 1),
                   keys // 2 % max(len(layouts), 1), keys % 2 == 1, rows["ts"].to_numpy()[order])

    def estimate(self) -> "stats.Estimate | None":
        """The stratified estimate from all the rows."""
        return next(self.at_looks([len(self.row_pair)]), None)

    def closed(self, before: float | None) -> int:
        """How many rows (the first ones) were served at or before `before`; all with None."""
        return len(self.ts) if before is None else int(np.searchsorted(self.ts, before, side="right"))

    def at_looks(self, rows):
        """The stratified estimate from the first r rows, for each r of the ascending `rows`
        (None where no period has 2 units in each arm yet), adding the rows look by look."""
        seen = np.maximum.accumulate(self.row_pair) + 1 if len(self.row_pair) else self.row_pair
        x, y, start = np.zeros(0), np.zeros(0), 0
        for end in rows:
            if end == 0:
                yield None
                continue
            m = int(seen[end - 1])
            x, y = np.pad(x, (0, m - len(x))), np.pad(y, (0, m - len(y)))
            x += np.bincount(self.row_pair[start:end], weights=self.clicked[start:end], minlength=m)
            y += np.bincount(self.row_pair[start:end], minlength=m)
            start = end
            yield stats.stratified(self.unit[:m], self.period[:m], self.treated[:m], x, y)


def look_rows(total: int) -> np.ndarray:
    """The row counts (of `total` so far) the sequential test looks at: LOOK_FIRST, then x
    LOOK_GROWTH each time. Only grows as rows arrive: an analysis repeats every earlier
    analysis's looks (on the same rows, as long as rows arrive in time order) and adds the
    ones the new rows reach. The newest rows wait for the next look: at most 5% more data.
    47 looks per tenfold growth; their sizes add up to ~21x all the rows (a geometric sum), so
    the whole test costs about 21 estimates on all the data, however long it runs."""
    if total < LOOK_FIRST:
        return np.zeros(0, int)
    last = int(math.floor(math.log(total / LOOK_FIRST) / math.log(LOOK_GROWTH))) + 1
    looks = np.unique(np.ceil(LOOK_FIRST * LOOK_GROWTH ** np.arange(last + 1)).astype(int))
    return looks[looks <= total]


def sequential_looks(pairs: Pairs, tau: float, closed_before: float | None = None) -> list[tuple[int, float, float]]:
    """(rows, Lambda, difference) at each look taken: the grid's looks over the rows served at
    or before `closed_before` (now minus the attribution window; None: all rows).

    Lambda uses the larger of the arms' own variance and the one under "no difference" (pooled
    as the two-proportion test pools it): with its own, an arm whose first units happen not to
    click has none and proves a loss at once; the pooled one understates the variance of a rare
    event's arm that happens to click more."""
    rows = look_rows(pairs.closed(closed_before))
    return [(int(r), stats.msprt_lambda(est.diff, max(est.var, est.null_var), tau), est.diff)
            for r, est in zip(rows, pairs.at_looks(rows)) if est is not None]


@dataclass(frozen=True)
class Sequential:
    p: float  # always valid: the minimum of 1/Lambda over the looks taken
    # The sign of the difference at every look where Lambda reached 1/alpha: +1 or -1, 0 when
    # looks crossed on both sides, None when none crossed. A decision must go that way: the
    # running minimum keeps an early crossing's evidence, not its direction.
    direction: int | None


def sequential(pairs: Pairs, tau: float, alpha: float, closed_before: float | None = None) -> Sequential:
    looks = sequential_looks(pairs, tau, closed_before)
    signs = {1 if diff > 0 else -1 for _, lam, diff in looks if lam >= 1 / alpha and diff != 0}
    direction = None if not signs else signs.pop() if len(signs) == 1 else 0
    return Sequential(stats.always_valid_p([lam for _, lam, _ in looks]), direction)


def sequential_p(ok, champion: str, challenger: str, tau: float, closed_before: float | None = None) -> float:
    """Always-valid p-value: the mSPRT on the stratified difference at each look of look_rows
    (rows in time order, those served at or before `closed_before`), running minimum of 1/Lambda."""
    return _sequential_p(Pairs.of(ok, champion, challenger), tau, closed_before)


def _sequential_p(pairs: Pairs, tau: float, closed_before: float | None = None) -> float:
    return stats.always_valid_p([lam for _, lam, _ in sequential_looks(pairs, tau, closed_before)])
