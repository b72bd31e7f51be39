"""Hyperparameter search: a search spec (or any Python function) -> Ray Tune trials steered
by a persistent Optuna study (random, grid, TPE, GP), ASHA early stopping, resume.

Trials of a job-spec search run `rayload train`'s loop (see `_tune_trial`). The driver keeps
`search.json` in the run folder (spec, storage, state); the study keeps every trial's
parameters and results, so `tune(..., resume=RUN)` after a killed driver runs only what is
missing: finished trials stay finished and running ones continue from their checkpoints.
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ._ray import ensure_ray
from ._tune_function import _cpus_issues, _fn_issues, _function_trial, _scheduler_issues, _ship_by_value, function_result  # noqa: F401  (function_result: public here)
from ._tune_capacity import SearchResourceError, _check_shape, _concurrency  # noqa: F401  (SearchResourceError: public here)
from .errors import RayloadError, SpecError, SpecIssue
from .paths import is_remote, join_uri, runs_root, shared_storage
from ._tune_runs import (ResumeSpecError, SearchRunningError, check_resumed_spec, driving, find_run, now, preparing,  # noqa: F401
                         read_state, status, study_url, write_state)  # status and the errors: public here
from .search_job import base_raw, check_init_from, job_from, job_issues, load_search_spec
from .search_spec import PREPROCESSING, SearchSpec, ignored_settings, mode_issues, startup_for, strategy_issues, trials_wanted

log = logging.getLogger(__name__)


@dataclass
class TuneResult:
    run_name: str
    run_dir: str
    storage: str
    metric: str
    mode: str
    trials: list[dict]  # best first; see _tune_report.trial_rows
    best: dict | None
    best_spec: str | None = None  # best.yaml (job-spec searches)
    plots: list[str] = field(default_factory=list)
    ended: str = "all trials finished"  # or why it ended sooner: its target reached, its time budget spent

    @property
    def best_params(self) -> dict | None:
        return self.best["params"] if self.best else None

    @property
    def best_value(self) -> float | None:
        return self.best["value"] if self.best else None

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.trials:
            out[row["state"]] = out.get(row["state"], 0) + 1
        return out


@dataclass
class _Plan:
    spec: SearchSpec
    run_dir: str
    storage: str
    resources: dict[str, float]  # one Tune trial's own resources
    concurrency: int
    step_attr: str = "epochs_done"
    max_t: int | None = None


# ---------------------------------------------------------------- job-spec searches


def tune(search: str | SearchSpec | None, resume: str | None = None, address: str | None = None, overrides=(),
         run_dir: str | None = None) -> TuneResult:
    """Run (or with `resume`, continue) the search in a search spec file or SearchSpec.
    `run_dir` puts a new search in that folder instead of runs/tune/<name>-<time>/.
    A resumed search runs the spec it was started with (search.json); `search` may then be
    None, and a given spec (with its overrides) must be that one: a different one is refused."""
    if resume:
        run_dir = find_run(resume)
        if read_state(run_dir, ("spec",)).get("kind") == "function":  # its base_raw: a KeyError
            raise RayloadError(f"{run_dir} is a search of a Python function; resume it with rayload.tune_function(..., resume=)")
        state = read_state(run_dir, ("spec", "base_raw"))
        if search is not None:
            check_resumed_spec(run_dir, state["spec"], _load(search, overrides)[0])
        elif overrides:
            raise RayloadError("overrides (--set) need the search spec they apply to; a resumed search runs its stored spec")
        spec, raw = SearchSpec.model_validate(state["spec"]), state["base_raw"]
    else:
        spec, raw = _load(search, overrides)
        _check_new_study(spec)
        _max_epochs(spec, job_from(raw, {}))  # a spec error before Ray starts
        run_dir = run_dir or os.path.join(runs_root(), "tune", f"{spec.name}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")
        ensure_ray(address)  # before the run folder exists: a cluster that cannot be reached leaves no empty run behind
    with driving(run_dir, resume=bool(resume)):  # a resume is refused while the run's driver is alive
        return _search_job(spec, raw, run_dir, resume, address)


def _max_epochs(spec: SearchSpec, base) -> int:
    """The trials' epochs: the scheduler's max_epochs, else the base job's; a grace period past them
    is refused (checked before Ray starts, as every other search-spec error is)."""
    max_t = spec.scheduler.max_epochs if spec.scheduler and spec.scheduler.max_epochs else base.train.epochs
    if spec.scheduler and spec.scheduler.grace_period > max_t:
        raise SpecError([SpecIssue("scheduler.grace_period", f"must be at most the trials' epochs ({max_t}, the base job's "
                                   "train.epochs); lower it or set scheduler.max_epochs", spec.scheduler.grace_period, True)])
    return max_t


def _search_job(spec: SearchSpec, raw: dict, run_dir: str, resume: str | None, address: str | None) -> TuneResult:
    ensure_ray(address)
    base = job_from(raw, {})
    from .train.resources import SEARCH_FIX, check_storage

    # Trials' checkpoints: on the object storage the job or the cluster names (train.storage_path,
    # RAYLOAD_STORAGE_PATH), under tune/<run>/trials; else in the run folder, which every node
    # must then reach. The study, search.json, plots and best.yaml stay in the driver's run folder.
    # A new search gets a root of its own (a pipeline's tune stages all call their run folder
    # "search"); a resumed one keeps the root search.json names (only remote roots are kept:
    # a local one is the run folder wherever it is found now).
    shared = shared_storage(base.train.storage_path)
    if resume:
        trial_root = read_state(run_dir).get("trial_root") or run_dir
    elif shared and is_remote(shared):
        trial_root = join_uri(shared, "tune", f"{os.path.basename(run_dir)}-{uuid.uuid4().hex[:8]}")
    else:
        trial_root = run_dir
    if not is_remote(trial_root):
        check_storage(run_dir, "the search's run folder", SEARCH_FIX)  # trials on other nodes write their checkpoints there
    max_t = _max_epochs(spec, base)
    raw = _with_epochs(raw, max_t)
    tr = spec.trial_resources
    cpus, gpus = tr.cpus_per_worker or base.resources.cpus_per_worker, tr.gpus_per_worker if tr.gpus_per_worker is not None else base.resources.gpus_per_worker
    per_worker = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    # A TorchTrainer places its own workers; the trial itself only drives it (Tune refuses an
    # empty resource request, hence a hundredth of a CPU).
    own = per_worker if tr.workers == 1 else {"CPU": 0.01}
    _check_shape(tr.workers, cpus, gpus, base.resources.accelerator_type, driver=None if tr.workers == 1 else own)
    # Every trial's job spec asks for what its trial holds (the in-process loop then uses the GPU it was given).
    raw["resources"] = {**raw.get("resources", {}), "workers": tr.workers, "cpus_per_worker": cpus, "gpus_per_worker": gpus}
    paths = tuple(p for p in spec.space if p.split(".")[0] in PREPROCESSING)
    from ._tune_trial import JobSearch, job_trial

    job = JobSearch(raw, run_dir, _preprocess_variants(spec, raw, paths, address), paths, tr.workers, trial_root,
                    (spec.metric, spec.score_mode))
    bundles = [own] if tr.workers == 1 else [own, *[per_worker] * tr.workers]  # one worker: the trial is the worker
    plan = _Plan(spec, run_dir, _storage(spec, run_dir, bool(resume)), own, _concurrency(spec.max_concurrent, bundles, trials_wanted(spec)),
                 max_t=max_t)
    write_state(run_dir, kind="job", spec=spec.model_dump(mode="json"), base_raw=raw, storage=plan.storage, **preparing(resume),
                trial_root=trial_root if is_remote(trial_root) else None,
                study=spec.name, total=trials_wanted(spec), metric=spec.metric, mode=spec.score_mode)
    study = _run(plan, job_trial, {"search": job}, resume=bool(resume))
    return _finish(plan, study, raw)


def _load(search, overrides) -> tuple[SearchSpec, dict]:
    if isinstance(search, SearchSpec):
        issues = job_issues(search, None)
        if issues:
            raise SpecError(issues)
        return search, base_raw(search, None)
    spec = load_search_spec(search, list(overrides))
    return spec, base_raw(spec, search)


def _with_epochs(raw: dict, epochs: int) -> dict:
    import copy

    raw = copy.deepcopy(raw)
    raw.setdefault("train", {})["epochs"] = epochs
    return raw


def _preprocess_variants(spec: SearchSpec, raw: dict, paths: tuple[str, ...], address) -> dict[str, tuple]:
    """Preprocess every data variant the space can ask for and build its datasets, here,
    before trials hold the CPUs (a trial waiting for Ray Data tasks that need a CPU would
    never finish)."""
    from ._tune_trial import variant_key
    from .data.pipeline import preprocess
    from .train.prior import training_counts
    from .train.trainer import training_datasets

    values = [spec.space[p].values for p in paths]
    # train.embedding_prior needs every ID's training count: read or counted here once per
    # variant (the trials read no data themselves, and may run where the driver's shards are not on disk)
    prior = bool(raw.get("train", {}).get("embedding_prior")) or "train.embedding_prior" in spec.space
    check_init_from(spec, raw)  # some trial's model must take the init_from checkpoint: refused before any data
    out = {}
    for combo in itertools.product(*values):
        params = dict(zip(paths, combo))
        job = job_from(raw, params)
        pre = preprocess(job, address=address)
        counts = training_counts(pre) if prior else None
        out[variant_key(params, paths)] = (pre, training_datasets(pre, job.train.cache_dataset), counts)
    return out


# ---------------------------------------------------------------- any Python objective


def tune_function(fn: Callable[[dict], Any], space: dict[str, Any], strategy: str = "bayes", sampler: str | None = None,
                  num_samples: int | None = None, metric: str = "value", mode: str | None = "metric's", seed: int = 0,
                  scheduler: dict | str | None = None, max_concurrent: int | None = None, cpus: float = 1,
                  max_failures: int = 0, storage: str | None = None, name: str = "function",
                  points_to_evaluate: list[dict] | None = None, startup_trials: int | None = None,
                  target: float | None = None, time_budget_s: float | None = None,
                  resume: str | None = None, address: str | None = None) -> TuneResult:
    """Search `fn(config) -> float | dict` with the same strategies, scheduler and storage as
    job specs. `space` uses the search-spec syntax: {"x": {"uniform": [-5, 10]}, "k": [1, 2]}.
    `fn` may instead call `ray.tune.report({...})` once per step (for ASHA) and return None.
    `mode=None` takes the direction of a metric rayload knows (val_auc: max, loss: min, ...) and
    raises SpecError for any other metric name, before Ray starts. Left out, `mode` is the same,
    except that the default metric "value" (what `fn` returns) is minimised, as Optuna does: the
    former default "min" minimised metric="val_auc" too."""
    from ._spec_load import validate_model

    if mode == "metric's":
        mode = "min" if metric == "value" else None

    raw = {"name": name, "base": "<python function>", "space": space, "strategy": strategy, "sampler": sampler,
           "num_samples": num_samples, "metric": metric, "mode": mode, "seed": seed, "scheduler": scheduler,
           "max_concurrent": max_concurrent, "max_failures": max_failures, "storage": storage,
           "points_to_evaluate": points_to_evaluate or [], "startup_trials": startup_trials, "target": target,
           "time_budget_s": time_budget_s}
    # mode=None with a metric of no known direction is refused for a new search (a resumed one
    # goes on in the direction its study was made with).
    spec = validate_model(SearchSpec, raw, check=lambda s: strategy_issues(s) + ([] if resume else mode_issues(s)) + _cpus_issues(cpus)
                                                    + _fn_issues(fn, address)
                                                    + _scheduler_issues(s))
    if resume:
        run_dir = find_run(resume)
        check_resumed_spec(run_dir, read_state(run_dir)["spec"], spec)
    else:
        _check_new_study(spec)
        run_dir = os.path.join(runs_root(), "tune", f"{name}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")
        ensure_ray(address)  # before the run folder exists: a cluster that cannot be reached leaves no empty run behind
    with driving(run_dir, resume=bool(resume)):  # a resume is refused while the run's driver is alive
        ensure_ray(address)
        _ship_by_value(fn)
        _check_shape(1, cpus, 0, None, fields="cpus")
        max_t = spec.scheduler.max_epochs if spec.scheduler else None
        plan = _Plan(spec, run_dir, _storage(spec, run_dir, bool(resume)), {"CPU": cpus},
                     _concurrency(max_concurrent, [{"CPU": cpus}], trials_wanted(spec)), step_attr="training_iteration", max_t=max_t)
        write_state(run_dir, kind="function", spec=spec.model_dump(mode="json"), storage=plan.storage, study=name, **preparing(resume),
                    total=trials_wanted(spec), metric=metric, mode=spec.score_mode)  # the mode the search ranks by (mode=None: the metric's)
        study = _run(plan, _function_trial, {"fn": fn, "metric": metric}, resume=bool(resume))
        return _finish(plan, study, None)


# ---------------------------------------------------------------- the search itself


def _run(plan: _Plan, trainable, parameters: dict, resume: bool):
    import ray.tune
    from ray.tune.logger import JsonLoggerCallback

    from ._study import SearchStopper, StudySearcher, make_sampler, stopping_asha
    from ._study_store import open_study

    spec = plan.spec
    total = trials_wanted(spec)
    startup = startup_for(spec, total)
    for note in ignored_settings(spec, total):
        log.warning("%s", note)
    sampler = functools.partial(make_sampler, spec.strategy, spec.sampler, spec.space, spec.seed, startup, plan.concurrency > 1)
    if resume:
        owner = read_state(plan.run_dir).get("run_uid")
    else:
        owner = uuid.uuid4().hex
        write_state(plan.run_dir, run_uid=owner)
    try:
        study = open_study(plan.storage, spec.name, spec.score_mode, lambda held: sampler(resumed_after=held), create=not resume,
                           owner=owner)
    except RayloadError as exc:
        if not resume:  # another search made the study first (checked before preparing, raced since): not resumable
            write_state(plan.run_dir, state="failed", finished=now(), ended=f"failed: {exc}")
        raise
    searcher = StudySearcher(study, spec.space, total, spec.metric, spec.score_mode, plan.step_attr, spec.points_to_evaluate)
    todo = searcher.remaining()
    stopper = SearchStopper(spec.metric, spec.score_mode, spec.target, spec.time_budget_s,
                            read_state(plan.run_dir).get("spent_s", 0.0) if resume else 0.0,
                            save=functools.partial(write_state, plan.run_dir))
    ended = stopper.ended(study, budget=True)  # a resumed search may have reached its target or spent its budget already
    write_state(plan.run_dir, state="running", pid=os.getpid(), host=socket.gethostname())
    if todo and not ended:
        scheduler = None
        if spec.scheduler:
            scheduler = stopping_asha(searcher, plan.step_attr, plan.max_t, metric=spec.metric, mode=spec.score_mode,
                                      grace_period=spec.scheduler.grace_period, reduction_factor=spec.scheduler.reduction_factor)
        # Results live in the study; Tune keeps only its JSON log (no CSV, no TensorBoard).
        os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
        # Tune's new console output prints its experiment box and "View detailed results here" to stdout
        # at any verbosity, above rayload's own table; the classic reporter is silent at verbose=0
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        tuner = ray.tune.Tuner(
            ray.tune.with_resources(ray.tune.with_parameters(trainable, **parameters), plan.resources),
            tune_config=ray.tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=todo, reuse_actors=True,
                                            max_concurrent_trials=min(plan.concurrency, todo),
                                            trial_dirname_creator=lambda t: t.trial_id),
            run_config=ray.tune.RunConfig(name=f"attempt_{_attempt(plan.run_dir)}", storage_path=os.path.join(plan.run_dir, "tune"),
                                          failure_config=ray.tune.FailureConfig(max_failures=spec.max_failures), verbose=0,
                                          callbacks=[JsonLoggerCallback()], stop=stopper),
        )
        try:
            tuner.fit()
        except Exception as exc:  # e.g. Tune's TuneError: a trial reported a result without the metric
            _failed(plan, searcher, stopper, exc)
        ended = stopper.ended(study, budget=stopper.budget_hit)
        if not ended and (searcher.live or searcher.remaining()):  # Tune caught a Ctrl-C (SIGINT) and returned as if done
            _interrupted(plan, searcher, stopper)
    if ended:
        cut = searcher.cut_off(ended)  # Tune stopped them without telling the searcher
        log.info("search %s ended: %s (%d running trial(s) stopped)", spec.name, ended, cut)
    write_state(plan.run_dir, state="finished", finished=now(), ended=ended or "all trials finished", spent_s=stopper.spent())
    return study


class SearchFailedError(RayloadError):
    pass


class SearchInterruptedError(RayloadError):
    pass


def _interrupted(plan: _Plan, searcher, stopper) -> None:
    """A search stopped by Ctrl-C is recorded as interrupted, not finished ("all trials
    finished", with best.yaml written from part of the search): its running trials stay
    running in the study, so --resume takes them up again."""
    running, finished = len(searcher.live), searcher.finished
    why = f"interrupted (Ctrl-C) with {running} trial(s) running, {finished} of {searcher.total} finished"
    write_state(plan.run_dir, state="interrupted", finished=now(), ended=why, spent_s=stopper.spent())
    raise SearchInterruptedError(f"search {plan.spec.name} {why}; resume it with --resume {os.path.basename(plan.run_dir)}")


def _failed(plan: _Plan, searcher, stopper, exc: Exception):
    """A search Tune ended with an error leaves a consistent run folder: the trials it was
    running are told FAIL in the study (with the reason), search.json says failed and why."""
    from optuna.trial import TrialState

    lines = [line for line in str(exc).splitlines() if line.strip()]
    reason = f"{type(exc).__name__}: {lines[-1] if lines else ''}".strip().rstrip(":")
    searcher.cut_off(f"the search failed: {reason}", state=TrialState.FAIL)
    write_state(plan.run_dir, state="failed", finished=now(), ended=f"failed: {reason}", spent_s=stopper.spent())
    raise SearchFailedError(f"search {plan.spec.name} failed ({plan.run_dir}): {reason}") from exc


def _finish(plan: _Plan, study, raw: dict | None) -> TuneResult:
    from ._tune_report import best_row, trial_rows, write_best_spec, write_csv, write_plots

    rows = trial_rows(study)
    write_csv(rows, os.path.join(plan.run_dir, "trials.csv"))
    best = best_row(rows)
    best_spec = None
    if best and raw is not None:
        best_spec = os.path.join(plan.run_dir, "best.yaml")
        write_best_spec(raw, best["params"], best_spec, [
            f"rayload train {best_spec}",
            f"best of search {os.path.basename(plan.run_dir)}: trial {best['number']}, {plan.spec.metric}={best['value']:.6g}",
            "searched: " + ", ".join(f"{k}={v!r}" for k, v in best["params"].items()),
        ])
    plots = write_plots(study, os.path.join(plan.run_dir, "plots"))
    return TuneResult(os.path.basename(plan.run_dir), plan.run_dir, plan.storage, plan.spec.metric, plan.spec.score_mode,
                      rows, best, best_spec, plots, read_state(plan.run_dir).get("ended", "all trials finished"))


def _storage(spec: SearchSpec, run_dir: str, resume: bool = False) -> str:
    """The study's URL: a resumed search's from its search.json; a relative SQLite path is made
    absolute here, once, so a search resumed from another folder finds its study."""
    os.makedirs(run_dir, exist_ok=True)
    if resume:
        return study_url(read_state(run_dir), run_dir)
    url = spec.storage
    if url and url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        url = "sqlite:///" + os.path.abspath(url[len("sqlite:///"):])
    return url or f"sqlite:///{os.path.join(run_dir, 'study.db')}"


def _attempt(run_dir: str) -> int:
    folder = os.path.join(run_dir, "tune")
    return len(os.listdir(folder)) if os.path.isdir(folder) else 0


def _check_new_study(spec: SearchSpec) -> None:
    """A new search on a storage that already holds a study of its name is refused before
    anything is prepared or written (a default storage is the new run's own folder)."""
    from ._study_store import StudyExistsError, study_exists

    if spec.storage and study_exists(spec.storage, spec.name):
        raise StudyExistsError(spec.name, spec.storage)


__all__ = ["tune", "tune_function", "status", "TuneResult"]
