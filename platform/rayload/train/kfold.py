"""`rayload train SPEC --kfold K`: train once per fold, mean and std over the folds.

Folds are cut the way the spec's split keeps rows together: a group split becomes group k-fold
(folds keyed by its group column, so a group is never in a fold's training and validation rows
at once), any other split keys its folds by `split.key` (every column by default). A temporal
split is refused: folds cut by hash would train on rows later than the ones they validate on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecError, SpecIssue
from ..spec import JobSpec


@dataclass
class KFoldResult:
    folds: list  # TrainResult per fold
    mean: dict
    std: dict


def fold_spec(spec: JobSpec, k: int, fold: int, run_name: str) -> JobSpec:
    """Fold `fold` of `k`: split.kind kfold, keyed as the spec's split keeps rows together,
    evaluated on the held-out test rows."""
    if spec.split.kind == "temporal":
        raise SpecError([SpecIssue("split.kind", "--kfold cuts folds by a hash of each row's key, which on a temporal split "
                                   "would train on rows later than the ones it validates on (the future leaks into training); "
                                   "train without --kfold (the temporal split validates on the latest rows), or use a random or "
                                   "group split for cross-validation", "temporal", True)])
    grouped = spec.split.kind in ("group", "kfold") and spec.split.group
    split = spec.split.model_copy(update={"kind": "kfold", "k": k, "fold": fold, "group": spec.split.group if grouped else None})
    from ..paths import RUN_NAME_MAX

    if len(named := f"{run_name}-fold{fold}") > RUN_NAME_MAX:  # the fold's run folder: a ValidationError traceback
        raise SpecError([SpecIssue("train.run_name", f"too long for its fold runs' names ({named[:40]}..., {len(named)} characters, "
                                   f"at most {RUN_NAME_MAX}); give a shorter --run-name", run_name, True)])
    train = spec.train.model_copy(update={"run_name": named})
    # The test_* figures are the held-out test rows' whatever the job evaluates after training
    # (eval.split: val would score each fold's validation rows again and call them test).
    evaluation = spec.eval.model_copy(update={"split": "test"})
    return JobSpec.model_validate(spec.model_copy(update={"split": split, "train": train, "eval": evaluation}).model_dump())


def kfold(spec: JobSpec, k: int, address: str | None = None) -> KFoldResult:
    """Train once per fold; mean and std over folds of each fold's best validation metrics
    (`val_*`) and, when the split holds out test rows (`split.test`, the same rows for every
    fold), of its best checkpoint's metrics on them (`test_*`). The val_* figures are
    optimistic: each fold's validation rows also picked its best epoch; the test_* figures come
    from rows no fold trained on or chose with."""
    import numpy as np

    from ..errors import SpecError, SpecIssue
    from . import trainer

    if isinstance(k, bool) or not isinstance(k, int) or k < 2:  # 1 was a pydantic traceback, -1 an IndexError
        raise SpecError([SpecIssue("--kfold", "k-fold cross-validation needs at least 2 folds", k, True)])
    name = trainer.run_name_for(spec)
    specs = [fold_spec(spec, k, fold, name) for fold in range(k)]  # every fold checked before the first trains
    folds = []
    for fold, s in enumerate(specs):
        try:
            folds.append(trainer.fit(s, address=address, evaluate_test=s.split.test > 0))
        except Exception as exc:
            # the error alone named no fold, and a relaunch without the run name trained every fold again
            exc.add_note(f"--kfold {k}: fold {fold} (run {s.train.run_name}) failed after {fold} finished fold(s); relaunch with "
                         f"--run-name {name} to keep the finished folds (a finished fold is not trained again)")
            raise

    def figures(result) -> dict:
        out = {key: v for key, v in result.metrics.items() if key.startswith("val_") and isinstance(v, (int, float))}
        out.update({f"test_{key}": v for key, v in (result.test or {}).items()
                    if key != "rows" and isinstance(v, (int, float)) and not isinstance(v, bool)})
        return out

    per_fold = [figures(f) for f in folds]
    keys = [key for key in per_fold[0] if all(key in p and p[key] is not None for p in per_fold)]
    values = {key: np.array([p[key] for p in per_fold], dtype=float) for key in keys}
    return KFoldResult(folds, {k_: float(v.mean()) for k_, v in values.items()},
                       {k_: float(v.std(ddof=1)) if len(v) > 1 else 0.0 for k_, v in values.items()})
