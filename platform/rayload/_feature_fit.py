"""Fitting the preprocessor in one pass: partial statistics per batch, merged on the driver.

Why not Ray's own preprocessors (StandardScaler, MinMaxScaler, OrdinalEncoder, ...): each one
fits with its own aggregation pass over the dataset, their state is pickled rather than JSON,
and they have no single-request transform for serving. Here one `map_batches` pass computes
every column's partial statistics at once (moments with Chan's parallel merge, min/max, a
mergeable quantile sketch, value counts), and the driver merges them.

Exactness: counts, mean, min/max and vocabularies are exact. Quantiles (median imputation,
quantile clipping, quantile buckets) come from a sketch of SKETCH order statistics per batch,
exact when a batch holds at most SKETCH values and within about 1/SKETCH in rank otherwise.
The z-score of a quantile-clipped column is computed from the same sketch, because its clip
bounds are only known after the pass; every other scale statistic is exact.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from . import target_stats
from ._categorical_fit import final_categorical, heavy_counts, merge_categorical, value_counts
from ._moments import (_constant_moments, _merge_moments, _moments, _negligible, _std, _weighted_moments, quantile_edges,
                       weighted_quantile)
from .data.validate import RAW_LABEL
from .derived import derive
from .errors import DataError
from .features import CrossState, FittedFeatures, LabelState, NumericState, clip_log, transform_numeric
from .spec import CategoricalFeature, NumericFeature

log = logging.getLogger(__name__)

SKETCH = 2048
_DECILES = np.linspace(0.0, 1.0, 11)


@dataclass(frozen=True)
class FitPlan:
    numeric: tuple[tuple[str, NumericFeature], ...]
    categorical: tuple[tuple[str, CategoricalFeature, bool, str], ...]  # name, cfg, multi, separator
    crosses: tuple[CrossState, ...]
    columns: tuple[dict, ...]
    label: dict
    oof_key: tuple[str, ...] = ()  # every declared column: target-statistic folds hash it
    oof_seed: int = 0
    derived: tuple[tuple[str, dict], ...] = ()

    @property
    def target_columns(self) -> list[tuple[str, CategoricalFeature]]:
        return [(name, cfg) for name, cfg, multi, _ in self.categorical if cfg.target_stats and not multi]

    @classmethod
    def from_spec(cls, features, schema, split=None) -> "FitPlan":
        numeric, categorical = [], []
        derived = tuple((name, d.model_dump()) for name, d in features.derived.items())
        columns = list(schema.columns) + [{"name": name, "role": "numeric"} for name, _ in derived]
        for col in columns:
            name, role = col["name"], col["role"]
            if role == "numeric":
                numeric.append((name, features.numeric.get(name, NumericFeature())))
            elif role in ("categorical", "multi_categorical"):
                cfg = features.categorical.get(name, CategoricalFeature())
                categorical.append((name, cfg, role == "multi_categorical", col.get("separator", "|")))
        crosses = tuple(CrossState(list(x.columns), x.buckets) for x in features.crosses)
        # every declared column, not the split key: with split.key [user] (or a group split) all of a
        # user's rows shared a fold, and out of fold each training row's user statistic was the prior
        # (0 on every training row, the real value at serving); identical rows (upsampled copies) still share one
        key = tuple(getattr(split, "columns", None) or split.key or ()) if split is not None else ()
        seed = split.seed if split is not None else 0
        return cls(tuple(numeric), tuple(categorical), crosses, schema.columns, schema.label, key, seed, derived)


# ---------------------------------------------------------------- per batch


def partial_stats(table: pa.Table, plan: FitPlan) -> dict:
    """Statistics of one batch of validated training rows; `merge_stats` combines them."""
    table = derive(table, dict(plan.derived))
    y = table.column(plan.label["column"]).to_numpy()
    out = {"rows": table.num_rows, "label_sum": float(y.sum()), "label_pos": int((y == 1).sum())}
    for name, cfg in plan.numeric:
        out["num:" + name] = _numeric_partial(table.column(name), cfg)
    for name, cfg, multi, sep in plan.categorical:
        if cfg.encode != "hash":
            out["cat:" + name] = value_counts(table.column(name), multi, sep)
        elif not multi:
            out["cat:" + name] = heavy_counts(table.column(name))
        else:  # a hashed bag's drift tracks its missing (empty) rate only (serve/drift.py)
            out["cat:" + name] = {"nulls": table.column(name).null_count, "counts": None}
    targets = plan.target_columns
    if targets:
        folds = {cfg.target_folds for _, cfg in targets}
        by_k = {k: target_stats.row_folds(table, plan.oof_key, plan.oof_seed, k) for k in folds}
        # the labels' spread scales the statistics (target_stats.TargetState.spread; a binary label's is fixed);
        # a list, so merging concatenates
        if plan.label["task"] != "binary":
            out["label_moments"] = [_moments(y.astype(np.float64))]
        if any(cfg.target_raw for _, cfg in targets):
            out["raw_moments"] = [_moments(table.column(RAW_LABEL).to_numpy(zero_copy_only=False).astype(np.float64))]
        for name, cfg in targets:
            out["te:" + name] = [target_stats.partial(table, name, plan.label["column"], by_k[cfg.target_folds])]
            if cfg.target_raw:
                out["tr:" + name] = [target_stats.partial(table, name, RAW_LABEL, by_k[cfg.target_folds])]
    return out


def _numeric_partial(column, cfg: NumericFeature) -> dict:
    x = column.to_numpy(zero_copy_only=False).astype(np.float64)
    valid = np.sort(x[~np.isnan(x)])
    n = len(valid)
    if n > SKETCH:
        idx = ((np.arange(SKETCH) + 0.5) * n / SKETCH).astype(np.int64)
        sketch, weights = valid[idx], np.full(SKETCH, n / SKETCH)
    else:
        sketch, weights = valid, np.ones(n)
    part = {"n": n, "nulls": len(x) - n, "sketch": sketch, "weights": weights}
    part["min"], part["max"] = (float(valid[0]), float(valid[-1])) if n else (np.inf, -np.inf)
    part["raw"] = _moments(valid)
    if cfg.clip is None or cfg.clip.quantiles is None:
        part["g"] = _moments(_g(valid, cfg, cfg.clip.min if cfg.clip else None, cfg.clip.max if cfg.clip else None))
    if cfg.impute == "most_frequent":
        part["mode"] = np.unique(valid, return_counts=True)
    return part


def _g(x: np.ndarray, cfg: NumericFeature, low, high) -> np.ndarray:
    return clip_log(x, low, high, cfg.log)


# ---------------------------------------------------------------- merge


def merge_stats(parts: list[dict]) -> dict:
    merged: dict = {"rows": 0, "label_sum": 0.0, "label_pos": 0}
    for part in parts:
        for key, value in part.items():
            if key.startswith(("num:", "cat:")):
                if key not in merged:
                    merged[key] = _copy_part(value)
                elif key.startswith("num:"):
                    _merge_numeric(merged[key], value)
                else:
                    merge_categorical(merged[key], value)
            else:  # counts add up; target-statistic partials ("te:", "tr:") are lists that concatenate
                merged[key] = merged[key] + value if key in merged else list(value) if isinstance(value, list) else value
    return merged


def _copy_part(part: dict) -> dict:
    out = dict(part)
    for key in ("sketch", "weights"):
        if key in out:
            out[key] = [out[key]]
    if out.get("counts") is not None:
        out["counts"] = [out["counts"]]
    if "mode" in out:
        out["mode"] = [out["mode"]]
    return out


def _merge_numeric(acc: dict, part: dict) -> None:
    acc["n"] += part["n"]
    acc["nulls"] += part["nulls"]
    acc["min"], acc["max"] = min(acc["min"], part["min"]), max(acc["max"], part["max"])
    acc["sketch"].append(part["sketch"])
    acc["weights"].append(part["weights"])
    acc["raw"] = _merge_moments(acc["raw"], part["raw"])
    if "g" in acc:
        acc["g"] = _merge_moments(acc["g"], part["g"])
    if "mode" in acc:
        acc["mode"].append(part["mode"])


# ---------------------------------------------------------------- finalize


def finalize(merged: dict, plan: FitPlan, class_weights: dict[str, float] | None = None) -> FittedFeatures:
    numeric = [_final_numeric(name, cfg, merged["num:" + name]) for name, cfg in plan.numeric]
    categorical = [final_categorical(name, cfg, multi, sep, merged["cat:" + name], merged["rows"]) for name, cfg, multi, sep in plan.categorical]
    rows = max(merged["rows"], 1)
    label = LabelState(
        column=plan.label["column"], task=plan.label["task"], threshold=plan.label.get("threshold"),
        domain=list(plan.label["domain"]) if plan.label.get("domain") else None,
        class_weights=class_weights,
        positive_rate=merged["label_pos"] / rows if plan.label["task"] == "binary" else None,
    )
    prior = merged["label_sum"] / rows
    targets = []
    # a binary label's own statistic keeps spread None (0.5 there): equal to the features.json files written before the field
    spread = {"label": None if plan.label["task"] == "binary" else target_stats.spread_of(_all_moments(merged.get("label_moments"))),
              "raw": target_stats.spread_of(_all_moments(merged.get("raw_moments")))}
    for name, cfg in plan.target_columns:
        args = (cfg.smoothing, cfg.target_folds, plan.oof_key, plan.oof_seed)
        targets.append(target_stats.finalize(name, merged["te:" + name], prior, *args, spread=spread["label"]))
        if cfg.target_raw:
            targets.append(target_stats.finalize(name, merged["tr:" + name], None, *args, source="raw", spread=spread["raw"]))
    return FittedFeatures(numeric, categorical, list(plan.crosses), label, [dict(c) for c in plan.columns], target=targets,
                          derived={name: dict(d) for name, d in plan.derived})


def _all_moments(parts: list | None) -> tuple:
    return functools.reduce(_merge_moments, parts or [], _moments(np.zeros(0)))


def _final_numeric(name: str, cfg: NumericFeature, acc: dict) -> NumericState:
    sketch, weights = np.concatenate(acc["sketch"]), np.concatenate(acc["weights"])
    n, nulls = acc["n"], acc["nulls"]
    impute = _impute_value(cfg, acc, sketch, weights)
    low, high = _clip_bounds(cfg, sketch, weights)
    gv = float(_g(np.array([impute]), cfg, low, high)[0])
    if "g" in acc:
        moments = _merge_moments(acc["g"], _constant_moments(nulls, gv))
    else:  # quantile clip: bounds known only now, so use the sketch (see module docstring)
        gs = _g(sketch, cfg, low, high)
        moments = _merge_moments(_weighted_moments(gs, weights), _constant_moments(nulls, gv))
    g_ends = _g(np.array([acc["min"], acc["max"]]), cfg, low, high) if n else np.array([gv, gv])
    state = NumericState(name, impute, low, high, cfg.log, cfg.scale)
    # Exact (min and max are), whatever the block layout: every training output is one value.
    state.constant = bool(g_ends[0] == g_ends[1] and (nulls == 0 or gv == g_ends[0]))
    if state.constant:
        _warn_constant(name, n, nulls, gv)
    if cfg.buckets is not None:
        held = np.concatenate([_g(sketch, cfg, low, high), g_ends, [gv] if nulls else []])
        state.boundaries = [] if state.constant else _boundaries(name, cfg, sketch, weights, low, high, held)
    elif cfg.scale == "zscore":
        std = _std(moments)
        state.offset, state.divisor = moments[1], std if not _negligible(std, moments[1]) else 1.0
    elif cfg.scale == "minmax":
        lo, hi = min(g_ends[0], gv) if nulls else g_ends[0], max(g_ends[1], gv) if nulls else g_ends[1]
        state.offset, state.divisor = float(lo), float(hi) - float(lo) if hi > lo else 1.0  # inf past 1.8e308: _check_in_range refuses it
    raw_std = _std(acc["raw"]) if n else 0.0
    state.stats = {
        "count": n + nulls, "null_rate": nulls / max(n + nulls, 1), "mean": acc["raw"][1] if n else None,
        "std": raw_std if n else None, "min": acc["min"] if n else None, "max": acc["max"] if n else None,
        "quantiles": [float(v) for v in weighted_quantile(sketch, weights, _DECILES)] if n else [],
    }
    if n:
        state.stats["histogram"] = _histogram(sketch, weights, state.stats["quantiles"])
    _check_in_range(state, [v for v in (acc["min"], acc["max"], impute) if np.isfinite(v)])
    return state


def _check_in_range(state: NumericState, ends: list[float]) -> None:
    """Refused before any shard is written: a fitted number past float64 (a min-max range past
    1.8e308) or a transformed training value past float32 (3.4e38, left unscaled) would put
    inf into the shards and features.json. The transform is monotone, so the ends of the
    training values (and the imputed value) give the ends of its outputs."""
    fitted = {"impute value": state.impute_value, "offset": state.offset, "divisor": state.divisor,
              "mean": state.stats.get("mean"), "std": state.stats.get("std")}
    bad = [k for k, v in fitted.items() if v is not None and not np.isfinite(v)]
    if state.boundaries is None and ends:
        with np.errstate(over="ignore", invalid="ignore"):
            out = transform_numeric(state, pa.array(ends, pa.float64()))[state.name].to_numpy()
        bad += [] if np.isfinite(out).all() else ["outputs past float32's 3.4e38"]
    if bad:
        raise DataError(
            f"features.numeric.{state.name}: training values from {min(ends):.6g} to {max(ends):.6g} overflow the "
            f"scale={state.scale} transform ({', '.join(bad)}); clip them (features.numeric.{state.name}.clip: "
            f"{{min: ..., max: ...}} or {{quantiles: [0.001, 0.999]}}) or compress them (features.numeric.{state.name}.log: true)")


def _histogram(sketch: np.ndarray, weights: np.ndarray, quantiles: list[float]) -> dict:
    """Shares of the training values between the distinct inner deciles: the reference that
    served traffic is compared with (PSI). Computed on the weighted sketch, so ties (a value
    repeated across several deciles) get their true share instead of an assumed 10%."""
    edges = sorted(set(quantiles[1:-1]))
    index = np.searchsorted(np.asarray(edges), sketch, side="right")
    shares = np.bincount(index, weights=weights, minlength=len(edges) + 1)
    return {"edges": [float(e) for e in edges], "shares": [float(v) for v in shares / max(float(shares.sum()), 1e-12)]}


def _impute_value(cfg: NumericFeature, acc: dict, sketch, weights) -> float:
    if cfg.impute == "constant" or acc["n"] == 0:
        return float(cfg.fill_value)
    if cfg.impute == "mean":  # within [min, max], as a mean is: rounding put a constant 0.1's at 0.10000000000000002
        return float(np.clip(acc["raw"][1], acc["min"], acc["max"]))
    if cfg.impute == "median":
        return float(weighted_quantile(sketch, weights, 0.5))
    values = np.concatenate([v for v, _ in acc["mode"]])
    counts = np.concatenate([c for _, c in acc["mode"]])
    uniq, inverse = np.unique(values, return_inverse=True)
    totals = np.bincount(inverse, weights=counts)
    return float(uniq[int(np.argmax(totals))])  # ties: the smallest value


def _clip_bounds(cfg: NumericFeature, sketch, weights):
    if cfg.clip is None:
        return None, None
    if cfg.clip.quantiles is None:
        return cfg.clip.min, cfg.clip.max
    if len(sketch) == 0:
        return None, None
    low, high = weighted_quantile(sketch, weights, list(cfg.clip.quantiles))
    return float(low), float(high)


def _boundaries(name: str, cfg: NumericFeature, sketch, weights, low, high, held) -> list[float]:
    if cfg.buckets.boundaries is not None:
        return [float(b) for b in cfg.buckets.boundaries]
    if len(sketch) == 0:
        return []
    edges, atoms = quantile_edges(_g(sketch, cfg, low, high), weights, cfg.buckets.quantiles, held)
    log.info("features.numeric.%s: %d quantile buckets asked, %d given (%d value(s) holding a bucket's share of the rows "
             "or more get a bucket each)", name, cfg.buckets.quantiles, len(edges) + 1, atoms)
    return edges


def _warn_constant(name: str, n: int, nulls: int, value: float) -> None:
    what = f"missing in all {nulls} training rows" if n == 0 else f"{value:.6g} in all {n + nulls} training rows (after imputation, clip and log)"
    log.warning("features.numeric.%s: the column is %s: the model cannot learn from it, so every value, served ones too, "
                "transforms to 0 (bucketised: one bucket). Check the data, or drop the column from data.columns", name, what)
