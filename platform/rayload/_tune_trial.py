"""What one tuning trial runs: `rayload train`'s loop on the trial's job spec.

One worker: the loop runs in the trial's own process (no worker group to start) with a
session that also reports every epoch to Tune. More workers: the trial starts a TorchTrainer
whose rank-0 reports reach Tune through Ray Train's TuneReportCallback. Either way a trial's
checkpoints live in `<run>/trials/trial_NNNN`, keyed by the Optuna trial number, so a retried
or re-attached trial resumes from its last epoch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .train.session import LocalSession


@dataclass(frozen=True)
class JobSearch:
    """Shipped once to every trial (tune.with_parameters).

    The driver builds each data variant's datasets (training rows materialised in the object
    store) before trials start: every trial then reads the same blocks, and no trial, holding
    its CPU, waits on Ray Data tasks that need a CPU (Parquet sampling does).
    """

    raw: dict  # the base job spec (fixed changes applied) as plain data
    run_dir: str
    variants: dict  # variant key (preprocessing params as JSON) -> (PreprocessResult, datasets, ID counts or None)
    preprocessing_paths: tuple[str, ...]
    workers: int


def variant_key(params: dict, paths: tuple[str, ...]) -> str:
    import json

    return json.dumps({p: params[p] for p in paths if p in params}, sort_keys=True)


def trial_dir(run_dir: str, number: int) -> str:
    return os.path.join(run_dir, "trials", f"trial_{number:04d}")


class TuneSession(LocalSession):
    """LocalSession that also reports each epoch (metrics + checkpoint folder) to Ray Tune."""

    def report(self, metrics: dict, checkpoint_dir: str | None, name: str) -> None:
        import ray.tune

        super().report(metrics, checkpoint_dir, name)
        # reported_at: Tune's own `timestamp` is in whole seconds, too coarse to time a search
        # whose trials report every second or two (benchmarks/bench_tune.py asha-stream)
        ray.tune.report({**metrics, "checkpoint": os.path.join(self.run_dir, name), "reported_at": time.time()})


def job_trial(config: dict, search: JobSearch) -> None:
    """The Tune function trainable of a job-spec search."""
    from .search_spec import job_from
    from .train.trainer import _fit_local, _fit_ray, loop_context

    spec = job_from(search.raw, config["params"])
    pre, datasets, counts = search.variants[variant_key(config["params"], search.preprocessing_paths)]
    context = loop_context(spec, pre, counts)
    folder = trial_dir(search.run_dir, config["number"])
    if search.workers == 1:
        _fit_local(spec, pre, folder, context, session_cls=TuneSession, datasets=dict(datasets))
    else:
        from ray.tune.integration.ray_train import TuneReportCallback

        _fit_ray(spec, pre, os.path.dirname(folder), os.path.basename(folder), context, callbacks=[TuneReportCallback()],
                 datasets=dict(datasets))

