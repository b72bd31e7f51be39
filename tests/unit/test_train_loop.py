"""The training loop in-process on in-memory batches: steps, accumulation, precision, checkpoints."""

import copy
import os

import numpy as np
import pyarrow as pa
import pydantic
import pytest
import torch

from _loop import MemorySession, RankSession, features, job, spawn_two, table
from rayload.features import CategoricalState, LabelState
from rayload.errors import SpecError
from rayload.spec import JobSpec
from rayload.train import checkpoint as ckpt
from rayload.train.batch import Layout, collate
from rayload.train.loop import Trainer, run
from rayload.train.session import Session


def test_training_learns_and_reports_every_epoch(tmp_path):
    session = MemorySession(table(4096, 0), table(2048, 1), str(tmp_path))
    out = run(job(epochs=3), features(), session, {"train_rows": 4096, "manifest": {}})
    aucs = [m["val_auc"] for m, _ in session.reports]
    assert len(aucs) == 3 and aucs[-1] > 0.75 and aucs[-1] > aucs[0] - 0.01
    assert out["history"][-1]["step"] == 3 * 16
    assert os.path.exists(os.path.join(session.reports[-1][1], "model.pt"))


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_sparse_embeddings_learn_with_either_sparse_optimizer_and_resume(tmp_path, optimizer):
    spec = JobSpec.model_validate({**job(epochs=2, sparse_optimizer=optimizer, sparse_lr=0.05).model_dump(),
                                   "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0, "sparse_embeddings": True}})
    session = MemorySession(table(4096, 0), table(2048, 1), str(tmp_path))
    run(spec, features(), session, {"train_rows": 4096, "manifest": {}})
    assert session.reports[-1][0]["val_auc"] > 0.75
    trainer = Trainer(spec, features(), MemorySession(table(16, 9), table(16, 9), "."), 1)
    kind = torch.optim.SparseAdam if optimizer == "adam" else torch.optim.Adagrad
    assert [type(o) for o in trainer.optimizers] == [torch.optim.AdamW, kind]
    trainer.restore(session.reports[-1][1])  # the sparse optimizer's state comes back with the weights
    assert trainer.optimizers[1].state


def test_a_trial_stopped_inside_report_leaves_no_scratch_checkpoint(tmp_path, monkeypatch):
    """Tune stops a trial (ASHA) by raising SystemExit inside its report call."""
    from rayload.train import loop

    made = []
    monkeypatch.setattr(loop, "scratch_dir", lambda: made.append(str(tmp_path / f"scratch{len(made)}")) or os.makedirs(made[-1]) or made[-1])

    class Stopped(MemorySession):
        def report(self, metrics, checkpoint_dir, name):
            raise SystemExit(0)

    with pytest.raises(SystemExit):
        run(job(epochs=2), features(), Stopped(table(512, 0), table(256, 1), str(tmp_path)), {"train_rows": 512, "manifest": {}})
    assert len(made) == 1 and not os.path.exists(made[0])


def test_accumulation_matches_one_large_batch():
    t = table(256, 3)
    big = Trainer(job(batch_size=256, accumulation=1), features(), MemorySession(t, t, "."), 1)
    small = Trainer(job(batch_size=256, accumulation=4), features(), MemorySession(t, t, "."), 1)
    layout = Layout(("x",), ("c",), ("b",))
    big.step([collate(t, layout)])
    small.step([collate(t.slice(i * 64, 64), layout) for i in range(4)])
    for (name, a), b in zip(big.model.named_parameters(), small.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_bf16_autocast_on_cpu_trains(tmp_path):
    t = table(1024, 4)
    trainer = Trainer(job(precision="bf16"), features(), MemorySession(t, t, str(tmp_path)), 4)
    layout = Layout(("x",), ("c",), ("b",))
    seen = []
    trainer.model.deep[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    with trainer.autocast():
        trainer.model(*collate(t.slice(0, 8), layout).inputs())
    assert seen == [torch.bfloat16]  # the MLP's matmuls ran in bf16
    before = copy.deepcopy(trainer.model.state_dict())
    loss = trainer.step([collate(t.slice(0, 256), layout)])
    assert np.isfinite(loss)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_checkpoint_round_trip_loads_with_weights_only(tmp_path):
    session = MemorySession(table(1024, 0), table(512, 1), str(tmp_path))
    run(job(epochs=1), features(), session, {"train_rows": 1024, "manifest": {"seed": 0}})
    path = session.reports[-1][1]
    weights = torch.load(os.path.join(path, "model.pt"), weights_only=True, map_location="cpu")
    assert not any(k.startswith("module.") for k in weights)
    loaded = ckpt.load(path)
    assert loaded.features == features()
    state = ckpt.load_train_state(path)
    assert state["state"].epoch == 0 and state["state"].step == 4
    # the history alone: history.json, equal to the state's; an older checkpoint without it is read whole
    assert ckpt.read_history(path) == state["state"].history and len(state["state"].history) == 1
    os.remove(os.path.join(path, "history.json"))
    assert ckpt.read_history(path) == state["state"].history
    batch = collate(table(16, 9), Layout(("x",), ("c",), ("b",)))
    trainer = Trainer(job(), features(), MemorySession(table(16, 9), table(16, 9), "."), 1)
    trainer.restore(path)
    trainer.model.eval()
    torch.testing.assert_close(trainer.model(*batch.inputs()), loaded.model(*batch.inputs()))


def test_resume_continues_at_the_next_epoch_with_the_same_rng(tmp_path):
    # With dropout the resumed epoch's masks come from the restored RNG: another stream would
    # train other weights, and the epoch's validation AUC would differ.
    spec = JobSpec.model_validate({**job(epochs=2).model_dump(), "model": {**job().model.model_dump(), "dropout": 0.3}})
    first = MemorySession(table(1024, 0), table(512, 1), str(tmp_path / "a"))
    run(spec, features(), first, {"train_rows": 1024, "manifest": {}})
    resumed = MemorySession(table(1024, 0), table(512, 1), str(tmp_path / "b"))
    resumed.reports = [first.reports[0]]  # as if the run died after epoch 0
    out = run(spec, features(), resumed, {"train_rows": 1024, "manifest": {}})
    assert [h["epoch"] for h in out["history"]] == [0, 1]
    assert len(resumed.reports) == 2 and resumed.reports[1][0]["epoch"] == 1
    assert resumed.reports[1][0]["val_auc"] == pytest.approx(first.reports[1][0]["val_auc"], abs=1e-6)


def test_restored_optimizers_keep_this_devices_kernel_choice(tmp_path, monkeypatch):
    """A checkpoint written with the fused AdamW (CUDA's choice) resumes with this device's choice."""
    from rayload.train import loop

    orig = loop.make_optimizers
    monkeypatch.setattr(loop, "make_optimizers", lambda m, s, fused=None: orig(m, s, fused=True))
    first = MemorySession(table(1024, 0), table(512, 1), str(tmp_path / "a"))
    run(job(epochs=1), features(), first, {"train_rows": 1024, "manifest": {}})
    assert ckpt.load_train_state(first.reports[-1][1])["optimizers"][0]["param_groups"][0]["fused"]
    monkeypatch.setattr(loop, "make_optimizers", orig)
    resumed = Trainer(job(epochs=2), features(), MemorySession(table(1024, 0), table(512, 1), str(tmp_path / "b")), 4)
    assert not resumed.optimizers[0].param_groups[0]["fused"]  # auto on CPU: not fused
    resumed.restore(first.reports[-1][1])
    assert not resumed.optimizers[0].param_groups[0]["fused"] and resumed.state.step == 4
    before = [p.detach().clone() for p in resumed.model.parameters()]
    resumed.step([collate(table(256, 2), Layout(("x",), ("c",), ("b",)))])
    assert any(not torch.equal(a, b) for a, b in zip(before, resumed.model.parameters()))


def test_a_run_restored_after_its_last_epoch_reports_its_result_again_and_trains_no_more(tmp_path):
    # A Tune driver killed after a trial's final epoch: the re-attached trial must still hand
    # the searcher its metric (Tune rejects a result without it), without training on.
    first = MemorySession(table(1024, 0), table(512, 1), str(tmp_path / "a"))
    run(job(epochs=2), features(), first, {"train_rows": 1024, "manifest": {}})
    again = MemorySession(table(1024, 0), table(512, 1), str(tmp_path / "b"))
    again.reports = list(first.reports)
    out = run(job(epochs=2), features(), again, {"train_rows": 1024, "manifest": {}})
    assert [h["epoch"] for h in out["history"]] == [0, 1]
    assert len(again.reports) == 3 and again.reports[2][0] == first.reports[1][0]
    # An early-stopped run stays stopped.
    stopped = MemorySession(table(512, 0), table(256, 1), str(tmp_path / "c"))
    spec = job(epochs=30, lr=0.2, early_stopping={"metric": "logloss", "patience": 2})
    done = run(spec, features(), stopped, {"train_rows": 512, "manifest": {}})
    n = len(stopped.reports)
    assert len(run(spec, features(), stopped, {"train_rows": 512, "manifest": {}})["history"]) == len(done["history"])
    assert len(stopped.reports) == n + 1 and stopped.reports[-1][0]["early_stopped"]


def test_early_stopping_stops_after_patience(tmp_path):
    session = MemorySession(table(512, 0), table(256, 1), str(tmp_path))
    out = run(job(epochs=30, lr=0.2, early_stopping={"metric": "logloss", "patience": 2}), features(), session, {"train_rows": 512, "manifest": {}})
    assert len(out["history"]) < 30 and out["history"][-1]["early_stopped"]


def test_invalid_training_settings_fail_at_spec_load():
    for bad, field in [({"model": {"name": "xgboost"}}, "model.name"), ({"train": {"accumulation": 0}}, "train.accumulation"),
                       ({"train": {"precision": "bf61"}}, "train.precision")]:
        with pytest.raises(pydantic.ValidationError) as info:
            JobSpec.model_validate({"name": "t", "data": {"source": {"kind": "movielens"}}, **bad})
        assert field.split(".")[-1] in str(info.value)


def test_load_spec_names_the_field(tmp_path):
    from rayload import load_spec

    path = tmp_path / "j.yaml"
    path.write_text("name: t\ndata: {source: {kind: movielens}}\nmodel: {name: xgboost}\ntrain: {accumulation: 0, precision: bf61}\n")
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert {i.path for i in info.value.issues} == {"model.name", "train.accumulation", "train.precision"}


def test_class_weights_weight_the_loss():
    t = table(512, 5)
    f = features()
    f.label.class_weights = {"0.0": 0.5, "1.0": 2.0}
    weighted = Trainer(job(), f, MemorySession(t, t, "."), 1)
    plain = Trainer(job(), features(), MemorySession(t, t, "."), 1)
    batch = collate(t, Layout(("x",), ("c",), ("b",)))
    with torch.no_grad():
        logits = plain.model(*batch.inputs())
        w = torch.where(batch.label > 0.5, 2.0, 0.5)
        expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.label, weight=w)
        torch.testing.assert_close(weighted.loss(batch), expected)


def test_gpu_worker_without_cuda_stops_unless_cpu_fallback_is_allowed(monkeypatch, caplog):
    import logging

    from rayload.errors import RayloadError
    from rayload.train.session import cpu_fallback_device

    monkeypatch.setenv("RAY_NODE_TYPE_NAME", "gpu_worker")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RayloadError, match=r"rank 1 on node type gpu_worker was given GPU\(s\) '0' but CUDA sees none.*cpu_fallback: true"):
        cpu_fallback_device(False, 1)
    with caplog.at_level(logging.WARNING, logger="rayload.train.session"):
        assert cpu_fallback_device(True, 1).type == "cpu"
    assert "CPU FALLBACK: rank 1 on node type gpu_worker" in caplog.text


class StreamSession(Session):
    """Session.train_batches itself, over a stream that counts how often it is read."""

    def __init__(self, train: pa.Table, cache_bytes: int):
        super().__init__({"layout": Layout(("x",), ("c",), ("b",)), "seed": 0, "prefetch_batches": 0, "shuffle_buffer": 0,
                          "cache_bytes": cache_bytes})
        self.train, self.reads = train, 0

    def _train_source(self):
        return self.train

    def _iter(self, source, batch_size, seed, drop_last):
        self.reads += 1
        for start in range(0, source.num_rows, batch_size):
            yield collate(source.slice(start, batch_size), self.loader["layout"])


def _labels(batches) -> list[float]:
    return [float(b.label.sum()) for b in batches]


def _rows(batches) -> list[tuple]:
    """Every row of the batches as (x, c, bag, label), in order."""
    out = []
    for b in batches:
        ends = list(b.bag_offsets[0][1:].tolist()) + [len(b.bag_values[0])]
        for i, (start, end) in enumerate(zip(b.bag_offsets[0].tolist(), ends)):
            out.append((float(b.dense[i, 0]), int(b.sparse[i, 0]), tuple(b.bag_values[0][start:end].tolist()), float(b.label[i])))
    return out


def test_worker_cache_serves_later_epochs_from_memory_reshuffled_row_by_row():
    t = table(2000, 0)  # 15 full batches of 128 and a short one of 80
    session = StreamSession(t, cache_bytes=2**20)
    first = list(session.train_batches(0, 128))
    second = list(session.train_batches(1, 128))
    third = list(session.train_batches(2, 128))
    assert session.reads == 1  # epochs 1 and 2 read nothing
    assert [len(b) for b in second] == [len(b) for b in third] == [len(b) for b in first] == [128] * 15 + [80]
    rows = _rows(first)
    assert sorted(_rows(second)) == sorted(_rows(third)) == sorted(rows)  # every row once, bags and labels with their row
    assert _rows(second) != rows and _rows(third) != _rows(second)
    # rows are dealt out anew, not whole batches reordered: a batch of epoch 1 mixes rows of many batches of epoch 0
    batch_of = {row: i // 128 for i, row in enumerate(rows)}
    assert len({batch_of[r] for r in _rows([second[0]])}) > 8
    again = StreamSession(t, cache_bytes=2**20)
    list(again.train_batches(0, 128))
    assert _rows(again.train_batches(1, 128)) == _rows(second)  # the order is seeded per rank and epoch
    list(session.train_batches(3, 64))
    assert session.reads == 2  # another batch size (accumulation changed) streams again


def test_worker_cache_streams_every_epoch_over_budget_or_when_off():
    t = table(2048, 0)
    for budget in (1000, 0):  # 1000 bytes hold less than an epoch; 0 turns the cache off
        session = StreamSession(t, cache_bytes=budget)
        for epoch in range(3):
            assert len(list(session.train_batches(epoch, 128))) == 16
        assert session.reads == 3
    from rayload.train.loop import loader_options

    assert loader_options(job(), features())["cache_bytes"] == 1024 * 2**20
    assert loader_options(job(shuffle_buffer=1000), features())["cache_bytes"] == 0  # a row-level shuffle needs the stream
    assert loader_options(job(worker_cache_mb=0), features())["cache_bytes"] == 0


def _two_ranks(rank: int, port: int, budgets: tuple, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    session = StreamSession(table(2048, rank), cache_bytes=budgets[rank])
    session.rank, session.world_size = rank, 2
    for epoch in range(3):
        list(session.train_batches(epoch, 128))
    out.put((rank, session.reads))
    dist.destroy_process_group()


def test_worker_cache_is_all_ranks_or_none():
    """One rank over its budget: no rank caches (a rank streaming alone would wait forever for
    the others at Ray Data's streaming split)."""
    for budgets, reads in (((2**20, 2**20), 1), ((2**20, 1000), 3)):
        assert spawn_two(_two_ranks, budgets) == [reads, reads]


def _sync_sparse_grads(rank: int, port: int, out) -> None:
    import torch.distributed as dist
    from torch import nn

    from rayload.train.sparse_sync import SparseGradSync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    tables = [nn.Embedding(10, 3, sparse=True), nn.EmbeddingBag(7, 2, mode="mean", sparse=True), nn.Embedding(5, 4, sparse=True)]
    untouched = nn.Embedding(3, 2, sparse=True)  # no rank's batch reaches it
    inputs = {0: (torch.tensor([1, 1, 4]), torch.tensor([0, 6, 6, 2]), None),  # rank 0 never touches the third table
              1: (torch.tensor([4, 9]), torch.tensor([6, 3]), torch.tensor([2, 2, 0]))}

    def loss(mods, r):
        a, b, c = inputs[r]
        total = (mods[0](a) * (r + 1.5)).sum() + (mods[1](b, torch.tensor([0, 1]) if r == 0 else torch.tensor([0])) ** 2).sum()
        return total + (mods[2](c).sum() * 3 if c is not None else 0)

    expected = []
    for r in (0, 1):  # the reference: DDP's average of the two ranks' dense gradients
        dense = [type(m)(m.num_embeddings, m.embedding_dim, **({"mode": "mean"} if isinstance(m, nn.EmbeddingBag) else {}))
                 for m in tables]
        for d, m in zip(dense, tables):
            d.weight.data.copy_(m.weight.data)
        loss(dense, r).backward()
        expected.append([torch.zeros_like(d.weight) if d.weight.grad is None else d.weight.grad.clone() for d in dense])
    loss(tables, rank).backward()
    assert tables[2].weight.grad is None if rank == 0 else tables[2].weight.grad.is_sparse
    SparseGradSync([m.weight for m in tables] + [untouched.weight], 2)()
    got = [m.weight.grad for m in tables]
    assert untouched.weight.grad is None  # the optimizer skips it, as it would in one process
    out.put((rank, ([g.is_sparse and g.is_coalesced() for g in got],
                    [float((g.to_dense() - (e0 + e1) / 2).abs().max()) for g, e0, e1 in zip(got, *expected)])))
    dist.destroy_process_group()


def test_sparse_gradients_are_averaged_across_ranks_like_ddp():
    """Each rank ends with the sparse, coalesced average of both ranks' gradients, also for a
    table one rank never touched (the reference is the dense gradients' mean)."""
    for flags, errors in spawn_two(_sync_sparse_grads):
        assert flags == [True, True, True]
        assert max(errors) < 1e-6, errors


def _train_two_ranks(rank: int, port: int, folder: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = JobSpec.model_validate({**job(epochs=2, sparse_lr=0.05, accumulation=2).model_dump(),
                                   "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0, "sparse_embeddings": True}})
    session = RankSession(rank, table(2048, 10 + rank), table(1024, 1), os.path.join(folder, str(rank)))
    trainer = Trainer(spec, features(), session, 2048 // 256)
    def weights():  # numpy: a tensor sent through the queue would be shared memory of an exited process
        return {k: v.detach().clone().numpy() for k, v in ckpt.unwrap(trainer.model).state_dict().items()}

    initial = weights()
    aucs = []
    for epoch in range(2):
        trainer.train_epoch(epoch)
        aucs.append(trainer.validate()["val_auc"])
    out.put((rank, {"aucs": aucs, "initial": initial, "final": weights(),
                    "ignored": set(trainer.model.parameters_to_ignore)}))
    dist.destroy_process_group()


def test_two_gloo_ranks_with_sparse_tables_keep_identical_weights(tmp_path):
    """The sparse tables stay out of DDP (its gloo sparse all-reduce corrupted the heap on
    torch 2.13) and are averaged by SparseGradSync: after two epochs on different data, with
    accumulation, both ranks hold the same weights bit for bit, and training moved the tables."""
    r0, r1 = spawn_two(_train_two_ranks, str(tmp_path))
    tables = {k for k in r0["final"] if ".tables." in k or ".bags." in k}
    assert tables and r0["ignored"] == r1["ignored"] == tables
    assert r0["aucs"][-1] > 0.7
    for k, v in r0["final"].items():
        assert np.array_equal(v, r1["final"][k]), k
    for k in tables:
        assert not np.array_equal(r0["final"][k], r0["initial"][k]), k


def _uneven_val_caches(rank: int, port: int, path: str, out) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a deadlock fails instead of hanging

    class ValSession(Session):
        VAL_CACHE_ROWS = 1050  # rank 0's stride holds 1,076 rows, rank 1's 1,024: only rank 1 caches

        def _val_source(self):
            raise AssertionError("the local shards should be read")

    session = ValSession({"layout": Layout(("x",), ("c",), ("b",)), "seed": 0, "prefetch_batches": 0, "shuffle_buffer": 0,
                          "val_files": [path]})
    session.rank, session.world_size = rank, 2
    rows = [sum(len(b) for b in session.val_batches(128)) for _ in range(3)]  # three epochs of validation
    out.put((rank, (rows, getattr(session, "_val_cache", None) is not None)))
    dist.destroy_process_group()


def test_validation_reader_is_chosen_once_so_uneven_val_caches_cannot_deadlock(tmp_path):
    """The ranks agree on the validation reader with a collective at the first validation only:
    afterwards a rank whose stride outgrew the cache reads again alone while the other serves
    its cache (a collective there would wait forever)."""
    import pyarrow.parquet as pq

    path = str(tmp_path / "val.parquet")
    pq.write_table(table(2100, 3), path)
    r0, r1 = spawn_two(_uneven_val_caches, path)
    assert r0 == ([1076] * 3, False) and r1 == ([1024] * 3, True)


def test_embedding_prior_weighs_each_row_by_its_ids_training_count():
    from rayload.models._inputs import FieldEmbeddings, InputShape

    torch.manual_seed(0)
    emb = FieldEmbeddings(InputShape(dense=0, sparse=(5,), bags=(4,)), 3)
    counts_c, counts_b = torch.tensor([1.0, 2.0, 10.0, 4.0, 1.0]), torch.tensor([1.0, 5.0, 2.0, 8.0])
    emb.inv_counts = [1 / counts_c, 1 / counts_b]
    sparse = torch.tensor([[2], [2], [1], [3]])
    values, offsets = torch.tensor([1, 3, 3, 2, 1]), torch.tensor([0, 2, 3, 4])  # bags [1, 3], [3], [2], [1]
    emb.train()
    emb(sparse, [values], [offsets])
    table, bag = emb.tables[0].weight, emb.bags[0].weight
    want = (sum(table[i].pow(2).sum() / counts_c[i] for i in [2, 2, 1, 3])
            + sum(bag[v].pow(2).sum() / counts_b[v] for v in [1, 3, 3, 2, 1])) / 4
    assert torch.allclose(emb.last_prior, want)
    emb.last_prior.backward()
    # d/d(row) = 2 * row * (times used in the batch / training count) / batch size
    assert torch.allclose(table.grad[2], 2 * table[2] * (2 / 10) / 4)
    assert torch.allclose(table.grad[1], 2 * table[1] * (1 / 2) / 4)
    assert torch.allclose(table.grad[0], torch.zeros(3))
    assert torch.allclose(bag.grad[3], 2 * bag[3] * (2 / 8) / 4)
    emb.eval()
    emb(sparse, [values], [offsets])
    assert emb.last_prior is None


def test_id_counts_come_from_the_training_shards_and_refuse_ids_outside_a_table(tmp_path):
    import pyarrow.parquet as pq

    from rayload.data.pipeline import LocalShards
    from rayload.errors import DataError
    from rayload.train.prior import id_counts

    parts = [table(300, 0), table(200, 1)]
    files = []
    for i, part in enumerate(parts):
        files.append(str(tmp_path / f"part-{i}.parquet"))
        pq.write_table(part, files[-1])
    counts = id_counts(features(), LocalShards(files))
    whole = pa.concat_tables(parts)
    fitted = features()
    assert set(counts) == {"c", "b"}
    assert counts["c"].tolist() == np.bincount(whole.column("c").to_numpy(), minlength=fitted.sparse_columns["c"]).tolist()
    flat = np.concatenate([np.asarray(v, dtype=np.int64) for v in whole.column("b").to_pylist()])
    assert counts["b"].tolist() == np.bincount(flat, minlength=fitted.bag_columns["b"]).tolist()
    bad = table(10, 2).set_column(1, "c", pa.array([99] * 10, pa.int64()))
    pq.write_table(bad, str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match="column c: ID 99 outside its embedding table"):
        id_counts(features(), LocalShards([str(tmp_path / "bad.parquet")]))


def test_training_counts_are_kept_beside_the_shards_for_the_same_shards_only(tmp_path, caplog):
    """The first run counts and writes id_counts.npz beside the shards; a later run on the same
    shards reads it (no pass over the data); other shards (cache key), other table sizes and a
    damaged file are counted again and the file replaced."""
    import pyarrow.parquet as pq

    from rayload.data.pipeline import PreprocessResult
    from rayload.train import prior

    pq.write_table(table(500, 0), str(tmp_path / "train.parquet"))
    pre = PreprocessResult(str(tmp_path), features(), {}, "key-1", files={"train": [str(tmp_path / "train.parquet")]})
    first = prior.training_counts(pre)
    assert (tmp_path / prior.COUNTS_FILE).exists() and not list(tmp_path.glob("*.tmp"))
    direct = prior.id_counts(pre.features, pre.batches("train"))
    assert {n: c.tolist() for n, c in first.items()} == {n: c.tolist() for n, c in direct.items()}

    os.rename(tmp_path / "train.parquet", tmp_path / "away.parquet")  # a second count would fail: the file is read
    again = prior.training_counts(pre)
    assert {n: (c.dtype, c.tolist()) for n, c in again.items()} == {n: (c.dtype, c.tolist()) for n, c in first.items()}

    pq.write_table(table(200, 1), str(tmp_path / "train.parquet"))  # other shards, another cache key
    other = PreprocessResult(str(tmp_path), features(), {}, "key-2", files={"train": [str(tmp_path / "train.parquet")]})
    assert int(prior.training_counts(other)["c"].sum()) == 200
    bigger = features()
    bigger.categorical[0] = CategoricalState("c", "vocab", vocab=[str(i) for i in range(35)])  # another table size, same key
    grown = PreprocessResult(str(tmp_path), bigger, {}, "key-2", files=other.files)
    assert len(prior.training_counts(grown)["c"]) == bigger.sparse_columns["c"]
    (tmp_path / prior.COUNTS_FILE).write_bytes(b"not a zip")
    with caplog.at_level("WARNING"):
        assert int(prior.training_counts(other)["c"].sum()) == 200
    assert "could not read" in caplog.text
    assert int(prior.training_counts(PreprocessResult(str(tmp_path), features(), {}, "key-2", files={}))["c"].sum()) == 200

    odd = tmp_path / "odd"  # columns named like savez's own arguments, or with a slash, round-trip
    odd.mkdir()
    renamed = table(300, 2).rename_columns(["x", "file", "allow_pickle/b", "y"])
    pq.write_table(renamed, str(odd / "train.parquet"))
    named = features()
    named.categorical = [CategoricalState("file", "vocab", vocab=[str(i) for i in range(30)]),
                         CategoricalState("allow_pickle/b", "vocab", multi=True, vocab=["p", "q", "r"])]
    pre_odd = PreprocessResult(str(odd), named, {}, "key-3", files={"train": [str(odd / "train.parquet")]})
    counted = prior.training_counts(pre_odd)
    os.rename(odd / "train.parquet", odd / "away.parquet")
    read = prior.training_counts(pre_odd)
    assert list(read) == ["file", "allow_pickle/b"] and read["file"].tolist() == counted["file"].tolist()


def test_embedding_prior_trains_and_needs_the_id_counts(tmp_path):
    from rayload.data.pipeline import LocalShards
    from rayload.errors import RayloadError
    from rayload.train.prior import id_counts
    import pyarrow.parquet as pq

    train = table(4096, 0)
    pq.write_table(train, str(tmp_path / "train.parquet"))
    counts = id_counts(features(), LocalShards([str(tmp_path / "train.parquet")]))
    spec = job(epochs=2, embedding_prior=5.0)
    session = MemorySession(train, table(2048, 1), str(tmp_path))
    run(spec, features(), session, {"train_rows": 4096, "manifest": {}, "id_counts": counts})
    assert session.reports[-1][0]["val_auc"] > 0.75
    with pytest.raises(RayloadError, match="embedding_prior is set but the loop got no ID counts"):
        run(spec, features(), MemorySession(train, table(64, 1), str(tmp_path / "b")), {"train_rows": 4096, "manifest": {}})


def test_a_resumed_worker_trains_its_first_epoch_in_the_order_the_run_would_have_had():
    """From epoch 1 on, batches come from the cache in a seeded order per rank and epoch; a
    worker restarted at epoch 2 (no cache in its new process) must not stream epoch 0's order."""
    t = table(2048, 0)
    whole = StreamSession(t, cache_bytes=2**20)
    orders = [_labels(whole.train_batches(epoch, 128)) for epoch in range(3)]
    assert whole.cached is True
    resumed = StreamSession(t, cache_bytes=2**20)
    resumed.cached_before = True  # what the checkpoint says (TrainState.cached)
    assert _labels(resumed.train_batches(2, 128)) == orders[2] != orders[0]
    assert _labels(resumed.train_batches(3, 128)) == _labels(whole.train_batches(3, 128)) and resumed.reads == 1
    streamed = StreamSession(t, cache_bytes=1000)  # over the budget: every epoch streams, resumed or not
    list(streamed.train_batches(0, 128))
    assert streamed.cached is False
    list(streamed.train_batches(1, 128))
    assert streamed.reads == 2


def test_a_resumed_worker_keeps_to_a_lower_cache_budget_or_fewer_ranks():
    """A resumed worker read its whole epoch into memory whenever the checkpoint said the run had
    cached, past a train.worker_cache_mb lowered at the relaunch (or more rows per rank after a
    restart on fewer ranks): the size the cache had, and on how many ranks, travels with it now."""
    t = table(2048, 0)
    whole = StreamSession(t, cache_bytes=2**20)
    list(whole.train_batches(0, 128))
    assert whole.cached is True and 0 < whole.cache_bytes <= 2**20
    # a lower budget; and two ranks' halves that fit, now one rank holding both
    for budget, before, world in ((1000, whole.cache_bytes, 1), (whole.cache_bytes // 2 + 100, whole.cache_bytes // 2, 2)):
        resumed = StreamSession(t, cache_bytes=budget)
        resumed.cached_before, resumed.cached_before_bytes, resumed.cached_before_world = True, before, world
        list(resumed.train_batches(2, 128))
        assert resumed.cached is False and getattr(resumed, "_train_cache", None) is None, (budget, world)
    same = StreamSession(t, cache_bytes=2**20)
    same.cached_before, same.cached_before_bytes, same.cached_before_world = True, whole.cache_bytes, 1
    list(same.train_batches(2, 128))
    assert same.cached is True and same.cache_bytes == whole.cache_bytes


def test_the_cache_state_travels_in_the_checkpoint(tmp_path):
    session = MemorySession(table(512, 0), table(256, 1), str(tmp_path))
    session._train_cache = (256, [])  # Session.cached is True: this rank kept its batches
    session.cache_bytes = 4096
    run(job(epochs=1), features(), session, {"train_rows": 512, "manifest": {}})
    state = ckpt.load_train_state(session.reports[-1][1])["state"]
    assert (state.cached, state.cached_bytes, state.cached_world) == (True, 4096, 1)


@pytest.mark.parametrize("rows,world,batch,k", [(1000, 1, 300, 1), (7800, 2, 400, 4), (4096, 1, 256, 1), (1001, 2, 250, 2),
                                                (400, 1, 256, 2)])
def test_the_schedule_counts_the_steps_the_loop_takes(tmp_path, rows, world, batch, k):
    """With linear or cosine decay, steps past the schedule's end would run at lr 0."""
    from rayload.train.loop import steps_per_epoch

    micro = max(1, batch // k)
    per_rank = rows // world
    batches = per_rank // micro if world > 1 else -(-per_rank // micro)  # ranks > 1 drop a short last batch
    assert steps_per_epoch(rows, world, batch, k) == -(-batches // k)
    if world == 1:  # and the loop itself takes exactly that many
        session = MemorySession(table(rows, 0), table(128, 1), str(tmp_path))
        out = run(job(epochs=2, batch_size=batch, accumulation=k, lr_decay="linear"), features(), session, {"train_rows": rows, "manifest": {}})
        assert out["history"][-1]["step"] == 2 * steps_per_epoch(rows, world, batch, k)


def test_a_short_last_micro_batch_weighs_by_its_rows():
    """400 rows, batch 256, k=2: micro-batches 128+128 and 128+16; the second group must step
    as one 144-row batch would."""
    t = table(144, 5)
    layout = Layout(("x",), ("c",), ("b",))
    big = Trainer(job(batch_size=256, accumulation=1), features(), MemorySession(t, t, "."), 1)
    small = Trainer(job(batch_size=256, accumulation=2), features(), MemorySession(t, t, "."), 1)
    big.step([collate(t, layout)])
    small.step([collate(t.slice(0, 128), layout), collate(t.slice(128, 16), layout)])
    for (name, a), b in zip(big.model.named_parameters(), small.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_warmup_and_decay_reach_the_sparse_tables_unless_held_constant():
    spec = JobSpec.model_validate({**job(epochs=1, lr=0.01, sparse_lr=0.02, warmup_steps=2, lr_decay="linear").model_dump(),
                                   "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0, "sparse_embeddings": True}})
    t = table(64, 0)
    layout = Layout(("x",), ("c",), ("b",))
    for schedule, expect in (("follow", [0.01, 0.02]), ("constant", [0.02, 0.02])):
        s = JobSpec.model_validate({**spec.model_dump(), "train": {**spec.train.model_dump(), "sparse_lr_schedule": schedule}})
        trainer = Trainer(s, features(), MemorySession(t, t, "."), 4)
        sparse = []
        for _ in range(2):
            sparse.append(trainer.optimizers[1].param_groups[0]["lr"])
            trainer.step([collate(t, layout)])
        assert sparse == pytest.approx(expect), schedule
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * (1 - 0 / 2))  # dense: warmed up, decay starting


def _norm_stats_after_ddp(rank: int, port: int, out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = JobSpec.model_validate({**job(epochs=1).model_dump(),
                                   "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0, "batch_norm": True}})

    class Ranked(MemorySession):
        def prepare(self, model):
            return DistributedDataParallel(model)

    session = Ranked(table(256, rank), table(64, 9), ".")
    session.rank, session.world_size = rank, 2
    trainer = Trainer(spec, features(), session, 1)
    trainer.step([collate(table(256, rank), session.loader["layout"])])
    module = ckpt.unwrap(trainer.model)

    def stats():
        return torch.cat([b.flatten().float() for m in module.modules() if isinstance(m, torch.nn.BatchNorm1d) for b in m.buffers()]).tolist()

    before = stats()
    trainer._share_norm_statistics(module)  # what validate() does first
    out.put((rank, (before, stats())))
    dist.destroy_process_group()


def test_validation_uses_rank_0s_batch_norm_statistics_on_every_rank():
    (before0, after0), (before1, after1) = spawn_two(_norm_stats_after_ddp)
    assert before0 != before1  # each rank updated the running statistics with its own batch
    assert len(after0) > 0 and after0 == after1 == before0


@pytest.mark.parametrize("rows_after,lr_after_epoch_1", [(512, 0.01 * (1 - 6 / 8)), (2048, 0.01 * (1 - 12 / 20))])
def test_the_schedule_ends_at_the_runs_end_after_an_elastic_resize(tmp_path, rows_after, lr_after_epoch_1):
    """A restart with another world size changes the steps per epoch (here 4 before; 2 after a
    grow, 8 after a shrink): the decay's total is the steps taken plus the epochs left at the
    new rate, so the lr reaches 0 at the last step, not before it or never."""
    first = MemorySession(table(1024, 0), table(128, 1), str(tmp_path / "a"))
    run(job(epochs=1, lr_decay="linear"), features(), first, {"train_rows": 1024, "manifest": {}})  # epoch 0: 4 steps
    resized = MemorySession(table(rows_after, 0), table(128, 1), str(tmp_path / "b"))
    resized.reports = [first.reports[0]]
    run(job(epochs=3, lr_decay="linear"), features(), resized, {"train_rows": rows_after, "manifest": {}})

    def lr(report):
        return ckpt.load_train_state(report[1])["optimizers"][0]["param_groups"][0]["lr"]

    assert lr(resized.reports[1]) == pytest.approx(lr_after_epoch_1)
    assert lr(resized.reports[2]) == pytest.approx(0.0, abs=1e-12)
    assert resized.reports[2][0]["step"] == 4 + 2 * rows_after // 256


def test_a_one_row_micro_batch_steps_batch_norm_models_with_the_running_statistics(tmp_path):
    """257 rows in batches of 256 leave a last micro-batch of one row, whose batch variance
    does not exist: it still steps (the schedule counts it), normalised by the running
    statistics, which it leaves as they were."""
    spec = JobSpec.model_validate({**job(epochs=1).model_dump(),
                                   "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0, "batch_norm": True}})
    session = MemorySession(table(257, 0), table(64, 1), str(tmp_path))
    out = run(spec, features(), session, {"train_rows": 257, "manifest": {}})
    assert out["history"][-1]["step"] == 2

    t = table(8, 2)
    trainer = Trainer(spec, features(), MemorySession(t, t, "."), 1)
    trainer.model.train()
    norms = [m for m in trainer.model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    assert norms
    stats = [b.clone() for m in norms for b in (m.running_mean, m.running_var)]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    assert np.isfinite(trainer.step([collate(t.slice(0, 1), Layout(("x",), ("c",), ("b",)))]))
    assert all(torch.equal(a, b) for a, b in zip(stats, [b for m in norms for b in (m.running_mean, m.running_var)]))
    assert all(m.training for m in norms) and trainer.state.step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_regression_runs_early_stop_on_val_rmse_and_refuse_a_binary_metric_before_any_work(monkeypatch):
    from rayload.train import trainer as trainer_module

    regression = features()
    regression.label = LabelState("y", "regression")
    t = table(64, 0)
    for rule in ({"metric": "rmse", "patience": 2}, {"patience": 2}):  # a rule without a metric follows the task's own
        spec = job(early_stopping=rule)
        assert trainer_module.score_metric(spec, "regression") == ("val_rmse", "min")
        trainer = Trainer(spec, regression, MemorySession(t, t, "."), 1)
        stops = [trainer.early_stop({"val_rmse": v}) for v in (1.0, 0.9, 0.95, 0.92)]
        assert stops == [False, False, False, True] and trainer.state.best == 0.9
    assert trainer_module.score_metric(job(early_stopping={"patience": 2}), "binary") == ("val_auc", "max")

    def no_work(*a, **k):
        raise AssertionError("fit started work on a spec it must refuse")

    monkeypatch.setattr(trainer_module, "ensure_ray", no_work)
    bad = JobSpec.model_validate({**job().model_dump(), "data": {"source": {"kind": "movielens"}, "label": {"column": "rating", "task": "regression"}},
                                  "train": {**job().train.model_dump(), "early_stopping": {"metric": "auc"}}})
    with pytest.raises(SpecError, match="train.early_stopping.metric: a regression label"):
        trainer_module.fit(bad)


def test_validation_scores_bf16_trained_models_in_fp32():
    """Under bf16 autocast predictions near 1000 round to steps of 4 (val_rmse doubled for a
    model 1.0 off); validation must give the fp32 metrics the test evaluation gives."""
    from rayload.evaluate import regression_metrics

    regression = features()
    regression.label = LabelState("y", "regression")
    t = table(512, 6)
    t = t.set_column(3, "label", pa.array(1000 + 3 * t.column("x").to_numpy(), pa.float32()))
    spec = JobSpec.model_validate({**job(precision="bf16").model_dump(), "model": {"name": "mlp", "embedding_dim": 4, "hidden": [16]}})
    trainer = Trainer(spec, regression, MemorySession(t, t, "."), 1)
    assert trainer.precision == "bf16"
    with torch.no_grad():
        trainer.model.deep[-1].bias.fill_(1000.0)
    trainer.model.eval()
    with torch.no_grad():
        exact = trainer.model(*collate(t, Layout(("x",), ("c",), ("b",))).inputs()).numpy()
    got = trainer.validate()["val_rmse"]
    assert got == pytest.approx(regression_metrics(t.column("label").to_numpy(), exact).rmse, rel=1e-6)


def test_validation_auc_ranks_the_logits():
    """Logits near +40 are all 1.0 as float32 probabilities: ranked by those, every row tied (AUC 0.5)."""
    from rayload.evaluate import auc

    t = table(512, 7)
    trainer = Trainer(job(), features(), MemorySession(t, t, "."), 1)
    with torch.no_grad():
        trainer.model.first.bias.fill_(40.0)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(*collate(t, Layout(("x",), ("c",), ("b",))).inputs()).numpy()
    assert (torch.sigmoid(torch.from_numpy(logits)) == 1.0).all()
    assert trainer.validate()["val_auc"] == pytest.approx(auc(t.column("label").to_numpy(), logits)) != pytest.approx(0.5)


def test_auto_precision_picks_bf16_only_where_the_gpu_computes_it_natively(monkeypatch):
    from rayload.train.loop import resolve_precision

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def emulated_only(including_emulation: bool = True):  # a Turing/Volta GPU: torch's default counts emulation
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated_only)
    assert resolve_precision("auto", cuda) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # Ampere and later
    assert resolve_precision("auto", cuda) == "bf16" and resolve_precision("auto", cpu) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)  # a torch without the argument
    assert resolve_precision("auto", cuda) == "bf16"
    assert resolve_precision("fp16", cuda) == "fp16" and resolve_precision("bf16", cpu) == "bf16"


def test_the_best_ray_checkpoint_is_picked_among_those_that_report_the_score():
    """A validation split with one class reports no val_auc: a clear error, not a KeyError."""
    from rayload.train.trainer import TrainingError, _best_reported

    reported = [("a", {"val_auc": 0.7}), ("b", {"val_logloss": 0.5}), ("c", {"val_auc": 0.8})]
    assert _best_reported(reported, "val_auc", "max", "run")[0] == "c"
    assert _best_reported(reported, "val_auc", "min", "run")[0] == "a"
    with pytest.raises(TrainingError, match="no checkpoint with val_auc was written in run; a validation split with one class has no AUC"):
        _best_reported([("b", {"val_logloss": 0.5})], "val_auc", "max", "run")


def test_the_epochs_train_loss_is_the_mean_over_its_rows_with_a_short_last_step():
    """The per-step losses were averaged as equals: 513 rows in steps of 256, 256 and 1 made the
    lone last row a third of the reported loss (0.427 against 0.566 over the rows)."""
    from rayload.train.loop import binary_loss

    t = table(513, 0)
    trainer = Trainer(job(batch_size=256, lr=1e-30), features(), MemorySession(t, t, "."), 3)  # the weights stay put
    reported = trainer.train_epoch(0)["train_loss"]
    batch = collate(t, Layout(("x",), ("c",), ("b",)))
    trainer.model.train()
    with torch.no_grad():
        over_rows = binary_loss(trainer.model(*batch.inputs()).float(), batch.label, None).item()
    assert reported == pytest.approx(over_rows, rel=1e-5)


def test_with_several_ranks_the_held_back_last_batch_is_cached_and_dealt_out_in_later_epochs(monkeypatch):
    """Each of several ranks drops its short last micro-batch; the cache kept only the batches
    trained on, so the same rows (80 of 2,000 here) were left out of every epoch of the run."""
    from rayload.train import session as session_module

    monkeypatch.setattr(session_module.dist, "all_reduce", lambda tensor, op=None: None)  # this rank alone agrees
    t = table(2000, 0)  # 15 full batches of 128 and a short one of 80
    session = StreamSession(t, cache_bytes=2**20)
    session.world_size = 2
    epochs = [list(session.train_batches(e, 128)) for e in range(4)]
    assert session.reads == 1 and session.cached
    assert all([len(b) for b in batches] == [128] * 15 for batches in epochs)  # the same steps every epoch, the tail held back
    all_rows = set(_rows([collate(t, session.loader["layout"])]))
    first = set(_rows(epochs[0]))
    assert len(all_rows - first) == 80  # epoch 0 streams: its tail is not trained on
    later = set().union(*(set(_rows(b)) for b in epochs[1:]))
    assert all_rows - first <= later  # ... but dealt out with the other rows afterwards
    assert len({frozenset(set(_rows(b))) for b in epochs[1:]}) == 3  # a different subset left out each epoch


def _norms_on_mixed_devices(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from rayload.train.setup import make_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = JobSpec.model_validate({**job(sync_bn=True).model_dump(),
                                   "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16], "dropout": 0.0, "batch_norm": True},
                                   "resources": {"workers": 2, "gpus_per_worker": 1, "cpu_fallback": True}})

    class Rank(Session):
        def __init__(self):
            super().__init__({})
            # rank 1: the node whose GPU CUDA cannot see, fallen back to its CPU
            self.rank, self.world_size, self.device = rank, 2, torch.device("cuda:0" if rank == 0 else "cpu")

        def prepare(self, model):
            return model

    model = make_model(spec, features(), Rank())
    out.put((rank, sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__})))
    dist.destroy_process_group()


def test_sync_bn_is_decided_by_every_rank_together_when_one_fell_back_to_its_cpu():
    """Each rank decided alone: the GPU ranks took SyncBatchNorm, the fallen-back rank plain batch
    norm, and their collectives differed (a deadlock)."""
    assert spawn_two(_norms_on_mixed_devices) == [["BatchNorm1d"], ["BatchNorm1d"]]


class _ShufflingSource:
    """Stands in for a rank's Ray Data stream under a shuffle buffer: Ray 2.60's shuffling batcher
    gives short batches in the middle of a stream, by block layout (review: 2,000 rows as blocks
    of 333 came as 17 batches of 128 and 77, as blocks of 1,000 as 15)."""

    def __init__(self, table, sizes):
        self.table, self.sizes, self.asked = table, sizes, {}

    def iter_batches(self, **kwargs):
        self.asked = kwargs
        start = 0
        for size in self.sizes:
            yield self.table.slice(start, size)
            start += size


def test_a_shuffled_stream_is_re_cut_to_exact_batches_so_ranks_take_the_planned_steps():
    t = table(2000, 0)
    sizes = [128, 77, 128, 77, 128, 77, 128, 77, 128, 77, 128, 128, 128, 128, 128, 128, 128, 77, 2]
    assert sum(sizes) == 2000
    session = Session({"layout": Layout(("x",), ("c",), ("b",)), "seed": 0, "prefetch_batches": 0, "shuffle_buffer": 128})
    source = _ShufflingSource(t, sizes)
    batches = list(session._iter(source, 128, seed=7, drop_last=True))
    assert [len(b) for b in batches] == [128] * 15  # 2,000 // 128, as steps_per_epoch plans, on every rank
    assert source.asked["local_shuffle_buffer_size"] == 128 and source.asked["local_shuffle_seed"] == 7
    assert _rows(batches) == _rows([collate(t.slice(0, 1920), session.loader["layout"])])  # every row in its order, none twice
    assert [len(b) for b in session._iter(_ShufflingSource(t, sizes), 128, seed=7, drop_last=False)] == [128] * 15 + [80]
