"""The job spec's `features:` section: how each numeric, categorical, derived and crossed column
is transformed (the settings the preprocessor is fitted with). `rayload.spec` re-exports it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ._spec_base import _Spec


class ClipSpec(_Spec):
    min: float | None = None
    max: float | None = None
    quantiles: tuple[float, float] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "ClipSpec":
        fixed = self.min is not None or self.max is not None
        if fixed == (self.quantiles is not None):
            raise ValueError("give either min/max bounds or quantiles: [low, high]")
        if self.quantiles and not 0.0 <= self.quantiles[0] < self.quantiles[1] <= 1.0:
            raise ValueError(f"quantiles must satisfy 0 <= low < high <= 1, got {list(self.quantiles)}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min must be <= max, got min={self.min}, max={self.max}")
        return self


class BucketSpec(_Spec):
    boundaries: list[float] | None = None
    quantiles: int | None = Field(default=None, ge=2, le=1000, description="number of quantile bins")

    @model_validator(mode="after")
    def _one_kind(self) -> "BucketSpec":
        if (self.boundaries is None) == (self.quantiles is None):
            raise ValueError("give either boundaries: [...] or quantiles: N")
        if self.boundaries is not None and not self.boundaries:  # one bucket for every value: a constant feature
            raise ValueError("boundaries: give at least one boundary")
        if self.boundaries is not None and sorted(set(self.boundaries)) != list(self.boundaries):
            raise ValueError(f"boundaries must be strictly increasing, got {self.boundaries}")
        return self


class NumericFeature(_Spec):
    impute: Literal["mean", "median", "constant", "most_frequent"] = "median"
    fill_value: float = 0.0
    clip: ClipSpec | None = None
    log: bool = False
    scale: Literal["none", "minmax", "zscore"] = "zscore"
    # Buckets turn the column into a categorical ID (for an embedding) instead of a dense value.
    buckets: BucketSpec | None = None


class CategoricalFeature(_Spec):
    encode: Literal["vocab", "hash", "onehot"] = "vocab"
    top_k: int | None = Field(default=None, gt=0)
    min_count: int = Field(default=1, ge=1)
    buckets: int = Field(default=100_000, ge=2, lt=2**31, description="hash buckets (encode=hash)")
    max_onehot: int = Field(default=64, ge=1)
    max_bag: int = Field(default=16, ge=1, description="IDs kept per row of a multi_categorical column")
    # Adds two dense features fitted on train: the smoothed label mean of the value and the log
    # of its count, out of fold for training rows (see target_stats.py).
    target_stats: bool = False
    # Also the smoothed mean of the label's raw value before the threshold (e.g. the star rating).
    target_raw: bool = False
    smoothing: float = Field(default=20.0, ge=0.0, description="prior weight, in rows, of the smoothed mean")
    target_folds: int = Field(default=5, ge=2)


class DerivedFeature(_Spec):
    """A numeric feature computed from a timestamp: a calendar part, optionally minus a column."""

    source: str = Field(description="a column with role timestamp")
    part: Literal["year", "month", "dayofweek", "hour", "days"] = "year"
    minus: str | None = Field(default=None, description="a numeric column subtracted from the part")


class CrossFeature(_Spec):
    columns: list[str] = Field(min_length=2)
    buckets: int = Field(default=100_000, ge=2, lt=2**31)  # an embedding table's rows


class FeatureSpec(_Spec):
    # Derived columns are numeric features: configure their transforms under `numeric`.
    derived: dict[str, DerivedFeature] = Field(default_factory=dict)
    numeric: dict[str, NumericFeature] = Field(default_factory=dict)
    categorical: dict[str, CategoricalFeature] = Field(default_factory=dict)
    crosses: list[CrossFeature] = Field(default_factory=list)
