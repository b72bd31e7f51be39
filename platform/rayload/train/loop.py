"""THE training loop: one function per worker, for `rayload train`, tuning trials and the SDK.

DDP (through the session), mixed precision, gradient accumulation with `no_sync`, clipping,
warmup and decay, SyncBatchNorm, seeded initialisation, class weights, early stopping and
resumable checkpoints at the end of every epoch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time

import numpy as np
import torch
from torch import nn

from ..evaluate import NonFiniteOutputs, metrics_for_outputs
from ..features import FittedFeatures
from ..models._inputs import FieldEmbeddings
from ..spec import JobSpec
from . import checkpoint as ckpt
from . import guards, identity, prior, transfer
from .batch import Batch, Layout
from .sparse_sync import SparseGradSync, clip_grad_norm_
from .session import RaySession, Session, scratch_dir
# set-up names, re-exported: callers and tests name them as train.loop's
from .fault import Fault
from .setup import lr_lambda, make_model, make_optimizers, place_steps, resolve_precision, seed_rank, steps_per_epoch  # noqa: F401

log = logging.getLogger(__name__)
LOWER_IS_BETTER = {"logloss", "rmse"}


def class_weight_pair(features: FittedFeatures) -> tuple[float, float] | None:
    """The rebalancing step's class weights (label 0, label 1), None without any."""
    weights = features.label.class_weights or {}
    return (float(weights.get("0.0", 1.0)), float(weights.get("1.0", 1.0))) if weights else None


def binary_loss(out: torch.Tensor, label: torch.Tensor, class_weights: tuple[float, float] | None) -> torch.Tensor:
    """Binary cross-entropy on logits, each row weighted by its class's weight when there are any."""
    weight = None if class_weights is None else torch.where(label > 0.5, class_weights[1], class_weights[0])
    return nn.functional.binary_cross_entropy_with_logits(out, label, weight=weight)


def score_name(spec: JobSpec, task: str) -> str:
    """The validation metric that early-stops the run and ranks its checkpoints: the early
    stopping rule's, else the task's own."""
    rule = spec.train.early_stopping
    return (rule.metric if rule else None) or ("auc" if task == "binary" else "rmse")


def worker_entry(config: dict) -> None:
    """Ray Train's train_loop_per_worker: dicts exist only at this boundary."""
    spec = JobSpec.model_validate(config["spec"])
    features = FittedFeatures.from_json(config["features"])
    res = spec.resources
    session = RaySession(loader_options(spec, features, use_gpu=res.gpus_per_worker > 0, cpu_fallback=res.cpu_fallback,
                                        val_files=config["context"].get("val_files")))
    run(spec, features, session, config["context"])


def loader_options(spec: JobSpec, features: FittedFeatures, use_gpu: bool = False, cpu_fallback: bool = False,
                   val_files: list[str] | None = None) -> dict:
    t = spec.train
    return {"prefetch_batches": t.prefetch_batches, "shuffle_buffer": t.shuffle_buffer, "seed": t.seed,
            "cache_bytes": 0 if t.shuffle_buffer else t.worker_cache_mb * 2**20, "layout": Layout.from_features(features), "use_gpu": use_gpu, "cpu_fallback": cpu_fallback,
            "val_files": val_files}


def _finite(grad: torch.Tensor) -> bool:
    """Whether every value of a gradient (dense, or a sparse one's stored values) is finite."""
    values = grad.coalesce().values() if grad.is_sparse else grad
    return bool(torch.isfinite(values).all())


class Trainer:
    """Per-worker state of one run: model, optimizers, scaler, schedule, counters."""

    def __init__(self, spec: JobSpec, features: FittedFeatures, session: Session, steps_per_epoch: int,
                 id_counts: dict | None = None):
        self.spec, self.features, self.session = spec, features, session
        self.precision = resolve_precision(spec.train.precision, session.device)
        if session.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = spec.train.tf32
        self.model = make_model(spec, features, session)
        self.norms = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.embeddings = [m for m in self.model.modules() if isinstance(m, FieldEmbeddings)]  # for the penalties
        if spec.train.embedding_prior:
            prior.attach(self.embeddings, features, id_counts, session.device)
        self.optimizers = make_optimizers(self.model, spec)
        self._trained = [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]  # what grad_clip bounds
        tables = [p for opt in self.optimizers[1:] for group in opt.param_groups for p in group["params"]]
        self.sparse_sync = SparseGradSync(tables, session.world_size) if tables and session.world_size > 1 else None
        # The dense optimizer follows the warmup and decay; so do the sparse tables' unless
        # train.sparse_lr_schedule is constant.
        scheduled = self.optimizers if spec.train.sparse_lr_schedule == "follow" else self.optimizers[:1]
        self.steps_per_epoch = steps_per_epoch
        factor = lr_lambda(spec, steps_per_epoch * spec.train.epochs)  # re-planned by restore()
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in scheduled]
        self.scaler = torch.amp.GradScaler(session.device.type) if self.precision == "fp16" else None
        self.state = ckpt.TrainState()
        self.binary = features.label.task == "binary"
        self.class_weights = class_weight_pair(features)

    # ------------------------------------------------------------ one optimizer step

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.session.device.type, dtype=dtype)

    def loss(self, batch: Batch) -> torch.Tensor:
        with self.autocast():
            out = self.model(*batch.inputs()).float()
        if self.binary:
            loss = binary_loss(out, batch.label, self.class_weights)
        else:
            loss = nn.functional.mse_loss(out, batch.label)
        if self.spec.train.embedding_l2:
            # last_sq is computed when read (a lookup per bag): read once per table
            loss = loss + self.spec.train.embedding_l2 * sum(sq for m in self.embeddings if (sq := m.last_sq) is not None)
        if self.spec.train.embedding_prior:
            loss = loss + self.spec.train.embedding_prior * sum(m.last_prior for m in self.embeddings if m.last_prior is not None)
        return loss

    def step(self, micro_batches: list[Batch]) -> float:
        """One optimizer step over k micro-batches; gradients sync only on the last one. Each
        micro-batch's mean loss is weighted by its share of the group's rows, so a group with a
        short micro-batch steps as one batch of all its rows would."""
        k, total, rows = len(micro_batches), 0.0, sum(len(b) for b in micro_batches)
        for i, batch in enumerate(micro_batches):
            sync = i == k - 1 or not hasattr(self.model, "no_sync")
            with contextlib.nullcontext() if sync else self.model.no_sync(), self._running_norms(len(batch)):
                loss = self.loss(batch.to(self.session.device)) * (len(batch) / rows)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += float(loss.detach())
        if self.scaler is None:  # a loss that is not a number: stop before stepping the weights with it
            guards.check_loss(total, self.state.epoch + 1, self.state.step + 1, self.state.history, self.spec.train.keep_checkpoints)
        self._apply()
        return total

    @contextlib.contextmanager
    def _running_norms(self, rows: int):
        """Batch norm normalises a one-row micro-batch by its running statistics. One row has no
        batch variance (PyTorch refuses it in training), and one rank keeps its short last
        micro-batch, so train_rows % micro-batch == 1 leaves such a row. Dropping it would
        break the step count steps_per_epoch promises the LR schedule when it is a step of its
        own; here it still steps, every layer learns from it (the norms' affine weights too),
        normalised as validation and serving do; only the running statistics skip it."""
        frozen = [m for m in self.norms if m.training] if rows == 1 else []
        for m in frozen:
            m.eval()
        try:
            yield
        finally:
            for m in frozen:
                m.train()

    def _apply(self) -> None:
        if self.sparse_sync:
            self.sparse_sync()
        overflow = False
        if self.scaler:
            for opt in self.optimizers:
                self.scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            # GradScaler.step skips per optimizer, on that optimizer's own gradients: when only the
            # dense part overflowed, the sparse tables' optimizer stepped alone (and with clipping,
            # on gradients scaled to 0 while its moments moved the rows). One overflow skips all.
            overflow = not all(_finite(p.grad) for p in self._trained if p.grad is not None)
        if self.spec.train.grad_clip and not overflow:  # the whole model's norm: the sparse tables' rows count too
            clip_grad_norm_(self._trained, self.spec.train.grad_clip)
        if not overflow:
            for opt in self.optimizers:
                self.scaler.step(opt) if self.scaler else opt.step()
        if self.scaler:
            self.scaler.update()  # reads the inf flags unscale_ recorded: an overflow lowers the scale
        for scheduler in self.schedulers:
            scheduler.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.state.step += 1

    # ------------------------------------------------------------ epochs

    def train_epoch(self, epoch: int, fault: "Fault | None" = None) -> dict:
        self.model.train()
        transfer.eval_frozen(self.model, self.spec.train.freeze)
        k = self.spec.train.accumulation
        micro = max(1, self.spec.train.batch_size // k)
        group, losses, rows, start = [], [], 0, time.perf_counter()
        for i, batch in enumerate(self.session.train_batches(epoch, micro)):
            if fault is not None:
                fault.maybe_fail(epoch, self.session.rank, i)
            group.append(batch)
            rows += len(batch)
            if len(group) == k:
                losses.append((self.step(group), sum(len(b) for b in group)))
                group = []
        if group:  # a short last group still steps; every rank has the same count
            losses.append((self.step(group), sum(len(b) for b in group)))
        seconds = time.perf_counter() - start
        # The mean over this rank's rows: a step's loss is its rows' mean, so a short last step
        # (one row of 513) weighs its rows, not a third of the epoch
        loss = sum(value * n for value, n in losses) / sum(n for _, n in losses) if losses else None
        return {"train_loss": loss, "train_rows": rows * self.session.world_size,
                "samples_per_s": rows * self.session.world_size / seconds if seconds else None}

    @torch.no_grad()
    def validate(self) -> dict:
        # The unwrapped module: DDP's forward broadcasts buffers from rank 0, and ranks run
        # different numbers of validation batches, so the wrapped forward could deadlock.
        model = ckpt.unwrap(self.model)
        self._share_norm_statistics(model)
        model.eval()
        outs, labels = [], []
        for batch in self.session.val_batches(self.spec.eval.batch_size):
            # In fp32, not under the training's autocast: the metrics pick the best epoch and
            # early-stop, so they score the model as the test evaluation and serving run it
            # (bf16 keeps 8 bits of mantissa: predictions near 1000 move by up to 2).
            out = model(*batch.to(self.session.device).inputs()).float()
            outs.append(out.cpu().numpy())  # logits of a binary model: AUC ranks them (metrics_for_outputs)
            labels.append(batch.label.numpy())
        y = self.session.gather(np.concatenate(labels) if labels else np.zeros(0, np.float32))
        p = self.session.gather(np.concatenate(outs) if outs else np.zeros(0, np.float32))
        m = metrics_for_outputs(self.features.label.task, y, p, self.spec.eval.calibration_bins)
        return {f"val_{k}": v for k, v in m.to_dict().items() if v is not None}

    def _share_norm_statistics(self, model: nn.Module) -> None:
        """Batch norm's running statistics from rank 0 on every rank: DDP broadcasts them
        before each training forward, after which each rank updates them with its own batch,
        so after the last step they differ by rank; validation (and the checkpoint, rank 0's)
        use rank 0's. SyncBatchNorm's are equal already."""
        if self.session.world_size < 2:
            return
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
                for buffer in module.buffers():
                    torch.distributed.broadcast(buffer.data, src=0)

    # ------------------------------------------------------------ checkpoints

    def restore(self, path: str) -> None:
        raw = ckpt.load_train_state(path)
        weights = torch.load(f"{path}/{ckpt.MODEL}", weights_only=True, map_location="cpu")
        ckpt.unwrap(self.model).load_state_dict(weights)
        for opt, sd in zip(self.optimizers, raw["optimizers"]):
            settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(sd)
            for group, keep in zip(opt.param_groups, settings):
                # The state (moments, step counts) is the checkpoint's; the settings (lr, weight
                # decay, betas) are this spec's, and the kernel choice this device's. The saved
                # groups' lr would otherwise override the spec's for the rest of the run.
                group.update(keep)
            place_steps(opt)
        saved = raw["scheduler"]
        if saved is not None:  # a list per scheduled optimizer; one dict (the dense one's) before
            for scheduler, sd in zip(self.schedulers, saved if isinstance(saved, list) else [saved]):
                scheduler.load_state_dict(sd)
                scheduler.base_lrs = [group["initial_lr"] for group in scheduler.optimizer.param_groups]
        if self.scaler and raw["scaler"] is not None:
            self.scaler.load_state_dict(raw["scaler"])
        self.state = raw["state"]
        self._plan_schedule()
        own = ckpt.saved_rng_state(raw, self.session.rank, self.session.world_size)
        if own is not None:  # each rank goes on with its own streams, as if never stopped
            ckpt.set_rng_state(own)
        else:  # saved with another world size (or, before per-rank states, by rank 0 alone): fresh streams
            seed_rank(self.spec.train.seed, self.session.rank, self.state.epoch + 1)

    def _plan_schedule(self) -> None:
        """The decay's total for a resumed run: the steps already taken plus the epochs left at
        this start's steps per epoch. An elastic restart with another world size changes the
        steps per epoch; a total of (new steps per epoch x epochs) beside the restored step
        count would end the decay early after a grow (lr 0 for the epochs left) and short of
        its end after a shrink. The restored optimizers hold the next step's lr of the old
        plan, so it is set from this one."""
        left = self.spec.train.epochs - 1 - self.state.epoch
        factor = lr_lambda(self.spec, self.state.step + max(0, left) * self.steps_per_epoch)
        for scheduler in self.schedulers:
            scheduler.lr_lambdas = [factor] * len(scheduler.lr_lambdas)
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base * factor(scheduler.last_epoch)

    def save(self, manifest: dict) -> str | None:
        rngs = ckpt.rank_rng_states(self.session.world_size)  # every rank takes part; rank 0 writes
        if self.session.rank != 0:
            return None
        path = scratch_dir()
        ckpt.save(path, self.model, self.features, self.spec.model.model_dump(),
                  {"optimizers": self.optimizers, "schedulers": self.schedulers, "scaler": self.scaler, "state": self.state,
                   "rng": rngs},
                  manifest)
        return path

    def early_stop(self, metrics: dict) -> bool:
        """Update the best score; True when `patience` epochs passed without improvement."""
        rule = self.spec.train.early_stopping
        name = score_name(self.spec, self.features.label.task)
        value = metrics.get(f"val_{name}")
        if value is None or not math.isfinite(value):  # a NaN best would compare worse than nothing ever after
            return False
        better = (lambda a, b: a < b - (rule.min_delta if rule else 0.0)) if name in LOWER_IS_BETTER else (lambda a, b: a > b + (rule.min_delta if rule else 0.0))
        if self.state.best is None or better(value, self.state.best):
            self.state.best, self.state.bad_epochs = value, 0
        else:
            self.state.bad_epochs += 1
        return rule is not None and self.state.bad_epochs >= rule.patience


def _resume_point(context: dict) -> str | None:
    """The checkpoint a Ray Train launch resumes from when Ray's own record lacks the run's
    latest (train/record.py: it was written in-process); on object storage, fetched once."""
    if not context.get("resume_from"):
        return None
    from ..paths import localize

    return localize(context["resume_from"])


def run(spec: JobSpec, features: FittedFeatures, session: Session, context: dict) -> dict:
    """Train for spec.train.epochs (or until early stopping), resuming from the latest checkpoint."""
    micro = max(1, spec.train.batch_size // spec.train.accumulation)
    share = context["train_rows"] // max(1, session.world_size)
    if session.world_size > 1 and share < micro:
        from .trainer import TrainingError

        # every rank drops its short last micro-batch (they must step alike): with less than one
        # each, no step was taken, and the run reported epochs and checkpoints of the initial weights
        raise TrainingError(f"each of the {session.world_size} workers gets {share} training rows, fewer than one micro-batch of "
                            f"{micro} (train.batch_size {spec.train.batch_size} / train.accumulation {spec.train.accumulation}): "
                            "no step would be taken. Lower train.batch_size or resources.workers")
    steps = steps_per_epoch(context["train_rows"], session.world_size, spec.train.batch_size, spec.train.accumulation)
    if spec.train.warmup_steps >= steps * spec.train.epochs and session.rank == 0:
        # legal (a short smoke run of a production spec), but the rate never reaches train.lr and never decays
        log.warning("train.warmup_steps (%d) is at least the run's %d optimizer steps (%d per epoch x %d epochs): the learning "
                    "rate stays below train.lr (%g) for the whole run and train.lr_decay never starts", spec.train.warmup_steps,
                    steps * spec.train.epochs, steps, spec.train.epochs, spec.train.lr)
    trainer = Trainer(spec, features, session, steps, context.get("id_counts"))
    with session.latest_checkpoint() as path:
        path = path or _resume_point(context)
        if path:
            # the driver checked before preprocessing; a trial, or a worker's own checkpoint, here
            identity.check_same_run(spec.train.run_name or os.path.basename(os.path.dirname(path)), path,
                                    identity.read_manifest(path), context.get("manifest", {}))
            trainer.restore(path)
            trainer.state.restarts += 1
            session.cached_before = trainer.state.cached
            session.cached_before_bytes, session.cached_before_world = trainer.state.cached_bytes, trainer.state.cached_world
            log.info("rank %d resumed from %s at epoch %d, step %d", session.rank, path, trainer.state.epoch + 1, trainer.state.step)
    history = trainer.state.history
    if history and (history[-1].get("early_stopped") or trainer.state.epoch + 1 >= spec.train.epochs):
        # A run restored after its last epoch (a driver killed between the final report and
        # its bookkeeping): nothing to train, but whoever waits for a result (Tune's searcher
        # needs the metric) gets the last one again, pointing at the checkpoint already kept.
        session.report(dict(history[-1]), None, f"epoch_{trainer.state.epoch:04d}")
        return {"history": history}
    fault = Fault.from_context(context)
    for epoch in range(trainer.state.epoch + 1, spec.train.epochs):
        metrics = {"epoch": epoch, **trainer.train_epoch(epoch, fault)}
        trainer.state.cached = session.cached
        trainer.state.cached_bytes, trainer.state.cached_world = (session.cache_bytes, session.world_size) if session.cached else (None, None)
        try:
            metrics.update(trainer.validate())
        except NonFiniteOutputs as exc:  # fp16 (its scaler skips non-finite steps) or a loss finite by luck
            raise guards.diverged(f"epoch {epoch}'s validation outputs: {exc}", trainer.state.history, spec.train.keep_checkpoints) from None
        guards.check_scored(spec, features.label.task, context, metrics)
        stop = trainer.early_stop(metrics)
        trainer.state.epoch = epoch
        metrics.update(step=trainer.state.step, epochs_done=epoch + 1, world_size=session.world_size, early_stopped=stop,
                       restarts=trainer.state.restarts)
        trainer.state.history.append(metrics)
        manifest = dict(context["manifest"], epoch=epoch, metrics=metrics)
        path = trainer.save(manifest)
        try:
            session.report(metrics, path, f"epoch_{epoch:04d}")
        finally:  # Tune stops a trial (ASHA) by raising inside report: the scratch copy goes either way
            if path:
                shutil.rmtree(path, ignore_errors=True)
        if stop:
            break
    return {"history": trainer.state.history}
