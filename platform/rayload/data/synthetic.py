"""Seeded, Criteo-like synthetic click-through data with a planted (known) click model.

Why: benchmarks and tests need click logs of any size that are reproducible bit for bit, look
like Criteo (heavy-tailed counts, Zipf-popular hashed IDs, nulls) and whose best achievable AUC
is known, so a trained model can be judged against the Bayes limit instead of a guess.
Row r depends only on (params, r): data are drawn in fixed chunks of CHUNK_ROWS rows, each from
its own seed, with one random stream per column, so any slice or shard layout gives equal rows.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)

CHUNK_ROWS = 65_536
_CALIB_CHUNK = 2**40  # seed key of the calibration sample; never a real chunk index
_CALIB_ROWS = 32_768
_TARGET_LOGIT_STD = 1.4  # total logit spread; tuned so the Bayes AUC is about 0.80
_TARGET_POSITIVE_RATE = 0.25
_SHARES = (0.25, 0.55, 0.20)  # logit variance shares: numeric, categorical, interactions
_N_INTERACTIONS = 4
_M32, _M64, _GOLDEN = 0xFFFFFFFF, (1 << 64) - 1, 0x9E3779B97F4A7C15
_TABLE_MAX = 1 << 21  # cardinalities up to this use cached per-ID tables
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@dataclass(frozen=True)
class SynthParams:
    """What to generate; validated on construction so bad values fail before any work."""

    rows: int = 100_000
    numeric: int = 13  # columns I1..I{numeric}
    categorical: int = 26  # columns C1..C{categorical}
    cardinalities: tuple[int, ...] | None = None  # per categorical column; None: 10..100_000 log-spaced
    zipf: float = 1.1  # Zipf exponent of categorical ID popularity
    missing_rate: float = 0.05  # fraction of nulls in each feature column
    shard_rows: int = 250_000  # rows per Parquet shard
    seed: int = 0

    def __post_init__(self) -> None:
        import numbers

        def whole(name: str, value):
            # rows=2.5 passed and failed deep in numpy as a TypeError, after the output folder was emptied
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value != int(value):
                raise ValueError(f"{name} must be a whole number, got {name}={value!r}")
            return int(value)

        for name in ("rows", "numeric", "categorical", "shard_rows", "seed"):
            object.__setattr__(self, name, whole(name, getattr(self, name)))
        if self.cardinalities is not None:  # counts too (2.5 was cut to 2, "7" taken)
            object.__setattr__(self, "cardinalities", tuple(whole("cardinalities", c) for c in self.cardinalities))
        cards = self.cardinalities
        for ok, msg in [(self.rows > 0, "rows must be > 0"), (self.numeric >= 0, "numeric must be >= 0"),
                        (self.categorical >= 0, "categorical must be >= 0"),
                        (self.numeric + self.categorical > 0, "numeric + categorical must be > 0"),
                        (1 < self.zipf < math.inf, "zipf must be > 1 and finite"), (self.shard_rows > 0, "shard_rows must be > 0"),
                        (0 <= self.missing_rate < 1, "missing_rate must be in [0, 1)"),
                        (self.seed >= 0, "seed must be >= 0")]:
            if not ok:
                field = msg.split()[0]
                raise ValueError(f"{msg}, got {field}={getattr(self, field)!r}")
        if cards is not None and len(cards) != self.categorical:
            raise ValueError(f"cardinalities length must equal categorical={self.categorical}, got {len(cards)}")
        if cards is not None and any(not 1 <= int(c) < 2**32 for c in cards):
            raise ValueError(f"cardinalities must each be in [1, 2**32), got cardinalities={cards!r}")
        if cards is not None:  # a list (or an array) failed later as an unhashable cache key
            object.__setattr__(self, "cardinalities", tuple(int(c) for c in cards))


@dataclass(frozen=True)
class SynthResult:
    """What write_synthetic wrote; bayes_auc is the noise-free AUC of the true click probability."""
    out_dir: str
    files: list[str]
    rows: int
    positive_rate: float
    bayes_auc: float
    params: SynthParams


@dataclass(frozen=True)
class _Model:
    """The planted click model; per-ID effects are hashes of (key, rank), never stored objects."""
    num_mu: np.ndarray
    num_sigma: np.ndarray
    num_w: np.ndarray
    cat_sigma: np.ndarray
    cards: tuple[int, ...]
    cat_keys: tuple[int, ...]
    id_keys: tuple[int, ...]
    pairs: tuple[tuple[str, int, int, float, int], ...]  # (kind, cat a, b, gamma, factor key)
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0)
    bias: float = 0.0


def feature_names(params: SynthParams) -> tuple[list[str], list[str]]:
    """Column names in Criteo's convention: (["I1", ...], ["C1", ...])."""
    return [f"I{i + 1}" for i in range(params.numeric)], [f"C{j + 1}" for j in range(params.categorical)]


def cardinalities(params: SynthParams) -> tuple[int, ...]:
    """Explicit cardinalities, or a deterministic log-spaced spread from 10 to 100_000."""
    cards = params.cardinalities or np.geomspace(10, 100_000, params.categorical).round()
    return tuple(int(c) for c in cards)


def _mix64(x: np.ndarray, key: int) -> np.ndarray:
    """Vectorised splitmix64 of (x ^ key): stateless pseudo-random values per ID (wrapping uint64)."""
    x = (x.astype(np.uint64) ^ np.uint64(key & _M64)) + np.uint64(_GOLDEN)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> int:
    """An independent 64-bit hash key per (seed, purpose, column), chained through splitmix64."""
    h = np.zeros(1, dtype=np.uint64)
    for part in parts:
        h = _mix64(h, part)
    return int(h[0])


def _hash_normal(ranks: np.ndarray, key: int) -> np.ndarray:
    """A standard normal per ID (Box-Muller on the two halves of one hash); rank 0 (null) -> 0."""
    h = _mix64(ranks, key)
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 1.0) * 2.0**-32
    u2 = (h & np.uint64(_M32)).astype(np.float64) * 2.0**-32
    return np.where(ranks > 0, np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2), 0.0)


def _hex_packed(ranks: np.ndarray, key32: int) -> np.ndarray:
    """8 hex chars per ID packed in a uint64, via murmur3's fmix32 (a bijection: no collisions)."""
    h = (ranks.astype(np.uint64) ^ np.uint64(key32)) & np.uint64(_M32)
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, 1)):
        h = ((h ^ (h >> np.uint64(shift))) * np.uint64(mult)) & np.uint64(_M32)
    chars = _HEX[(h[:, None] >> np.arange(28, -1, -4, dtype=np.uint64)) & np.uint64(15)]
    return np.ascontiguousarray(chars).view(np.uint64).ravel()


@lru_cache(maxsize=256)
def _id_table(fn: Callable[[np.ndarray, int], np.ndarray], key: int, card: int) -> np.ndarray:
    return fn(np.arange(card + 1, dtype=np.int64), key)


def _per_id(fn: Callable[[np.ndarray, int], np.ndarray], ranks: np.ndarray, key: int, card: int) -> np.ndarray:
    """fn(ranks, key) via a cached table of all IDs while that is small (a gather beats re-hashing
    every row), by hashing each row beyond _TABLE_MAX IDs."""
    return _id_table(fn, key, card)[ranks] if card <= _TABLE_MAX else fn(ranks, key)


def _strings(packed: np.ndarray, valid: np.ndarray) -> pa.Array:
    """Arrow strings straight from the packed chars: no Python string objects per row."""
    n, nulls = len(packed), int(len(valid) - np.count_nonzero(valid))
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    offsets = pa.py_buffer(np.arange(0, 8 * n + 1, 8, dtype=np.int32))
    return pa.StringArray.from_buffers(n, offsets, pa.py_buffer(packed.tobytes()), bitmap, nulls)


@lru_cache(maxsize=64)
def _zipf_cdf(card: int, s: float) -> np.ndarray:
    """Exact bounded-Zipf CDF over ranks 1..card (cached: sampling is one searchsorted)."""
    cdf = np.cumsum(np.arange(1, card + 1, dtype=np.float64) ** -s)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    return cdf


@lru_cache(maxsize=8)
def _zipf_head(s: float) -> np.ndarray:
    """Unnormalised cumulative weights of ranks 1.._TABLE_MAX (the exact head of a larger one)."""
    return np.cumsum(np.arange(1, _TABLE_MAX + 1, dtype=np.float64) ** -s)


def _zipf_ranks(card: int, s: float, u: np.ndarray) -> np.ndarray:
    """Bounded-Zipf ranks in 1..card for uniforms u. Up to _TABLE_MAX ranks, the exact CDF. Past
    it the exact CDF would hold 8 bytes per rank (16 GiB at 2**31, which validation allows), so
    the head stays exact and the tail's weights sum_{k>H} k^-s are the midpoint-rule integral
    of x^-s over [H + 0.5, card + 0.5], inverted in closed form and rounded to the nearest rank
    (relative error of a tail rank's weight ~ s(s+1)/(24 k^2) < 1e-12 at k > 2**21)."""
    if card <= _TABLE_MAX:
        return np.minimum(np.searchsorted(_zipf_cdf(card, s), u, side="right") + 1, card)
    head = _zipf_head(s)
    a, lo = 1.0 - s, _TABLE_MAX + 0.5
    tail = ((card + 0.5) ** a - lo ** a) / a
    v = u * (head[-1] + tail)
    in_head = v < head[-1]
    ranks = np.empty(len(u), dtype=np.int64)
    ranks[in_head] = np.searchsorted(head, v[in_head], side="right") + 1
    x = (lo ** a + a * (v[~in_head] - head[-1])) ** (1.0 / a)
    ranks[~in_head] = np.clip(np.floor(x + 0.5), _TABLE_MAX + 1, card).astype(np.int64)
    return ranks


def _draw(params: SynthParams, model: _Model, seq: np.random.SeedSequence, n: int) -> dict[str, np.ndarray]:
    """The first n rows of one chunk (rows on the last axis). One stream per column and purpose
    makes every prefix stable, so a short final chunk or a slice never shifts later values."""
    rngs = iter([np.random.default_rng(s) for s in seq.spawn(1 + 2 * (params.numeric + params.categorical))])
    label_u = next(rngs).random(n)
    nums = np.empty((params.numeric, n), dtype=np.int64)
    num_valid = np.empty((params.numeric, n), dtype=bool)
    for i, (mu, sigma) in enumerate(zip(model.num_mu, model.num_sigma)):
        nums[i] = np.floor(next(rngs).lognormal(mu, sigma, n))
        num_valid[i] = next(rngs).random(n) >= params.missing_rate
    ranks = np.empty((params.categorical, n), dtype=np.int64)
    for j, card in enumerate(model.cards):
        r = _zipf_ranks(card, params.zipf, next(rngs).random(n))
        ranks[j] = np.where(next(rngs).random(n) >= params.missing_rate, r, 0)
    return {"label_u": label_u, "nums": nums, "num_valid": num_valid, "ranks": ranks}


def _logs(d: dict[str, np.ndarray]) -> np.ndarray:
    """log1p of every numeric count, 0 where missing (the generator's view of a missing count)."""
    return np.where(d["num_valid"], np.log1p(d["nums"]), 0.0)


def _pair_factors(model: _Model, d: dict[str, np.ndarray], logs: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per planted interaction (model.pairs order), its two per-row factors: the first ID's
    factor and the second ID's (cat x cat) or the numeric log count (cat x numeric)."""
    return [(_per_id(_hash_normal, d["ranks"][a], key, model.cards[a]),
             _per_id(_hash_normal, d["ranks"][b], key ^ 1, model.cards[b]) if kind == "cc" else logs[b])
            for kind, a, b, _, key in model.pairs]


def _raw_scores(model: _Model, d: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unscaled logit parts (numeric, categorical, interactions); missing values add 0."""
    logs = _logs(d)
    num, cat, inter = (np.zeros(len(d["label_u"])) for _ in range(3))
    for w, lg in zip(model.num_w, logs):  # a plain loop, not BLAS: same sums whatever the slice
        num += w * lg
    for sigma, key, card, r in zip(model.cat_sigma, model.cat_keys, model.cards, d["ranks"]):
        cat += sigma * _per_id(_hash_normal, r, key, card)
    for (_, _, _, gamma, _), (fa, fb) in zip(model.pairs, _pair_factors(model, d, logs)):
        inter += gamma * fa * fb
    return num, cat, inter


def _logit(model: _Model, d: dict[str, np.ndarray]) -> np.ndarray:
    num, cat, inter = _raw_scores(model, d)
    return model.bias + model.scales[0] * num + model.scales[1] * cat + model.scales[2] * inter


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _pick_pairs(rng: np.random.Generator, params: SynthParams) -> tuple:
    """A few cat x cat interactions plus one cat x numeric, as far as the column counts allow."""
    pairs = []
    for k in range(_N_INTERACTIONS):
        gamma, key = float(rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.0)), _key(params.seed, 3, k)
        if params.categorical >= 2 and (k < _N_INTERACTIONS - 1 or params.numeric == 0):
            a, b = (int(i) for i in rng.choice(params.categorical, 2, replace=False))
            pairs.append(("cc", a, b, gamma, key))
        elif params.categorical >= 1 and params.numeric >= 1:
            a, b = int(rng.integers(params.categorical)), int(rng.integers(params.numeric))
            pairs.append(("cn", a, b, gamma, key))
    return tuple(pairs)


def _model(params: SynthParams) -> _Model:
    # rows and shard_rows do not change the model: normalise them so layouts share one cache entry
    return _build_model(dataclasses.replace(params, rows=1, shard_rows=1))


@lru_cache(maxsize=16)
def _build_model(params: SynthParams, items_seed: int | None = None) -> _Model:
    """Draw the planted model from default_rng(seed), then calibrate it on a private sample:
    group scales fix the variance shares (so the Bayes AUC barely moves with column counts)
    and the bias is bisected to a Criteo-like positive rate. `items_seed`: the feature values
    (numeric distributions, ID strings, cardinalities) are that seed's model's, and the
    calibration sample is drawn from them (a drifted world: drifted_model)."""
    rng, m = np.random.default_rng(params.seed), params.categorical
    model = _Model(
        num_mu=rng.uniform(-0.5, 4.0, params.numeric), num_sigma=rng.uniform(0.6, 2.2, params.numeric),
        num_w=rng.normal(0.0, 1.0, params.numeric), cat_sigma=rng.uniform(0.5, 1.5, m),
        cards=cardinalities(params), cat_keys=tuple(_key(params.seed, 1, j) for j in range(m)),
        id_keys=tuple(_key(params.seed, 2, j) & _M32 for j in range(m)), pairs=_pick_pairs(rng, params))
    if items_seed is not None:
        items = _model(dataclasses.replace(params, seed=items_seed))
        model = dataclasses.replace(model, num_mu=items.num_mu, num_sigma=items.num_sigma, id_keys=items.id_keys, cards=items.cards)
    sample = _draw(params, model, np.random.SeedSequence([params.seed, _CALIB_CHUNK]), _CALIB_ROWS)
    # a part constant up to rounding (every categorical of cardinality 1, no missing values) has a
    # spread of ~1e-16, not 0: scaled by its inverse the logit was +-1e16, and every label the same
    stds = [float(np.std(part)) if np.ptp(part) > 1e-9 * (1.0 + float(np.abs(part).max(initial=0.0))) else 0.0
            for part in _raw_scores(model, sample)]
    if not any(stds):
        from ..errors import DataError

        raise DataError(f"the synthetic features carry no signal (cardinalities={cardinalities(params)}, "
                         f"missing_rate={params.missing_rate}, numeric={params.numeric}): raise a cardinality above 1, "
                         "missing_rate above 0, or numeric above 0")
    total = sum(share for share, sd in zip(_SHARES, stds) if sd > 0)
    scales = tuple(float(_TARGET_LOGIT_STD * np.sqrt(sh / total) / sd) if sd > 0 else 0.0
                   for sh, sd in zip(_SHARES, stds))
    centred = _logit(dataclasses.replace(model, scales=scales), sample)
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _sigmoid(centred + mid).mean() < _TARGET_POSITIVE_RATE else (lo, mid)
    log.debug("synthetic model: scales=%s bias=%.4f", scales, (lo + hi) / 2)
    return dataclasses.replace(model, scales=scales, bias=(lo + hi) / 2)


def _to_table(params: SynthParams, model: _Model, d: dict[str, np.ndarray], p: np.ndarray) -> pa.Table:
    """Arrow columns for drawn rows; labels are Bernoulli(p) and p itself stays out."""
    num_names, cat_names = feature_names(params)
    cols = {"label": pa.array((d["label_u"] < p).astype(np.int8))}
    for name, x, valid in zip(num_names, d["nums"], d["num_valid"]):
        cols[name] = pa.array(x, type=pa.int64(), mask=~valid)
    for name, r, key, card in zip(cat_names, d["ranks"], model.id_keys, model.cards):
        cols[name] = _strings(_per_id(_hex_packed, r, key, card), r > 0)
    return pa.table(cols)


def drifted_model(params: SynthParams, drift_seed: int) -> _Model:
    """The world after a change of taste: the same users, items and feature values (ID strings,
    numeric distributions), but click effects drawn afresh from `drift_seed`, calibrated to the
    same positive rate and logit spread on those items."""
    # Calibrated on the items it will score: calibrated on the drift seed's own numeric
    # distributions and then given the base's, its positive rate landed anywhere from 0.16 to 0.47.
    return _build_model(dataclasses.replace(params, seed=drift_seed, rows=1, shard_rows=1), items_seed=params.seed)


def generate_table_with_truth(params: SynthParams, start: int, stop: int, drift_seed: int | None = None) -> tuple[pa.Table, np.ndarray]:
    """Rows [start, stop) plus their true click probability; built chunk by chunk so the peak
    memory beyond the result stays one chunk's worth. With `drift_seed` the rows are the same
    but labels and probabilities follow the drifted ground truth (drifted_model)."""
    if not 0 <= start <= stop <= params.rows:
        raise ValueError(f"need 0 <= start <= stop <= rows={params.rows}, got start={start}, stop={stop}")
    model, tables, probs, first = _model(params), [], [], start // CHUNK_ROWS
    truth = model if drift_seed is None else drifted_model(params, drift_seed)
    for chunk in range(first, max(-(-stop // CHUNK_ROWS), first + 1)):
        c0 = chunk * CHUNK_ROWS
        lo, hi = max(start, c0) - c0, min(stop, c0 + CHUNK_ROWS) - c0
        drawn = _draw(params, model, np.random.SeedSequence([params.seed, chunk]), hi)
        d = {k: v[..., lo:] for k, v in drawn.items()}
        probs.append(_sigmoid(_logit(truth, d)))
        tables.append(_to_table(params, model, d, probs[-1]))
    return pa.concat_tables(tables), np.concatenate(probs)


def generate_table(params: SynthParams, start: int, stop: int) -> pa.Table:
    """Rows [start, stop) of the data set: label (int8), I* (int64), C* (string)."""
    return generate_table_with_truth(params, start, stop)[0]


# Writing the data set (shards and synthetic.json) and the weighted AUC of its truth: synthetic_files.
from .synthetic_files import weighted_auc, write_synthetic  # noqa: E402, F401  (public here)
