"""Each rank's own random streams (dropout masks), kept across a resume; gradient clipping
that bounds the sparse tables' gradients too. In-process, and on two gloo ranks without Ray."""

import os
import shutil

import numpy as np
import pytest
import torch

from rayload.spec import JobSpec
from rayload.train import checkpoint as ckpt
from rayload.train.batch import Layout, collate
from rayload.train.loop import Trainer, run
from rayload.train.setup import seed_rank
from _loop import MemorySession, RankSession, spawn_two, features, job, table

LAYOUT = Layout(("x",), ("c",), ("b",))


def dropout_job(sparse: bool = False, **train) -> JobSpec:
    return JobSpec.model_validate({**job(**train).model_dump(),
                                   "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [32], "dropout": 0.5, "sparse_embeddings": sparse}})


def ranked(rank: int, world_size: int = 2) -> MemorySession:
    session = MemorySession(table(64, 3), table(64, 4), ".")
    session.rank, session.world_size = rank, world_size
    return session


def masked_output(trainer: Trainer) -> np.ndarray:
    """The training-mode output of the unwrapped model on a fixed batch: with equal weights it
    differs only by the dropout masks drawn."""
    model = ckpt.unwrap(trainer.model)
    model.train()
    with torch.no_grad():
        return model(*collate(table(32, 5), LAYOUT).inputs()).numpy()


def test_ranks_draw_different_dropout_masks_from_equal_weights_reproducibly():
    spec = dropout_job()
    trainers, outs = [], []
    for rank in (0, 1, 1):  # one process-wide stream: each rank's masks drawn right after its set-up
        trainers.append(Trainer(spec, features(), ranked(rank), 1))
        outs.append(masked_output(trainers[-1]))
    weights = [ckpt.unwrap(t.model).state_dict() for t in trainers]
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k  # the shared initialisation seed
    assert not np.allclose(outs[0], outs[1])  # rank 0 and rank 1: other masks
    np.testing.assert_array_equal(outs[1], outs[2])  # rank 1 again: the same masks


def test_resume_restores_each_ranks_stream_or_draws_a_fresh_one_per_rank(tmp_path):
    session = MemorySession(table(256, 0), table(128, 1), str(tmp_path))
    spec = dropout_job(epochs=1)
    run(spec, features(), session, {"train_rows": 256, "manifest": {}})
    path = session.reports[-1][1]
    raw = ckpt.load_train_state(path)
    assert len(raw["rng_ranks"]) == 1 and torch.equal(raw["rng"]["torch"], raw["rng_ranks"][0]["torch"])

    def draws(rank: int, world_size: int) -> torch.Tensor:
        trainer = Trainer(spec, features(), ranked(rank, world_size), 1)
        torch.rand(100)  # a stream moved on: the restore must set it
        trainer.restore(path)
        return torch.rand(8)

    torch.set_rng_state(raw["rng_ranks"][0]["torch"])
    saved = torch.rand(8)
    assert torch.equal(draws(0, 1), saved)
    # saved with one rank, resumed with two: a fresh stream per rank, from (seed, rank, next epoch)
    fresh = [draws(rank, 2) for rank in (0, 1)]
    assert not torch.equal(fresh[0], fresh[1]) and not torch.equal(fresh[0], saved)
    for rank in (0, 1):
        seed_rank(spec.train.seed, rank, 1)
        assert torch.equal(fresh[rank], torch.rand(8))
    # a checkpoint from before the per-rank states ("rng" alone) still resumes
    state_file = os.path.join(path, ckpt.STATE)
    old = torch.load(state_file, weights_only=True)
    del old["rng_ranks"]
    torch.save(old, state_file)
    assert torch.equal(draws(0, 1), saved)
    assert torch.equal(draws(1, 2), fresh[1])


def _dropout_ranks(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = dropout_job(sparse=True, epochs=1, sparse_lr=0.05, grad_clip=0.01, batch_size=64)
    session = RankSession(rank, table(256, 10 + rank), table(64, 1), ".")
    trainer = Trainer(spec, features(), session, 4)
    first = masked_output(trainer)  # this rank's first dropout masks
    trainer.train_epoch(0)
    weights = {k: v.detach().clone().numpy() for k, v in ckpt.unwrap(trainer.model).state_dict().items()}
    shared = [trainer.save({})]  # every rank takes part; rank 0 writes
    dist.broadcast_object_list(shared, src=0)
    expected = torch.rand(8)  # what this rank draws next, uninterrupted
    resumed = Trainer(spec, features(), session, 4)
    resumed.restore(shared[0])
    out.put((rank, {"first": first, "weights": weights, "expected": expected.numpy(), "resumed": torch.rand(8).numpy()}))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()


def test_two_gloo_ranks_draw_their_own_masks_keep_equal_weights_and_resume_their_own_streams():
    """DDP (sparse tables through SparseGradSync, clipped): the ranks' dropout masks differ, their
    weights stay equal, and a resume gives each rank its own stream back, not rank 0's."""
    r0, r1 = spawn_two(_dropout_ranks)
    assert not np.allclose(r0["first"], r1["first"])
    for k, v in r0["weights"].items():
        assert np.array_equal(v, r1["weights"][k]), k
    for r in (r0, r1):
        np.testing.assert_array_equal(r["resumed"], r["expected"])
    assert not np.array_equal(r0["expected"], r1["expected"])


def grad_norm(params) -> float:
    """The whole model's gradient norm: a sparse gradient's rows coalesced (summed) first."""
    grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_clipping_bounds_the_sparse_tables_gradients_too(monkeypatch, precision):
    """train.grad_clip holds for dense and sparse gradients together, measured on what the
    optimizers apply (after the grad scaler unscaled them all, under fp16)."""
    bound = 1e-3
    spec = JobSpec.model_validate({**job(grad_clip=bound, precision=precision).model_dump(),
                                   "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0, "sparse_embeddings": True}})
    trainer = Trainer(spec, features(), MemorySession(table(64, 0), table(64, 1), "."), 1)
    params = [p for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]]
    tables = {id(p) for group in trainer.optimizers[1].param_groups for p in group["params"]}
    seen = []
    last = trainer.optimizers[-1]
    step = last.step

    def measured(*args, **kwargs):  # the last optimizer to step: every gradient unscaled by then
        seen.append((grad_norm(params), grad_norm([p for p in params if id(p) in tables])))
        return step(*args, **kwargs)

    monkeypatch.setattr(last, "step", measured)
    batch = collate(table(64, 2), LAYOUT)
    loss = trainer.loss(batch) * 10  # a large loss: gradients far over the bound (fp16 would overflow at 1e3)
    (trainer.scaler.scale(loss) if trainer.scaler else loss).backward()
    before = grad_norm(params) / (trainer.scaler.get_scale() if trainer.scaler else 1.0)
    assert before > 100 * bound, before
    trainer._apply()
    (total, sparse), = seen
    assert sparse > 0  # the tables' gradients took part
    assert bound * 0.999 <= total <= bound * (1 + 1e-5), (before, total, sparse)


def test_a_cuda_rng_state_saved_with_more_gpus_restores_on_fewer(monkeypatch):
    """rng_state kept every visible GPU's generator and set_rng_state_all put them back by
    index: a run resumed where fewer GPUs are visible (a Ray worker sees one) failed on an
    invalid device. Only the rank's own device is saved and restored. (torch.cuda's state calls
    are recorded here: this machine has no GPU; the gpu-marked tests resume on a real one.)"""
    from rayload.train import checkpoint

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state.tolist()))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every GPU's state set"))
    state = checkpoint.rng_state()
    assert state["cuda"].tolist() == [7]
    checkpoint.set_rng_state(state)
    old = dict(state, cuda=[torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)])  # saved on 2 GPUs
    checkpoint.set_rng_state(old)
    assert restored == [[7], [1]]
