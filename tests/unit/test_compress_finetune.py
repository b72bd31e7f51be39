"""`compress --method prune --finetune-epochs N`: the fine-tune reads the train split in the
trainer's batches (across shard files) and steps a batch-norm model without one-row batches."""

import pyarrow.parquet as pq
import pytest
import torch

from rayload.pruning import finetune as _finetune
from rayload.data.result import LocalShards
from rayload.models import build_model
from rayload.models._inputs import InputShape
from rayload.spec import ModelSpec
from rayload.train.batch import Layout
from _loop import features, table


@pytest.mark.parametrize("batch_norm", [True, False])
def test_the_fine_tune_batches_across_shards_and_skips_a_one_row_batch_only_for_batch_norm(tmp_path, batch_norm):
    # 33 + 32 rows in batches of 16: file by file a 1-row tail ends the first shard (batch norm
    # in training mode refuses it: a bare ValueError); across files, 4 full batches and 1 row
    files = []
    for i, rows in enumerate((33, 32)):
        files.append(str(tmp_path / f"train-{i}.parquet"))
        pq.write_table(table(rows, i), files[-1])
    config = ModelSpec.model_validate({"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0, "batch_norm": batch_norm})
    torch.manual_seed(0)
    model = build_model(config.model_dump(), InputShape.from_features(features()))
    sizes = []
    model.register_forward_pre_hook(lambda module, inputs: sizes.append(inputs[0].shape[0]))
    _finetune(model, LocalShards(files), Layout(("x",), ("c",), ("b",)), 1, 0.01, 16, 0.0)
    assert sizes == [16, 16, 16, 16] + ([] if batch_norm else [1])
    assert not model.training


def _tuned(tmp_path, **options):
    files = [str(tmp_path / "train.parquet")]
    pq.write_table(table(256, 3), files[0])
    config = ModelSpec.model_validate({"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0})
    torch.manual_seed(0)
    model = build_model(config.model_dump(), InputShape.from_features(features()))
    _finetune(model, LocalShards(files), Layout(("x",), ("c",), ("b",)), 2, 0.01, 32, 0.0, **options)
    return model, LocalShards(files)


def _mean_score(model, shards) -> float:
    from rayload.train.batch import collate

    with torch.no_grad():
        batch = collate(next(iter(shards.exact_batches(256))), Layout(("x",), ("c",), ("b",)))
        return float(torch.sigmoid(model(*batch.inputs())).mean())


def test_the_fine_tune_weights_the_loss_by_the_models_class_weights(tmp_path):
    """The fine-tune's loss was unweighted whatever the model was trained with: a model trained
    on rebalanced classes drifted back toward the raw rate while being pruned."""
    plain, shards = _tuned(tmp_path)
    ones, _ = _tuned(tmp_path, class_weights=(1.0, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ones.state_dict().values()))
    positives, _ = _tuned(tmp_path, class_weights=(0.05, 1.0))  # negatives barely count: scores rise
    negatives, _ = _tuned(tmp_path, class_weights=(1.0, 0.05))
    assert _mean_score(negatives, shards) < _mean_score(plain, shards) < _mean_score(positives, shards)


def test_the_fine_tune_clips_gradients_at_the_jobs_grad_clip(tmp_path, monkeypatch):
    norms = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: norms.append(max_norm) or clip(params, max_norm))
    _tuned(tmp_path)
    assert norms == []
    _tuned(tmp_path, grad_clip=0.5)
    assert norms == [0.5] * 16  # 2 epochs of 8 batches
