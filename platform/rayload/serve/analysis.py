"""The live analysis of an experiment (`GET /experiment`, `rayload ab status`) and the
decision it supports: promote, rollback or continue."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from ..ab_spec import ABSpec, Guardrails
from . import stats

# The sequential test looks after the first 100 compared rows, then each time the rows grow by
# 5% (look_rows): a grid fixed in advance, so a look once taken is taken again, on the same rows,
# by every later analysis, and the always-valid p-value can only fall as data arrives.
LOOK_FIRST, LOOK_GROWTH = 100, 1.05


@dataclass
class ArmReport:
    """One arm's descriptive figures, pooled over its whole history: units (distinct units with
    an ok exposure in this arm; a unit a ramp step moved from the champion counts in both
    arms), exposures, clicks, and the CTR with its interval. Pooled figures mix weight periods,
    so the comparison (Analysis.diff, lift, the tests) does not use them: it compares the arms
    within each period (stats.stratified). Guardrails: error_rate over all the arm's requests,
    p99_ms over its last guardrails.latency_window; a breach is reported only when it is clear
    (guardrail_breaches)."""

    arm: str
    units: int
    exposures: int
    clicks: int
    ctr: float
    ctr_ci: tuple[float, float]
    requests: int
    error_rate: float
    p99_ms: float
    guardrail_ok: bool
    guardrail_reasons: list[str] = field(default_factory=list)


@dataclass
class Analysis:
    experiment: str
    champion: str
    challenger: str | None
    weights: dict[str, float]
    arms: list[ArmReport]
    diff: float | None = None
    diff_ci: tuple[float, float] | None = None
    lift: float | None = None  # None where the champion's CTR is 0 (no relative change is defined)
    lift_ci: tuple[float, float] | None = None
    z_p_value: float | None = None
    sequential_p: float | None = None
    sequential_significant: bool = False
    compared_units: dict[str, int] = field(default_factory=dict)  # per arm: units in the periods the comparison uses
    srm_p: float = 1.0
    srm_flagged: bool = False
    valid: bool = True
    # Power. The decisions are the mSPRT's: sequential_units_needed is about how many more units
    # it needs to have detected an effect of analysis.mde with analysis.power (conservative:
    # stats.msprt_sample_size), sequential_mde_now the effect it would detect so with the units
    # so far. units_needed and mde_now are the same for a fixed-horizon z-test looked at once,
    # which needs fewer units but is not what decides. All as if every unit came at today's split.
    units_needed: int | None = None
    mde_now: float | None = None
    sequential_units_needed: int | None = None
    sequential_mde_now: float | None = None
    decision: str = "continue"
    reasons: list[str] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    drift: list[dict] = field(default_factory=list)  # per arm and feature (serve/monitor.py); filled by the caller
    # Shadow mode: per shadow arm, requests it scored and how many failed (EventReader.shadow_summary); filled by the caller
    shadow_scores: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(_finite(asdict(self)), default=str, allow_nan=False))


def _finite(value):
    """JSON-able copy: NaN and infinities become None (JSON has neither), numpy scalars plain numbers."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def unit_sums(frame) -> "stats.ArmSums":
    per_unit = frame.groupby("unit_id").agg(clicks=("clicked", "sum"), exposures=("clicked", "size"))
    return stats.ArmSums.from_units(per_unit["clicks"].to_numpy(), per_unit["exposures"].to_numpy())


def analyze(frame, spec: ABSpec, weights: dict[str, float] | None = None, champion: str | None = None) -> Analysis:
    """`frame`: EventReader.frame(...) rows. Weights and champion: those in force now."""
    weights = weights or spec.weights
    champion = champion or spec.champion_arm
    challengers = [a.name for a in spec.arms if a.name != champion]
    challenger = challengers[0] if len(challengers) == 1 else None
    frame = frame.assign(clicked=(frame["outcome"] > 0).astype(float)) if len(frame) else frame.assign(clicked=[])
    ok = frame[frame["status"] == "ok"] if len(frame) else frame
    result = Analysis(spec.name, champion, challenger, dict(weights), [_arm_report(frame, ok, a.name, spec) for a in spec.arms])
    result.srm_p = stats.srm_p_value(_periods(ok))
    result.srm_flagged = result.srm_p < spec.analysis.srm_p
    result.valid = not result.srm_flagged
    if challenger is not None and len(ok):
        _compare(result, ok, champion, challenger, spec)
    result.timeline = timeline(ok, [a.name for a in spec.arms], spec.analysis.alpha)
    result.decision, result.reasons = decide(result, spec)
    return result


def _arm_report(frame, ok, arm: str, spec: ABSpec) -> ArmReport:
    rows, good = frame[frame["arm"] == arm], ok[ok["arm"] == arm]
    sums = unit_sums(good) if len(good) else stats.ArmSums(0, 0, 0, 0, 0, 0)
    requests, errors = len(rows), int((rows["status"] != "ok").sum())
    order = np.argsort(rows["ts"].to_numpy(), kind="stable")
    recent = rows["latency_ms"].to_numpy(dtype=float)[order][-spec.guardrails.latency_window:]
    reasons = guardrail_breaches(errors, requests, recent, spec.guardrails)
    return ArmReport(arm, sums.n, int(sums.y), int(sums.x), sums.ctr, stats.ctr_interval(sums, spec.analysis.alpha), requests,
                     errors / requests if requests else 0.0, stats.p99(recent), not reasons, reasons)


def guardrail_breaches(errors: int, requests: int, recent: np.ndarray, g: Guardrails) -> list[str]:
    """An arm's clear guardrail breaches (a challenger's roll it back, final), so each must be
    statistically clear under continuous looking, not a point estimate over its limit:

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
    reasons = []
    if requests >= g.min_requests:
        p = stats.rate_above_p(errors, requests, g.max_error_rate)
        if p <= g.alpha:
            reasons.append(f"error rate {errors / requests:.3%} over {requests} requests is clearly above {g.max_error_rate:.3%} "
                           f"(anytime-valid p={p:.2g} <= {g.alpha})")
    if len(recent) >= g.min_requests:
        slow = int((recent > g.max_p99_ms).sum())
        p = stats.rate_above_p(slow, len(recent), 0.01)
        level = g.alpha * 6 / (math.pi**2 * math.ceil(max(requests, len(recent)) / g.latency_window) ** 2)
        if p <= level:
            reasons.append(f"p99 latency {stats.p99(recent):.1f} ms > {g.max_p99_ms:.1f} ms over the last {len(recent)} requests: "
                           f"{slow / len(recent):.1%} of them slower, clearly more than 1% (p={p:.2g} <= {level:.2g})")
    return reasons


def _periods(ok) -> list[tuple[dict[str, int], dict[str, float]]]:
    """Units by the weights in force when each unit was first exposed."""
    if not len(ok):
        return []
    first = ok.sort_values("ts").drop_duplicates("unit_id")
    return [(group.groupby("arm").size().to_dict(), json.loads(layout)) for layout, group in first.groupby("layout")]


def _compare(result: Analysis, ok, champion: str, challenger: str, spec: ABSpec) -> None:
    """Difference, lift and tests from the arms compared within each weight period."""
    a = spec.analysis
    pairs = Pairs.of(ok, champion, challenger)
    est = pairs.estimate()
    if est is None:
        result.compared_units = {champion: 0, challenger: 0}
        return
    result.compared_units = {champion: est.units[0], challenger: est.units[1]}
    cmp = stats.comparison(est, a.alpha)
    result.diff, result.diff_ci, result.lift, result.lift_ci, result.z_p_value = cmp.diff, cmp.diff_ci, cmp.lift, cmp.lift_ci, cmp.p_value
    result.sequential_p = _sequential_p(pairs, a.tau)
    result.sequential_significant = result.sequential_p <= a.alpha
    _power(result, unit_sums(ok[ok["arm"] == champion]), unit_sums(ok[ok["arm"] == challenger]), a)


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


def _power(result: Analysis, control: "stats.ArmSums", treatment: "stats.ArmSums", a) -> None:
    """Units needed and the effect detectable now, for the mSPRT that decides and for a
    fixed-horizon z-test, from the observed per-unit variances (CTR is a ratio over units: ten
    exposures of one user are worth less than ten users). n/a (None) while the challenger's
    share is 0 or 1."""
    share = result.weights.get(result.challenger, 0.0)
    base = control.ctr if math.isfinite(control.ctr) and 0 < control.ctr < 1 else 0.5
    unit_var = (control.unit_variance(base), treatment.unit_variance(base))
    n = sum(result.compared_units.values())
    needed = stats.sample_size(base, a.mde, a.alpha, a.power, share, unit_var)
    result.units_needed = None if needed is None else max(0, needed - n)
    result.mde_now = stats.minimum_detectable_effect(n, base, a.alpha, a.power, share, unit_var)
    needed = stats.msprt_sample_size(base, a.mde, a.alpha, a.power, share, unit_var, a.tau)
    result.sequential_units_needed = None if needed is None else max(0, needed - n)
    result.sequential_mde_now = stats.msprt_mde(n, base, a.alpha, a.power, share, unit_var, a.tau)


def sequential_p(ok, champion: str, challenger: str, tau: float) -> float:
    """Always-valid p-value: the mSPRT on the stratified difference at each look of look_rows
    (rows in time order), running minimum of 1/Lambda."""
    return _sequential_p(Pairs.of(ok, champion, challenger), tau)


def look_rows(total: int) -> np.ndarray:
    """The row counts (of `total` so far) the sequential test looks at: LOOK_FIRST, then x
    LOOK_GROWTH each time. Only grows as rows arrive: an analysis repeats every earlier
    analysis's looks (on the same rows, as long as rows arrive in time order and outcomes are
    known; an outcome that arrives later changes the look its exposure is in), and adds the
    ones the new rows reach. The newest rows wait for the next look: at most 5% more data.
    47 looks per tenfold growth; their sizes add up to ~21x all the rows (a geometric sum), so
    the whole test costs about 21 estimates on all the data, however long it runs."""
    if total < LOOK_FIRST:
        return np.zeros(0, int)
    last = int(math.floor(math.log(total / LOOK_FIRST) / math.log(LOOK_GROWTH))) + 1
    looks = np.unique(np.ceil(LOOK_FIRST * LOOK_GROWTH ** np.arange(last + 1)).astype(int))
    return looks[looks <= total]


def _sequential_p(pairs: Pairs, tau: float) -> float:
    # The larger of the arms' own variance and the one under "no difference" (pooled as the
    # two-proportion test pools it): with its own, an arm whose first units happen not to click
    # has none and proves a loss at once; the pooled one understates the variance of a rare
    # event's arm that happens to click more.
    looks = pairs.at_looks(look_rows(len(pairs.ts)))
    lambdas = [stats.msprt_lambda(est.diff, max(est.var, est.null_var), tau) for est in looks if est is not None]
    return stats.always_valid_p(lambdas)


def cumulative_unit_sums(frame, times) -> list["stats.ArmSums"]:
    """unit_sums of the rows with ts <= t, for each t of the ascending `times`, in one pass:
    per-unit counters grow look by look instead of a group-by over all rows at every look
    (that was half of a live experiment's analysis time)."""
    order = np.argsort(frame["ts"].to_numpy(), kind="stable")
    ts = frame["ts"].to_numpy()[order]
    codes, uniques = pd.factorize(frame["unit_id"].to_numpy()[order])
    clicked = frame["clicked"].to_numpy(dtype=float)[order]
    clicks, exposures = np.zeros(len(uniques)), np.zeros(len(uniques))
    out, start = [], 0
    for t in times:
        end = int(np.searchsorted(ts, t, side="right"))
        np.add.at(clicks, codes[start:end], clicked[start:end])
        np.add.at(exposures, codes[start:end], 1.0)
        start = end
        seen = exposures > 0
        out.append(stats.ArmSums.from_units(clicks[seen], exposures[seen]))
    return out


def timeline(ok, arms: list[str], alpha: float, points: int = 30) -> list[dict]:
    """Cumulative exposures, clicks and CTR per arm at `points` times, for the report, with the
    band the arm table gives its CTR (stats.ctr_interval: Wilson at the effective sample size
    of the per-unit, delta-method variance; a user's correlated requests are not independent
    trials), pooled over weight periods as the table is."""
    if not len(ok):
        return []
    times = np.quantile(ok["ts"].to_numpy(), np.linspace(0, 1, points + 1)[1:])
    sums = {arm: cumulative_unit_sums(ok[ok["arm"] == arm], times) for arm in arms}
    out = []
    for i, t in enumerate(times):
        row = {"ts": float(t)}
        for arm in arms:
            s = sums[arm][i]
            low, high = stats.ctr_interval(s, alpha) if s.y else (None, None)
            row[arm] = {"exposures": int(s.y), "clicks": float(s.x), "ctr": s.ctr if s.y else None, "low": low, "high": high}
        out.append(row)
    return out


def decide(result: Analysis, spec: ABSpec) -> tuple[str, list[str]]:
    """promote | rollback | continue, with the reasons. Invalid results (SRM) never decide on
    the comparison; a challenger's guardrail breach rolls back all the same."""
    if result.challenger is None:
        return "continue", ["automatic decisions need one challenger"]
    arms = {a.arm: a for a in result.arms}
    bad = arms[result.challenger]
    # Guardrails (errors, latency) are per-arm facts, not comparisons: a sample ratio mismatch
    # does not make them invalid, and a breach must roll back whatever the split looks like.
    if not bad.guardrail_ok:
        return "rollback", [f"challenger guardrail: {r}" for r in bad.guardrail_reasons]
    if result.srm_flagged:
        return "continue", [f"sample ratio mismatch (p={result.srm_p:.2g} < {spec.analysis.srm_p}): results invalid until it is explained"]
    need = spec.analysis.min_units
    have = [result.compared_units.get(a, 0) for a in (result.champion, result.challenger)]
    if min(have) < need:
        return "continue", [f"each arm needs {need} units in the comparison (served while both arms had traffic) first "
                            f"(have {have[0]} and {have[1]})"]
    if result.sequential_significant:
        # The test says which way only through the difference: without a finite one there is
        # nothing to act on (NaN > 0 is False, which once rolled back a clear winner).
        if result.diff is None or not math.isfinite(result.diff) or result.diff == 0:
            return "continue", [f"sequential test p={result.sequential_p:.3g} but the CTR difference is not defined ({result.diff}): no decision"]
        word = "promote" if result.diff > 0 else "rollback"
        return word, [f"sequential test p={result.sequential_p:.3g} <= {spec.analysis.alpha}: CTR difference {result.diff:+.4f}"]
    more = ""
    if result.sequential_units_needed:
        more = (f"; the sequential test needs about {result.sequential_units_needed} more units for {spec.analysis.power:.0%} power "
                f"at an effect of {spec.analysis.mde} (a fixed-horizon test looked at once: {result.units_needed})")
    return "continue", [f"no significant difference yet (sequential p={_fmt(result.sequential_p)}){more}"]


def final_reasons(final: dict) -> list[str]:
    """The reasons reported once a promote or rollback is final (`final`: its decision, reason
    and time, as serve.json and the router's user_config keep it): the live statistics then
    compare the arms in their new roles and no longer steer anything."""
    return [f"decided: {final['decision']} ({final['reason']}); automatic steps have stopped, "
            "`rayload ab set-weights` starts a new ramp"]


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"
