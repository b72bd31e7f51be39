"""GPU paths: skipped without CUDA (tests/conftest.py), run when a GPU is lent."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _trainer(**train):
    import sys, os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
    from test_train_loop import MemorySession, features, job, table  # noqa: E402

    from rayload.train.loop import Trainer

    class CudaSession(MemorySession):
        device = torch.device("cuda")

    t = table(4096, 0)
    return Trainer(job(**train), features(), CudaSession(t, t, "."), 16), t


def test_auto_precision_is_bf16_on_gpus_that_support_it():
    trainer, _ = _trainer(precision="auto")
    assert trainer.precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")


def test_fp16_with_grad_scaler_trains():
    from rayload.train.batch import Layout, collate

    trainer, t = _trainer(precision="fp16")
    assert trainer.scaler is not None
    layout = Layout(("x",), ("c",), ("b",))
    losses = [trainer.step([collate(t.slice(i * 256, 256), layout)]) for i in range(16)]
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0]
    assert trainer.scaler.get_scale() > 0


def test_nccl_worker_group(tmp_path):
    """One GPU worker through TorchTrainer: NCCL backend, model on cuda, checkpoint loads on CPU."""
    import ray

    from rayload.spec import JobSpec
    from rayload.train import load
    from rayload.train.trainer import fit

    ray.init(include_dashboard=False, ignore_reinit_error=True)
    try:
        spec = JobSpec.model_validate({
            "name": "gpu", "data": {"source": {"kind": "synthetic-ctr", "rows": 50_000, "shard_rows": 25_000}},
            "model": {"name": "dlrm", "hidden": [64]}, "train": {"epochs": 1, "storage_path": str(tmp_path)},
            "resources": {"workers": 1, "gpus_per_worker": 1},
        })
        res = fit(spec, address="auto")
        assert res.metrics["val_auc"] > 0.6
        assert next(load(res.checkpoint).model.parameters()).device.type == "cpu"
    finally:
        ray.shutdown()
