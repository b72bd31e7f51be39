"""The live analysis of an experiment (`GET /experiment`, `rayload ab status`) and the
decision it supports: promote, rollback or continue. The sequential test that decides is in
serve/sequential.py, the guardrails in serve/guardrails.py."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from ..ab_spec import ABSpec
from . import stats
from .guardrails import breaches, recent_rows, versus_champion
from .sequential import Pairs, sequential

__all__ = ["Analysis", "ArmReport", "analyze", "decide", "decided_champion", "final_reasons", "points", "timeline", "unit_sums", "cumulative_unit_sums",
           "attribution_window", "ATTRIBUTION_S"]

# How long after its exposure an outcome may still arrive, by analysis.event (seconds): the
# sequential test takes a look only once all its exposures are older (serve/sequential.py). A
# page's click comes with or just after its request (the simulator's in the same call), so 0;
# a conversion may take its time: 30 minutes, retraining's default attribution window. An
# outcome later than the window still changes the looks that hold its exposure.
ATTRIBUTION_S = {"click": 0.0, "conversion": 1800.0}


def attribution_window(spec: ABSpec) -> float:
    """The spec's analysis.attribution_s where it has one, else ATTRIBUTION_S by its event."""
    own = getattr(spec.analysis, "attribution_s", None)
    return float(own) if own is not None else ATTRIBUTION_S[spec.analysis.event]


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
    sequential_p: float | None = None  # over the looks whose exposures' attribution windows have closed
    sequential_significant: bool = False
    # +1 / -1: the sign of the difference at every look where the sequential test crossed;
    # 0: looks crossed on both sides; None: none crossed (serve/sequential.py, Sequential)
    sequential_direction: int | None = None
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
    # Per guardrail the challenger breaches ("errors", "latency"): its reason, whether the
    # champion breaches it too, and p, the anytime-valid p-value that the challenger fails more
    # often than the champion on the same requests (None: too few champion requests to tell)
    guardrail_vs_champion: dict[str, dict] = field(default_factory=dict)
    timeline: list[dict] = field(default_factory=list)
    first_ts: float | None = None  # the first exposure's time: the timeline's first point is a quantile past it
    drift: list[dict] = field(default_factory=list)  # per arm and feature (serve/monitor.py); filled by the caller
    # Shadow mode: per shadow arm, requests it scored and how many failed (EventReader.shadow_summary); filled by the caller
    shadow_scores: dict[str, dict] = field(default_factory=dict)
    # The arm serving as champion now, where it is not `champion`: after a promote the figures
    # stay in the roles it was decided in (champion: the arm replaced), while the winner serves
    live_champion: str | None = None
    confidence: float = 0.95  # the intervals' level: 1 - analysis.alpha

    @property
    def ci_label(self) -> str:
        """The intervals' heading, at their level (a "95% CI" heading sat over 90% intervals at alpha 0.1)."""
        return f"{100 * self.confidence:.10g}% CI"  # 99.995% at alpha 5e-5 (.4g said 100%)

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


def analyze(frame, spec: ABSpec, weights: dict[str, float] | None = None, champion: str | None = None,
            now: float | None = None, attribution_s: float | None = None) -> Analysis:
    """`frame`: EventReader.frame(...) rows. Weights and champion: those in force now.

    An exposure counts a click (or conversion) when its outcome's value is > 0; only ok
    exposures enter the CTRs and their comparison (an error is the error-rate guardrail's).
    The sequential test looks only at exposures served at or before `now` (default: the clock)
    minus the attribution window (`attribution_s`, default attribution_window(spec)); the
    descriptive figures (CTRs, difference, lift, intervals) use every outcome known now."""
    weights = weights or spec.weights
    champion = champion or spec.champion_arm
    challengers = [a.name for a in spec.arms if a.name != champion]
    challenger = challengers[0] if len(challengers) == 1 else None
    frame = frame.assign(clicked=(frame["outcome"] > 0).astype(float)) if len(frame) else frame.assign(clicked=[])
    ok = frame[frame["status"] == "ok"] if len(frame) else frame
    reports = {a.name: _arm_report(frame, ok, a.name, spec) for a in spec.arms}
    result = Analysis(spec.name, champion, challenger, dict(weights), [r for r, _ in reports.values()],
                      confidence=1 - spec.analysis.alpha)
    result.srm_p = stats.srm_p_value(_periods(ok))
    result.srm_flagged = result.srm_p < spec.analysis.srm_p
    result.valid = not result.srm_flagged
    if challenger is not None and reports[challenger][1]:
        result.guardrail_vs_champion = versus_champion(frame, champion, challenger, reports[challenger][1], reports[champion][1],
                                                       spec.guardrails)
    if challenger is not None and len(ok):
        window = attribution_window(spec) if attribution_s is None else attribution_s
        _compare(result, ok, champion, challenger, spec, (time.time() if now is None else now) - window)
    result.timeline = timeline(ok, [a.name for a in spec.arms], spec.analysis.alpha)
    result.first_ts = float(ok["ts"].min()) if len(ok) else None
    result.decision, result.reasons = decide(result, spec)
    return result


def _arm_report(frame, ok, arm: str, spec: ABSpec) -> tuple[ArmReport, dict[str, str]]:
    """The arm's figures, and its guardrail breaches by kind (guardrails.breaches)."""
    rows, good = frame[frame["arm"] == arm], ok[ok["arm"] == arm]
    sums = unit_sums(good) if len(good) else stats.ArmSums(0, 0, 0, 0, 0, 0)
    requests, errors = len(rows), int((rows["status"] != "ok").sum())
    recent = recent_rows(rows, spec.guardrails.latency_window)["latency_ms"].to_numpy(dtype=float)
    kinds = breaches(errors, requests, recent, spec.guardrails)
    return ArmReport(arm, sums.n, int(sums.y), int(sums.x), sums.ctr, stats.ctr_interval(sums, spec.analysis.alpha), requests,
                     errors / requests if requests else 0.0, stats.p99(recent), not kinds, list(kinds.values())), kinds


def _periods(ok) -> list[tuple[dict[str, int], dict[str, float]]]:
    """Units by the weights in force when each unit was first exposed."""
    if not len(ok):
        return []
    first = ok.sort_values("ts").drop_duplicates("unit_id")
    return [(group.groupby("arm").size().to_dict(), json.loads(layout)) for layout, group in first.groupby("layout")]


def _compare(result: Analysis, ok, champion: str, challenger: str, spec: ABSpec, closed_before: float) -> None:
    """Difference, lift and tests from the arms compared within each weight period; the
    sequential test on the rows served at or before `closed_before`."""
    a = spec.analysis
    pairs = Pairs.of(ok, champion, challenger)
    est = pairs.estimate()
    if est is None:
        result.compared_units = {champion: 0, challenger: 0}
        return
    result.compared_units = {champion: est.units[0], challenger: est.units[1]}
    cmp = stats.comparison(est, a.alpha)
    result.diff, result.diff_ci, result.lift, result.lift_ci, result.z_p_value = cmp.diff, cmp.diff_ci, cmp.lift, cmp.lift_ci, cmp.p_value
    seq = sequential(pairs, a.tau, a.alpha, closed_before)
    result.sequential_p, result.sequential_direction = seq.p, seq.direction
    result.sequential_significant = result.sequential_p <= a.alpha
    _power(result, unit_sums(ok[ok["arm"] == champion]), unit_sums(ok[ok["arm"] == challenger]), a)


def _power(result: Analysis, control: "stats.ArmSums", treatment: "stats.ArmSums", a) -> None:
    """Units needed and the effect detectable now, for the mSPRT that decides and for a
    fixed-horizon z-test, from the observed per-unit variances (CTR is a ratio over units: ten
    exposures of one user are worth less than ten users). n/a (None) while the challenger's
    share is 0 or 1."""
    share = result.weights.get(result.challenger, 0.0)
    base = _base_rate(control.x + treatment.x, control.y + treatment.y, a.alpha)
    unit_var = (control.unit_variance(base), treatment.unit_variance(base))
    n = sum(result.compared_units.values())
    # At a CTR within mde of 1 only a drop of mde can happen; past 0.5 maybe neither (n/a then)
    mde = next((d for d in (a.mde, -a.mde) if 0 <= base + d <= 1), None)
    if mde is None:
        return
    needed = stats.sample_size(base, mde, a.alpha, a.power, share, unit_var)
    result.units_needed = None if needed is None else max(0, needed - n)
    result.mde_now = stats.minimum_detectable_effect(n, base, a.alpha, a.power, share, unit_var)
    needed = stats.msprt_sample_size(base, mde, a.alpha, a.power, share, unit_var, a.tau)
    result.sequential_units_needed = None if needed is None else max(0, needed - n)
    result.sequential_mde_now = stats.msprt_mde(n, base, a.alpha, a.power, share, unit_var, a.tau)


def _base_rate(clicks: float, exposures: float, alpha: float) -> float:
    """The CTR the power figures assume where a unit's variance is not known yet: both arms'
    pooled CTR; before the first click (or with every exposure clicked) the Wilson bound of
    that pooled rate nearest 1/2, the rate the data cannot rule out yet that needs the most
    units (a 50% CTR asked 50x too many units of a conversion test at its start)."""
    if not exposures:
        return 0.5
    if 0 < clicks < exposures:
        return clicks / exposures
    low, high = stats.wilson(clicks, exposures, alpha)
    return high if clicks == 0 else low


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
    the comparison; a challenger's guardrail breach where it is worse than the champion rolls
    back all the same. A breach the challenger is not clearly worse in (one the champion
    shares: an incident) decides nothing, and the ramp holds while it lasts (control._ramp)."""
    if result.challenger is None:
        return "continue", ["automatic decisions need one challenger"]
    bad = next(a for a in result.arms if a.arm == result.challenger)
    # Guardrails (errors, latency) are per-request facts: a sample ratio mismatch does not make
    # them invalid, and a breach the challenger is worse in rolls back whatever the split.
    if not bad.guardrail_ok:
        return _guardrail_decision(result, bad, spec)
    if result.srm_flagged:
        return "continue", [f"sample ratio mismatch (p={result.srm_p:.2g} < {spec.analysis.srm_p}): results invalid until it is explained"]
    need = spec.analysis.min_units
    have = [result.compared_units.get(a, 0) for a in (result.champion, result.challenger)]
    if min(have) < need:
        return "continue", [f"each arm needs {need} units in the comparison (served while both arms had traffic) first "
                            f"(have {have[0]} and {have[1]})"]
    if result.sequential_significant:
        decision, reasons = _sequential_decision(result, spec)
        if decision == "promote" and bad.requests < spec.guardrails.min_requests:
            # no breach yet is not a judgement: below min_requests the guardrails have not looked (a
            # challenger at 900 ms against a 250 ms limit was promoted on 726 requests of 1,000 needed)
            return "continue", reasons + [f"but the challenger's guardrails are not judged yet ({bad.requests} of "
                                          f"guardrails.min_requests={spec.guardrails.min_requests} requests): no promote before"]
        return decision, reasons
    more = ""
    if result.sequential_units_needed:
        more = (f"; the sequential test needs about {result.sequential_units_needed} more units for {spec.analysis.power:.0%} power "
                f"at an effect of {spec.analysis.mde} (a fixed-horizon test looked at once: {result.units_needed})")
    return "continue", [f"no significant difference yet (sequential p={_fmt(result.sequential_p)}){more}"]


def _guardrail_decision(result: Analysis, bad: ArmReport, spec: ABSpec) -> tuple[str, list[str]]:
    """Roll back on the breaches the challenger is clearly worse than the champion in (or that
    have no champion requests to compare with); otherwise continue, saying why."""
    alpha, compared = spec.guardrails.alpha, result.guardrail_vs_champion
    if not compared:  # not judged against the champion (a result built by hand): the breach decides
        return "rollback", [f"challenger guardrail: {r}" for r in bad.guardrail_reasons]
    worse = [c for c in compared.values() if c["p"] is None or c["p"] <= alpha]
    if worse:
        return "rollback", [f"challenger guardrail: {c['reason']}" + ("" if c["p"] is None else f"; worse than the champion on the same "
                            f"requests (anytime-valid p={c['p']:.2g} <= {alpha})") for c in worse]
    return "continue", [f"challenger guardrail: {c['reason']}; " + (
        "the champion breaches too: a shared incident, not the challenger's doing" if c["champion_breaches"] else
        "but it is not clearly worse than the champion on the same requests") + f" (anytime-valid p={c['p']:.2g} > {alpha} that it "
        "is worse); no decision, and the ramp holds, until it ends" for c in compared.values()]


def _sequential_decision(result: Analysis, spec: ABSpec) -> tuple[str, list[str]]:
    """The significant sequential test's decision: the way the difference points now, where
    that is the way the looks that crossed pointed."""
    p = f"sequential test p={result.sequential_p:.3g} <= {spec.analysis.alpha}"
    # The test says which way only through the difference: without a finite one there is
    # nothing to act on (NaN > 0 is False, which once rolled back a clear winner).
    if result.diff is None or not math.isfinite(result.diff) or result.diff == 0:
        return "continue", [f"sequential test p={result.sequential_p:.3g} but the CTR difference is not defined ({result.diff}): no decision"]
    sign = 1 if result.diff > 0 else -1
    if result.sequential_direction is not None and result.sequential_direction != sign:
        then = {1: "a win", -1: "a loss", 0: "a win at some and a loss at others"}[result.sequential_direction]
        return "continue", [f"{p}, but the looks that crossed saw {then} and the CTR difference is {points(result.diff)} now: the effect "
                            "changed sign over time, so the evidence is not for this direction; no automatic decision"]
    return ("promote" if sign > 0 else "rollback"), [f"{p}: CTR difference {points(result.diff)}"]


def points(diff: float | None, interval=None) -> str:
    """A CTR difference in percentage points, three significant figures (with its interval):
    four fixed decimals showed a real 0.004-point effect at conversion-sized rates as +0.0000."""
    def one(x):
        return f"{x * 100:+.3g}" if x is not None and math.isfinite(x) else "n/a"

    text = f"{one(diff)} points"
    return text if interval is None else f"{text} [{one(interval[0])}, {one(interval[1])}]"


def decided_champion(arms: list[str], champion: str, final: dict | None) -> str:
    """The champion a final decision was made against, for the analysis reported beside it: a
    promote makes the winner the champion, and analysed in those roles the lift read as the
    loser's (a promote shown beside "lift -23%", in the report, the demo and decision.json)."""
    if final and final.get("decision") == "promote":
        others = [a for a in arms if a != champion]
        if len(others) == 1:
            return others[0]
    return champion


def final_reasons(final: dict) -> list[str]:
    """The reasons reported once a promote or rollback is final (`final`: its decision, reason
    and time, as serve.json and the router's user_config keep it): the live statistics then
    compare the arms in their new roles and no longer steer anything."""
    return [f"decided: {final['decision']} ({final['reason']}); automatic steps have stopped, "
            "`rayload ab set-weights` starts a new ramp on the same evidence"]


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"
