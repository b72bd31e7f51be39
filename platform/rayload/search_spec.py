"""Typed search specs (`tune/*.yaml`); loading and the checks against the base job spec are in
`search_job` (`load_search_spec`).

A search spec names a base job spec and the hyperparameters to search, as dotted paths into
that job spec (`train.lr`, `model.embedding_dim`). Everything that can be checked before a
trial runs is checked here: every path exists, bounds are ordered, log scales are positive,
choices are not empty, the strategy can use the parameter kinds, and every extreme value of
the space still makes a valid job spec.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ._quantities import GpuQuantity, RayQuantity
from .errors import SpecIssue
from .paths import NAME_MAX, NAME_PATTERN
from .spec import _Spec as _JobSpecBase


# Parameters under these sections change the preprocessed data; the driver prepares each variant.
PREPROCESSING = ("data", "split", "rebalance", "features")
MAX_VARIANTS = 8

# Which way is better for every metric a job's epochs report (search_job._reported_metrics), by
# its name without val_/train_. None: neither (calibration is best at 1; the mean prediction and
# the observed rate describe the data), so a search on it must give `mode`.
METRIC_MODES: dict[str, str | None] = {"loss": "min", "logloss": "min", "rmse": "min", "ece": "min", "auc": "max",
                                       "calibration": None, "mean_prediction": None, "observed_rate": None}


def metric_mode(metric: str) -> str | None:
    """The mode a metric is better in, or None (no better direction, or not a metric epochs report)."""
    return METRIC_MODES.get(metric.removeprefix("val_").removeprefix("train_"))


class _Spec(_JobSpecBase):
    """As a job spec's sections (no true/false for a number: num_samples=true ran one trial), but
    bounds may be written infinite: Param.problems names them."""

    model_config = ConfigDict(allow_inf_nan=True)


_int = int  # `int` is also a field name of Param


class Param(_Spec):
    """One searched value. Exactly one of the kinds; a bare YAML list is a grid."""

    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    int: tuple[_int, _int] | None = None
    choice: list[Any] | None = None
    grid: list[Any] | None = None
    log: bool = False  # for int: sample on a log scale
    step: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # for uniform/int: a quantised range

    @model_validator(mode="before")
    @classmethod
    def _bare_list_is_grid(cls, value):
        return {"grid": value} if isinstance(value, list) else value

    @property
    def kind(self) -> str:
        kinds = [k for k in ("uniform", "loguniform", "int", "choice", "grid") if getattr(self, k) is not None]
        return kinds[0] if len(kinds) == 1 else ""

    @property
    def values(self) -> list[Any]:
        """The values a check can try: both bounds of a range, every choice or grid value (none
        for a parameter of no kind or of two, which `problems` refuses: getattr(self, '') raised)."""
        return list(getattr(self, self.kind)) if self.kind else []

    def inside(self) -> float | None:
        """A value strictly inside a float range that the sampler can draw, with a fractional
        part where the range allows one (None for int ranges, lists and empty ranges). The ends
        alone pass an integer field (pydantic takes 8.0 for an int) while 23.7 would not."""
        import math

        if self.kind not in ("uniform", "loguniform"):
            return None
        low, high = getattr(self, self.kind)
        if not low < high:
            return None
        at = 0.4142135623730951  # an irrational fraction of the way: never a round value
        if self.step is not None:
            n = int((high - low) // self.step)
            if n < 2:
                return None
            # of two neighbouring steps one has a fractional part when the steps have any (from 8
            # by 0.5, 31.0 alone would hide 31.5, and the integer field would pass)
            k = max(1, round(n * at))
            return next((v for v in (low + self.step * k, low + self.step * (k + 1)) if v != round(v)), low + self.step * k)
        if self.kind == "loguniform" or self.log:
            if low <= 0:
                return None
            return math.exp(math.log(low) + at * (math.log(high) - math.log(low)))
        return low + at * (high - low)

    def refuses(self, value: Any) -> str | None:
        """Why `value` is not a value of this parameter (a point to evaluate first), or None."""
        import math
        import numbers

        kind = self.kind
        if kind in ("choice", "grid"):
            same = [v for v in getattr(self, kind) if v == value and isinstance(v, bool) == isinstance(value, bool)]
            return None if same else f"not one of the {kind} values {getattr(self, kind)}"
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            return f"not a number in the {kind} range"
        low, high = getattr(self, kind)
        if kind == "int" and not isinstance(value, numbers.Integral):
            return f"an int range takes whole numbers (write {value!r} as an integer)"
        if not low <= value <= high:
            return f"outside the {kind} range [{low:g}, {high:g}]"
        if self.step is not None:
            steps = (value - low) / self.step
            if abs(steps - round(steps)) > 1e-9 * max(1.0, abs(steps)):
                return f"not on the range's steps ({low:g}, {low + self.step:g}, ... by {self.step:g})"
        return None

    def problems(self) -> list[str]:
        kinds = [k for k in ("uniform", "loguniform", "int", "choice", "grid") if getattr(self, k) is not None]
        if len(kinds) != 1:
            return [f"give exactly one of uniform, loguniform, int, choice or a grid list (got {', '.join(kinds) or 'none'})"]
        kind = kinds[0]
        if kind in ("choice", "grid"):
            values = getattr(self, kind)
            if self.step is not None:
                return [f"step is for uniform and int ranges; a {kind} list takes its values as given (remove step)"]
            if self.log:
                return [f"log is for uniform and int ranges; a {kind} list takes its values as given (remove log)"]
            if not values:
                return [f"{kind} needs at least one value"]
            # By value, as the job spec will read them (8 and 8.0 are one value; a bool is not a number).
            if any(v == w and isinstance(v, bool) == isinstance(w, bool) for i, v in enumerate(values) for w in values[:i]):
                return [f"{kind} lists a value twice: {values}"]
            return []
        low, high = getattr(self, kind)
        import math

        if not (math.isfinite(low) and math.isfinite(high)):  # inf passed and failed the first draw, inside Tune
            return [f"{kind} bounds must be finite numbers (got [{low}, {high}])"]
        out = []
        if low > high:
            out.append(f"low > high ({low} > {high})")
        if (kind == "loguniform" or self.log) and low <= 0:
            out.append(f"a log scale needs low > 0 (got low={low})")
        if (kind == "loguniform" or self.log) and self.step is not None:
            out.append(f"{'loguniform' if kind == 'loguniform' else 'log'} and step cannot be combined: a log scale is not "
                       "quantised; use uniform with step, or drop step")
        if kind == "int" and not (-2**63 <= low and high < 2**63):
            out.append(f"int bounds must fit in 64 bits (got [{low}, {high}])")
        if kind == "int" and self.step is not None and self.step != _int(self.step):
            out.append(f"an int range steps by a whole number (got step={self.step:g})")
        elif self.step is not None and low < high and not out:
            # Optuna moves high down to the last step at or below it, with only a log warning:
            # [8, 16] by 32 drew 8 in every trial, [0, 1] by 0.3 never drew 1
            steps = (high - low) / self.step
            if self.step > high - low:  # a step 1e10 times the range passed the tolerance below: every trial drew low
                out.append(f"step {self.step:g} is larger than the range [{low:g}, {high:g}]: every trial would draw {low:g}; "
                           f"use a step of at most {high - low:g}")
            elif abs(steps - round(steps)) > 1e-9 * max(1.0, steps):
                last = low + math.floor(steps + 1e-9) * self.step
                out.append(f"[{low:g}, {high:g}] is not a whole number of steps of {self.step:g}: the sampler would never "
                           f"draw past {last:g}; make high - low a multiple of step (for example high: {last:g})")
        return out


class Asha(_Spec):
    kind: Literal["asha"] = "asha"
    grace_period: int = Field(default=1, ge=1, description="epochs every trial runs before it can be stopped")
    reduction_factor: float = Field(default=3, gt=1, allow_inf_nan=False)
    max_epochs: int | None = Field(default=None, ge=1, description="default: the base job's train.epochs")

    @model_validator(mode="after")
    def _grace(self) -> "Asha":
        if self.max_epochs is not None and self.grace_period > self.max_epochs:
            raise ValueError(f"grace_period ({self.grace_period}) must be at most max_epochs ({self.max_epochs}): "
                             "a trial cannot be stopped after the last epoch")
        return self


class TrialResources(_Spec):
    workers: int = Field(default=1, ge=1, description="1: the loop runs inside the trial; more: a TorchTrainer per trial")
    cpus_per_worker: RayQuantity | None = Field(default=None, gt=0, description="default: the base job's")
    gpus_per_worker: GpuQuantity | None = Field(default=None, ge=0, description="default: the base job's")


class SearchSpec(_Spec):
    name: str = Field(min_length=1, pattern=NAME_PATTERN, max_length=NAME_MAX)
    base: str = Field(description="the job spec to search; relative paths are relative to this file")
    space: dict[str, Param] = Field(min_length=1)
    fixed: dict[str, Any] = Field(default_factory=dict, description="changes to the base job for every trial")
    strategy: Literal["random", "grid", "bayes"] = "bayes"
    sampler: Literal["tpe", "gp"] | None = None
    num_samples: int | None = Field(default=None, ge=1, description="default: the grid's size, else 16")
    startup_trials: int | None = Field(default=None, ge=1, description="random trials before TPE/GP model the space")
    points_to_evaluate: list[dict[str, Any]] = Field(default_factory=list, description="configurations tried first")
    metric: str = "val_auc"
    mode: Literal["max", "min"] | None = None
    seed: int = Field(default=0, ge=0, lt=2**32, description="Optuna's samplers take seeds in [0, 2**32)")
    scheduler: Asha | None = None
    trial_resources: TrialResources = Field(default_factory=TrialResources)
    max_concurrent: int | None = Field(default=None, ge=1)
    max_failures: int = Field(default=1, ge=0, description="retries of a trial that raises before it is recorded failed")
    target: float | None = Field(default=None, allow_inf_nan=False, description="end the search as soon as a trial reports the metric at or past this "
                                 "value (at least it for mode max, at most for min); that trial is recorded complete")
    time_budget_s: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="wall-clock seconds for the whole search, counted across "
                                        "resumes; trials still running when it is spent are stopped and recorded pruned")
    storage: str | None = Field(default=None, description="Optuna storage URL; default: SQLite in the run folder")

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler_words(cls, value):
        if value in (None, "none", {"kind": "none"}):
            return None
        return {"kind": "asha"} if value == "asha" else value

    @field_validator("storage")
    @classmethod
    def _storage_url(cls, value):
        if value is not None and not value.startswith(("sqlite:///", "postgresql", "mysql")):
            raise ValueError("an SQLAlchemy URL: sqlite:///path/study.db or postgresql://user@host:5432/db")
        return value

    @property
    def score_mode(self) -> str:
        """`mode`, else the metric's own. A new search refuses a metric without either (search_job
        for a job's metric, `mode_issues` for tune_function's); "max" is left only for a search
        started before tune_function refused it, which a resume continues as it was made."""
        return self.mode or metric_mode(self.metric) or "max"


def mode_issues(spec: SearchSpec) -> list[SpecIssue]:
    """An objective's metric with no known better direction needs `mode`: without it the search
    would pick one (maximise) whatever the metric means ("error" and "value" are minimised)."""
    if spec.mode is not None or metric_mode(spec.metric) is not None:
        return []
    known = ", ".join(f"{name} ({mode})" for name, mode in METRIC_MODES.items() if mode)
    return [SpecIssue("mode", f"the metric {spec.metric!r} has no known better direction (known: {known}, also with val_ or "
                      "train_); pass mode='min' or mode='max'", spec.mode, True)]


def startup_for(spec: SearchSpec, total: int) -> int:
    """Random trials before TPE or GP model the space: the spec's, else a quarter of the search (3 to 10)."""
    return spec.startup_trials or min(10, max(3, total // 4))


def ignored_settings(spec: SearchSpec, total: int) -> list[str]:
    """Settings the search will not use, said when it starts (not refused: a search started with
    them, resumed, must run the spec it was started with): startup_trials outside bayes (random
    and grid draw every trial alike), and a Bayesian search whose startup covers every trial."""
    if spec.startup_trials is not None and spec.strategy != "bayes":
        return [f"startup_trials {spec.startup_trials} is for strategy bayes; a {spec.strategy} search draws every trial alike "
                "and ignores it"]
    startup = startup_for(spec, total)
    if spec.strategy == "bayes" and startup >= total:
        return [f"startup_trials {startup} >= the search's {total} trials: every trial is drawn at random, none by the "
                f"{(spec.sampler or 'tpe').upper()} model"]
    return []


def strategy_issues(spec: SearchSpec) -> list[SpecIssue]:
    """Problems of the space itself and of the strategy with this space."""
    issues = [SpecIssue(f"space.{path}", msg) for path, p in spec.space.items() for msg in p.problems()]
    issues += _overlap_issues(spec)
    kinds = {path: p.kind for path, p in spec.space.items()}
    if spec.strategy == "grid":
        for path, kind in kinds.items():
            if kind in ("uniform", "loguniform", "int") and (kind != "int" or (spec.space[path].log)):
                issues.append(SpecIssue(f"space.{path}", f"grid search needs a list of values, not a {kind} range"))
    else:
        for path, kind in kinds.items():
            if kind == "grid":
                issues.append(SpecIssue(f"space.{path}", f"a grid list needs strategy: grid; the {spec.strategy} "
                                        f"strategy{' with sampler ' + (spec.sampler or 'tpe') if spec.strategy == 'bayes' else ''} "
                                        "samples, so write it as {choice: [...]}"))
    if spec.sampler and spec.strategy != "bayes":
        issues.append(SpecIssue("sampler", f"sampler is for strategy: bayes, not {spec.strategy}", spec.sampler, True))
    if spec.strategy == "grid" and grid_size(spec) > MAX_GRID:
        issues.append(SpecIssue("space", f"the grid has {grid_size(spec):,} points, each a trial; a grid search runs every one "
                                f"(at most {MAX_GRID:,}): list fewer values, or sample the space with strategy random or bayes"))
    elif spec.strategy == "grid" and spec.num_samples is not None and spec.num_samples != grid_size(spec):
        issues.append(SpecIssue("num_samples", f"a grid search runs its grid exactly once: {grid_size(spec)} trials; leave num_samples out",
                                spec.num_samples, True))
    sched = spec.scheduler
    if sched and sched.max_epochs is not None and "train.epochs" in spec.fixed and spec.fixed["train.epochs"] != sched.max_epochs:
        issues.append(SpecIssue("fixed.train.epochs", f"under a scheduler every trial runs scheduler.max_epochs "
                                f"({sched.max_epochs}) epochs, so this value would be ignored; set one of the two",
                                spec.fixed["train.epochs"], True))
    if sched and "train.epochs" in spec.space:  # ASHA ends every trial at max_t, recorded as complete: a drawn 30 ran 16
        issues.append(SpecIssue("space.train.epochs", "under a scheduler the scheduler decides how many epochs each trial runs "
                                "(up to scheduler.max_epochs, default the base job's train.epochs); a searched value past it "
                                "would be cut there and reported as if trained in full. Search it with scheduler: none"))
    if spec.strategy == "grid" and spec.points_to_evaluate:
        issues.append(SpecIssue("points_to_evaluate", "a grid search runs every grid point exactly once; a point given first "
                                "would run twice and push a grid point out. Leave points_to_evaluate out",
                                spec.points_to_evaluate, True))
    for i, point in enumerate(spec.points_to_evaluate):
        for path, value in point.items():
            if path not in spec.space:
                issues.append(SpecIssue(f"points_to_evaluate.{i}.{path}", f"not a path in space ({', '.join(spec.space)})", value, True))
            elif spec.space[path].kind and (why := spec.space[path].refuses(value)):
                issues.append(SpecIssue(f"points_to_evaluate.{i}.{path}", why, value, True))
    if spec.strategy != "grid" and len(spec.points_to_evaluate) > trials_wanted(spec):
        issues.append(SpecIssue("points_to_evaluate", f"{len(spec.points_to_evaluate)} points but only {trials_wanted(spec)} trials "
                                "(num_samples): the extra points would never run; raise num_samples or give fewer points"))
    return issues


def _overlap_issues(spec: SearchSpec) -> list[SpecIssue]:
    """Two searched paths where one holds the other (model.hidden and model.hidden.0), or a fixed
    value at or under a searched path: one value silently replaced the other in every trial,
    while the study and best.yaml credited both. A fixed section with a searched field inside it
    is fine (the searched value is applied after it)."""
    issues = []
    for path in spec.space:
        for other in spec.space:
            if other.startswith(path + "."):
                issues.append(SpecIssue(f"space.{other}", f"lies inside space.{path}, which is searched too: one would "
                                        "overwrite the other in every trial; search one of the two"))
        for fixed in spec.fixed:
            if fixed == path or fixed.startswith(path + "."):
                issues.append(SpecIssue(f"fixed.{fixed}", f"is {'also' if fixed == path else 'inside'} searched as "
                                        f"space.{path}: the searched value would replace it in every trial; "
                                        "fix it or search it, not both"))
    return issues


MAX_GRID = 100_000  # trials a grid search may hold: Tune expands the whole grid up front


def grid_size(spec: SearchSpec) -> int:
    size = 1
    for p in spec.space.values():
        if p.kind == "int":
            low, high = p.int  # counted, not ranged: len(range) overflows past 2**63 values
            size *= max(0, (high - low) // max(1, _int(p.step or 1)) + 1)
        else:
            size *= len(p.values) if p.kind in ("choice", "grid") else 1
    return size


def trials_wanted(spec: SearchSpec) -> int:
    return grid_size(spec) if spec.strategy == "grid" else spec.num_samples or 16
