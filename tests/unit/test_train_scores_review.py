"""Training review fixes (2026-11-27), in-process without Ray: a NaN or infinite output has no
metric (regression's RMSE and binary's logloss turned NaN silently), a NaN score never ranks
(it kept a diverged checkpoint and deleted the best one) nor becomes early stopping's best; a
validation split without the ranking metric ends the run at its first epoch, not after all."""

import math

import numpy as np
import pyarrow as pa
import pytest
from _loop import MemorySession, features, job, table

from rayload.evaluate import metrics_for_outputs
from rayload.train.local_session import best_of
from rayload.train.loop import Trainer, run
from rayload.train.trainer import TrainingError, _best_reported


@pytest.mark.parametrize("task, outputs", [("regression", [np.nan, 1.0, 2.0]), ("regression", [np.inf, 1.0, 2.0]),
                                           ("binary", [np.inf, -1.0, 0.5]), ("binary", [-np.inf, -1.0, 0.5])])
def test_non_finite_outputs_have_no_metric(task, outputs):
    with pytest.raises(ValueError, match=r"outputs hold 1 NaN or infinite value\(s\) of 3"):
        metrics_for_outputs(task, np.array([0.0, 1.0, 0.0]), np.array(outputs))
    assert metrics_for_outputs("regression", np.zeros(0), np.zeros(0)).rmse is None  # no rows: no figure, not NaN


def test_a_nan_score_never_ranks_among_the_kept_checkpoints():
    entries = [{"path": f"epoch_{i}", "metrics": {"val_rmse": v}} for i, v in enumerate([0.5, math.nan, 0.3, 0.9])]
    assert [e["path"] for e in best_of(entries, "val_rmse", "min")] == ["epoch_2", "epoch_0", "epoch_3"]
    reported = [("c0", {"val_rmse": math.nan}), ("c1", {"val_rmse": 0.5}), ("c2", {"val_rmse": 0.3})]
    assert _best_reported(reported, "val_rmse", "min", "r")[0] == "c2"
    with pytest.raises(TrainingError, match="no checkpoint with val_rmse"):
        _best_reported([("c0", {"val_rmse": math.nan})], "val_rmse", "min", "r")


def test_a_nan_epoch_does_not_become_early_stoppings_best(tmp_path):
    spec = job(epochs=4, early_stopping={"metric": "logloss", "patience": 2})
    trainer = Trainer(spec, features(), MemorySession(table(64, 0), table(64, 1), str(tmp_path)), 1)
    stops = [trainer.early_stop({"val_logloss": v}) for v in (math.nan, 0.9, 0.8, 0.85)]
    assert stops == [False, False, False, False] and trainer.state.best == 0.8 and trainer.state.bad_epochs == 1


def test_a_validation_split_of_one_class_ends_the_run_at_its_first_epoch_naming_the_metric(tmp_path):
    val = table(64, 1)
    val = val.set_column(val.column_names.index("label"), "label", pa.array(np.zeros(64, np.float32)))
    session = MemorySession(table(256, 0), val, str(tmp_path))
    with pytest.raises(TrainingError) as info:
        run(job(epochs=4, early_stopping={"patience": 1}), features(), session, {"train_rows": 256, "manifest": {}})
    assert "the validation split (64 rows) gives no val_auc" in str(info.value) and "early-stop on logloss" in str(info.value)
    assert session.reports == []  # nothing trained past the first epoch's validation
    # ranked by a metric the split has (a search's logloss), the same run trains
    run(job(epochs=1), features(), session, {"train_rows": 256, "manifest": {}, "score": "val_logloss"})
    assert len(session.reports) == 1 and "val_auc" not in session.reports[0][0]
