"""Typed A/B specs (`jobs/ab_*.yaml`) and `load_ab_spec`.

An A/B spec names the arms (each a checkpoint, or a job spec that is trained when no
checkpoint is given), their traffic weights, how the models are served, where events go, and
the rules that turn the live analysis into promote / rollback / continue.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ._quantities import RayQuantity
from .errors import SpecError, SpecIssue
from .paths import NAME_PATTERN
from .spec import _Spec as _JobSpecBase

BUCKETS = 10_000  # assignment granularity: a weight is a whole number of 0.01% buckets
# The event store's columns (serve/events.py: ab_exposures.experiment and .arm, ab_drift's): a
# longer name fails every insert on PostgreSQL, whose VARCHAR(n) is a limit.
MAX_NAME, MAX_ARM_NAME = 128, 64


class _Spec(_JobSpecBase):
    """As a job spec's sections: unknown keys refused, no infinite or NaN number (an infinite
    ramp interval overflowed the controller's sleep), no true/false for a number."""


class Arm(_Spec):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    weight: float = Field(ge=0, le=1, description="share of units; all arms sum to 1.0")
    checkpoint: str | None = Field(default=None, description="a checkpoint folder (rayload train's output)")
    job: str | None = Field(default=None, description="a job spec to train when no checkpoint is given (relative to this file)")
    set: list[str] = Field(default_factory=list, description="overrides for `job` (key=value), as with --set")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.checkpoint is None) == (self.job is None):
            raise ValueError(f"arm {self.name!r}: give exactly one of checkpoint or job")
        if self.checkpoint is not None and self.set:  # it was ignored
            raise ValueError(f"arm {self.name!r}: set overrides a job spec; a checkpoint arm takes none")
        return self


class Serving(_Spec):
    mode: Literal["auto", "combined", "separate"] = Field(
        default="auto", description="combined: every arm's model in the router replica (small models); separate: one deployment per arm")
    combined_max_params: int = Field(default=20_000_000, ge=0, description="auto picks combined when all arms together have at most this many parameters")
    replicas: int = Field(default=1, ge=1)
    cpus_per_replica: RayQuantity = Field(default=0.5, ge=0)  # 1e-5 loaded, and failed only when the deployment was made
    max_batch_size: int = Field(default=32, ge=1)
    batch_wait_ms: float = Field(default=2.0, ge=0)
    max_ongoing_requests: int = Field(default=64, ge=1, description="per replica")
    max_queued_requests: int = Field(default=256, ge=1, description="beyond it a request gets 503 at once")
    max_body_bytes: int = Field(default=65_536, ge=256)
    max_candidates: int = Field(default=100, ge=1)
    torchscript: bool = Field(default=True, description="serve each model's frozen TorchScript trace, checked against the eager "
                              "model at load (models/inference.py; falls back to eager where they differ); false: always eager")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    ingress: Literal["proxy", "direct"] = Field(
        default="proxy", description="proxy: clients reach the router through Serve's HTTP proxy at host:port; direct: "
        "each router replica answers HTTP itself on a port of its own (Ray Serve's direct ingress, no proxy hop: "
        "3.3x the A/B requests per second on 2 cores, benchmarks/RESULTS.md); the proxy at host:port still answers too")
    route_prefix: str = Field(default="/", pattern=r"^/([^{}/]+(/[^{}/]+)*)?$",
                              description="starts with /, no trailing / (but /), no { or }: Serve's rules, checked at load")
    # Replica logs reach the driver's console; per-request access lines at INFO drown it.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    access_log: bool = False
    api_key_env: str | None = Field(default=None, description="name of an env var holding the API key; unset: no key")


class Events(_Spec):
    url: str | None = Field(default=None, description="SQLAlchemy URL; default: SQLite (WAL) in the run folder")
    flush_ms: float = Field(default=1.0, ge=0, le=60_000, description="how long the writer waits after an event for others to share its commit; "
                             "0: commit at once (what arrives during a commit still shares the next)")
    max_batch: int = Field(default=512, ge=1)
    log_features: bool = Field(default=True, description="keep each exposure's raw features: `rayload retrain` learns from them")
    sync: Literal["normal", "full"] = Field(
        default="normal", description="SQLite: normal = an answer waits for the commit into the WAL (safe against a killed "
        "replica) and the WAL is fsynced within fsync_s; full = an fsync per commit (serve/event_writer.py)")
    fsync_s: float = Field(default=1.0, gt=0, le=86_400, description="SQLite with sync normal: the longest a commit waits for its fsync "
                           "(bounds what a machine crash can lose)")

    @field_validator("url")
    @classmethod
    def _url(cls, value):
        if value is not None and not value.startswith(("sqlite:///", "postgresql")):
            raise ValueError("an SQLAlchemy URL: sqlite:///path/events.db or postgresql://user@host:5432/db")
        return value


class Guardrails(_Spec):
    """Per-arm limits. A challenger's breach rolls it back (final) when the challenger also
    fails clearly more often than the champion on the same requests; when the champion
    breaches too (a shared incident), the ramp holds instead (serve/guardrails.py). A breach
    must be clear: the error rate is judged over the arm's whole history and p99 latency over
    its last `latency_window` requests, each by a test that stays at level `alpha` however often
    it is looked at (serve/analysis.py, guardrail_breaches)."""

    max_error_rate: float = Field(default=0.01, ge=0, le=1)
    max_p99_ms: float = Field(default=250.0, gt=0)
    min_requests: int = Field(default=200, ge=1, description="requests an arm needs (in the latency window too) before its guardrails are judged")
    latency_window: int = Field(default=1000, ge=1, description="p99 latency is judged over the arm's last this many requests: "
                                "a late regression is not diluted by a long good history, and warm-up requests age out")
    alpha: float = Field(default=0.05, gt=0, lt=0.5, description="chance of a breach reported for an arm whose rate sits just "
                         "at a limit, however often it is looked at; below the limit far less")


class Analysis(_Spec):
    event: Literal["click", "conversion"] = "click"
    alpha: float = Field(default=0.05, gt=0, lt=0.5)
    srm_p: float = Field(default=0.001, gt=0, lt=1)
    tau: float = Field(default=0.01, gt=0, description="mSPRT mixing standard deviation: the size of effect expected, in CTR points")
    mde: float = Field(default=0.01, gt=0, description="the effect (absolute CTR) the power figures are for: units the sequential "
                       "test that decides needs to detect it (sequential_units_needed), and what a fixed-horizon test looked at "
                       "once would need (units_needed, fewer: not the deciding test)")
    power: float = Field(default=0.8, gt=0, lt=1, description="the power those figures are for")
    min_units: int = Field(default=500, ge=1, description="exposed units per arm before any decision")
    attribution_s: float | None = Field(default=None, ge=0, description="how long after an exposure its outcome may still "
                                        "arrive: the sequential test looks only at exposures older than this, so a look is "
                                        "final when taken (default: 0 for clicks, 1800 for conversions)")


class Drift(_Spec):
    """Feature drift of served traffic against each model's training data (serve/drift.py)."""

    enabled: bool = True
    threshold: float = Field(default=0.2, gt=0, description="PSI above which a feature is flagged")
    min_rows: int = Field(default=500, ge=1, description="rows a feature needs before it can be flagged")
    flush_s: float = Field(default=5.0, gt=0, le=86_400, description="how often each replica writes its counts to the event store")
    window_s: float | None = Field(default=86_400.0, ge=60, description="the served traffic compared: the last window_s seconds "
                                   "(counted in 24 periods; null: everything since each replica started)")


class Ramp(_Spec):
    """Automatic decisions: the challenger's share steps up while guardrails hold; the
    sequential test promotes (significant win) or rolls back (significant loss)."""

    steps: list[float] = Field(default_factory=lambda: [0.05, 0.25, 0.5])
    min_units_per_step: int = Field(default=500, ge=1)
    auto: bool = True
    interval_s: float = Field(default=5.0, gt=0, le=86_400, description="how often the controller looks")

    @field_validator("steps")
    @classmethod
    def _increasing(cls, value):
        # A share of 1 is checked in spec_issues (a spec saved in a run before that rule still loads)
        if not value or any(not 0 < s <= 1 for s in value) or value != sorted(value):
            raise ValueError("ramp steps must be increasing shares in (0, 1)")
        # The controller sets these as weights: one off the bucket grid would be refused at run time.
        for i, share in enumerate(value):
            if not on_grid(share):
                raise ValueError(f"ramp step {i} ({share}) must be a whole number of 1/{BUCKETS} buckets, "
                                 f"for example {max(1, round(share * BUCKETS)) / BUCKETS}")
        return value


class Simulation(_Spec):
    source: Literal["synthetic-ctr", "movielens"] = "movielens"
    users: int = Field(default=2000, ge=1)
    requests: int = Field(default=20000, ge=1)
    concurrency: int = Field(default=8, ge=1)
    seed: int = Field(default=0, ge=0)
    drift_seed: int | None = Field(default=None, ge=0, description="synthetic-ctr: clicks follow a ground truth redrawn from this seed")


class ABSpec(_Spec):
    name: str = Field(min_length=1, pattern=NAME_PATTERN)
    salt: str | None = Field(default=None, description="assignment salt; default: the name. A new salt reshuffles every unit")
    arms: list[Arm] = Field(min_length=2)
    champion: str | None = Field(default=None, description="the arm that owns the rest of the traffic; default: the first")
    shadow: bool = Field(default=False, description="challengers score every request and are logged; the champion answers")
    serving: Serving = Field(default_factory=Serving)
    events: Events = Field(default_factory=Events)
    analysis: Analysis = Field(default_factory=Analysis)
    guardrails: Guardrails = Field(default_factory=Guardrails)
    drift: Drift = Field(default_factory=Drift)
    ramp: Ramp = Field(default_factory=Ramp)
    simulate: Simulation = Field(default_factory=Simulation)

    @property
    def experiment_salt(self) -> str:
        return self.salt or self.name

    @property
    def champion_arm(self) -> str:
        return self.champion or self.arms[0].name

    @property
    def weights(self) -> dict[str, float]:
        return {a.name: a.weight for a in self.arms}

    @property
    def challengers(self) -> list[str]:
        return [a.name for a in self.arms if a.name != self.champion_arm]


def on_grid(share: float) -> bool:
    """A share is a whole number of assignment buckets."""
    return round(share * BUCKETS, 6) == round(share * BUCKETS)


def weight_issues(weights: dict[str, float], arms: list[str], champion: str, where: str = "arms",
                  shadow: bool = False) -> list[SpecIssue]:
    """Weights must name every arm once, be >= 0, sum to 1.0 and give each challenger at most
    its own slice of the bucket space (see serve.assign). In shadow mode the champion answers
    every request, so every challenger's weight is 0."""
    issues = []
    if champion not in arms:  # set_weights(champion="contrl") was saved while the router refused it
        issues.append(SpecIssue("champion", f"must be one of the arms {arms}", champion, True))
    if sorted(map(str, weights)) != sorted(arms) or not all(isinstance(k, str) for k in weights):  # 1 and "1" both: a TypeError
        issues.append(SpecIssue(where, f"weights must name exactly the arms {arms}", list(weights), True))
        return issues
    # true/false are ints to Python: a hand-edited user_config's true was taken as weight 1.0
    negative = {k: v for k, v in weights.items()
                if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)}
    if negative:
        issues.append(SpecIssue(where, "every weight must be a number >= 0", negative, True))
        return issues
    if abs(sum(weights.values()) - 1.0) > 1e-9:
        issues.append(SpecIssue(where, "traffic weights must sum to 1.0", list(weights.values()), True))
    slots = len(arms) - 1
    for name, w in weights.items():
        if name != champion and w > 1 / slots + 1e-12:
            issues.append(SpecIssue(f"{where}.{name}", f"with {slots} challengers each may take at most 1/{slots} of the traffic", w, True))
        if not on_grid(w):
            issues.append(SpecIssue(f"{where}.{name}", f"a weight is a whole number of 1/{BUCKETS} buckets", w, True))
        if shadow and name != champion and w > 0:
            issues.append(SpecIssue(f"{where}.{name}", "in shadow mode the champion answers every request and challengers only "
                                    "score alongside it: a challenger's weight must be 0 (or turn shadow off to split traffic)", w, True))
    return issues


def spec_issues(spec: ABSpec) -> list[SpecIssue]:
    names = [a.name for a in spec.arms]
    issues = []
    if len(set(names)) != len(names):
        issues.append(SpecIssue("arms", "arm names must be unique", names, True))
        return issues
    if spec.champion is not None and spec.champion not in names:
        issues.append(SpecIssue("champion", f"must be one of the arms {names}", spec.champion, True))
        return issues
    issues += weight_issues(spec.weights, names, spec.champion_arm, shadow=spec.shadow)
    issues += _name_issues(spec) + _ramp_issues(spec)
    g = spec.guardrails
    if g.latency_window < g.min_requests:
        issues.append(SpecIssue("guardrails.latency_window", f"must be at least guardrails.min_requests ({g.min_requests}): latency is "
                                "judged once the window holds that many requests; raise the window or lower min_requests",
                                g.latency_window, True))
    if spec.ramp.auto and len(names) != 2:
        issues.append(SpecIssue("ramp.auto", "automatic decisions need exactly two arms (champion and challenger)", len(names), True))
    # checked here, not in the model: a run saved with it before this rule must still load
    if spec.simulate.drift_seed is not None and spec.simulate.source != "synthetic-ctr":  # it was ignored without a word
        issues.append(SpecIssue("simulate.drift_seed", "needs source: synthetic-ctr (MovieLens replays recorded ratings, which "
                                "have no ground truth to redraw)", spec.simulate.drift_seed, True))
    return issues


def _name_issues(spec: ABSpec) -> list[SpecIssue]:
    issues = []
    if len(spec.name) > MAX_NAME:
        issues.append(SpecIssue("name", f"at most {MAX_NAME} characters (the event store keeps it in a VARCHAR({MAX_NAME}) "
                                "column): shorten it", f"{len(spec.name)} characters", True))
    for i, arm in enumerate(spec.arms):
        if len(arm.name) > MAX_ARM_NAME:
            issues.append(SpecIssue(f"arms.{i}.name", f"at most {MAX_ARM_NAME} characters (the event store keeps it in a "
                                    f"VARCHAR({MAX_ARM_NAME}) column): shorten it", f"{len(arm.name)} characters", True))
    return issues


def _ramp_issues(spec: ABSpec) -> list[SpecIssue]:
    if any(s >= 1 for s in spec.ramp.steps):
        return [SpecIssue("ramp.steps", "every step must be below 1: a step is the challenger's share while it is tested, and "
                          "all traffic to it is a promote, which the sequential test decides (or `rayload ab promote`); "
                          "drop the step of 1", spec.ramp.steps, True)]
    steps = spec.ramp.steps
    if repeated := sorted({a for a, b in zip(steps, steps[1:]) if a == b}):  # a spec saved in a run before this rule still loads
        return [SpecIssue("ramp.steps", f"steps must be strictly increasing: {', '.join(map(str, repeated))} is given twice "
                          "(the ramp skips a step at the share it already has); drop the repeat", steps, True)]
    return []


def resolve_paths(spec: ABSpec, spec_file: str) -> ABSpec:
    """Checkpoint and job paths, and a SQLite event store's file, relative to the spec file become absolute."""
    folder = os.path.dirname(os.path.abspath(spec_file))

    def fix(path: str | None) -> str | None:
        if path is None or "://" in path:
            return path
        path = os.path.expanduser(path)  # ~/ckpt was joined to the spec's folder
        if os.path.isabs(path):
            return path
        here = os.path.join(folder, path)
        return here if os.path.exists(here) else os.path.abspath(path)

    arms = [a.model_copy(update={"checkpoint": fix(a.checkpoint), "job": fix(a.job)}) for a in spec.arms]
    update = {"arms": arms}
    url = spec.events.url
    if url and url.startswith("sqlite:///") and not url.startswith("sqlite:////") and not url[len("sqlite:///"):].startswith(":memory:"):
        # a relative SQLite file: the spec file's folder's, as the readers started elsewhere open it
        update["events"] = spec.events.model_copy(update={"url": "sqlite:///" + os.path.join(folder, url[len("sqlite:///"):])})
    return spec.model_copy(update=update)


def load_ab_spec(path: str, overrides: list[str] | tuple[str, ...] = ()) -> ABSpec:
    """Read an A/B spec; raises SpecError listing every problem with its field path."""
    from ._spec_load import load_model

    spec = resolve_paths(load_model(ABSpec, path, overrides, check=spec_issues), path)
    if issues := arm_job_issues(spec):
        raise SpecError(issues, file=path)
    return spec


def arm_job_issues(spec: ABSpec) -> list[SpecIssue]:
    """Each job arm's spec loads with its `set`: a bad one was found only when that arm's turn
    to train came, after the arms before it had trained in full."""
    from .spec import load_spec

    issues = []
    for i, arm in enumerate(spec.arms):
        if arm.job is None:
            continue
        try:
            load_spec(arm.job, arm.set)
        except SpecError as exc:
            issues += [SpecIssue(f"arms.{i}.job", f"{os.path.basename(arm.job)}: {issue.render()}") for issue in exc.issues]
    return issues


def ab_from_dict(raw: dict[str, Any]) -> ABSpec:
    from ._spec_load import validate_model

    return validate_model(ABSpec, raw, check=spec_issues)
