"""A persistent Optuna study driven by Ray Tune: distributions, samplers, and the Searcher.

The study (SQLite or PostgreSQL) is the durable record of a search. The searcher asks it for
each new trial and tells it every result as it arrives, so a driver killed at any moment
leaves finished trials finished; `resume` re-attaches the trials that were running.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import time
import warnings
from typing import Any, Callable

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from ray.tune.search import Searcher
from ray.tune.stopper import Stopper

from .search_spec import Param

log = logging.getLogger(__name__)
optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

_SCALAR = (type(None), bool, int, float, str)


def distribution(param: Param) -> BaseDistribution:
    kind = param.kind
    if kind == "uniform":
        return FloatDistribution(*param.uniform, step=param.step, log=param.log)
    if kind == "loguniform":
        return FloatDistribution(*param.loguniform, log=True)
    if kind == "int":
        return IntDistribution(*param.int, log=param.log, step=int(param.step or 1))
    return CategoricalDistribution([encode(v) for v in param.values])


def encode(value: Any) -> Any:
    """Optuna stores scalars only; lists and mappings (e.g. `model.hidden`) travel as JSON."""
    return value if isinstance(value, _SCALAR) else "json:" + json.dumps(value)


def decode(value: Any) -> Any:
    return json.loads(value[5:]) if isinstance(value, str) and value.startswith("json:") else value


def make_sampler(strategy: str, sampler: str | None, space: dict[str, Param], seed: int, startup: int, concurrent: bool,
                 resumed_after: int = 0):
    """`resumed_after`: the trials the study already holds when a search is resumed. A sampler
    seeded as the first run was would draw the same random sequence again: a random search,
    and TPE or GP during their start-up trials, would propose the finished trials' parameters
    once more. A resumed sampler gets a seed of its own, derived from the seed and that count
    (so resuming the same study state proposes the same trials). Not a grid: GridSampler
    shuffles its points by the seed and the study knows finished ones only by their index, so a
    new seed ran finished points again and left others out; it never repeats a point anyway."""
    if resumed_after and strategy != "grid":
        seed = (seed * 1_000_003 + resumed_after) % 2**32
    if strategy == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if strategy == "grid":
        grid = {}
        for path, p in space.items():
            values = list(range(p.int[0], p.int[1] + 1, int(p.step or 1))) if p.kind == "int" else p.values
            grid[path] = [encode(v) for v in values]
        return _Grid(grid, seed=seed)
    if sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup)
    # constant_liar keeps concurrent TPE trials from all proposing the same point.
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True, constant_liar=concurrent)


class _Grid(optuna.samplers.GridSampler):
    """GridSampler whose exhausted grid does not call study.stop() (which raises outside
    study.optimize); the searcher's budget already ends the search with the grid."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
BEST_CHECKPOINT = "best_checkpoint"  # a running trial's user attribute: the checkpoint of its best epoch so far


class StudySearcher(Searcher):
    """Ray Tune searcher over a persistent Optuna study.

    Each Tune trial gets `{"number": optuna trial number, "params": {name: value}}`.
    Trials still RUNNING in the study (a killed driver's) are handed out first, with their
    number, so they continue in their own folder; then new trials are asked until the study
    holds `total` trials. Results report intermediate values (pruning history, plots); a trial
    is told COMPLETE, PRUNED (stopped by the scheduler) or FAIL.
    """

    def __init__(self, study: optuna.Study, space: dict[str, Param], total: int, metric: str, mode: str,
                 step_attr: str = "epochs_done", points: list[dict] | None = None):
        super().__init__(metric=metric, mode=mode)
        self.study, self.total, self.step_attr = study, total, step_attr
        self.distributions = {path: distribution(p) for path, p in space.items()}
        self.live: dict[str, optuna.trial.Trial] = {}
        self.stopped_early: set[str] = set()  # filled by StoppingAsha
        self.best: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.best_checkpoint: dict[str, str | None] = {}
        trials = study.get_trials(deepcopy=False)
        self.resumable = [t for t in trials if t.state == TrialState.RUNNING]
        self.asked = sum(t.state != TrialState.WAITING for t in trials)  # running ones included
        for point in points or []:  # a resumed study has them already: skip_if_exists
            study.enqueue_trial({k: self._stored(k, v) for k, v in point.items()}, skip_if_exists=True)

    def _stored(self, path: str, value: Any) -> Any:
        """A point's value as the study holds it: for a choice, that choice's own encoding. A
        mapping with its keys in another order is the same choice but not the same JSON, and a
        value that is not one of the categorical choices fails the trial's first suggest. (The
        encoding itself stays as it was: a study keeps the choices it was made with, and Optuna
        refuses other ones for the same parameter, so a resumed study must get the same JSON.)"""
        dist = self.distributions[path]
        if isinstance(dist, CategoricalDistribution):
            for choice in dist.choices:
                was = decode(choice)
                if was == value and isinstance(was, bool) == isinstance(value, bool):
                    return choice
        return encode(value)

    @property
    def finished(self) -> int:
        return sum(t.state in FINISHED for t in self.study.get_trials(deepcopy=False))

    def remaining(self) -> int:
        """Trials this run still has to start (re-attached running ones included)."""
        return max(0, self.total - self.finished)

    def suggest(self, trial_id: str) -> dict | None:
        if self.resumable:
            frozen = self.resumable.pop(0)
            trial = optuna.trial.Trial(self.study, frozen._trial_id)
            log.info("re-attaching trial %d (running when the search stopped)", frozen.number)
            # Killed between creating the trial and storing its values (ask stores one value at a
            # time): drawn now, or it trained the base's values and counted as a searched trial
            for name in [k for k in self.distributions if k not in frozen.params]:
                trial._suggest(name, self.distributions[name])
            # What it reported before the stop counts: its best epoch may be one it will not run again.
            earlier = self._best_reported(frozen)
            if earlier is not None:
                self.best[trial_id] = earlier
                self.best_checkpoint[trial_id] = frozen.user_attrs.get(BEST_CHECKPOINT)
            if frozen.intermediate_values:
                self.steps[trial_id] = max(frozen.intermediate_values)
        elif self.asked >= self.total:
            return Searcher.FINISHED
        else:
            trial = self.study.ask(self.distributions)
            self.asked += 1
        self.live[trial_id] = trial
        return {"number": trial.number, "params": {k: decode(v) for k, v in trial.params.items()}}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        trial, value = self.live.get(trial_id), result.get(self.metric)
        if trial is None or not _finite(value):
            return
        value = float(value)
        improved = trial_id not in self.best or (value != self.best[trial_id] and (value > self.best[trial_id]) == (self.mode == "max"))
        if improved:
            self.best[trial_id] = float(value)
            # The checkpoint of the best epoch (TuneSession: "checkpoint"; Ray Train's TuneReportCallback: "checkpoint_path").
            self.best_checkpoint[trial_id] = result.get("checkpoint") or result.get("checkpoint_path")
        step = result.get(self.step_attr, result.get("training_iteration"))
        if step is not None and (self.steps.get(trial_id) is None or int(step) > self.steps[trial_id]):
            # Tune may hand the last result twice; a re-attached trial re-reports its restored last epoch
            self.steps[trial_id] = int(step)
            trial.report(float(value), int(step))
            if improved:  # kept in the study so that a resumed search knows it (one commit per new best)
                trial.set_user_attr(BEST_CHECKPOINT, self.best_checkpoint[trial_id])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if result and not error:
            self.on_trial_result(trial_id, result)
        trial, best = self.live.pop(trial_id, None), self.best.pop(trial_id, None)
        self.steps.pop(trial_id, None)
        checkpoint = self.best_checkpoint.pop(trial_id, None)
        if trial is None:
            return
        if error or best is None:
            self.study.tell(trial, state=TrialState.FAIL)
            return
        # One attribute, one commit: epochs (or steps) run, the best value, the checkpoint folder.
        trial.set_user_attr("rayload", {"epochs_done": result.get(self.step_attr), "best_value": best,
                                        "checkpoint": checkpoint})
        if trial_id in self.stopped_early:
            # Stopped by the scheduler: Optuna keeps its last intermediate value; TPE weighs it by how far it got.
            self.study.tell(trial, state=TrialState.PRUNED)
        else:
            self.study.tell(trial, best)

    def _best_reported(self, frozen) -> float | None:
        values = [v for v in frozen.intermediate_values.values() if _finite(v)]
        if not values:
            return None
        return max(values) if self.mode == "max" else min(values)

    def cut_off(self, reason: str, state: TrialState = TrialState.PRUNED) -> int:
        """Record the trials a search ended before they finished (its target reached, its time
        budget spent): Tune stops them without telling the searcher. Each is told PRUNED (or
        `state`: FAIL when the search itself failed), with its best value so far and why it
        stopped; returns how many there were."""
        running = {t._trial_id: t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        mine = [(tid, trial._trial_id) for tid, trial in self.live.items()] + [(None, t._trial_id) for t in self.resumable]
        told = 0
        for tid, key in mine:
            frozen = running.get(key)
            if frozen is None:
                continue
            values = frozen.intermediate_values
            best = self.best.get(tid)
            if best is None:
                best = self._best_reported(frozen)
            checkpoint = self.best_checkpoint.get(tid) if tid in self.best else frozen.user_attrs.get(BEST_CHECKPOINT)
            trial = optuna.trial.Trial(self.study, key)
            trial.set_user_attr("rayload", {"epochs_done": max(values, default=None), "best_value": best,
                                            "checkpoint": checkpoint, "stopped": reason})
            self.study.tell(trial, state=state)
            told += 1
        self.live.clear()
        self.resumable = []
        return told

    # Tune checkpoints searchers with its experiment state; the study is our state.
    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "w") as f:
            json.dump({"study": self.study.study_name}, f)

    def restore(self, checkpoint_path: str) -> None:  # pragma: no cover - resume goes through the study
        pass


def _finite(value) -> bool:
    """A finite real number of any type (numpy float32, Decimal, Fraction...), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def stopping_asha(searcher: StudySearcher, time_attr: str, max_t: int, **kwargs):
    """ASHA that tells the searcher which trials it stopped before max_t (Tune marks those
    results `done` like any finished trial)."""
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    class StoppingAsha(ASHAScheduler):
        def on_trial_result(self, tune_controller, trial, result):
            decision = super().on_trial_result(tune_controller, trial, result)
            # A trial that ended itself (train.early_stopping) on a rung is complete, not pruned: its last
            # result passes through here too, and a STOP there made the best trial lose to a worse one.
            if decision == TrialScheduler.STOP and result.get(time_attr, max_t) < max_t and not result.get("early_stopped"):
                searcher.stopped_early.add(trial.trial_id)
            return decision

    return StoppingAsha(time_attr=time_attr, max_t=max_t, **kwargs)


class SearchStopper(Stopper):
    """Ends a whole search when a trial reports `target` (at least it for mode max, at most for
    min) or when `budget_s` of wall time is spent, counting `spent_s` from earlier attempts.

    The trial that reaches the target stops with that result and is recorded complete; Tune
    stops the other running trials without telling the searcher (StudySearcher.cut_off records
    them). With a budget, the time spent goes to search.json every few seconds, so a resumed
    search knows what is left of it even after a killed driver (without one, only the final
    figure is written, when the search ends): `save(spent_s=...)` writes it. `clock` is the
    monotonic clock the budget is measured on (a test passes its own)."""

    SAVE_EVERY_S = 5.0

    def __init__(self, metric: str, mode: str, target: float | None, budget_s: float | None, spent_s: float,
                 save: Callable[..., None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.metric, self.mode, self.target, self.budget_s, self.save = metric, mode, target, budget_s, save
        self.clock = clock
        self.spent_before, self.started = float(spent_s), clock()
        self.saved = self.started
        self.reached = self.budget_hit = False

    def spent(self) -> float:
        return self.spent_before + self.clock() - self.started

    def meets(self, value) -> bool:
        return (self.target is not None and _finite(value)
                and (float(value) >= self.target if self.mode == "max" else float(value) <= self.target))

    def ended(self, study, budget: bool) -> str | None:
        """Why the search is over before its trials ran out, or None; `budget`: whether a spent
        budget counts (after a run, only if it stopped the run: not if the trials ran out first)."""
        if self.reached or (self.target is not None and any(
                self.meets(v) for t in study.get_trials(deepcopy=False) for v in t.intermediate_values.values())):
            return f"target {self.metric} {'>=' if self.mode == 'max' else '<='} {self.target:g} reached"
        if budget and self.budget_s is not None and self.spent() >= self.budget_s:
            return f"time budget of {self.budget_s:g} s spent"
        return None

    def __call__(self, trial_id: str, result: dict) -> bool:
        if self.meets(result.get(self.metric)):
            self.reached = True
            return True
        return False

    def stop_all(self) -> bool:
        if self.budget_s is not None:
            now = self.clock()
            if self.save is not None and now - self.saved >= self.SAVE_EVERY_S:
                self.saved = now
                self.save(spent_s=round(self.spent(), 3))
            self.budget_hit = self.spent() >= self.budget_s
        return self.reached or self.budget_hit
