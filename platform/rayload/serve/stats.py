"""Experiment statistics: CTR per arm with intervals, lift, a two-proportion test, the
sample-ratio-mismatch check, an always-valid sequential test (mSPRT), and power.

The unit of randomisation is the unit (user), not the request: a user's requests are
correlated, so CTR = sum(clicks) / sum(exposures) over units is a ratio metric and its
variance comes from the delta method over per-unit sums. With one exposure per unit it is
exactly the binomial variance. Distributions come from scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special, stats


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
    made of with the variance of the log of their ratio (the relative lift's delta method)."""

    diff: float
    var: float
    control: float
    treatment: float
    log_ratio_var: float
    units: tuple[int, int] = (0, 0)  # units of (control, treatment) the estimate is made of
    null_var: float = float("nan")  # the variance if the arms did not differ (for the mSPRT; stats.stratified)


@dataclass(frozen=True)
class Comparison:
    diff: float
    diff_ci: tuple[float, float]
    lift: float | None  # None where the control's CTR is 0: no relative change is defined
    lift_ci: tuple[float, float] | None  # None also where the challenger's CTR is 0 (lift -100%, no log ratio)
    z: float
    p_value: float  # fixed-horizon two-sided test: valid only when looked at once


def compare(control: ArmSums, treatment: ArmSums, alpha: float = 0.05) -> Comparison:
    """Difference (treatment - control), relative lift (delta method on the log ratio) and a
    two-sided z-test of equal CTRs. A control CTR of 0 leaves only the lift undefined: the
    difference, its interval and the test hold at any CTR (a broken champion or a rare event)."""
    c, t = control.ctr, treatment.ctr
    log_var = control.var / c**2 + treatment.var / t**2 if c > 0 and t > 0 else float("nan")
    return comparison(Estimate(t - c, control.var + treatment.var, c, t, log_var, (control.n, treatment.n)), alpha)


def comparison(est: Estimate, alpha: float = 0.05) -> Comparison:
    """Interval and z-test of an estimated difference; NaN where its variance is not defined."""
    nan = float("nan")
    if not (math.isfinite(est.diff) and math.isfinite(est.var)):
        return Comparison(nan, (nan, nan), None, None, nan, nan)
    z_c, se = z_crit(alpha), math.sqrt(max(est.var, 0.0))
    if se > 0:
        z = est.diff / se
        p = float(2 * stats.norm.sf(abs(z)))
    else:  # no variation within either arm (every unit alike): no test, unless there is nothing to test
        z, p = (0.0, 1.0) if est.diff == 0 else (nan, nan)
    lift, lift_ci = _lift(est, z_c)
    return Comparison(est.diff, (est.diff - z_c * se, est.diff + z_c * se), lift, lift_ci, z, p)


def _lift(est: Estimate, z_c: float) -> tuple[float | None, tuple[float, float] | None]:
    if not (math.isfinite(est.control) and est.control > 0 and math.isfinite(est.treatment)):
        return None, None
    lift = est.treatment / est.control - 1
    if not (est.treatment > 0 and math.isfinite(est.log_ratio_var)):
        return lift, None
    log_ratio, se = math.log(est.treatment / est.control), math.sqrt(max(est.log_ratio_var, 0.0))
    return lift, (math.exp(log_ratio - z_c * se) - 1, math.exp(log_ratio + z_c * se) - 1)


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
    relative lift) are combined with the same weights.

    Variance: units, not rows or periods, are independent. A unit seen in several periods (a
    returning user, or one a ramp step moved from the champion to the challenger) adds up its
    linearised contributions to the estimate before they are squared, so its correlated
    behaviour across periods is neither ignored nor double counted. With one period this is
    ArmSums.var of each arm summed, and the levels are the arms' CTRs."""
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
    log_var = _squared_unit_sums(unit, resid * np.where(treated, 1 / levels[1], -1 / levels[0])) if min(levels) > 0 else float("nan")
    used = w[period] > 0
    units = tuple(int(np.count_nonzero(np.bincount(unit[used & (treated == arm)]))) for arm in (False, True))
    return Estimate(levels[1] - levels[0], var, levels[0], levels[1], log_var, units, null_var)


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
    return math.sqrt(var / (var + t2)) * math.exp(t2 * diff * diff / (2 * var * (var + t2)))


def always_valid_p(lambdas: list[float]) -> float:
    """p_n = min over looks of 1 / Lambda_m: the sequential p-value at every look so far."""
    return min([1.0] + [1.0 / lam for lam in lambdas if lam > 0])


SRM_MIN_EXPECTED = 5  # the usual rule for the chi-square approximation


def srm_statistic(units: dict[str, int], weights: dict[str, float]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of exposed units against the configured
    shares (arms with weight > 0). (0, 0), no test, while an arm expects fewer than
    SRM_MIN_EXPECTED units: the chi-square distribution is no approximation there (the first
    unit of a 5% arm, a 1-in-20 event, read as p = 1e-5), and a mismatch large enough to matter
    shows once the counts are."""
    arms = [a for a, w in weights.items() if w > 0]
    total = sum(units.get(a, 0) for a in arms)
    if len(arms) < 2 or total == 0:
        return (0.0, 0)
    observed = np.array([units.get(a, 0) for a in arms], float)
    expected = np.array([weights[a] for a in arms]) / sum(weights[a] for a in arms) * total
    if expected.min() < SRM_MIN_EXPECTED:
        return (0.0, 0)
    return float(((observed - expected) ** 2 / expected).sum()), len(arms) - 1


def srm_p_value(periods: list[tuple[dict[str, int], dict[str, float]]]) -> float:
    """SRM p-value over weight periods: each period's units against that period's weights;
    independent periods add their chi-square statistics and degrees of freedom. Periods too
    small for the chi-square approximation (srm_statistic) are left out; 1.0 if all are."""
    parts = [srm_statistic(units, weights) for units, weights in periods]
    stat, dof = sum(p[0] for p in parts), sum(p[1] for p in parts)
    return float(stats.chi2.sf(stat, dof)) if dof else 1.0


def _split_variance(unit_var: tuple[float, float], share: float) -> float | None:
    """n_total * Var(treatment CTR - control CTR) when the challenger gets `share` of n_total
    units; None when one arm gets no units (share 0 or 1: nothing to compare)."""
    if not 0 < share < 1:
        return None
    return unit_var[0] / (1 - share) + unit_var[1] / share


def sample_size(p_base: float, mde: float, alpha: float = 0.05, power: float = 0.8, share: float = 0.5,
                unit_var: tuple[float, float] | None = None) -> int | None:
    """Units in total for a two-sided FIXED-HORIZON z-test, looked at once, to detect an absolute
    CTR change `mde` with the challenger getting `share` of the units; None when share is 0 or
    1. Not what the mSPRT that decides needs: see msprt_sample_size.

    `unit_var`: (control, challenger) variance of one unit's share of the CTR estimate
    (ArmSums.unit_variance: the delta method, so a unit with many exposures counts for what it
    holds); default: one exposure per unit, the binomial at p_base and p_base + mde."""
    var = _split_variance(_default_unit_var(p_base, mde, unit_var), share)
    if var is None:
        return None
    z = z_crit(alpha) + float(stats.norm.ppf(power))
    return int(math.ceil(z * z * var / (mde * mde)))


def minimum_detectable_effect(n_total: int, p_base: float, alpha: float = 0.05, power: float = 0.8, share: float = 0.5,
                              unit_var: tuple[float, float] | None = None) -> float | None:
    """Smallest absolute CTR change the fixed-horizon z-test on `n_total` units detects with the
    given power; None when share is 0 or 1. `unit_var` as in sample_size; default: one exposure
    per unit, equal variances. The mSPRT's: msprt_mde."""
    var = _split_variance(unit_var or (p_base * (1 - p_base),) * 2, share)
    if var is None:
        return None
    if n_total <= 0:
        return float("inf")
    z = z_crit(alpha) + float(stats.norm.ppf(power))
    return z * math.sqrt(var / n_total)


def msprt_power(effect: float, var: float, tau: float, alpha: float) -> float:
    """Chance that ONE look at a normal estimate of variance `var` and mean `effect` finds the
    mSPRT's Lambda >= 1/alpha: |z| beyond the boundary b with b^2 = 2 (var + tau^2) / tau^2 *
    (log(1/alpha) + log((var + tau^2) / var) / 2), solved from msprt_lambda."""
    b = math.sqrt(2 * (var + tau * tau) / (tau * tau) * (math.log(1 / alpha) + 0.5 * math.log((var + tau * tau) / var)))
    m = abs(effect) / math.sqrt(var)
    return float(stats.norm.cdf(m - b) + stats.norm.cdf(-m - b))


def msprt_sample_size(p_base: float, mde: float, alpha: float = 0.05, power: float = 0.8, share: float = 0.5,
                      unit_var: tuple[float, float] | None = None, tau: float = 0.01) -> int | None:
    """Units in total by which the mSPRT (mixing scale `tau`) has detected an absolute CTR change
    `mde` with probability at least `power`; None when share is 0 or 1 (or beyond 2^62 units).

    Conservative: it is the sample size at which one look has that power. Looking continuously
    can only reject earlier (the look at that sample size is among the looks), so the real
    chance by then is higher: 0.86 instead of 0.80 at 10% -> 11% with tau = 0.01, where the
    fixed-horizon z-test's sample_size gives the mSPRT only about 0.55. `unit_var` as in
    sample_size (normal approximation, plug-in variances)."""
    var1 = _split_variance(_default_unit_var(p_base, mde, unit_var), share)
    if var1 is None:
        return None
    gap = lambda n: msprt_power(mde, var1 / n, tau, alpha) - power  # noqa: E731
    n = 2.0
    while gap(n) < 0:
        if n > 2.0**62:
            return None
        n *= 2
    return int(math.ceil(optimize.brentq(gap, n / 2, n))) if n > 2 else 2


def msprt_mde(n_total: int, p_base: float, alpha: float = 0.05, power: float = 0.8, share: float = 0.5,
              unit_var: tuple[float, float] | None = None, tau: float = 0.01) -> float | None:
    """Smallest absolute CTR change that one look at the mSPRT on `n_total` units detects with
    the given power (conservative as msprt_sample_size); None when share is 0 or 1."""
    var1 = _split_variance(unit_var or (p_base * (1 - p_base),) * 2, share)
    if var1 is None:
        return None
    if n_total <= 0:
        return float("inf")
    var = var1 / n_total
    gap = lambda effect: msprt_power(effect, var, tau, alpha) - power  # noqa: E731
    if gap(0.0) >= 0:
        return 0.0
    high = math.sqrt(var)
    while gap(high) < 0:
        high *= 2
    return float(optimize.brentq(gap, 0.0, high))


def _default_unit_var(p_base: float, mde: float, unit_var: tuple[float, float] | None) -> tuple[float, float]:
    """One exposure per unit: the binomial at p_base and p_base + mde, unless given."""
    if unit_var is not None:
        return unit_var
    p2 = min(max(p_base + mde, 1e-9), 1 - 1e-9)
    return (p_base * (1 - p_base), p2 * (1 - p2))


def rate_above_p(events, trials, limit: float):
    """Anytime-valid p-value against "the rate is at most `limit`", from `events` in `trials`
    independent Bernoulli trials (numbers, or arrays of them): 1 / M where M is the likelihood
    ratio of a rate p against `limit`, mixed over p > limit by a Beta(1, b) prior of mean
    2 * limit truncated there.

    For any p > limit and true rate q <= limit each trial multiplies the ratio by a factor of
    expectation q p/limit + (1-q)(1-p)/(1-limit) <= 1, so M is a nonnegative supermartingale
    and, by Ville's inequality, the chance that it EVER reaches 1/alpha is at most alpha:
    rejecting at the first look where p <= alpha keeps the false-breach rate at alpha however
    often one looks. Rejecting is the same as the anytime-valid lower confidence bound of the
    rate lying above the limit. The prior's mean 2 * limit spends the power on breaches of a few
    times the limit: a true 2% against 1% is caught after about 1,000 trials (median) at alpha 0.05."""
    events, trials = np.asarray(events, float), np.asarray(trials, float)
    if limit >= 1:
        p = np.ones_like(trials)
    elif limit <= 0:
        p = np.where(events > 0, 0.0, 1.0)
    else:
        b = max((1 - 2 * limit) / (2 * limit), 1.0)
        a1, b1 = 1.0 + events, b + trials - events
        with np.errstate(divide="ignore"):  # a posterior with no mass above the limit: log 0, M = 0, p = 1
            log_tail = np.log(special.betaincc(a1, b1, limit)) - math.log(special.betaincc(1.0, b, limit))
        log_m = (special.betaln(a1, b1) - special.betaln(1.0, b) + log_tail
                 - events * math.log(limit) - (trials - events) * math.log1p(-limit))
        p = np.minimum(1.0, np.exp(-np.clip(log_m, -700.0, 700.0)))
    p = np.where(trials > 0, p, 1.0)
    return float(p) if p.ndim == 0 else p


def p99(latencies: np.ndarray) -> float:
    return float(np.percentile(latencies, 99)) if len(latencies) else float("nan")
