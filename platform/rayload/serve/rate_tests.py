"""The sample-ratio-mismatch check and the guardrails' rate tests: counts of units, failures and
slow requests against what the configured split or a limit allows (re-exported by stats)."""

from __future__ import annotations

import math

import numpy as np
from scipy import special, stats

SRM_MIN_EXPECTED = 5  # the usual rule for the chi-square approximation


def srm_statistic(units: dict[str, int], weights: dict[str, float]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of exposed units against the configured
    shares (arms with weight > 0). (0, 0), no test, while an arm expects fewer than
    SRM_MIN_EXPECTED units: the chi-square distribution is no approximation there (the first
    unit of a 5% arm, a 1-in-20 event, read as p = 1e-5), and a mismatch large enough to matter
    shows once the counts are. Units in an arm the weights give no share (weight 0, or not
    named) are a mismatch outright: (inf, 1), p = 0. Leaving them out of the test let a
    broken assignment that sent half the units to a weight-0 arm pass with p = 1."""
    arms = [a for a, w in weights.items() if w > 0]
    if any(n > 0 and a not in arms for a, n in units.items()):
        return (math.inf, max(1, len(arms) - 1))
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


ODDS_RATIOS = np.geomspace(1.25, 20.0, 13)  # the mixture's alternatives: a challenger failing 1.25x to 20x as often


def failures_above_p(challenger: np.ndarray, share: np.ndarray) -> float:
    """Anytime-valid p-value against "the challenger fails no more often than the champion",
    from the failed requests of the two arms: per failure, whether it was the challenger's and
    the challenger's share of the requests of its weight period (the split then in force).

    Were the arms to fail alike, a failure is the challenger's with probability `share`; no
    more if it fails less. Against a challenger whose odds of failing are theta >= 1 times the
    champion's, each failure multiplies the likelihood ratio by theta^x / (1 - share + share
    theta), whose expectation under that null is at most 1; the product is a nonnegative
    supermartingale, and so is its mixture over ODDS_RATIOS (equal weights). By Ville's
    inequality the chance that 1 / mixture EVER falls to alpha is at most alpha, however often
    one looks. Conditioning on the failures cancels what both arms share (an incident), and a
    period's own share keeps a ramp step from looking like a difference."""
    x, q = np.asarray(challenger, float)[:, None], np.asarray(share, float)[:, None]
    if not len(x):
        return 1.0
    log_lr = (x * np.log(ODDS_RATIOS) - np.log1p(q * (ODDS_RATIOS - 1))).sum(axis=0)
    log_m = float(special.logsumexp(log_lr) - math.log(len(ODDS_RATIOS)))
    return float(min(1.0, math.exp(-min(log_m, 700.0))))


def p99(latencies: np.ndarray) -> float:
    return float(np.percentile(latencies, 99)) if len(latencies) else float("nan")
