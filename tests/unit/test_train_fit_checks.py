"""`fit` refuses what can never run before it preprocesses anything: the resource and storage
checks are cheap, preprocessing is not (no Ray here: its edges are replaced)."""

import pytest

import helpers
from rayload.train import trainer
from rayload.train.resources import ResourceError


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


def test_a_one_worker_gpu_job_is_checked_against_the_cluster_before_preprocessing(no_ray, monkeypatch, tmp_path):
    """The in-process path (one worker, no address) asks the same question as the Ray path."""
    asked = []

    def check(resources, driver=None):
        asked.append(resources)
        raise ResourceError("resources ask for 1 worker(s) with CPU=1, GPU=1 each, but the cluster has CPU=2, GPU=0")

    monkeypatch.setattr(trainer, "check_resources", check)
    spec = helpers.job(str(tmp_path / "none.parquet"), resources={"workers": 1, "gpus_per_worker": 1, "accelerator_type": "H100"})
    with pytest.raises(ResourceError, match="GPU=1 each"):
        trainer.fit(spec)
    assert asked == [spec.resources]


def test_in_process_without_cuda_a_gpu_job_stops_unless_cpu_fallback_allows_the_cpu(tmp_path, monkeypatch, caplog):
    import logging

    import torch

    from rayload.errors import RayloadError
    from rayload.train.local_session import LocalSession

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RayloadError, match="CUDA sees none.*resources.cpu_fallback: true"):
        LocalSession({"use_gpu": True, "cpu_fallback": False}, {}, str(tmp_path / "a"), 1, "val_auc", "max")
    with caplog.at_level(logging.WARNING, logger="rayload.train.session"):
        session = LocalSession({"use_gpu": True, "cpu_fallback": True}, {}, str(tmp_path / "b"), 1, "val_auc", "max")
    assert session.device.type == "cpu" and "CPU FALLBACK" in caplog.text
    assert LocalSession({"use_gpu": False}, {}, str(tmp_path / "c"), 1, "val_auc", "max").device.type == "cpu"


def test_fit_in_process_hands_cpu_fallback_to_the_session(monkeypatch):
    from types import SimpleNamespace

    seen = {}

    class Stop(Exception):
        pass

    def session(loader, *args, **kwargs):
        seen.update(loader)
        raise Stop

    spec = helpers.job("x.parquet", resources={"workers": 1, "gpus_per_worker": 1, "cpu_fallback": True})

    class Pre:
        features = SimpleNamespace(label=SimpleNamespace(task="binary"))

    monkeypatch.setattr(trainer, "loader_options", lambda spec, features, **kw: kw)
    with pytest.raises(Stop):
        trainer._fit_local(spec, Pre(), "unused", {}, session_cls=session, datasets={"train": _Dataset()})
    assert seen["use_gpu"] and seen["cpu_fallback"]


class _Dataset:
    class context:
        class execution_options:
            preserve_order = False
