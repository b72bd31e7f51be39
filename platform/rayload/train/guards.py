"""What ends a run that cannot go on usefully, with the reason and where: a validation split
that gives no metric to rank checkpoints by, and a model that diverged (its training loss or
its validation outputs no longer numbers)."""

from __future__ import annotations

import math

from ..spec import JobSpec


def check_scored(spec: JobSpec, task: str, context: dict, metrics: dict) -> None:
    """A validation split with rows but without the metric that ranks checkpoints (or
    early-stops) ends the run at its first epoch: AUC needs both classes, and without it every
    epoch trained on, nothing counted as better, each checkpoint but the last was deleted as
    unscored, and the run failed only at the end, unresumable with another metric."""
    from .loop import score_name
    from .trainer import TrainingError

    if not metrics.get("val_rows"):
        return
    own = f"val_{score_name(spec, task)}"
    needed = {context.get("score") or own} | ({own} if spec.train.early_stopping else set())
    if missing := sorted(m for m in needed if metrics.get(m) is None):
        hint = ("; AUC needs both classes: early-stop on logloss (train.early_stopping.metric: logloss), or split "
                "stratified" if any(m.endswith("_auc") for m in missing) else "")
        raise TrainingError(f"the validation split ({metrics['val_rows']} rows) gives no {', '.join(missing)}, which ranks "
                            f"this run's checkpoints{' and early-stops it' if own in missing and spec.train.early_stopping else ''}{hint}")


def check_loss(loss: float, epoch: int, step: int, history: list[dict], keep: int) -> None:
    """A training loss that is not a number (NaN, infinite) means the weights the step just
    took are not either: every later step and the epoch's validation only spread it. The run
    stopped at that validation with a bare ValueError (a traceback, no epoch or step named)
    after training the rest of the epoch on NaN weights. (Under fp16 the gradient scaler skips
    such steps and keeps the weights, so fp16 runs are not checked here.)"""
    if math.isfinite(loss):
        return
    raise diverged(f"the training loss became {loss} at optimizer step {step} (epoch {epoch})", history, keep)


def diverged(what: str, history: list[dict], keep: int):
    """The error, naming what went wrong and the checkpoints the run kept before it: the best
    `keep` (train.keep_checkpoints) by validation of the epochs it finished."""
    from .trainer import TrainingError

    first, last = (history[0]["epoch"], history[-1]["epoch"]) if history else (None, None)
    kept = "" if not history else (f"; the run folder keeps the checkpoint of epoch {first}" if first == last else
                                   f"; the run folder keeps the best {min(keep, last - first + 1)} by validation of epochs "
                                   f"{first}-{last}'s checkpoints (train.keep_checkpoints)")
    return TrainingError(f"the model diverged: {what}. Lower train.lr, set train.grad_clip, or scale or clip the numeric "
                         f"features (features.numeric.<name>.scale / clip){kept}")
