"""Offline metrics: AUC ranks unclipped scores (logits where the model gives them); log loss comes
from the logits where the model gives them, and clips probabilities given alone."""

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from rayload.evaluate import auc, binary_metrics, evaluate_checkpoint, metrics_for_outputs


def test_auc_ranks_confident_probabilities_as_they_are():
    """float32 sigmoid of logits -30..-17: all below the log-loss clip of 1e-7, where they tied (AUC 0.5)."""
    p = torch.sigmoid(torch.tensor([-30.0, -25.0, -20.0, -18.0, -17.0])).numpy()
    y = np.array([0, 0, 1, 0, 1], dtype=np.float32)
    m = binary_metrics(y, p)
    assert m.auc == pytest.approx(5 / 6) == auc(y, p)
    assert m.logloss == pytest.approx(-np.mean(np.where(y > 0, np.log(1e-7), np.log1p(-1e-7))))


def test_binary_metrics_from_logits_rank_the_logits_a_sigmoid_saturates():
    logits = np.array([20.0, 25.0, 30.0, 35.0, -3.0, 0.5], dtype=np.float32)
    y = np.array([0, 1, 0, 1, 0, 1], dtype=np.float32)
    assert len(set(torch.sigmoid(torch.from_numpy(logits[:4])).tolist())) == 1  # float32 probabilities: all 1.0
    m = metrics_for_outputs("binary", y, logits)
    assert m.auc == pytest.approx(6 / 9)  # positives 25, 35, 0.5 outrank 2, 3 and 1 of the negatives 20, 30, -3
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    assert m.mean_prediction == pytest.approx(p.mean())
    assert m.logloss == pytest.approx(np.mean(np.logaddexp(0.0, logits.astype(np.float64)) - y * logits))  # exact, not clipped
    assert metrics_for_outputs("regression", y, logits).rmse == pytest.approx(np.sqrt(np.mean((y - logits) ** 2)))


def test_checkpoint_evaluation_ranks_by_logits(tmp_path):
    """A model whose logits all lie near +40 (float32 probabilities all 1.0) keeps its ranking."""
    from _loop import MemorySession, features, job, table

    from rayload.data.pipeline import LocalShards
    from rayload.train import checkpoint as ckpt
    from rayload.train.batch import Layout, collate
    from rayload.train.loop import run

    session = MemorySession(table(256, 0), table(64, 1), str(tmp_path))
    run(job(epochs=1), features(), session, {"train_rows": 256, "manifest": {}})
    path = session.reports[-1][1]
    weights = torch.load(os.path.join(path, ckpt.MODEL), weights_only=True)
    weights["first.bias"] += 40.0
    torch.save(weights, os.path.join(path, ckpt.MODEL))
    test = table(512, 2)
    pq.write_table(test, str(tmp_path / "test.parquet"))
    model = ckpt.load(path).model
    with torch.no_grad():
        logits = model(*collate(test, Layout(("x",), ("c",), ("b",))).inputs()).numpy()
    assert (torch.sigmoid(torch.from_numpy(logits)) == 1.0).all()
    m = evaluate_checkpoint(path, LocalShards([str(tmp_path / "test.parquet")]))
    assert m.auc == pytest.approx(auc(test.column("label").to_numpy(), logits)) and m.auc > 0.6


def test_log_loss_from_logits_is_exact_past_the_clip():
    """From probabilities log loss clips them to [1e-7, 1 - 1e-7], which capped a confidently
    wrong row's loss near 16.1: a logit of 40 against its label counted 16.1 instead of 40."""
    y = np.array([0.0, 1.0, 1.0, 0.0])
    logits = np.array([40.0, -40.0, 18.0, -3.0])
    exact = np.mean(np.logaddexp(0.0, logits) - y * logits)
    assert metrics_for_outputs("binary", y, logits).logloss == pytest.approx(exact, rel=1e-12)
    assert metrics_for_outputs("binary", y[:2], logits[:2]).logloss == pytest.approx(40.0)


def test_nan_outputs_are_refused_by_name_and_no_rows_give_no_figures():
    with pytest.raises(ValueError, match=r"outputs hold 1 NaN or infinite value\(s\) of 2"):
        metrics_for_outputs("binary", np.array([0.0, 1.0]), np.array([np.nan, 1.0]))
    with pytest.raises(ValueError, match="NaN"):  # one class only: the AUC's own check never ran
        metrics_for_outputs("binary", np.array([1.0, 1.0]), np.array([np.nan, 1.0]))
    empty = metrics_for_outputs("binary", np.zeros(0), np.zeros(0))
    assert empty.rows == 0 and (empty.auc, empty.logloss, empty.ece, empty.mean_prediction) == (None, None, None, None)
