"""Offline metrics: exact AUC (ties as half), log loss, calibration; and checkpoint evaluation."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import numpy as np

from .data.synthetic import weighted_auc
from .errors import RayloadError


@dataclass(frozen=True)
class Metrics:
    rows: int
    auc: float | None
    logloss: float | None
    mean_prediction: float | None  # None (and observed_rate) for no rows
    observed_rate: float | None
    calibration: float | None  # mean predicted / observed rate (1.0 = calibrated)
    ece: float | None  # expected calibration error over equal-width bins
    rmse: float | None = None  # regression tasks

    def to_dict(self) -> dict:
        return asdict(self)


# How far two AUCs (fractions k / (positives x negatives)) may differ in floating point and still be
# equal to a gate: 0.7 - 0.6 is 0.0999..., 0.51 - 0.508 is 0.0020000000000000018.
AUC_TOLERANCE = 1e-12


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    labels = np.asarray(labels, dtype=np.float64)
    return weighted_auc(np.asarray(scores, dtype=np.float64), labels, 1.0 - labels)


def paired_auc_difference(labels: np.ndarray, base: np.ndarray, other: np.ndarray, alpha: float = 0.05
                          ) -> tuple[float, tuple[float, float], float]:
    """AUC(other) - AUC(base) for two models' scores of the same rows, with its 1 - alpha
    confidence interval and two-sided p-value by DeLong's test for correlated AUCs (DeLong,
    DeLong & Clarke-Pearson 1988, in Sun & Xu's O(n log n) form): the two AUCs share their
    rows, so their difference varies far less than either AUC alone. Ties count half, as in
    `auc`. Needs at least two rows of each class."""
    from scipy.stats import norm, rankdata

    y = np.asarray(labels, dtype=np.float64) > 0.5
    m, n = int(y.sum()), int((~y).sum())
    if m < 2 or n < 2:
        raise ValueError(f"a paired AUC test needs 2 rows of each class, got {m} positive and {n} negative")
    scores = np.stack([np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)])
    pos, neg = scores[:, y], scores[:, ~y]
    tx, ty = rankdata(pos, axis=1), rankdata(neg, axis=1)
    tz = rankdata(np.concatenate([pos, neg], axis=1), axis=1)
    aucs = (tz[:, :m].sum(axis=1) - m * (m + 1) / 2) / (m * n)
    v01 = (tz[:, :m] - tx) / n  # per positive: the share of negatives it outscores
    v10 = 1.0 - (tz[:, m:] - ty) / m  # per negative: the share of positives that outscore it
    cov = np.cov(v01) / m + np.cov(v10) / n
    diff = float(aucs[1] - aucs[0])
    se = float(np.sqrt(max(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1], 0.0)))
    if se == 0.0:  # the same ranking of every row by both models
        return diff, (diff, diff), 1.0 if diff == 0.0 else 0.0
    z = norm.ppf(1 - alpha / 2)
    return diff, (float(diff - z * se), float(diff + z * se)), float(2 * norm.sf(abs(diff) / se))


class NonFiniteOutputs(RayloadError, ValueError):
    """A model's outputs hold NaN or infinite values: no metric is defined for them."""


def _refuse_non_finite(outputs: np.ndarray) -> None:
    """NaN or infinite outputs have no metric (an infinite logit made logloss NaN, a NaN
    prediction made RMSE NaN), and a NaN score ranked a diverged epoch as best."""
    bad = int((~np.isfinite(outputs)).sum())
    if bad:
        raise NonFiniteOutputs(f"the model's outputs hold {bad} NaN or infinite value(s) of {len(outputs)}: no metric is defined "
                         "for them (a diverged model: lower the learning rate, or clip gradients)")


def binary_metrics(labels: np.ndarray, probs: np.ndarray, bins: int = 10, logits: np.ndarray | None = None) -> Metrics:
    """AUC ranks the `logits` when given (no sigmoid saturates them into ties), else the
    probabilities as they are. Log loss comes from the logits when given, exactly at any size
    (log(1 + e^z) - y z); from probabilities alone it clips them to [1e-7, 1 - 1e-7] to stay
    finite, which caps a row's loss near 16.1. Only AUC needs both classes; outputs that are
    not finite numbers (NaN, inf) are refused, naming how many."""
    y = np.asarray(labels, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    _refuse_non_finite(p if logits is None else np.asarray(logits, np.float64))
    if len(y) == 0:
        return Metrics(rows=0, auc=None, logloss=None, mean_prediction=None, observed_rate=None, calibration=None, ece=None)
    both = 0 < y.sum() < len(y)
    if logits is not None:
        z = np.asarray(logits, dtype=np.float64)
        logloss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    else:
        clipped = np.clip(p, 1e-7, 1 - 1e-7)
        logloss = float(-np.mean(y * np.log(clipped) + (1 - y) * np.log(1 - clipped)))
    edges = np.minimum((p * bins).astype(np.int64), bins - 1)
    counts = np.bincount(edges, minlength=bins)
    gap = np.abs(np.bincount(edges, weights=p, minlength=bins) - np.bincount(edges, weights=y, minlength=bins))
    rate = float(y.mean())
    return Metrics(
        rows=len(y), auc=auc(y, p if logits is None else logits) if both else None, logloss=logloss,
        mean_prediction=float(p.mean()), observed_rate=rate,
        calibration=float(p.mean() / rate) if rate > 0 else None,
        ece=float(gap.sum() / max(counts.sum(), 1)),
    )


def regression_metrics(targets: np.ndarray, preds: np.ndarray) -> Metrics:
    y, p = np.asarray(targets, np.float64), np.asarray(preds, np.float64)
    _refuse_non_finite(p)
    if len(y) == 0:
        return Metrics(rows=0, auc=None, logloss=None, mean_prediction=None, observed_rate=None, calibration=None, ece=None)
    return Metrics(rows=len(y), auc=None, logloss=None, mean_prediction=float(p.mean()), observed_rate=float(y.mean()),
                   calibration=None, ece=None, rmse=float(np.sqrt(np.mean((y - p) ** 2))))


def metrics_for(task: str, labels: np.ndarray, outputs: np.ndarray, bins: int = 10) -> Metrics:
    """outputs: probabilities for binary tasks, predictions for regression."""
    return binary_metrics(labels, outputs, bins) if task == "binary" else regression_metrics(labels, outputs)


def metrics_for_outputs(task: str, labels: np.ndarray, outputs: np.ndarray, bins: int = 10) -> Metrics:
    """outputs: the model's raw outputs, logits for binary tasks, predictions for regression.
    AUC ranks the logits: a float32 sigmoid rounds every logit above ~17 to 1.0 (a float64 one
    above ~37), tying rows the model ranks apart; the probabilities are the float64 sigmoid."""
    if task != "binary":
        return regression_metrics(labels, outputs)
    from scipy.special import expit

    logits = np.asarray(outputs, dtype=np.float64)
    return binary_metrics(labels, expit(logits), bins, logits=logits)


def predict(model, dataset, layout, batch_size: int = 8192, binary: bool = True, raw: bool = False
            ) -> tuple[np.ndarray, np.ndarray]:
    """(labels, outputs) for every row of a preprocessed split (a Ray Dataset or LocalShards),
    on CPU in this process: probabilities of a binary model, or its logits with `raw`."""
    import torch

    from .train.batch import collate

    labels, outputs = [], []
    with torch.no_grad():
        for table in dataset.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
            batch = collate(table, layout)
            out = model(*batch.inputs()).float()
            outputs.append((torch.sigmoid(out) if binary and not raw else out).numpy())
            labels.append(batch.label.numpy())
    return np.concatenate(labels), np.concatenate(outputs)


def evaluate_checkpoint(path: str, dataset, eval_spec=None) -> Metrics:
    from .train import checkpoint as ckpt
    from .train.batch import Layout

    loaded = ckpt.load(path)
    bins = eval_spec.calibration_bins if eval_spec else 10
    y, out = predict(loaded.model, dataset, Layout.from_features(loaded.features), eval_spec.batch_size if eval_spec else 8192, raw=True)
    return metrics_for_outputs(loaded.features.label.task, y, out, bins)


def evaluate_split(spec, checkpoint: str, split: str = "test", address: str | None = None) -> Metrics:
    """Evaluate a checkpoint on a split of the spec's preprocessed data.

    The shards must come from the same fitted preprocessor as the checkpoint; otherwise IDs
    and scales would silently mean something else, so that is refused.
    """
    from .data.pipeline import preprocess
    from .errors import DataError, RayloadError
    from .features import FittedFeatures
    from .paths import localize

    # both before preprocessing, which may start Ray and take minutes: a mistyped split was
    # refused after it as "has no rows", a missing checkpoint as a FileNotFoundError traceback
    if split not in ("train", "val", "test"):
        raise RayloadError(f"--split must be train, val or test (got {split!r})")
    local = localize(checkpoint)
    if not os.path.isfile(os.path.join(local, "features.json")):
        raise RayloadError(_not_a_checkpoint(checkpoint, local))
    trained = FittedFeatures.load(os.path.join(local, "features.json"))  # a damaged one: said before Ray and the data
    pre = preprocess(with_own_features(spec, checkpoint), address=address)
    if trained != pre.features:
        from .train.identity import features_differ, read_manifest

        raise DataError(features_differ(f"checkpoint {checkpoint}", read_manifest(local), spec,
                                        "evaluate with the job spec (and --set overrides) it was trained with"))
    return evaluate_checkpoint(checkpoint, pre.batches(split), spec.eval)


def with_own_features(spec, checkpoint: str):
    """`spec` reading a fine-tuned checkpoint's fitted features from the checkpoint itself.

    A model fine-tuned from another checkpoint (`train.init_from`) transforms its data with
    that one's fitted features, which its own features.json holds too (with this data's label):
    read them there, so evaluating or gating the model does not need the ancestor, which may be
    gone (replaced by this model). Specs without `init_from` are returned as they are."""
    if not spec.train.init_from:
        return spec
    return spec.model_copy(update={"train": spec.train.model_copy(update={"init_from": checkpoint})})


def _not_a_checkpoint(checkpoint: str, local: str) -> str:
    """A missing folder, a run folder (its epochs inside) or some other folder, each said as it is."""
    if not os.path.exists(local):
        return f"--checkpoint {checkpoint} does not exist; name a checkpoint folder (runs/train/<run>/epoch_NNNN)"
    epochs = sorted(n for n in os.listdir(local) if n.startswith("epoch_")) if os.path.isdir(local) else []
    if epochs:
        return f"--checkpoint {checkpoint} is a run folder; name one of its checkpoints: {', '.join(epochs)}"
    return f"--checkpoint {checkpoint}: not a checkpoint folder (no features.json there)"
