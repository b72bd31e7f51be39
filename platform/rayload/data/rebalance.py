"""Rebalancing of the training split: down-sampling, up-sampling or class weights.

Decisions are per row from a stable hash, so the same rows are kept or repeated on every run
and under any block layout. The plan is computed on the driver from the training label counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..hashing import to_unit


# Downsampling whose chance of keeping no majority row at all is above this is refused: the rows
# are kept one by one with a probability, so a handful expected can be none (343 rows, one
# positive: the 342 negatives were all dropped 37% of the time, and the model trained on one row
# of one class). About 7 rows expected, or more, pass.
MAX_EMPTY_CHANCE = 1e-3


@dataclass(frozen=True)
class RebalancePlan:
    method: str  # none | downsample | upsample | class_weights
    seed: int = 0
    label_to_change: float | None = None  # the class whose rows are dropped or repeated
    rate: float = 1.0  # keep probability (downsample) or expected copies (upsample)
    class_weights: tuple[tuple[float, float], ...] = ()


def plan_rebalance(method: str, target_ratio: float, counts: dict[float, int], seed: int = 0) -> RebalancePlan:
    """counts: training rows per label (0.0 and 1.0)."""
    if method == "none" or len(counts) < 2:
        return RebalancePlan("none", seed)
    (minority, n_min), (majority, n_maj) = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]))
    total = n_min + n_maj
    if method == "class_weights":
        # The classes' summed weights in the ratio asked (1.0: "balanced", each class contributes
        # total/2 to the loss), the total kept: w_min * n_min = r * w_maj * n_maj and
        # w_min * n_min + w_maj * n_maj = total. Data already at least as balanced as asked keeps
        # weights of 1 (r = n_min / n_maj), as resampling then leaves it alone; target_ratio was
        # ignored here, every class weighted to 1:1.
        r = max(target_ratio, n_min / n_maj)
        share = {minority: r / (1.0 + r), majority: 1.0 / (1.0 + r)}
        weights = tuple((label, total * share[label] / n) for label, n in sorted(counts.items()))
        return RebalancePlan(method, seed, class_weights=weights)
    if n_min >= target_ratio * n_maj:
        return RebalancePlan("none", seed)  # already at least as balanced as asked
    if method == "downsample":
        rate = n_min / (target_ratio * n_maj)
        if (1 - rate) ** n_maj > MAX_EMPTY_CHANCE:  # kept row by row: the class could be left empty, without a word
            from ..errors import DataError

            raise DataError(f"rebalance.method downsample: the training split has {n_min} row(s) of label {minority:g} and "
                            f"{n_maj} of label {majority:g}; keeping {n_min} / target_ratio {target_ratio:g} of the latter, each "
                            f"row drawn on its own, keeps about {rate * n_maj:.1f}, and none at all with probability "
                            f"{(1 - rate) ** n_maj:.2%}. Use rebalance.method: class_weights or upsample, or more data")
        return RebalancePlan(method, seed, majority, rate)
    return RebalancePlan(method, seed, minority, target_ratio * n_maj / n_min)


def multiplicity(labels: np.ndarray, u: np.ndarray, plan: RebalancePlan) -> np.ndarray:
    """Copies of each training row to emit (0 drops it)."""
    copies = np.ones(len(labels), dtype=np.int64)
    if plan.method not in ("downsample", "upsample"):
        return copies
    target = labels == plan.label_to_change
    if plan.method == "downsample":
        copies[target & (u >= plan.rate)] = 0
    else:
        whole = int(np.floor(plan.rate))
        copies[target] = whole + (u[target] < plan.rate - whole)
    return copies


def apply(table: pa.Table, labels: np.ndarray, u: np.ndarray, plan: RebalancePlan) -> pa.Table:
    copies = multiplicity(labels, u, plan)
    if (copies == 1).all():
        return table
    return table.take(pa.array(np.repeat(np.arange(len(copies)), copies)))


def row_rebalance_unit(table: pa.Table, key: tuple[str, ...], seed: int) -> np.ndarray:
    """key: a row's identity, every declared column, never the split key alone: under a group
    split that is the group, and one draw per group kept or dropped whole groups."""
    from .split import row_hash

    return to_unit(row_hash(table, key, seed, salt="rebalance"))
