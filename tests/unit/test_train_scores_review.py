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


class _Corrupt(MemorySession):
    """A session whose training batches in epoch `bad` hold a value no float32 model survives."""

    bad = 2

    def train_batches(self, epoch, batch_size):
        t = self.train
        if epoch == self.bad:
            x = np.array(t.column("x")).copy()
            x[:256] = 1e30
            t = t.set_column(t.column_names.index("x"), "x", pa.array(x.astype(np.float32)))
        return self._batches(t, batch_size)


def test_a_diverged_loss_stops_the_run_at_its_step_naming_it_and_the_kept_epochs(tmp_path):
    """The loop never looked at the loss: it trained the rest of the epoch on NaN weights and
    stopped at the validation with a bare ValueError (a traceback, no epoch or step named)."""
    session = _Corrupt(table(2048, 0), table(512, 1), str(tmp_path))
    with pytest.raises(TrainingError, match=r"the model diverged: the training loss became nan at optimizer step 17 \(epoch 2\)"
                                            r".*the run folder keeps the best 2 by validation of epochs 0-1's checkpoints"):
        run(job(epochs=4), features(), session, {"train_rows": 2048, "manifest": {}})
    assert [m["epoch"] for m, _ in session.reports] == [0, 1]


def test_non_finite_validation_outputs_are_a_training_error_naming_the_epoch(tmp_path, monkeypatch):
    """fp16 skips a non-finite step (its gradient scaler), so its weights can still end NaN only by
    outputs: the validation's refusal was a bare ValueError, which the CLI showed as a traceback."""
    from rayload.errors import RayloadError
    from rayload.evaluate import NonFiniteOutputs

    def nan_outputs(self):
        raise NonFiniteOutputs("the model's outputs hold 3 NaN or infinite value(s) of 512")

    monkeypatch.setattr(Trainer, "validate", nan_outputs)
    with pytest.raises(TrainingError, match=r"the model diverged: epoch 0's validation outputs: the model's outputs hold 3"):
        run(job(epochs=2), features(), MemorySession(table(512, 0), table(128, 1), str(tmp_path)), {"train_rows": 512, "manifest": {}})
    assert issubclass(NonFiniteOutputs, RayloadError) and issubclass(NonFiniteOutputs, ValueError)


@pytest.mark.parametrize("where", ["a_file", "a_file/runs"])
def test_a_checkpoint_folder_that_cannot_be_made_is_refused_before_ray_and_the_data(tmp_path, monkeypatch, where):
    """A file in the way (or a read-only mount) failed with a bare OSError at the first checkpoint,
    after the whole preprocessing. The check makes nothing (a multi-node refusal after it found the
    folder made)."""
    from rayload import _ray
    from rayload.errors import RayloadError
    from rayload.train import trainer

    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.setattr(_ray, "ensure_ray", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(trainer, "ensure_ray", lambda *a, **k: pytest.fail("Ray was started"))
    with pytest.raises(RayloadError, match=r"train.storage_path '.*a_file.*': .*a_file is a file, not a folder"):
        trainer.fit(job(epochs=1, storage_path=str(tmp_path / where)))
    from rayload.train.resources import check_writable

    check_writable(str(tmp_path / "new" / "deep"), "given")  # can be made: fine, and nothing is made yet
    assert not (tmp_path / "new").exists()
    (tmp_path / "store").symlink_to(tmp_path / "not_mounted")  # a link to nothing: the check climbed past it
    with pytest.raises(RayloadError, match=r"store is a link to .*not_mounted, which does not exist"):
        check_writable(str(tmp_path / "store" / "run"), "given")
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "a_file"))  # not given: named by where it came from
    with pytest.raises(RayloadError, match=r"^the run folder \(RAYLOAD_HOME\) '.*a_file.*': .*a_file is a file, not a folder"):
        trainer.fit(job(epochs=1))


def test_the_training_table_shows_the_metric_a_regression_run_is_ranked_by(monkeypatch):
    """`rayload train` printed val auc and val logloss, both empty for regression; val_rmse, which
    ranks its checkpoints and early-stops it, was never shown."""
    import types

    from rayload import cli

    out = []
    monkeypatch.setattr(cli.console, "print", lambda item, *a, **k: out.append(item))
    history = [{"epoch": 0, "train_loss": 15.5, "val_rmse": 3.94, "samples_per_s": 3e4},
               {"epoch": 1, "train_loss": 12.7, "val_rmse": 3.34, "samples_per_s": 6e4}]
    cli.print_training(types.SimpleNamespace(run_name="r", history=history, test=None, checkpoint="c"))
    table = out[0]
    assert [c.header for c in table.columns] == ["epoch", "train loss", "val rmse", "samples/s"]
    assert list(table.columns[2].cells) == ["3.94", "3.34"]
    out.clear()
    cli.print_training(types.SimpleNamespace(run_name="r", history=[{"epoch": 0, "val_auc": 0.8, "val_logloss": 0.4}], test=None, checkpoint="c"))
    assert [c.header for c in out[0].columns] == ["epoch", "train loss", "val auc", "val logloss", "samples/s"]
