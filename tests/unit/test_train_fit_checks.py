"""`fit` refuses what can never run before it preprocesses anything: the resource and storage
checks are cheap, preprocessing is not (no Ray here: its edges are replaced)."""

import pytest

import helpers
from rayload.train import trainer
from rayload.train.resources import ResourceError


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(trainer, "ensure_ray", lambda address=None: None)
    monkeypatch.setattr(trainer, "preprocess", lambda *a, **k: pytest.fail("preprocessed before the cheap checks"))


def _refuse(what):
    def check(*args, **kwargs):
        raise ResourceError(what)

    return check


def test_a_request_the_cluster_cannot_hold_is_refused_before_preprocessing(no_ray, monkeypatch, tmp_path):
    monkeypatch.setattr(trainer, "check_resources", _refuse("resources ask for 3 worker(s)"))
    with pytest.raises(ResourceError, match="3 worker"):
        trainer.fit(helpers.job(str(tmp_path / "none.parquet"), resources={"workers": 3}))


def test_local_storage_on_a_multi_node_cluster_is_refused_before_preprocessing(no_ray, monkeypatch, tmp_path):
    monkeypatch.setattr(trainer, "check_resources", lambda *a, **k: None)
    monkeypatch.setattr(trainer, "check_storage", _refuse("train.storage_path is a local folder"))
    with pytest.raises(ResourceError, match="local folder"):
        trainer.fit(helpers.job(str(tmp_path / "none.parquet"), resources={"workers": 2}))
