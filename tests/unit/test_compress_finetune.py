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
from test_train_loop import features, table


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
