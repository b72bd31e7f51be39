"""What one tuning trial runs: `rayload train`'s loop on the trial's job spec.

One worker: the loop runs in the trial's own process (no worker group to start) with a
session that also reports every epoch to Tune. More workers: the trial starts a TorchTrainer
whose rank-0 reports reach Tune through Ray Train's TuneReportCallback. Either way a trial's
checkpoints live in `<run>/trials/trial_NNNN` (or under the search's trial root on object
storage), keyed by the Optuna trial number, so a retried or re-attached trial resumes from its
last epoch, on any node when they are on object storage.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .train.local_session import LocalSession


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
    trial_root: str = ""  # where trials' checkpoints go: the run folder, or a URI on object storage
    score: tuple[str, str] | None = None  # (metric, mode) of the search: each trial keeps its best epochs by it


def variant_key(params: dict, paths: tuple[str, ...]) -> str:
    import json

    return json.dumps({p: params[p] for p in paths if p in params}, sort_keys=True)


def trial_dir(run_dir: str, number: int) -> str:
    return os.path.join(run_dir, "trials", f"trial_{number:04d}")


class TuneSession(LocalSession):
    """LocalSession that also reports each epoch (metrics + checkpoint) to Ray Tune. With
    `remote` (the trial's folder on object storage) checkpoints are mirrored there as they are
    written (LocalSession), and Tune is told their URIs: the driver, the A/B stage and any node
    read them from there, and a trial retried on another node resumes from its last epoch."""

    def report(self, metrics: dict, checkpoint_dir: str | None, name: str) -> None:
        import ray.tune

        super().report(metrics, checkpoint_dir, name)
        # reported_at: Tune's own `timestamp` is in whole seconds, too coarse to time a search
        # whose trials report every second or two (benchmarks/bench_tune.py asha-stream)
        ray.tune.report({**metrics, "checkpoint": self.uri(name), "reported_at": time.time()})


def job_trial(config: dict, search: JobSearch) -> None:
    """The Tune function trainable of a job-spec search."""
    from .search_job import job_from
    from .train.trainer import _fit_local, _fit_ray, loop_context

    spec = job_from(search.raw, config["params"])
    pre, datasets, counts = search.variants[variant_key(config["params"], search.preprocessing_paths)]
    context = loop_context(spec, pre, counts)
    from .paths import is_remote, join_uri, remote_scratch

    root, name = search.trial_root or search.run_dir, f"trial_{config['number']:04d}"
    if search.workers == 1:
        if is_remote(root):  # trained on this node's disk, each checkpoint uploaded as it is written
            import functools

            remote = join_uri(root, "trials", name)
            _fit_local(spec, pre, remote_scratch(remote, "tune"), context, session_cls=functools.partial(TuneSession, remote=remote),
                       datasets=dict(datasets), score=search.score)
        else:
            _fit_local(spec, pre, trial_dir(root, config["number"]), context, session_cls=TuneSession, datasets=dict(datasets),
                       score=search.score)
    else:
        storage = join_uri(root, "trials")
        _fit_ray(spec, pre, storage, name, context, callbacks=[_uri_reporter(storage)], datasets=dict(datasets), score=search.score)


def _uri_reporter(storage: str):
    """Ray Train's TuneReportCallback, with the checkpoint named as rayload names it: on object
    storage Ray Train's Checkpoint.path lacks the scheme and the filesystem's options."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from .paths import uri_for

    class _Reporter(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if checkpoint:
                metrics = [{**metrics[0], "checkpoint": uri_for(storage, checkpoint.path)}, *metrics[1:]]
            super().after_report(run_context, metrics, checkpoint)

    return _Reporter()

