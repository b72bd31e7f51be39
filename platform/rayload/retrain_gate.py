"""The offline gate of a retrained model: both models scored on the same held-out events (the
GATE_SPLIT rows: neither model trained on them, and they did not pick the retrained model's
best epoch), their AUCs, and the gain's paired interval (`rayload retrain`, retraining.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .errors import DataError, RayloadError

log = logging.getLogger(__name__)

GATE_SPLIT = "test"  # the rows the gate scores: not trained on, not used to pick the best epoch
MIN_GATE_CLASS = 10  # rows of each class the gate's split needs


@dataclass(frozen=True)
class Gate:
    auc_new: float
    auc_champion: float
    rows: int
    positives: int
    gain_ci: tuple[float, float]
    gain_p: float


def gate_aucs(pre, checkpoint: str, champion: str, eval_spec) -> Gate:
    """Both models' AUC on the GATE_SPLIT rows (neither trained on them nor picked its epoch
    with them: validation picks the retrained model's best epoch, so it flatters it), and the
    gain's paired interval. DataError when the split is missing or has too few rows of a class."""
    from .evaluate import predict
    from .train import checkpoint as ckpt
    from .train.batch import Layout

    if not pre.files.get(GATE_SPLIT):
        raise DataError(f"the retrain rows gave no held-out {GATE_SPLIT} split to gate on; retrain with a wider --window")
    batch = eval_spec.batch_size if eval_spec else 8192
    scored = {}
    for name, path in (("new", checkpoint), ("champion", champion)):
        loaded = ckpt.load(path)
        if loaded.features.label.task != "binary":
            raise DataError(f"the retrain gate compares AUCs: the {name} model's label is {loaded.features.label.task}, not binary")
        # logits: AUCs rank them without the ties a float32 sigmoid makes of confident scores
        scored[name] = predict(loaded.model, pre.batches(GATE_SPLIT), Layout.from_features(loaded.features), batch, raw=True)
    labels = scored["new"][0]
    if not np.array_equal(labels, scored["champion"][0]):
        raise RayloadError(f"the {GATE_SPLIT} split was read in a different order for the two models; cannot pair their scores")
    return gate_from_scores(labels, scored["new"][1], scored["champion"][1])


def gate_from_scores(labels: np.ndarray, new_scores: np.ndarray, champion_scores: np.ndarray) -> Gate:
    """The gate's figures from both models' scores of the same held-out rows."""
    from .evaluate import auc, paired_auc_difference

    positives = int((np.asarray(labels) > 0.5).sum())
    if min(positives, len(labels) - positives) < MIN_GATE_CLASS:
        raise DataError(f"the held-out {GATE_SPLIT} split has {positives} positive and {len(labels) - positives} negative events; "
                        f"the gate needs {MIN_GATE_CLASS} of each to compare AUCs; retrain with a wider --window or after more traffic")
    for name, scores in (("the retrained model", new_scores), ("the champion", champion_scores)):
        if bad := int((~np.isfinite(np.asarray(scores, dtype=np.float64))).sum()):  # was a bare ValueError from auc()
            raise DataError(f"{name} scored {bad} of the {len(labels)} held-out {GATE_SPLIT} rows NaN or infinite: "
                            "its AUC cannot be compared (a diverged model?)")
    gain, ci, p = paired_auc_difference(labels, champion_scores, new_scores)
    new, old = auc(labels, new_scores), auc(labels, champion_scores)
    log.info("gate on the held-out %s split (%d rows): champion AUC %.5f, retrained %.5f, gain %+.5f [%+.5f, %+.5f]",
             GATE_SPLIT, len(labels), old, new, gain, *ci)
    return Gate(new, old, len(labels), positives, ci, p)
