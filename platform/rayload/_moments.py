"""Moments and weighted quantiles of the fit (`_feature_fit`): exact, mergeable in any order,
and safe from overflow for every finite column."""

from __future__ import annotations

import numpy as np


# Moments are (count, mean, M2 / 4**e, e), with max|x| < 2**e: the sum of squared deviations is
# held in units of 2**e (a power of two, so scaling is exact and ordinary columns get the very
# numbers unscaled arithmetic gives), and no finite column can overflow it (1e200 made std inf).
def _moments(x: np.ndarray) -> tuple[float, float, float, int]:
    if len(x) == 0:
        return (0.0, 0.0, 0.0, 0)
    e = _exponent(x)
    xs = np.ldexp(x, -e)
    mean = float(xs.mean())
    return (float(len(x)), float(np.ldexp(mean, e)), float(((xs - mean) ** 2).sum()), e)


def _exponent(x: np.ndarray) -> int:
    return int(np.frexp(np.max(np.abs(x)))[1])


def _constant_moments(n: float, value: float) -> tuple[float, float, float, int]:
    return (float(n), float(value), 0.0, _exponent(np.array([value])))


def _merge_moments(a, b):
    """Chan et al.'s parallel merge of (count, mean, M2): stable where sum of squares is not."""
    na, ma, m2a, ea = a
    nb, mb, m2b, eb = b
    if na == 0 or nb == 0:
        return b if na == 0 else a
    n, e = na + nb, max(ea, eb)
    ma, mb = np.ldexp(ma, -e), np.ldexp(mb, -e)
    delta = mb - ma
    m2 = np.ldexp(m2a, 2 * (ea - e)) + np.ldexp(m2b, 2 * (eb - e)) + delta * delta * na * nb / n
    return (n, float(np.ldexp(ma + delta * nb / n, e)), float(m2), e)


def _std(moments) -> float:
    n, _, m2, e = moments
    return float(np.ldexp(np.sqrt(max(m2 / max(n, 1.0), 0.0)), e))


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q) -> np.ndarray:
    """Inverse-CDF quantiles of a weighted sample (numpy's method="inverted_cdf" for unit weights)."""
    order = np.argsort(values, kind="stable")
    v, cw = values[order], np.cumsum(weights[order])
    idx = np.searchsorted(cw, np.asarray(q) * cw[-1] - 1e-9 * cw[-1], side="left")
    return v[np.minimum(idx, len(v) - 1)]


# A constant column's computed std is not 0 but rounding noise: the mean of n copies of c is
# off by up to about (16 + log2 n) ulps of c (numpy's pairwise sum, then Chan's merges, which
# stay within the blocks' means), about 1e-14 * |c|, and so is every deviation from it. Dividing
# by that noise blew a constant's values up to +-1 (7e15 for a served value off by 0.1), different
# for every block layout. A std below 1e-12 of the mean's magnitude (75x that bound; 12 bits of
# the mantissa) is such noise: no real feature varies that little relative to its size.
_CONSTANT_RTOL = 1e-12


def _negligible(std: float, mean: float) -> bool:
    return std <= _CONSTANT_RTOL * abs(mean)


def _weighted_moments(x: np.ndarray, w: np.ndarray):
    total = float(w.sum())
    if total == 0:
        return (0.0, 0.0, 0.0, 0)
    e = _exponent(x)
    xs = np.ldexp(x, -e)
    mean = float((xs * w).sum() / total)
    return (total, float(np.ldexp(mean, e)), float((w * (xs - mean) ** 2).sum()), e)
