"""GPU-path review fixes (2026-11-27), checked on the CPU: a one-worker group fallen back to its
CPU keeps the model on the CPU (Ray's prepare_model moved it to the CUDA device it assigned);
sync_bn on fallback CPU workers keeps plain batch norm (SyncBatchNorm failed on every rank);
fit runs load_spec's checks on a spec built in code (sparse tables on GPU workers went ahead)."""

import types

import pytest
import torch
from torch import nn

from _loop import features, job
from rayload.errors import SpecError
from rayload.train import trainer
from rayload.train.session import RaySession
from rayload.train.setup import make_model


def test_a_one_worker_group_on_its_cpu_keeps_the_model_on_the_cpu(monkeypatch):
    import ray.train.torch

    def prepare_model(model, *a, **k):
        raise AssertionError("Ray's prepare_model would move it to the CUDA device Ray assigned")

    monkeypatch.setattr(ray.train.torch, "prepare_model", prepare_model)
    session = object.__new__(RaySession)
    session.device, session.world_size = torch.device("cpu"), 1
    model = nn.Linear(3, 1)
    prepared = session.prepare(model)
    assert prepared is model and next(prepared.parameters()).device.type == "cpu"


def test_sync_bn_on_fallback_cpu_workers_keeps_plain_batch_norm(caplog):
    spec = job(sync_bn=True)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"batch_norm": True})})
    session = types.SimpleNamespace(world_size=2, rank=0, device=torch.device("cpu"), prepare=lambda m: m)
    model = make_model(spec, features(), session)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and not any(isinstance(m, nn.SyncBatchNorm) for m in norms)
    assert "train.sync_bn: a worker fell back to the CPU" in caplog.text
    on_gpu = types.SimpleNamespace(world_size=2, rank=0, device=torch.device("meta"), prepare=lambda m: m)  # any non-CPU device
    assert any(isinstance(m, nn.SyncBatchNorm) for m in make_model(spec, features(), on_gpu).modules())


def test_fit_runs_the_spec_checks_on_a_spec_built_in_code(monkeypatch):
    def ensure_ray(address):
        raise AssertionError("fit went on to start Ray")

    monkeypatch.setattr(trainer, "ensure_ray", ensure_ray)
    spec = job()
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"sparse_embeddings": True}),
                                   "resources": spec.resources.model_copy(update={"gpus_per_worker": 1.0})})
    with pytest.raises(SpecError, match="model.sparse_embeddings: sparse embedding gradients are synchronised on CPU"):
        trainer.fit(spec)


def test_a_state_saved_unfused_resumed_by_a_fused_optimizer_gets_its_steps_on_the_parameters_device():
    """load_state_dict places step counts by the saved groups' settings: a CPU run's (unfused)
    kept them on the CPU when a GPU's fused AdamW resumed it. A parameter on the meta device
    stands in for a CUDA one."""
    from rayload.train.setup import place_steps

    p = nn.Parameter(torch.empty(3, device="meta"))
    opt = torch.optim.AdamW([p], lr=0.1)
    opt.state[p] = {"step": torch.tensor(7.0), "exp_avg": torch.empty(3, device="meta"), "exp_avg_sq": torch.empty(3, device="meta")}
    place_steps(opt)  # unfused: steps stay where load_state_dict put them (the CPU, as PyTorch wants)
    assert opt.state[p]["step"].device.type == "cpu"
    opt.param_groups[0]["fused"] = True
    place_steps(opt)
    assert opt.state[p]["step"].device.type == "meta" and opt.state[p]["step"].dtype == torch.float32
