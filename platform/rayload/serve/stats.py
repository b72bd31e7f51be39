"""Experiment statistics: CTR per arm with intervals, lift, a two-proportion test, the
sample-ratio-mismatch check, an always-valid sequential test (mSPRT), the guardrails' rate
tests (serve/rate_tests.py) and power (serve/power.py), both re-exported here.

The unit of randomisation is the unit (user), not the request: a user's requests are
correlated, so CTR = sum(clicks) / sum(exposures) over units is a ratio metric and its
variance comes from the delta method over per-unit sums. With one exposure per unit it is
exactly the binomial variance. Distributions come from scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from . import power


@dataclass(frozen=True)
class ArmSums:
    """Per-arm sums over units: n units, x = clicks, y = exposures (and squares, cross)."""

    n: int
    x: float
    y: float
    xx: float
    yy: float
    xy: float

    @classmethod
    def from_units(cls, clicks: np.ndarray, exposures: np.ndarray) -> "ArmSums":
        clicks, exposures = np.asarray(clicks, float), np.asarray(exposures, float)
        return cls(len(clicks), clicks.sum(), exposures.sum(), (clicks**2).sum(), (exposures**2).sum(), (clicks * exposures).sum())

    @property
    def ctr(self) -> float:
        return self.x / self.y if self.y else float("nan")

    @property
    def var(self) -> float:
        """Delta-method variance of the ratio estimate sum(x)/sum(y)."""
        n = self.n
        if n < 2 or not self.y:
            return float("nan")
        mx, my = self.x / n, self.y / n
        sxx = (self.xx - n * mx * mx) / (n - 1)
        syy = (self.yy - n * my * my) / (n - 1)
        sxy = (self.xy - n * mx * my) / (n - 1)
        r = mx / my
        return max(0.0, (sxx - 2 * r * sxy + r * r * syy) / (n * my * my))

    def unit_variance(self, p_fallback: float) -> float:
        """What one unit contributes to the CTR estimate's variance (n * var), for the power
        calculator. Without a usable estimate (no clicks yet, one unit): the binomial at
        `p_fallback` divided by the observed exposures per unit."""
        v = self.n * self.var
        if math.isfinite(v) and v > 0:
            return v
        per_unit = self.y / self.n if self.n and self.y else 1.0
        return p_fallback * (1 - p_fallback) / per_unit


def z_crit(alpha: float) -> float:
    return float(stats.norm.ppf(1 - alpha / 2))


def wilson(x: float, n: float, alpha: float = 0.05) -> tuple[float, float]:
    """Wilson score interval for a proportion (good near 0 and with few trials)."""
    if n <= 0:
        return (float("nan"), float("nan"))
    z, p = z_crit(alpha), x / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def ctr_interval(a: ArmSums, alpha: float = 0.05) -> tuple[float, float]:
    """Wilson with the effective sample size the delta-method variance implies."""
    p, v = a.ctr, a.var
    if not math.isfinite(v) or not math.isfinite(p):
        return wilson(a.x, a.y, alpha)
    n_eff = p * (1 - p) / v if v > 0 else a.y
    return wilson(p * n_eff, n_eff, alpha)


@dataclass(frozen=True)
class Estimate:
    """A CTR difference (treatment - control) with its variance, and the two CTR levels it is
    made of, each with its own variance and the exposures it would rest on were they all
    independent (its binomial size: where no unit varies yet, e.g. before the first click)."""

    diff: float
    var: float
    control: float
    treatment: float
    level_var: tuple[float, float] = (float("nan"), float("nan"))  # (control, treatment): delta method over units
    level_n: tuple[float, float] = (float("nan"), float("nan"))  # (control, treatment) binomial sizes
    units: tuple[int, int] = (0, 0)  # units of (control, treatment) the estimate is made of
    null_var: float = float("nan")  # the variance if the arms did not differ (for the mSPRT; stats.stratified)


@dataclass(frozen=True)
class Comparison:
    diff: float
    diff_ci: tuple[float, float]
    lift: float | None  # None where the control's CTR is 0: no relative change is defined
    lift_ci: tuple[float, float] | None  # None with the lift (and where an interval bound is not finite)
    z: float
    p_value: float  # fixed-horizon two-sided test: valid only when looked at once


def compare(control: ArmSums, treatment: ArmSums, alpha: float = 0.05) -> Comparison:
    """Difference (treatment - control), relative lift and a two-sided z-test of equal CTRs. A
    control CTR of 0 leaves only the lift undefined: the difference, its interval and the test
    hold at any CTR (a broken champion or a rare event)."""
    c, t = control.ctr, treatment.ctr
    return comparison(Estimate(t - c, control.var + treatment.var, c, t, (control.var, treatment.var), (control.y, treatment.y),
                               (control.n, treatment.n), _pooled_null_var(control, treatment)), alpha)


def _pooled_null_var(control: ArmSums, treatment: ArmSums) -> float:
    """The difference's variance if the arms did not differ, from per-unit sums: one per-unit
    variance of the residuals around the pooled CTR serves both arms (as `_null_variance` for
    the stratified estimate): the two-proportion test's pooled variance, for a ratio metric."""
    arms = (control, treatment)
    if not all(a.y for a in arms) or control.n + treatment.n < 2:
        return float("nan")
    p0 = (control.x + treatment.x) / (control.y + treatment.y)
    s2 = sum(a.xx - 2 * p0 * a.xy + p0 * p0 * a.yy for a in arms) / (control.n + treatment.n - 1)
    return max(0.0, s2) * sum(a.n / (a.y * a.y) for a in arms)


def comparison(est: Estimate, alpha: float = 0.05) -> Comparison:
    """Intervals and z-test of an estimated difference; NaN where its variance is not defined.

    The intervals are score intervals, not Wald's: each level gets its Wilson interval at the
    effective size its variance implies (ctr_interval's), and the difference combines them by
    Newcombe's hybrid score method, the relative lift by MOVER-R (Zou & Donner): the method of
    variance estimates recovery, with the correlation of the levels where a unit is in both arms
    (a ramp step moved it). Wald's estimate +- z se has zero width with no clicks (or all) and
    covered a difference at 0.2% -> 0.4% on 200 units per arm in about half the experiments;
    these hold about 95% there, and equal Wald's at large counts.

    The z-test divides the difference by its standard error if the arms did not differ (the
    pooled variance, `est.null_var`, as the two-proportion test takes it; the delta-method one
    where that is not known). Each arm's own variance is 0 before its first click: an A/A test
    at 0.2% CTR with a 1% challenger arm was "significant" in 37% of experiments at alpha 0.05,
    beside an interval holding 0."""
    nan = float("nan")
    if not (math.isfinite(est.diff) and math.isfinite(est.var)):
        return Comparison(nan, (nan, nan), None, None, nan, nan)
    se = math.sqrt(est.null_var if math.isfinite(est.null_var) and est.null_var > 0 else max(est.var, 0.0))
    if se > 0:
        z = est.diff / se
        p = float(2 * stats.norm.sf(abs(z)))
    else:  # no variation within either arm (every unit alike): no test, unless there is nothing to test
        z, p = (0.0, 1.0) if est.diff == 0 else (nan, nan)
    c, t = (_level_interval(level, v, n, alpha) for level, v, n in zip((est.control, est.treatment), est.level_var, est.level_n))
    rho = _correlation(est)
    low = est.diff - _root_sum(est.treatment - t[0], c[1] - est.control, rho)
    high = est.diff + _root_sum(t[1] - est.treatment, est.control - c[0], rho)
    lift, lift_ci = _lift(est, c, t, rho)
    return Comparison(est.diff, (low, high), lift, lift_ci, z, p)


def _level_interval(p: float, var: float, n_binomial: float, alpha: float) -> tuple[float, float]:
    """Wilson at the effective size the level's variance implies, as ctr_interval; where it has
    none (no unit varies: no clicks yet, or every exposure clicked) at its binomial size."""
    n_eff = p * (1 - p) / var if math.isfinite(var) and var > 0 and 0 < p < 1 else n_binomial
    if not (math.isfinite(n_eff) and n_eff > 0):
        return (p, p)
    return wilson(p * n_eff, n_eff, alpha)


def _correlation(est: Estimate) -> float:
    """Correlation of the two levels: 0 for disjoint arms; positive where units are in both."""
    v_c, v_t = est.level_var
    if not (math.isfinite(v_c) and math.isfinite(v_t) and v_c > 0 and v_t > 0):
        return 0.0
    return min(1.0, max(-1.0, (v_c + v_t - est.var) / (2 * math.sqrt(v_c * v_t))))


def _root_sum(a: float, b: float, rho: float) -> float:
    return math.sqrt(max(a * a + b * b - 2 * rho * a * b, 0.0))


def _lift(est: Estimate, c: tuple[float, float], t: tuple[float, float], rho: float):
    """Relative lift treatment / control - 1 and its MOVER-R interval: the bounds are the ratios
    r where the difference treatment - r * control has a MOVER bound of 0 (the roots of a
    quadratic). Defined at a challenger CTR of 0 (lift -100%, lower bound -100%); where a root is
    missing (a champion with a handful of clicks), the conservative ratio of the outer bounds."""
    p_c, p_t = est.control, est.treatment
    if not (math.isfinite(p_c) and p_c > 0 and math.isfinite(p_t)):
        return None, None
    ratio = p_t / p_c
    a, b = p_t - t[0], c[1] - p_c
    low = _ratio_root(c[1] * (2 * p_c - c[1]), p_t * p_c - rho * a * b, t[0] * (2 * p_t - t[0]), ratio, upper=False)
    low = max(low, 0.0) if low is not None else t[0] / c[1]
    a, b = t[1] - p_t, p_c - c[0]
    high = _ratio_root(c[0] * (2 * p_c - c[0]), p_t * p_c - rho * a * b, t[1] * (2 * p_t - t[1]), ratio, upper=True)
    if high is None:
        high = t[1] / c[0] if c[0] > 0 else float("inf")
    if not (math.isfinite(low) and math.isfinite(high)):
        return ratio - 1, None
    return ratio - 1, (min(low, ratio) - 1, max(high, ratio) - 1)


def _ratio_root(a: float, b: float, c: float, ratio: float, upper: bool) -> float | None:
    """The root of a r^2 - 2 b r + c = 0 on its side of the estimated `ratio` (the nearest, were
    there two); None where there is none."""
    if abs(a) < 1e-300:
        roots = [c / (2 * b)] if b else []
    else:
        disc = b * b - a * c
        roots = [(b - math.sqrt(disc)) / a, (b + math.sqrt(disc)) / a] if disc >= 0 else []
    kept = [r for r in roots if r >= 0 and (r >= ratio * (1 - 1e-12) if upper else r <= ratio * (1 + 1e-12))]
    return (min(kept) if upper else max(kept)) if kept else None


def stratified(unit: np.ndarray, period: np.ndarray, treated: np.ndarray, x: np.ndarray, y: np.ndarray) -> Estimate | None:
    """The CTR difference within each weight period, combined over the periods; None while no
    period has 2 units in each arm.

    One element per (unit, period, arm) cell member: that unit's clicks `x` and exposures `y`
    (> 0) there; `unit` and `period` are codes 0..k-1, `treated` is True for the challenger.
    Within a period the weights were fixed, so which arm a unit is in is random and the arms
    are comparable; across periods they are not (a CTR that drifts while the challenger's share
    grows would look like a treatment effect, Simpson's paradox), so rows are never pooled.

    Weights: each period's difference of ratio estimates counts n_c n_t / (n_c + n_t) of its
    units (the Mantel-Haenszel weights for a risk difference). For a per-unit variance alike in
    all periods they are the inverse-variance (fixed-effect) weights; unlike weights from each
    period's estimated variance they do not depend on the outcomes, so a short period whose few
    units happened not to click (estimated variance 0) cannot take all the weight, and the
    estimate stays unbiased for an effect common to the periods. The CTR levels (for the
    intervals and the relative lift) are combined with the same weights.

    Variance: units, not rows or periods, are independent. A unit seen in several periods (a
    returning user, or one a ramp step moved from the champion to the challenger) adds up its
    linearised contributions to the estimate before they are squared, so its correlated
    behaviour across periods is neither ignored nor double counted; each level's own variance
    is that of its arm's terms, and their covariance (units in both arms) what the difference's
    variance lacks of their sum. With one period this is ArmSums.var of each arm summed, and the
    levels are the arms' CTRs."""
    treated = np.asarray(treated, bool)
    cells = 2 * (int(period.max()) + 1) if len(period) else 0
    cell = 2 * period + treated
    n = np.bincount(cell, minlength=cells).astype(float)
    clicks, exposures = np.bincount(cell, weights=x, minlength=cells), np.bincount(cell, weights=y, minlength=cells)
    ratio = clicks / np.maximum(exposures, 1e-300)
    n_c, n_t = n[0::2], n[1::2]
    w = np.where((n_c >= 2) & (n_t >= 2), n_c * n_t / np.maximum(n_c + n_t, 1.0), 0.0)
    if not w.sum():
        return None
    w = w / w.sum()
    levels = float(w @ ratio[0::2]), float(w @ ratio[1::2])
    # d(ratio_c) = sum over the cell's units of (x - ratio_c y) / Y_c; sqrt(n/(n-1)): ArmSums.var's n - 1
    scale = np.repeat(w, 2) * np.sqrt(n / np.maximum(n - 1, 1.0)) / np.maximum(exposures, 1e-300)
    resid = (x - ratio[cell] * y) * scale[cell]
    sign = np.where(treated, 1.0, -1.0)
    var = _squared_unit_sums(unit, sign * resid)
    null_var = _null_variance(unit, period, cell, sign, x, y, w, n, clicks, exposures)
    level_var = tuple(_squared_unit_sums(unit, np.where(treated == arm, resid, 0.0)) for arm in (False, True))
    level_n = tuple(1.0 / float((w[w > 0] ** 2 / e[w > 0]).sum()) for e in (exposures[0::2], exposures[1::2]))  # 1 / sum w^2 / Y
    used = w[period] > 0
    units = tuple(int(np.count_nonzero(np.bincount(unit[used & (treated == arm)]))) for arm in (False, True))
    return Estimate(levels[1] - levels[0], var, levels[0], levels[1], level_var, level_n, units, null_var)


def _null_variance(unit, period, cell, sign, x, y, w, n, clicks, exposures) -> float:
    """stratified's variance if the arms did not differ, for the mSPRT. Then both arms of a
    period draw their units from one distribution: one per-unit variance s2 (residuals around
    the period's CTR, both arms pooled) serves both cells, Var(ratio) = s2 n / Y^2 each: the
    two-proportion test's pooled variance, for a ratio metric. A cell's own residuals would
    give an arm whose first units happen not to click no variance at all, and a sure "loss".
    Returning units' covariances across cells (the cross terms of the per-unit sums) are kept."""
    pooled = (clicks[0::2] + clicks[1::2]) / np.maximum(exposures[0::2] + exposures[1::2], 1e-300)
    resid = x - pooled[period] * y
    n_k = n[0::2] + n[1::2]
    s2 = np.bincount(period, weights=resid**2, minlength=len(n_k)) / np.maximum(n_k - 1, 1.0)
    coef = np.repeat(w, 2) / np.maximum(exposures, 1e-300)
    within = float((coef**2 * n * np.repeat(s2, 2)).sum())
    share = sign * coef[cell] * resid
    across = _squared_unit_sums(unit, share) - float((share**2).sum())  # 0 when no unit is in two cells
    return within + across


def _squared_unit_sums(unit: np.ndarray, values: np.ndarray) -> float:
    return float((np.bincount(unit, weights=values) ** 2).sum())


def msprt_lambda(diff: float, var: float, tau: float) -> float:
    """Mixture SPRT likelihood ratio for a normal estimate `diff` with variance `var` against
    H0: no difference, mixing over N(0, tau^2) alternatives (Johari et al., 2017). Rejecting
    when it first reaches 1/alpha keeps the false-positive rate at alpha however often one looks."""
    if not (math.isfinite(diff) and math.isfinite(var) and var > 0):
        return 1.0
    t2 = tau * tau
    # In logs, capped: exp overflowed past |z| ~ 38 (a broken arm after ~27k rows), and every
    # later analysis raised with it, since the looks are kept. e**700 is p = 1e-304 all the same.
    log_lam = 0.5 * math.log(var / (var + t2)) + t2 * diff * diff / (2 * var * (var + t2))
    return math.exp(min(log_lam, 700.0))


def always_valid_p(lambdas: list[float]) -> float:
    """p_n = min over looks of 1 / Lambda_m: the sequential p-value at every look so far."""
    return min([1.0] + [1.0 / lam for lam in lambdas if lam > 0])


# The power calculator (serve/power.py), importable from here as before.
sample_size, minimum_detectable_effect = power.sample_size, power.minimum_detectable_effect
msprt_power, msprt_sample_size, msprt_mde = power.msprt_power, power.msprt_sample_size, power.msprt_mde

# The sample-ratio check and the guardrails' rate tests (serve/rate_tests.py), importable from here as before.
from .rate_tests import ODDS_RATIOS, SRM_MIN_EXPECTED, failures_above_p, p99, rate_above_p, srm_p_value, srm_statistic  # noqa: E402,F401
