"""A relaunch under a run's name continues that run only with the spec and data it started
with (train/identity.py): the checkpoint's manifest.json is compared with the launch's, fields a
relaunch may change aside; anything else is refused, naming the run and each field old -> new."""

import json
import os

import pytest

import helpers
from rayload.errors import SpecError
from rayload.train import identity, trainer
from rayload.train.loop import Trainer, run
from _loop import MemorySession, features, job, table


def manifest(spec, data_hash="d1", cache_key="k1") -> dict:
    return {"spec": spec.model_dump(mode="json"), "data_hash": data_hash, "cache_key": cache_key}


def test_what_a_relaunch_may_change_is_not_a_change():
    base = helpers.job("/data/a.parquet", train={"epochs": 2, "lr": 0.01})
    relaunch = helpers.job("/moved/a.parquet", name="renamed",
                           train={"epochs": 9, "lr": 0.01, "max_failures": 3, "run_name": "nightly", "storage_path": "/ckpts",
                                  "keep_checkpoints": 5, "prefetch_batches": 4, "cache_dataset": False, "worker_cache_mb": 0},
                           resources={"workers": {"min": 1, "max": 4}, "cpus_per_worker": 2, "gpus_per_worker": 1,
                                      "placement_timeout_s": 5, "cpu_fallback": True, "accelerator_type": "L4"},
                           eval={"split": "val", "batch_size": 64, "calibration_bins": 20})  # the bins: how it is reported
    assert identity.changes(manifest(base), manifest(relaunch)) == []


def test_a_changed_spec_or_data_is_listed_field_by_field():
    base = helpers.job("/data/a.parquet", train={"lr": 0.01}, model={"hidden": [8]})
    other = helpers.job("/data/a.parquet", train={"lr": 0.5}, model={"hidden": [16]}, split={"seed": 3})
    assert identity.changes(manifest(base), manifest(other, data_hash="d2")) == [
        ("model.hidden", [8], [16]), ("split.seed", 0, 3), ("train.lr", 0.01, 0.5), ("data_hash", "d1", "d2")]
    assert identity.changes(manifest(base), {"spec": base.model_dump(mode="json")}) == []  # before preprocessing: the spec alone


def test_a_manifest_from_before_the_content_hash_is_compared_by_its_cache_key():
    spec = helpers.job("/data/a.parquet")
    old = {"spec": spec.model_dump(mode="json"), "data_hash": "k1"}  # data_hash held the cache key then
    assert identity.changes(old, manifest(spec, data_hash="d1", cache_key="k1")) == []
    assert identity.changes(old, manifest(spec, data_hash="d1", cache_key="k2")) == [("data_hash", "k1", "k2")]


def test_a_field_added_since_the_run_started_counts_as_its_default():
    spec = helpers.job("/data/a.parquet")
    old = manifest(spec)
    del old["spec"]["train"]["tf32"], old["spec"]["model"]["align"]
    assert identity.changes(old, manifest(spec)) == []


def test_the_refusal_names_the_run_each_field_and_the_way_out():
    base, other = helpers.job("/a.parquet", train={"lr": 0.01}), helpers.job("/a.parquet", train={"lr": 0.5})
    with pytest.raises(SpecError) as info:
        identity.check_same_run("nightly", "/runs/nightly/epoch_0001", manifest(base), manifest(other, data_hash="d2"))
    issues = {i.path: i.message for i in info.value.issues}
    assert issues["train.lr"].startswith("0.01 -> 0.5: run 'nightly' was trained with 0.01")
    assert issues["data_hash"].startswith("d1 -> d2: run 'nightly' was trained on other data")
    assert "use a new run name" in issues["train.run_name"] and "/runs/nightly/epoch_0001" in issues["train.run_name"]
    identity.check_same_run("nightly", "x", None, manifest(other))  # nothing to compare with
    identity.check_same_run("nightly", "x", {"epoch": 0}, manifest(other))


def test_a_restored_optimizer_keeps_this_specs_settings():
    """The checkpoint gives the optimizer's state; its lr (and the schedule's base) is the spec's."""
    import tempfile

    folder = tempfile.mkdtemp()
    first = MemorySession(table(1024, 0), table(512, 1), folder)
    run(job(epochs=1, lr=0.01, weight_decay=0.1), features(), first, {"train_rows": 1024, "manifest": {}})
    resumed = Trainer(job(epochs=2, lr=0.5, weight_decay=0.0), features(), MemorySession(table(16, 0), table(16, 1), folder), 4)
    resumed.restore(first.reports[-1][1])
    group = resumed.optimizers[0].param_groups[0]
    assert (group["lr"], group["initial_lr"], group["weight_decay"]) == (0.5, 0.5, 0.0)
    assert resumed.schedulers[0].base_lrs == [0.5] and resumed.optimizers[0].state  # the moments came back


def test_the_loop_refuses_to_resume_a_checkpoint_of_another_spec(tmp_path):
    spec = job(epochs=1, lr=0.01)
    first = MemorySession(table(512, 0), table(256, 1), str(tmp_path / "a"))
    run(spec, features(), first, {"train_rows": 512, "manifest": manifest(spec)})
    assert json.load(open(os.path.join(first.reports[-1][1], "manifest.json")))["spec"]["train"]["lr"] == 0.01
    other = job(epochs=2, lr=0.5)
    again = MemorySession(table(512, 0), table(256, 1), str(tmp_path / "b"))
    again.reports = list(first.reports)
    with pytest.raises(SpecError, match="train.lr: 0.01 -> 0.5"):
        run(other, features(), again, {"train_rows": 512, "manifest": manifest(other)})
    more = job(epochs=2, lr=0.01)  # more epochs: the same run
    out = run(more, features(), again, {"train_rows": 512, "manifest": manifest(more)})
    assert [h["epoch"] for h in out["history"]] == [0, 1]


def _run_folder(tmp_path, spec, data_hash="d1") -> str:
    """A run folder as an in-process launch leaves it: one checkpoint, its manifest, the index."""
    home = tmp_path / "ckpts" / "nightly"
    ckpt = home / "epoch_0000"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps(dict(manifest(spec, data_hash), epoch=0)))
    (home / "checkpoints.json").write_text(json.dumps([{"path": str(ckpt), "metrics": {"epoch": 0, "val_auc": 0.7}}]))
    return str(ckpt)


def test_fit_refuses_a_changed_spec_under_a_runs_name_before_preprocessing(no_ray, monkeypatch, tmp_path):
    monkeypatch.setattr(trainer, "preprocess", lambda *a, **k: pytest.fail("preprocessed a launch it must refuse"))
    train = {"run_name": "nightly", "storage_path": str(tmp_path / "ckpts")}
    _run_folder(tmp_path, helpers.job("/a.parquet", train={**train, "lr": 0.01}))
    with pytest.raises(SpecError) as info:
        trainer.fit(helpers.job("/a.parquet", train={**train, "lr": 0.5}))
    assert "run 'nightly'" in str(info.value) and "train.lr: 0.01 -> 0.5" in str(info.value)


def test_fit_refuses_other_data_under_a_finished_runs_name_once_it_is_prepared(no_ray, monkeypatch, tmp_path):
    train = {"run_name": "nightly", "storage_path": str(tmp_path / "ckpts"), "epochs": 1}
    spec = helpers.job("/a.parquet", train=train)
    _run_folder(tmp_path, spec)  # epoch 0 of 1: finished

    class Pre:
        data_hash, cache_key = "d2", "k2"

    monkeypatch.setattr(trainer, "preprocess", lambda *a, **k: Pre())
    monkeypatch.setattr(trainer, "loop_context", lambda spec, pre: {"manifest": trainer.manifest(spec, pre)})
    monkeypatch.setattr(trainer, "_fit_local", lambda *a, **k: pytest.fail("trained (or returned the old result) on other data"))
    with pytest.raises(SpecError, match=r"data_hash: d1 -> d2: run 'nightly' was trained on other data"):
        trainer.fit(spec)
