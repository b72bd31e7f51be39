"""`fit(spec)`: preprocess, then run the training loop in this process or as a TorchTrainer."""

from __future__ import annotations

import contextlib
import functools
import datetime as _dt
import logging
import math
import os
import subprocess
from dataclasses import dataclass, field, replace as _replace

from .._ray import embedded, ensure_ray
from .._spec_checks import check_job, warn_ignored_model_settings
from ..data.pipeline import PreprocessResult, preprocess
from ..errors import RayloadError, SpecError
from ..paths import exclusive, is_remote, join_uri, local_path, lock_file, remote_scratch, runs_root, shared_storage
from ..spec import JobSpec
from . import checkpoint as ckpt
from . import identity, record, transfer
from .loop import LOWER_IS_BETTER, loader_options, run, score_name, worker_entry
from .resources import (START_TIMEOUT_ENV, alive_nodes, check_resources, check_storage, check_writable, elastic_max,
                        elastic_wait_bound, placement_timed_out, requested, start_timeout)
from .local_session import LocalSession, best_of

log = logging.getLogger(__name__)

# Ray Train's controller polls its workers this often (seconds); Ray's default is 2 (_controller_env).
HEALTH_CHECK_INTERVAL_S = 0.5


class TrainingError(RayloadError):
    """Training failed after its retries; the message names the rank and the original error."""


@dataclass
class TrainResult:
    run_name: str
    run_dir: str
    checkpoint: str  # the best checkpoint by the validation metric
    metrics: dict  # validation metrics of that checkpoint
    history: list[dict] = field(default_factory=list)
    test: dict | None = None
    preprocessed: PreprocessResult | None = None


def score_metric(spec: JobSpec, task: str) -> tuple[str, str]:
    name = score_name(spec, task)
    return f"val_{name}", "min" if name in LOWER_IS_BETTER else "max"


def run_name_for(spec: JobSpec) -> str:
    """A given train.run_name resumes that run; otherwise every launch is a new run."""
    return spec.train.run_name or f"{spec.name}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}"


def fit(spec: JobSpec, address: str | None = None, evaluate_test: bool = True) -> TrainResult:
    if issues := check_job(spec):  # load_spec's checks, for a spec built in code too (sparse tables on GPUs were let through)
        raise SpecError(issues)
    transfer.check_before_training(spec)  # a checkpoint the model does not fit: before Ray and the data, in the driver
    warn_ignored_model_settings(spec)
    # A cluster sets RAYLOAD_STORAGE_PATH (cluster.yaml: s3://bucket/...) so every node reaches the checkpoints.
    storage = shared_storage(spec.train.storage_path) or os.path.join(runs_root(), "train")
    name = run_name_for(spec)
    # One driver per run: two launches of one run name took each other's checkpoints (top-k removed one's best)
    with exclusive(run_lock(storage, name), f"run {name!r} is being trained by another process (train.run_name); wait for it, "
                   "or give another run name"):
        return _fit(spec, address, evaluate_test, storage, name)


def run_lock(storage: str, name: str) -> str:
    """The lock file of the run `name` at `storage` (`paths.lock_file`: nothing beside the runs)."""
    return lock_file(join_uri(storage, name) if is_remote(storage) else os.path.abspath(os.path.join(local_path(storage), name)))


def _fit(spec: JobSpec, address: str | None, evaluate_test: bool, storage: str, name: str) -> TrainResult:
    check_writable(storage, spec.train.storage_path)  # once the run is ours: a second launch makes nothing
    ensure_ray(address)
    in_process = address is None and not os.environ.get("RAY_ADDRESS") and spec.resources.workers == 1
    # Cheap, so before preprocessing: a request that can never run is refused first. In-process
    # too: its one worker asks for this machine's CPUs and GPUs as a Ray worker would.
    check_resources(spec.resources)
    if not in_process:
        check_storage(storage)
    last = record.latest(join_uri(storage, name))  # a relaunch: the run's latest checkpoint, by either path
    previous = identity.read_manifest(last["path"]) if last else None
    if previous:  # the spec now, the data once it is prepared: a changed run is refused before its work
        identity.check_same_run(name, last["path"], previous, {"spec": spec.model_dump(mode="json")})
    pre = preprocess(spec, address=address)
    context = loop_context(spec, pre)
    if previous:
        identity.check_same_run(name, last["path"], previous, context["manifest"])
    trained_in = None  # a mirrored run's best checkpoint on this machine's disk
    if in_process:
        if is_remote(storage):  # trained on this machine's disk, in a folder of this remote run's own,
            # each checkpoint mirrored to the storage as it is written (a relaunch resumes: here from
            # the local folder, elsewhere from the storage)
            remote = join_uri(storage, name)
            local = _fit_local(spec, pre, remote_scratch(remote, "train"), context, session_cls=functools.partial(LocalSession, remote=remote))
            result, trained_in = _named_remote(local, remote), local.checkpoint
        else:
            result = _fit_local(spec, pre, os.path.join(local_path(storage), name), context)  # file:// as its folder
    else:
        result = _fit_ray(spec, pre, storage, name, context)
    result.preprocessed = pre
    if evaluate_test and pre.files.get(spec.eval.split):
        from ..evaluate import evaluate_checkpoint

        # A mirrored run is evaluated from its local copy, not downloaded again; a run resumed on
        # this machine from the storage fetched only its latest checkpoint, so an earlier best is
        # read from the storage.
        source = trained_in if trained_in and os.path.isdir(trained_in) else result.checkpoint
        result.test = evaluate_checkpoint(source, pre.batches(spec.eval.split), spec.eval).to_dict()
    return result


def finished_run(spec: JobSpec, cache_key: str) -> TrainResult | None:
    """The result of the run `spec.train.run_name` when that run already trained to its end
    (its last epoch, or early stopping) on this spec and on data of this preprocessing cache
    key, read from the run's record without starting Ray or the loop; None otherwise (not run,
    unfinished, another spec or data, a best checkpoint no longer there): `fit` decides then.
    A finished run relaunched by `fit` starts Ray, preprocesses (a cache hit) and starts the
    loop (or a Ray Train group) only for the loop to find nothing to train."""
    if not spec.train.run_name:
        return None
    storage = shared_storage(spec.train.storage_path) or os.path.join(runs_root(), "train")
    home = join_uri(storage, spec.train.run_name)
    kept = record.entries(home)
    if not kept:
        return None
    last = kept[-1]
    metrics = last["metrics"]
    if not (metrics.get("early_stopped") or metrics.get("epochs_done", -1) >= spec.train.epochs):
        return None
    manifest = identity.read_manifest(last["path"])
    if not manifest or manifest.get("cache_key") != cache_key or identity.changes(manifest, {"spec": spec.model_dump(mode="json")}):
        return None
    from ..features import FittedFeatures
    from ..paths import read_text

    try:
        task = FittedFeatures.from_json(read_text(join_uri(last["path"], "features.json"))).label.task
    except FileNotFoundError:
        return None
    score, mode = score_metric(spec, task)
    best = best_of(kept, score, mode)
    if not best or (not is_remote(best[0]["path"]) and not os.path.exists(os.path.join(best[0]["path"], "model.pt"))):
        return None
    return TrainResult(spec.train.run_name, local_path(home) if not is_remote(home) else home, best[0]["path"], best[0]["metrics"],
                       ckpt.read_history(last["path"]))


def loop_context(spec: JobSpec, pre: PreprocessResult, id_counts: dict | None = None) -> dict:
    """What the loop needs besides the spec and features (plain data: it crosses to workers).
    `id_counts`: the training split's ID counts when the caller has them (a search counts once
    per data variant); read or counted here otherwise (train/prior.py), when train.embedding_prior
    needs them."""
    context = {"train_rows": pre.counts["written"]["train"], "manifest": manifest(spec, pre), "fault": os.environ.get("RAYLOAD_FAULT"),
               "val_files": pre.files.get("val", [])}
    if spec.train.embedding_prior:
        from .prior import training_counts

        context["id_counts"] = id_counts if id_counts is not None else training_counts(pre)
    return context


def manifest(spec: JobSpec, pre: PreprocessResult) -> dict:
    """data_hash: the prepared data's content digest (the same rows give the same hash wherever
    they were read from); cache_key: the preprocessing cache entry it came from."""
    return {"versions": ckpt.versions(), "seed": spec.train.seed, "data_hash": pre.data_hash, "cache_key": pre.cache_key,
            "git_commit": _git_commit(), "spec": spec.model_dump(mode="json"),
            "workdir": os.getcwd()}  # what the spec's relative data paths meant (compress reads them from elsewhere)


def _git_commit() -> str | None:
    """This checkout's commit; in an uploaded job (no .git) the one `rayload submit` sent along."""
    if os.environ.get("RAYLOAD_GIT_COMMIT"):
        return os.environ["RAYLOAD_GIT_COMMIT"]
    try:
        # in rayload's own folder: the working directory may be another repository, or none
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _fit_local(spec: JobSpec, pre: PreprocessResult, run_dir: str, context: dict,
               session_cls=LocalSession, datasets: dict | None = None, score: tuple[str, str] | None = None) -> TrainResult:
    """The loop in this process (one worker); `session_cls` lets a tuning trial report to Tune.
    `score`: (metric, mode) the kept checkpoints are ranked by, when not the job's own (a
    search's trial keeps the best epochs by the search's metric)."""
    score, mode = score or score_metric(spec, pre.features.label.task)
    datasets = datasets or training_datasets(pre, spec.train.cache_dataset)
    # One process: read blocks in order so a seed reproduces the run exactly.
    datasets["train"].context.execution_options.preserve_order = True
    res = spec.resources
    loader = loader_options(spec, pre.features, use_gpu=res.gpus_per_worker > 0, cpu_fallback=res.cpu_fallback,
                            val_files=context.get("val_files"))
    session = session_cls(loader, datasets, run_dir, spec.train.keep_checkpoints, score, mode)
    out = run(spec, pre.features, session, dict(context, score=score))
    best = best_of(session.index(), score, mode)
    if not best:
        raise TrainingError(_unscored(score, run_dir))
    return TrainResult(os.path.basename(run_dir), run_dir, best[0]["path"], best[0]["metrics"], out["history"])


def _unscored(score: str, run: str) -> str:
    hint = "; a validation split with one class has no AUC: early-stop on logloss, or use a stratified split" if score == "val_auc" else ""
    return f"no checkpoint with {score} was written in {run}{hint}"


def _finite(value) -> bool:
    """A score that can rank: NaN compares False both ways, so one NaN could sort first."""
    return value is not None and math.isfinite(value)


def _best_reported(checkpoints: list, score: str, mode: str, run: str) -> tuple:
    """The best of Ray Train's (checkpoint, metrics) pairs by `score`, among those that report it."""
    scored = [cm for cm in checkpoints if _finite(cm[1].get(score))]
    if not scored:
        raise TrainingError(_unscored(score, run))
    return min(scored, key=lambda cm: cm[1][score] * (-1 if mode == "max" else 1))


def _fit_ray(spec: JobSpec, pre: PreprocessResult, storage: str, name: str, context: dict, callbacks: list | None = None,
             datasets: dict | None = None, score: tuple[str, str] | None = None) -> TrainResult:
    import ray.train

    from .shards import ingest

    res = spec.resources
    score, mode = score or score_metric(spec, pre.features.label.task)
    home = join_uri(storage, name)
    if resume := record.ray_resume_point(home):  # the run went on (or began) in-process: Ray's snapshot lacks it
        context = dict(context, resume_from=resume)
    # elastic: at most what the cluster's free resources place now (Ray sizes it from the totals)
    workers = res.workers if isinstance(res.workers, int) else (res.workers.min, elastic_max(res))
    callbacks = callbacks if isinstance(res.workers, int) else [*(callbacks or []), elastic_wait_bound(res)]
    per_worker = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus_per_worker} if res.gpus_per_worker else {})}
    torch_config = None
    if res.gpus_per_worker and res.cpu_fallback:
        from ray.train.torch import TorchConfig

        # NCCL needs CUDA; gloo runs on both, so a fallback worker can still join the group.
        log.warning("resources.cpu_fallback: the worker group uses gloo; GPU workers without CUDA compute on CPU")
        torch_config = TorchConfig(backend="gloo")
    data_config, datasets = ingest(datasets or training_datasets(pre, spec.train.cache_dataset), workers)
    trainer = _trainer_class()(
        worker_entry, torch_config=torch_config,
        train_loop_config={"spec": spec.model_dump(mode="json"), "features": pre.features.to_json(), "context": dict(context, score=score)},
        scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=res.gpus_per_worker > 0,
                                               resources_per_worker=per_worker, accelerator_type=res.accelerator_type),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage, callbacks=callbacks,
            failure_config=ray.train.FailureConfig(max_failures=spec.train.max_failures, controller_failure_limit=0),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=spec.train.keep_checkpoints,
                                                         checkpoint_score_attribute=score, checkpoint_score_order=mode),
        ),
        datasets=datasets,
        dataset_config=data_config,
    )
    try:
        with _controller_env(res), _placement_groups_removed_on_error():
            trainer.fit()
    except ray.train.TrainingFailedError as exc:
        raise TrainingError(_failure_message(exc, spec)) from exc
    # The run's record, not this launch's alone: the best may be an epoch trained in-process. On
    # shared storage (s3://...) checkpoints are named by URI, which every node can load.
    kept = record.entries(home)
    checkpoint, metrics = _best_reported([(e["path"], e["metrics"]) for e in kept], score, mode, home)
    history = ckpt.read_history(kept[-1]["path"])  # history.json only, not the optimizer state
    return TrainResult(name, home, checkpoint, metrics, history)


def _trainer_class():
    """Ray Train's TorchTrainer; in the embedded local Ray, without its PlacementGroupCleaner.

    The cleaner is one more actor process per run, started with the controller, that asks
    Ray's State API once a second whether the controller is alive, so that it can remove the
    worker group's placement group if the controller dies while its driver lives on. The State
    API is a dashboard module, which the embedded Ray does not start: every one of those
    questions fails (and logs a warning). On this 2-core machine the process cost 1.5-2 s of a
    no-op run's `fit` (benchmarks/RESULTS.md, "The PlacementGroupCleaner dropped"), and its polling
    runs beside the training workers all run long. The embedded Ray ends with this process;
    the one case it covered, a controller that dies with this driver still running, is
    handled by `_placement_groups_removed_on_error`. A joined cluster keeps the cleaner."""
    from ray.train.torch import TorchTrainer

    if not embedded():
        return TorchTrainer
    try:
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:  # another Ray: its trainer as it is
        return TorchTrainer

    class EmbeddedTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            return [c for c in super()._create_default_callbacks() if not isinstance(c, PlacementGroupCleanerCallback)]

    return EmbeddedTorchTrainer


@contextlib.contextmanager
def _placement_groups_removed_on_error():
    """In the embedded Ray, a `fit` that ends in an error other than the workers' own (the
    controller's process died, an interrupt) removes the placement groups created during it
    that are still there: Ray Train's controller removes its worker group's placement group on
    every path it lives to see, and without the cleaner (`_trainer_class`) nothing else would,
    so the next `fit` in this process could not place its workers."""
    if not embedded():
        yield
        return
    import ray.train
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    before = set(placement_group_table())
    try:
        yield
    except ray.train.TrainingFailedError:
        raise
    except BaseException:
        for pg_id, info in placement_group_table().items():
            if pg_id not in before and info.get("state") != "REMOVED":
                with contextlib.suppress(Exception):
                    remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
                    log.warning("removed placement group %s, left by a training run that ended in an error", pg_id)
        raise


def _named_remote(result: TrainResult, remote_run: str) -> TrainResult:
    """An in-process run whose checkpoints were mirrored to object storage as they were written
    (LocalSession with `remote`), named by their URIs. The local folder stays: a relaunch on
    this machine resumes from it, one elsewhere from the remote copy."""
    rel = os.path.relpath(result.checkpoint, result.run_dir)
    return _replace(result, run_dir=remote_run, checkpoint=join_uri(remote_run, *rel.split(os.sep)))


@contextlib.contextmanager
def _controller_env(res):
    """Settings Ray Train reads from the environment when `trainer.fit()` starts its controller
    (which forwards them to its actor), set for that call only:
    - the worker-group start timeout: Ray Train retries a group that cannot be placed forever;
      this bounds the wait (`resources.start_timeout`);
    - no PreemptionWatcher on a one-node cluster that holds the whole group: the watcher is one
      more actor process per worker-group start, polling for drains of the nodes that hold
      ranks, and a drain of the only node ends the run with it. A user's own
      RAY_TRAIN_ENABLE_PREEMPTION_WATCHER wins;
    - the controller polls its workers every 0.5 s instead of Ray's 2 s: it learns that
      training ended (and registers reported checkpoints) at its next poll: a run ended
      3.4-5.4 s after its last report with 2 s, 1.3-1.8 s with 0.5 s (RESULTS.md). A poll is one
      small actor call per worker; a poll that does not answer in time is awaited again at the
      next one, and a worker is declared dead only after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S
      (10 minutes), whatever the interval. A user's own RAY_TRAIN_HEALTH_CHECK_INTERVAL_S wins."""
    env = {START_TIMEOUT_ENV: str(start_timeout(res))}
    if "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in os.environ:
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(HEALTH_CHECK_INTERVAL_S)
    _, per_worker = requested(res)
    most = res.workers if isinstance(res.workers, int) else res.workers.max
    nodes = alive_nodes()
    if "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ and len(nodes) == 1 and all(
            nodes[0]["Resources"].get(k, 0) >= v * most for k, v in per_worker.items()):
        env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def training_datasets(pre: PreprocessResult, cache: bool = True) -> dict:
    train, val = pre.dataset("train", for_training=True), pre.dataset("val", for_training=True)
    if cache:
        train = train.materialize()
    # Every rank reads all of val and keeps every world_size-th batch (exact metrics, no
    # dropped rows); that needs the same batches in the same order on every rank.
    val.context.execution_options.preserve_order = True
    for ds in (train, val):
        ds.context.enable_progress_bars = False
    return {"train": train, "val": val}


def _failure_message(exc, spec: JobSpec) -> str:
    failures = getattr(exc, "worker_failures", None)
    if failures:
        ranks = ", ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(failures.items()))
        return f"training failed after {spec.train.max_failures} retr{'y' if spec.train.max_failures == 1 else 'ies'} (train.max_failures); {ranks}"
    cause = getattr(exc, "controller_failure", None) or exc
    if type(cause).__name__ == "WorkerGroupStartupTimeoutError":
        return "training could not run: " + placement_timed_out(spec.resources, start_timeout(spec.resources))
    return f"training could not run: {type(cause).__name__}: {cause}"


from .kfold import KFoldResult, kfold  # noqa: E402,F401  k-fold cross-validation, re-exported: callers name it as train.trainer's
