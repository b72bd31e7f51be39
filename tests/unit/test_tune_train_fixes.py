"""Training and tuning review fixes (2026-11-26): best.yaml of a searched list item, fp16 steps
skipped on every optimizer together, train.epochs searched under ASHA, the default concurrency
of multi-worker trials."""

import os

import yaml

from rayload._tune_report import write_best_spec
from rayload.search_job import base_raw, job_from
from rayload.search_spec import SearchSpec
from rayload.spec import load_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _base_without_hidden(tmp_path) -> str:
    with open(os.path.join(ROOT, "jobs", "movielens_deepfm.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["model"].pop("hidden", None)  # left at the default list
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_best_yaml_of_a_searched_list_item_is_the_trials_job(tmp_path):
    spec = SearchSpec.model_validate({"name": "t", "base": _base_without_hidden(tmp_path), "strategy": "random", "num_samples": 2,
                                      "space": {"model.hidden.0": {"choice": [64, 512]}, "train.lr": {"loguniform": [1e-4, 1e-2]}}})
    raw = base_raw(spec, None)
    params = {"model.hidden.0": 512, "train.lr": 0.003}
    trial = job_from(raw, params)
    write_best_spec(raw, params, str(tmp_path / "best.yaml"), ["best"])
    best = load_spec(str(tmp_path / "best.yaml"), [])  # was: model.hidden: Input should be a valid list (got {'0': 512})
    assert best.model.hidden == trial.model.hidden and best.model.hidden[0] == 512 and len(best.model.hidden) > 1
    assert best.train.lr == 0.003


def _fp16_trainer(clip):
    import types

    import torch
    from torch import nn

    from rayload.train import checkpoint as ckpt
    from rayload.train.loop import Trainer

    torch.manual_seed(0)
    emb, lin = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
    t = Trainer.__new__(Trainer)  # _apply alone: the real GradScaler, AdamW and SparseAdam
    t.sparse_sync, t.schedulers, t.state = None, [], ckpt.TrainState()
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    t.spec = types.SimpleNamespace(train=types.SimpleNamespace(grad_clip=clip))
    t.optimizers = [torch.optim.AdamW(lin.parameters(), lr=0.1), torch.optim.SparseAdam([emb.weight], lr=0.1)]
    t._trained = [*lin.parameters(), emb.weight]

    def step(overflow: bool):
        t.scaler.scale(lin(emb(torch.tensor([1, 2]))).sum()).backward()
        if overflow:  # only the dense part overflows, as it does early in an fp16 run
            lin.weight.grad.fill_(float("inf"))
        t._apply()

    return t, emb, lin, step


def test_an_fp16_overflow_skips_the_sparse_tables_step_too():
    import pytest
    import torch

    for clip in (1.0, None):
        t, emb, lin, step = _fp16_trainer(clip)
        step(False)  # a normal step: both optimizers move, Adam's moments exist
        dense, table, scale = lin.weight.detach().clone(), emb.weight.detach().clone(), t.scaler.get_scale()
        step(True)
        assert t.scaler.get_scale() == scale / 2  # the overflow was seen: the scale drops
        assert torch.equal(lin.weight.detach(), dense)
        assert torch.equal(emb.weight.detach(), table), f"grad_clip={clip}: the sparse rows moved on a skipped step"
        step(False)  # and training goes on
        assert not torch.equal(emb.weight.detach(), table) and t.state.step == 3
        assert float(lin.weight.detach().sub(dense).abs().max()) == pytest.approx(0.1, rel=0.5)


def test_train_epochs_searched_under_a_scheduler_is_refused(tmp_path):
    from rayload.search_job import job_issues

    raw = {"name": "t", "base": _base_without_hidden(tmp_path), "strategy": "random", "num_samples": 2,
           "space": {"train.epochs": {"int": [2, 30]}}, "scheduler": {"kind": "asha"}}
    issues = job_issues(SearchSpec.model_validate(raw), None)
    assert [i.path for i in issues] == ["space.train.epochs"] and "scheduler: none" in issues[0].render()
    assert job_issues(SearchSpec.model_validate({**raw, "scheduler": "none"}), None) == []  # each trial trains what it drew


def test_the_default_concurrency_counts_each_trials_bundles_node_by_node():
    from rayload._tune_capacity import trials_that_fit

    two_workers = [{"CPU": 0.01}, {"CPU": 2}, {"CPU": 2}]  # a trial's own share, then its TorchTrainer's workers
    # 8 free CPUs on one node: 8 // 4 = 2 by totals, but two trials need 8.02 (the review's 2-worker case)
    assert trials_that_fit([{"CPU": 8}], two_workers, 10) == 1
    assert trials_that_fit([{"CPU": 8.02}], two_workers, 10) == 2
    # 3 + 3 CPUs on two nodes: 6 // 4 = 1 by totals, and a trial does fit (one worker per node)
    assert trials_that_fit([{"CPU": 3}, {"CPU": 3}], two_workers, 10) == 1
    # 1.5 CPUs on each of four nodes: 6 // 4 = 1 by totals, but no 2-CPU worker fits anywhere
    assert trials_that_fit([{"CPU": 1.5}] * 4, two_workers, 10) == 0
    assert trials_that_fit([{"CPU": 2, "GPU": 1}, {"CPU": 2}], [{"CPU": 1, "GPU": 1}], 10) == 1
    assert trials_that_fit([{"CPU": 16}], [{"CPU": 1}], 5) == 5  # never more than the search's trials
