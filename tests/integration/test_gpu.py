"""GPU paths: skipped without CUDA (tests/conftest.py), run when a GPU is lent."""

import os

import pytest
import torch

from _loop import MemorySession, features, job, table  # the loop's in-process helpers (an in-memory session, a tiny spec and table)

pytestmark = pytest.mark.gpu


class CudaSession(MemorySession):
    device = torch.device("cuda")


def _trainer(**train):
    from rayload.train.loop import Trainer

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
    # The scaler was updated after each of the 16 steps: 16 without an overflow at the initial
    # scale (it grows only every 2000), or an overflow halved the scale and restarted the count.
    state = trainer.scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"]) == (65536.0, 16) or state["scale"] < 65536.0, state


def test_bf16_autocast_runs_the_linear_layers_in_bf16_and_trains():
    from rayload.train.batch import Layout, collate

    trainer, t = _trainer(precision="bf16")
    dtypes = set()
    hooks = [m.register_forward_hook(lambda mod, i, o: dtypes.add(o.dtype)) for m in trainer.model.modules()
             if isinstance(m, torch.nn.Linear)]
    layout = Layout(("x",), ("c",), ("b",))
    losses = [trainer.step([collate(t.slice(i * 256, 256), layout)]) for i in range(16)]
    for h in hooks:
        h.remove()
    assert dtypes == {torch.bfloat16}
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 and p.is_cuda for p in trainer.model.parameters())  # master weights stay fp32


def test_cuda_uses_tf32_and_the_fused_adamw_and_its_checkpoint_resumes_on_cpu(tmp_path):
    from rayload.train.loop import Trainer, run

    trainer, _ = _trainer(precision="fp32", tf32=False)
    assert not torch.backends.cuda.matmul.allow_tf32
    trainer, _ = _trainer(precision="fp32")
    assert torch.backends.cuda.matmul.allow_tf32 and trainer.optimizers[0].param_groups[0]["fused"]
    gpu = CudaSession(table(2048, 0), table(1024, 1), str(tmp_path / "gpu"))
    run(job(epochs=1), features(), gpu, {"train_rows": 2048, "manifest": {}})
    ckpt_dir = gpu.reports[-1][1]
    cpu = MemorySession(table(2048, 0), table(1024, 1), str(tmp_path / "cpu"))
    resumed = Trainer(job(epochs=2), features(), cpu, 8)
    resumed.restore(ckpt_dir)
    assert not resumed.optimizers[0].param_groups[0].get("fused")  # CPU keeps its own kernel choice
    assert resumed.state.epoch == 0 and resumed.state.step == 8
    saved = torch.load(os.path.join(ckpt_dir, "model.pt"), weights_only=True)
    assert all(torch.equal(v, saved[k]) for k, v in resumed.model.state_dict().items())
    resumed.step([next(iter(cpu.train_batches(1, 256)))])  # the restored CPU optimizer steps


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
            "model": {"name": "dlrm", "hidden": [64]}, "train": {"epochs": 2, "lr": 0.005, "storage_path": str(tmp_path)},
            "resources": {"workers": 1, "gpus_per_worker": 1},
        })
        res = fit(spec, address="auto")
        assert res.metrics["val_auc"] > 0.6
        assert next(load(res.checkpoint).model.parameters()).device.type == "cpu"
    finally:
        ray.shutdown()
