"""Moments and weighted quantiles of the fit (`_feature_fit`): mergeable in any order and safe
from overflow for every finite column. Quantiles and min/max are exact whatever the batch layout;
the mean and standard deviation merge in floating point (Chan's method), so two layouts of the
same rows agree to within a few ulps, not bit for bit (a mean of 0.4666666666666667 against
0.4666666666666666 in a probe)."""

from __future__ import annotations

import numpy as np


# Moments are (count, mean, M2 / 4**e, e, pivot, (mean - pivot) / 2**e), with max|x| < 2**e: the
# sum of squared deviations is held in units of 2**e (a power of two, so scaling is exact), and
# no finite column can overflow it (1e200 made std inf). The mean is carried as an offset from a
# pivot (a block's first value): an offset from a value of the column is small and keeps every
# digit, where the mean itself, rounded to its ulp at every merge, threw the spread of a large,
# low-spread column off (std of sorted blocks of 1e15 + N(0, 1) 10% wrong). `mean` (index 1) is
# pivot + offset, for readers.
_EMPTY = (0.0, 0.0, 0.0, 0, 0.0, 0.0)


def _moments(x: np.ndarray) -> tuple:
    return _weighted_moments(x, None)


def _weighted_moments(x: np.ndarray, w: np.ndarray | None) -> tuple:
    total = float(len(x)) if w is None else float(w.sum())
    if len(x) == 0 or total == 0:
        return _EMPTY
    e = _exponent(x)
    pivot = float(x[0])
    d = np.ldexp(x, -e) - np.ldexp(pivot, -e)  # in (-2, 2): no overflow
    rel = float(d.mean() if w is None else (d * w).sum() / total)
    m2 = float(((d - rel) ** 2).sum() if w is None else (w * (d - rel) ** 2).sum())
    return (total, _mean(pivot, rel, e), m2, e, pivot, rel)


def _mean(pivot: float, rel: float, e: int) -> float:
    return float(np.ldexp(np.ldexp(pivot, -e) + rel, e))  # summed in units of 2**e: cannot overflow


def _exponent(x: np.ndarray) -> int:
    return int(np.frexp(np.max(np.abs(x)))[1])


def _constant_moments(n: float, value: float) -> tuple:
    return (float(n), float(value), 0.0, _exponent(np.array([value])), float(value), 0.0) if n else _EMPTY


def _merge_moments(a, b):
    """Chan et al.'s parallel merge of (count, mean, M2): stable where sum of squares is not.
    b's mean is moved to a's pivot first."""
    if a[0] == 0 or b[0] == 0:
        return b if a[0] == 0 else a
    na, _, m2a, ea, pa, ra = a
    nb, _, m2b, eb, pb, rb = b
    n, e = na + nb, max(ea, eb)
    ra = np.ldexp(ra, ea - e)
    rb = np.ldexp(rb, eb - e) + (np.ldexp(pb, -e) - np.ldexp(pa, -e))
    delta = rb - ra
    m2 = np.ldexp(m2a, 2 * (ea - e)) + np.ldexp(m2b, 2 * (eb - e)) + delta * delta * na * nb / n
    rel = float(ra + delta * nb / n)
    return (n, _mean(pa, rel, e), float(m2), e, pa, rel)


def _std(moments) -> float:
    n, m2, e = moments[0], moments[2], moments[3]
    return float(np.ldexp(np.sqrt(max(m2 / max(n, 1.0), 0.0)), e))


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q) -> np.ndarray:
    """Inverse-CDF quantiles of a weighted sample (numpy's method="inverted_cdf" for unit weights)."""
    order = np.argsort(values, kind="stable")
    v, cw = values[order], np.cumsum(weights[order])
    idx = np.searchsorted(cw, np.asarray(q) * cw[-1] - 1e-9 * cw[-1], side="left")
    return v[np.minimum(idx, len(v) - 1)]


# A constant column (caught exactly by its min and max, `_feature_fit`) has std 0 here: every
# offset from its pivot is 0. Before the pivot its computed std was rounding noise (the mean of
# n copies of c is off by up to about (16 + log2 n) ulps of c), and dividing by it blew values
# up to +-1. A std within _NOISE_ULPS ulps of the mean is still taken for noise (values a few
# ulps apart, e.g. sums rounded differently upstream) and not divided by. (A relative 1e-12, about
# 4,500 ulps, also took real spreads for noise: epoch nanoseconds 0.4 ms apart, std 9e5 at 1.7e18,
# went unscaled, their z-scores near 1e6.)
# That rule only matters for a std under 1: dividing by a std of 1 or more can only shrink the
# offsets, so it never blows noise up, and leaving it undivided left real spreads of large
# values as raw offsets (epoch nanoseconds 5 us apart: outputs +-1.3e4 instead of +-1.5).
_NOISE_ULPS = 64


def _negligible(std: float, mean: float) -> bool:
    return std < 1.0 and std <= _NOISE_ULPS * float(np.spacing(abs(mean)))


def quantile_edges(values: np.ndarray, weights: np.ndarray, buckets: int, held: np.ndarray) -> tuple[list[float], int]:
    """Edges of about `buckets` equal-frequency buckets (`searchsorted(side="right")`) of a
    weighted sample, none of them without training values, and how many values got a bucket
    of their own.

    A value holding a bucket's share of the rows or more (an atom: the zeros of a zero-inflated
    column) gets a bucket of its own, [a, nextafter(a)), and the other buckets share the rest
    of the rows equally: plain quantiles repeat the atom, and dropping the duplicates lost
    buckets (10 asked, 5 given). `held` are the values training rows hold (the sketch's, the
    exact min and max, the imputed value): an edge that would leave a bucket without one is
    dropped, so the values below the training minimum share the lowest trained bucket rather
    than an untrained one of their own. A sample without atoms gets its plain quantiles."""
    u, inverse = np.unique(values, return_inverse=True)
    mass = np.bincount(inverse, weights=weights, minlength=len(u))
    atom = _atoms(mass, buckets)
    # An atom inside the range splits one equal-frequency bucket in three; at an end, in two.
    inner = atom.copy()
    inner[[0, -1]] = False
    k = buckets - int(atom.sum()) - int(inner.sum())
    rest = ~np.isin(values, u[atom])
    out = []
    for balanced in (False, True):
        edges = [u[atom], np.nextafter(u[atom], np.inf)]
        if k >= 2 and rest.any():
            edges.append(_quantiles(values[rest], weights[rest], np.arange(1, k) / k, balanced))
        out.append(_at_most(_trained(np.unique(np.concatenate(edges)), np.unique(held)), buckets, u[atom]))
    # The tie-balanced edges where they even the buckets out (a lower largest share; at a tie, more
    # buckets), else the plain quantiles: at ties, each quantile's nearer side alone can leave a
    # bucket beside an atom short (ratings in 4 buckets), or merge two.
    return min(out, key=lambda e: (_largest(values, weights, e), -len(e))), int(atom.sum())


def _largest(values: np.ndarray, weights: np.ndarray, edges: list[float]) -> float:
    """The largest bucket's share of the weight (rounded, so float noise does not decide a tie)."""
    shares = np.bincount(np.searchsorted(np.asarray(edges), values, side="right"), weights=weights, minlength=len(edges) + 1)
    return round(float(shares.max() / max(float(shares.sum()), 1e-300)), 9)


def _quantiles(values: np.ndarray, weights: np.ndarray, q: np.ndarray, balanced: bool) -> np.ndarray:
    """Edges at the q-quantiles; `balanced`: a tied quantile value on the side that leaves the
    bucket below it nearer its share (an edge at v puts v's rows above it, one at nextafter(v)
    below). Always at v, integers 1..10 in 5 buckets were split 10/30/10/30/20%, not 20% each.
    A value held once (continuous data) keeps its edge at v."""
    at = weighted_quantile(values, weights, q)
    if not balanced:
        return at
    order = np.argsort(values, kind="stable")
    v, cw = values[order], np.cumsum(weights[order])
    total = cw[-1]
    lo, hi = np.searchsorted(v, at, side="left"), np.searchsorted(v, at, side="right")
    below = np.where(lo > 0, cw[np.maximum(lo - 1, 0)], 0.0)  # the mass an edge at v leaves below it
    upto = cw[hi - 1]  # ... and one at nextafter(v)
    tied = hi - lo > 1
    after = tied & (np.abs(upto - q * total) < np.abs(below - q * total))
    return np.where(after, np.nextafter(at, np.inf), at)


def _at_most(edges: list[float], buckets: int, atoms: np.ndarray) -> list[float]:
    """At most `buckets` buckets: an atom inside the range takes three (below, itself, above), so
    with few buckets asked (2, or many atoms) the atoms' own buckets could add up to more. Then
    an atom shares the bucket above it (its upper edge goes, the last atom's first), and if that
    is not enough, the bucket below it."""
    over = len(edges) + 1 - buckets
    for bound in (set(np.nextafter(atoms, np.inf).tolist()), set(atoms.tolist())):
        for e in sorted((e for e in edges if e in bound), reverse=True)[:max(over, 0)]:
            edges.remove(e)
            over -= 1
    return edges


def _atoms(mass: np.ndarray, buckets: int) -> np.ndarray:
    """The values holding a bucket's share or more of the mass the other values leave."""
    atom = np.zeros(len(mass), dtype=bool)
    while True:
        k, rest = buckets - int(atom.sum()), float(mass[~atom].sum())
        new = ~atom & (mass >= rest / max(k, 1) - 1e-9 * rest)  # weighted_quantile's tolerance
        if k < 1 or rest <= 0 or not new.any():
            return atom
        atom |= new


def _trained(edges: np.ndarray, held: np.ndarray) -> list[float]:
    """The edges, less those that would leave a bucket without a held value."""
    kept: list[float] = []
    low = -np.inf
    for e in edges:
        i = np.searchsorted(held, low, side="left")
        if i < len(held) and held[i] < e:  # some value in [low, e)
            kept.append(float(e))
            low = e
    if kept and not (held >= kept[-1]).any():
        kept.pop()
    return kept
