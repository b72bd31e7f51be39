"""Numeric values too far outside the training rows for any model to score: the limit per
column, the rows of a transformed table past it, and the reason given (a request's 422, a
validation or test row's quarantine)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from .features import NumericState


# A scaled numeric value beyond this is refused (`far_limit`): a model's float32 layers overflow
# near 1e20 (DLRM's dot products square their inputs), and no z-scored or min-max scaled
# training value comes near it (a z-score is at most sqrt(rows), a min-max value within [0, 1]).
EXTREME_SCALED = 1e12


def far_limit(state: NumericState) -> float:
    """The scaled magnitude past which a value of the column is refused: a request with one
    gets a 422 and a validation or test row is quarantined (past float32 the value was inf and
    scored NaN; short of it the score depended on the architecture: an MLP answered 1.0, DLRM
    0.0, DeepFM NaN for the same request). EXTREME_SCALED, or 1,000 times the column's largest
    transformed training value where that is more (`scale: none` over millisecond timestamps,
    ~1.7e12: its own rows are not far)."""

    def build() -> float:
        ends = [v for v in (state.stats.get("min"), state.stats.get("max"), state.impute_value) if v is not None and np.isfinite(v)]
        if not ends:
            return EXTREME_SCALED
        from .features import clip_log

        x = clip_log(np.asarray(ends, np.float64), state.clip_low, state.clip_high, state.log)
        with np.errstate(over="ignore", invalid="ignore"):
            top = float(np.abs((x - state.offset) / state.divisor).max())
        return max(EXTREME_SCALED, 1e3 * top) if np.isfinite(top) else EXTREME_SCALED

    cached = state.__dict__.get("_far_limit")  # once per state (the serving hot path: _memo's checks cost microseconds)
    if cached is None or cached[0] is not state.stats:
        cached = state.__dict__["_far_limit"] = (state.stats, build())
    return cached[1]


def _collect_far(state: NumericState, values: pa.Array, far: dict) -> None:
    x = values.to_numpy(zero_copy_only=False)
    limit = far_limit(state)
    if float(np.abs(x).max(initial=0.0)) <= limit:  # NaN fails it, without a warning
        return
    for j in np.flatnonzero(~(np.abs(x) <= limit)).tolist():
        far.setdefault(j, (state, float(x[j])))


_NO_VALUE = object()


def far_reason(far: tuple[NumericState, float], raw=_NO_VALUE) -> str:
    """Why a row is refused (`far_limit`); without `raw`, one text for all such rows of the
    feature (a quarantine reason, counted)."""
    state, x = far
    limit = far_limit(state)
    what = (f"the value {raw!r} is {abs(x):.3g} once scaled (scale={state.scale}), past {limit:.3g}" if raw is not _NO_VALUE
            else f"a value not finite or past {limit:.3g} once scaled (scale={state.scale})")
    return (f"{state.name}: {what}: too far outside anything the model was trained on to score; clip the column "
            f"(features.numeric.{state.name}.clip)")
