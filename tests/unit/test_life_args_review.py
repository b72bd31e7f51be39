"""Lifecycle review fixes (2026-11-27), without Ray: compress refuses a validation split of one
class by name (a bare ValueError traceback after the scoring), --max-auc-drop NaN, and an --out
inside the checkpoint (the source gained a nested copy); retrain refuses a NaN --min-auc-gain
before reading or training anything."""

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from _loop import features, table
from _retrain import NOW, stub_fit
from helpers import job
from rayload import compression
from rayload.errors import DataError, RayloadError
from rayload.models import InputShape, build_model, model_json
from rayload.retraining import retrain
from rayload.spec import ModelSpec


def _checkpoint(folder) -> str:
    os.makedirs(folder)
    cfg = ModelSpec.model_validate({"name": "mlp", "embedding_dim": 4, "hidden": [8], "dropout": 0.0}).model_dump()
    torch.manual_seed(0)
    shape = InputShape.from_features(features())
    torch.save(build_model(cfg, shape).state_dict(), os.path.join(folder, "model.pt"))
    features().save(os.path.join(folder, "features.json"))
    with open(os.path.join(folder, "model.json"), "w") as f:
        json.dump(model_json(cfg, shape), f)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"spec": {}}, f)
    return str(folder)


def _validation(monkeypatch, tmp_path, val: pa.Table):
    from rayload.data.result import LocalShards

    pq.write_table(val, tmp_path / "val.parquet")
    pre = SimpleNamespace(files={"val": [str(tmp_path / "val.parquet")]}, features=features(),
                          batches=lambda split: LocalShards([str(tmp_path / "val.parquet")]))
    monkeypatch.setattr(compression, "_validation_data", lambda *a, **k: (SimpleNamespace(train=None), pre))


def test_a_validation_split_of_one_class_is_named_before_anything_is_compressed(tmp_path, monkeypatch):
    ck = _checkpoint(tmp_path / "run" / "epoch_0001")
    val = table(256, 2)
    _validation(monkeypatch, tmp_path, val.set_column(val.column_names.index("label"), "label", pa.array(np.zeros(256, np.float32))))
    with pytest.raises(DataError, match=r"has 0 positive and 256 negative rows: the gate compares AUCs"):
        compression.compress(ck, "int8")
    assert sorted(os.listdir(tmp_path / "run")) == ["epoch_0001"]
    _validation(monkeypatch, tmp_path, table(256, 2))  # both classes: it compresses
    assert compression.compress(ck, "int8", max_auc_drop=1.0).passed


@pytest.mark.parametrize("drop", [math.nan, math.inf, -0.1])
def test_a_max_auc_drop_that_is_not_a_finite_number_at_least_0_is_refused(tmp_path, drop):
    ck = _checkpoint(tmp_path / "epoch_0001")
    with pytest.raises(RayloadError, match=r"--max-auc-drop must be >= 0 \(and finite\)"):
        compression.compress(ck, "int8", max_auc_drop=drop)


def test_an_out_inside_the_checkpoint_is_refused_and_the_checkpoint_left_as_it_was(tmp_path):
    ck = _checkpoint(tmp_path / "epoch_0001")
    before = sorted(os.listdir(ck))
    with pytest.raises(RayloadError, match=r"--out .*/epoch_0001/sub lies inside the checkpoint being compressed"):
        compression.compress(ck, "int8", out=f"{ck}/sub")
    assert sorted(os.listdir(ck)) == before
    with pytest.raises(RayloadError, match="lies inside the checkpoint being compressed"):
        compression._check_remote_out("s3://b/run/epoch_0001/int8", "s3://b/run/epoch_0001")


@pytest.mark.parametrize("gain", [math.nan, math.inf])
def test_retrain_refuses_a_min_auc_gain_that_is_not_finite_before_any_work(tmp_path, monkeypatch, gain):
    calls = []
    stub_fit(monkeypatch, tmp_path, calls)
    with pytest.raises(RayloadError, match="--min-auc-gain must be a finite number"):
        retrain(job(str(tmp_path / "unused.parquet")), str(tmp_path / "no-such-run"), min_auc_gain=gain, now=NOW)
    assert calls == []
