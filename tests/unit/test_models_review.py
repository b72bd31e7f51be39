"""Model review fixes (2026-11-27), without Ray: an int8 layer clamps its input to the range of
its calibration rows, so one row's huge value no longer flattens the scores of the rows batched
beside it (serving scores many clients' requests in one call); DLRM with fewer than two vectors
to interact and MLP sizes below 1 are refused by name."""

import json
import os
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from _loop import features, table
from rayload import compression
from rayload.models import InputShape, build_model, model_json, quantized
from rayload.spec import ModelSpec


def _mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1)).eval()


def test_an_outlier_row_no_longer_flattens_the_int8_scores_of_its_batch():
    fp32 = _mlp()
    ranges = quantized.InputRanges(fp32)
    with torch.no_grad():
        fp32(torch.randn(2000, 64, generator=torch.Generator().manual_seed(2)))
    ranges.remove()
    assert set(ranges.bounds()) == {"0", "2"}  # the two layers that become int8
    unclamped = quantized.build(_mlp(), *quantized.quantize(_mlp()))
    clamped = quantized.build(_mlp(), *quantized.quantize(_mlp(), ranges.bounds()))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    batch = torch.cat([x, torch.full((1, 64), 1e6)])
    with torch.no_grad():
        ref = fp32(x).squeeze(-1)
        before = unclamped(batch).squeeze(-1)[:8]
        after = clamped(batch).squeeze(-1)[:8]
        alone = clamped(x).squeeze(-1)
    assert before.std() < 1e-6 and (before - ref).abs().max() > 0.05  # the defect: one score for all eight
    assert (after - ref).abs().max() < 0.01 and (alone - ref).abs().max() < 0.01 and after.std() > 0.01


def test_compress_records_the_clamps_and_the_loaded_model_applies_them(tmp_path, monkeypatch):
    from rayload.data.result import LocalShards
    from rayload.train import checkpoint as ckpt

    folder = tmp_path / "run" / "epoch_0001"
    os.makedirs(folder)
    cfg = ModelSpec.model_validate({"name": "mlp", "embedding_dim": 8, "hidden": [64, 32], "dropout": 0.0}).model_dump()
    shape = InputShape.from_features(features())
    torch.manual_seed(0)
    torch.save(build_model(cfg, shape).state_dict(), folder / "model.pt")
    features().save(str(folder / "features.json"))
    (folder / "model.json").write_text(json.dumps(model_json(cfg, shape)))
    (folder / "manifest.json").write_text(json.dumps({"spec": {}}))
    pq.write_table(table(512, 2), tmp_path / "val.parquet")
    pre = SimpleNamespace(files={"val": [str(tmp_path / "val.parquet")]}, features=features(),
                          batches=lambda split: LocalShards([str(tmp_path / "val.parquet")]))
    monkeypatch.setattr(compression, "_validation_data", lambda *a, **k: (SimpleNamespace(train=None), pre))
    result = compression.compress(str(folder), "int8", max_auc_drop=1.0)
    state = torch.load(os.path.join(result.checkpoint, "model.pt"), weights_only=True)
    linear = [k[: -len(".lo")] for k in state if k.endswith(".lo")]
    assert linear and all(f"{name}.hi" in state and (state[f"{name}.hi"] >= state[f"{name}.lo"]).all() for name in linear)
    loaded = ckpt.load(result.checkpoint).model
    layers = [m for m in loaded.modules() if isinstance(m, quantized.Int8Linear)]
    assert layers and all(m.lo is not None for m in layers)


def test_dlrm_with_fewer_than_two_vectors_to_interact_is_refused_by_name():
    cfg = ModelSpec.model_validate({"name": "dlrm", "embedding_dim": 4, "hidden": [8], "bottom": [8]}).model_dump()
    for shape in (InputShape(0, (10,), ()), InputShape(0, (), (10,))):
        with pytest.raises(ValueError, match="model.name: dlrm interacts pairs of vectors .* these features give 1"):
            build_model(cfg, shape)
    assert build_model(cfg, InputShape(2, (10,), ())) is not None  # dense + one ID field: one pair


@pytest.mark.parametrize("field, value", [("hidden", [0]), ("hidden", [16, -4]), ("bottom", [0])])
def test_mlp_sizes_below_one_are_refused_naming_the_field(field, value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=rf"{field}\.\d+\s+Input should be greater than or equal to 1"):
        ModelSpec.model_validate({"name": "dlrm", field: value})


def test_a_column_constant_in_the_calibration_rows_is_not_pinned_to_that_constant():
    """Clamped per column, a column always 0 in the calibration rows (a rare flag, a unit that
    never fired) was held at 0 when served, and the int8 model ignored it. One range per layer."""
    fp32 = _mlp()
    ranges = quantized.InputRanges(fp32)
    calibration = torch.randn(2000, 64, generator=torch.Generator().manual_seed(2))
    calibration[:, 0] = 0.0
    with torch.no_grad():
        fp32(calibration)
    ranges.remove()
    lo, hi = ranges.bounds()["0"]
    assert lo.dim() == 0 and hi.dim() == 0 and lo < 0 < hi
    clamped = quantized.build(_mlp(), *quantized.quantize(_mlp(), ranges.bounds()))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    x[:, 0] = 2.0  # inside the layer's range, never seen in column 0
    with torch.no_grad():
        assert (clamped(x) - fp32(x)).abs().max() < 0.01
