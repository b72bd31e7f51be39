"""The power calculator: units needed for an effect, and the effect detectable with the units
so far, for the mSPRT that decides and for a fixed-horizon z-test looked at once. Normal
approximation with plug-in variances; distributions from scipy. (Re-exported by serve/stats.)"""

from __future__ import annotations

import math
import numbers

from scipy import optimize, stats


def _check(**args) -> None:
    """The calculator's inputs, named when out of range: alpha 0 or power 1 overflowed, mde 0
    divided by zero, and alpha 1.5 or p_base 1.5 answered a number (-117733 units)."""
    for name, value in args.items():
        if value is None:
            continue
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if name in ("alpha", "power") and not 0 < value < 1:
            raise ValueError(f"{name} must be in (0, 1), got {value!r}")
        if name == "p_base" and not 0 <= value <= 1:
            raise ValueError(f"p_base is a rate in [0, 1], got {value!r}")
        if name == "mde" and value == 0:
            raise ValueError("mde must not be 0: no number of units detects no change")
        if name in ("tau", "share") and not (value > 0 if name == "tau" else 0 <= value <= 1):
            raise ValueError(f"{name} must be {'> 0' if name == 'tau' else 'in [0, 1]'}, got {value!r}")
        if name == "n_total" and value < 0:
            raise ValueError(f"n_total is a count of units, got {value!r}")
    p_base, mde = args.get("p_base"), args.get("mde")
    if p_base is not None and mde is not None and not 0 <= p_base + mde <= 1:  # 0.95 + 0.1 answered 75 units
        raise ValueError(f"mde {mde!r} takes the rate {p_base!r} to {p_base + mde:.6g}, outside [0, 1]: no arm can reach it")


def _z(alpha: float) -> float:
    return float(stats.norm.ppf(1 - alpha / 2))


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
    _check(p_base=p_base, mde=mde, alpha=alpha, power=power, share=share)
    var = _split_variance(_default_unit_var(p_base, mde, unit_var), share)
    if var is None:
        return None
    z = _z(alpha) + float(stats.norm.ppf(power))
    return int(math.ceil(z * z * var / (mde * mde)))


def minimum_detectable_effect(n_total: int, p_base: float, alpha: float = 0.05, power: float = 0.8, share: float = 0.5,
                              unit_var: tuple[float, float] | None = None) -> float | None:
    """Smallest absolute CTR change the fixed-horizon z-test on `n_total` units detects with the
    given power; None when share is 0 or 1. `unit_var` as in sample_size; default: one exposure
    per unit, equal variances. The mSPRT's: msprt_mde. None too when the variance is 0 (a base
    rate of 0 or 1 with no unit_var: the normal approximation says nothing there)."""
    _check(n_total=n_total, p_base=p_base, alpha=alpha, power=power, share=share)
    var = _split_variance(unit_var or (p_base * (1 - p_base),) * 2, share)
    if not var:
        return None
    if n_total <= 0:
        return float("inf")
    z = _z(alpha) + float(stats.norm.ppf(power))
    return z * math.sqrt(var / n_total)


def msprt_power(effect: float, var: float, tau: float, alpha: float) -> float:
    """Chance that ONE look at a normal estimate of variance `var` and mean `effect` finds the
    mSPRT's Lambda >= 1/alpha: |z| beyond the boundary b with b^2 = 2 (var + tau^2) / tau^2 *
    (log(1/alpha) + log((var + tau^2) / var) / 2), solved from stats.msprt_lambda."""
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
    _check(p_base=p_base, mde=mde, alpha=alpha, power=power, share=share, tau=tau)
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
    the given power (conservative as msprt_sample_size); None when share is 0 or 1, or the
    variance is 0 (as minimum_detectable_effect)."""
    _check(n_total=n_total, p_base=p_base, alpha=alpha, power=power, share=share, tau=tau)
    var1 = _split_variance(unit_var or (p_base * (1 - p_base),) * 2, share)
    if not var1:
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
