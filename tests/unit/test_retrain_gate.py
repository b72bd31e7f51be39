"""`rayload retrain`'s job and gate: the gate scores champion and retrained model on a held-out
test split of the events (not the validation split that picked the best epoch), and a
compressed champion warm-starts the retrain from the checkpoint it was compressed from."""

import dataclasses
import json
import os
import shutil
import types

import pytest

from rayload import evaluate
from rayload.errors import DataError, RayloadError
from rayload.retraining import GATE_SPLIT, RetrainResult, gate_aucs, job_for, warm_start
from rayload.spec import JobSpec
from test_train_loop import features

COLUMNS = [{"name": "x", "role": "numeric"}, {"name": "c", "role": "categorical"}, {"name": "y", "role": "label"}]


def _checkpoint(folder, compression=None):
    os.makedirs(folder)
    dataclasses.replace(features(), columns=COLUMNS).save(os.path.join(folder, "features.json"))
    with open(os.path.join(folder, "model.json"), "w") as f:
        json.dump({"config": {"name": "mlp", "hidden": [8]}, **({"compression": compression} if compression else {})}, f)
    open(os.path.join(folder, "model.pt"), "wb").close()
    return str(folder)


@pytest.fixture()
def champions(tmp_path):
    source = _checkpoint(tmp_path / "run" / "epoch_0003")
    int8 = _checkpoint(tmp_path / "run" / "epoch_0003-int8", {"method": "int8", "source": source})
    return source, int8


class _Pre:
    def __init__(self, splits):
        self.files = {s: [f"{s}.parquet"] for s in splits}

    def batches(self, split):
        return f"{split} rows"


def test_champion_and_retrained_model_are_gated_on_the_same_held_out_test_rows(monkeypatch):
    scored = []
    monkeypatch.setattr(evaluate, "evaluate_checkpoint",
                        lambda path, rows, spec: scored.append((path, rows)) or types.SimpleNamespace(auc=0.7 if path == "new" else 0.6))
    assert gate_aucs(_Pre(["train", "val", "test"]), "new", "champion", None) == (0.7, 0.6)
    assert GATE_SPLIT == "test" and scored == [("new", "test rows"), ("champion", "test rows")]
    with pytest.raises(DataError, match="no held-out test split"):
        gate_aucs(_Pre(["train", "val"]), "new", "champion", None)
    result = RetrainResult("r", "e", "champion", "new", 100, 10, 0.6, 0.7, 0.0, None)
    assert result.to_dict()["gate_split"] == "test"


def test_the_retrain_job_holds_out_a_test_split_and_warm_starts_from_the_champion(champions, tmp_path):
    source, _ = champions
    spec = JobSpec.model_validate({"name": "x", "data": {"source": {"kind": "movielens"}}})
    job = job_for(spec, source, str(tmp_path / "events.parquet"), "y", "retrain-x")
    assert job.split.test > 0 and job.split.val > 0 and job.split.key == ["request_id"]
    assert job.train.init_from == os.path.abspath(source)


def test_a_compressed_champion_warm_starts_from_its_source(champions, tmp_path):
    source, int8 = champions
    assert warm_start(source) == os.path.abspath(source)
    assert warm_start(int8) == source
    spec = JobSpec.model_validate({"name": "x", "data": {"source": {"kind": "movielens"}}})
    assert job_for(spec, int8, str(tmp_path / "events.parquet"), "y", "retrain-x").train.init_from == source


def test_a_compressed_champion_whose_source_is_gone_or_changed_is_refused_naming_it(champions):
    source, int8 = champions
    with open(os.path.join(source, "features.json")) as f:
        fitted = json.load(f)
    with open(os.path.join(source, "features.json"), "w") as f:
        json.dump({**fitted, "columns": COLUMNS[1:]}, f)
    with pytest.raises(RayloadError, match="features.json has changed"):
        warm_start(int8)
    shutil.rmtree(source)
    with pytest.raises(RayloadError, match=f"compression.source: '{source}'.*is gone"):
        warm_start(int8)
