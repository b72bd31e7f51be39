"""Ray Train on a local Ray: 2 gloo workers, recovery from worker failures, resumption, limits."""

import os
import statistics
import time

import pytest
import helpers

from rayload.errors import RayloadError
from rayload.spec import JobSpec
from rayload.data.pipeline import job_cache_key
from rayload.train.trainer import TrainingError, finished_run, fit

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def movielens_subset(ray_local, tmp_path_factory):
    """The first 30,000 MovieLens ratings as a Parquet file (the built-in source, materialised)."""
    folder = tmp_path_factory.mktemp("ml")
    return helpers.movielens_subset(folder, 30_000)


def job(path: str, **sections) -> JobSpec:
    """`helpers.movielens_job` with a seeded split and a wider DeepFM, two workers, two epochs;
    each of `sections` updates that section key by key."""
    base = {"split": {"seed": 0}, "model": {"embedding_dim": 8, "hidden": [32], "dropout": 0.0}}
    merged = {key: {**base.get(key, {}), **sections.get(key, {})} for key in {*base, *sections}}
    return helpers.movielens_job(path, "ml-subset", workers=2, epochs=2, **merged)


def test_worker_crash_restarts_group_from_last_checkpoint(movielens_subset, tmp_path, monkeypatch):
    """With sparse embedding tables (SparseAdam state and SparseGradSync's path in a real Ray
    Train group; the other 2-worker tests train dense tables) and the per-ID embedding prior
    (its ID counts cross to the workers with the loop's context, also after the restart)."""
    import ray

    def coordinators():  # every SplitCoordinator this Ray has seen, live or dead
        return sum(a["ActorClassName"] == "SplitCoordinator" for a in ray._private.state.actors().values())

    before = coordinators()
    marker = tmp_path / "crashed-once"
    # Mid-epoch, seconds after the epoch-0 checkpoint: Ray Train registers a reported
    # checkpoint asynchronously, so a crash right after report() can lose it.
    monkeypatch.setenv("RAYLOAD_FAULT", f"epoch=1,rank=1,batch=80,delay=5,marker={marker}")
    res = fit(job(movielens_subset, model={"sparse_embeddings": True},
                  train={"epochs": 2, "max_failures": 2, "batch_size": 128, "storage_path": str(tmp_path), "embedding_prior": 2.0}),
              evaluate_test=False)
    assert marker.exists()
    assert [h["epoch"] for h in res.history] == [0, 1]  # resumed at checkpoint epoch 0 + 1
    assert [h["restarts"] for h in res.history] == [0, 1]  # exactly one restart
    assert res.history[-1]["val_auc"] > 0.65, res.history
    # Both group starts read the parts split once in the driver (train/shards.py), no coordinator.
    assert coordinators() == before


def test_worker_failing_every_attempt_names_rank_and_error(movielens_subset, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLOAD_FAULT", "epoch=0,rank=1,always=1")
    with pytest.raises(TrainingError) as info:  # max_failures 1: the first run and one retry, then the error
        fit(job(movielens_subset, train={"max_failures": 1, "storage_path": str(tmp_path)}))
    msg = str(info.value)
    assert "rank 1" in msg and "injected failure at epoch 0 on rank 1" in msg and "train.max_failures" in msg


def test_relaunch_with_same_run_name_resumes_and_new_name_starts_fresh(movielens_subset, tmp_path):
    """The in-process path (one worker); tests/e2e/test_cli.py kills a two-worker Ray Train
    driver and relaunches it."""
    one = {"workers": 1}
    first = fit(job(movielens_subset, train={"epochs": 1, "run_name": "resume-me", "storage_path": str(tmp_path)}, resources=one),
                evaluate_test=False)
    again = fit(job(movielens_subset, train={"epochs": 2, "run_name": "resume-me", "storage_path": str(tmp_path)}, resources=one),
                evaluate_test=False)
    assert [h["epoch"] for h in again.history] == [0, 1] and again.history[-1]["restarts"] == 1
    # The whole record, samples_per_s included: resumed from the checkpoint, not trained again.
    assert again.history[0] == first.history[0]
    fresh = fit(job(movielens_subset, train={"epochs": 1, "run_name": "other", "storage_path": str(tmp_path)}, resources=one),
                evaluate_test=False)
    assert fresh.history[-1]["restarts"] == 0 and fresh.run_dir != again.run_dir


def test_a_relative_or_home_storage_path_names_one_absolute_folder_on_both_paths(movielens_subset, tmp_path, monkeypatch):
    """`ckpts` on the Ray Train path (pyarrow refused a relative path in the controller, after
    preprocessing) and `~/ckpts` in-process (it became a folder named `~`)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    small = {"hidden": [16]}
    on_ray = fit(job(movielens_subset, model=small, train={"epochs": 1, "storage_path": "ckpts", "run_name": "rel"},
                     resources={"workers": {"min": 1, "max": 1}}), evaluate_test=False)
    assert on_ray.checkpoint == str(tmp_path / "ckpts" / "rel" / "epoch_0000")
    here = fit(job(movielens_subset, model=small, train={"epochs": 1, "storage_path": "~/ckpts", "run_name": "home"},
                   resources={"workers": 1}), evaluate_test=False)
    assert here.checkpoint == str(tmp_path / "home" / "ckpts" / "home" / "epoch_0000")
    assert not (tmp_path / "~").exists()


def test_a_relaunch_with_another_worker_count_resumes_where_the_other_path_stopped(movielens_subset, tmp_path):
    """workers: 2 runs on Ray Train (checkpoint_manager_snapshot.json), workers: 1 in-process
    (checkpoints.json): each relaunch resumes from the other's latest checkpoint, never trains
    an epoch again, and never writes over a checkpoint."""
    def spec(epochs: int, workers: int = 1, lr: float = 0.005):
        return job(movielens_subset, model={"hidden": [16]}, resources={"workers": workers},
                   train={"epochs": epochs, "run_name": "switch", "storage_path": str(tmp_path), "keep_checkpoints": 3, "lr": lr})

    def launch(epochs: int, workers: int):
        return fit(spec(epochs, workers), evaluate_test=False)

    def answered_from_record(result, epochs: int) -> None:
        """finished_run reads what fit returned off the run's record, whichever path wrote it;
        an unfinished run, another spec or other data is left to fit."""
        key = job_cache_key(spec(epochs))
        done = finished_run(spec(epochs, workers=2), key)  # the worker count may change on a relaunch
        assert (done.checkpoint, done.metrics, done.history) == (result.checkpoint, result.metrics, result.history)
        assert finished_run(spec(epochs + 1), key) is None  # more epochs to train
        assert finished_run(spec(epochs, lr=0.01), key) is None and finished_run(spec(epochs), "other-data") is None

    def written(epoch: int) -> int:
        return os.stat(tmp_path / "switch" / f"epoch_{epoch:04d}" / "model.pt").st_mtime_ns

    on_ray = launch(1, 2)
    answered_from_record(on_ray, 1)
    first = written(0)
    here = launch(2, 1)
    answered_from_record(here, 2)
    assert [(h["epoch"], h["restarts"], h["world_size"]) for h in here.history] == [(0, 0, 2), (1, 1, 1)]
    assert here.history[0] == on_ray.history[0] and written(0) == first
    back = launch(3, 2)
    assert [(h["epoch"], h["restarts"], h["world_size"]) for h in back.history] == [(0, 0, 2), (1, 1, 1), (2, 2, 2)]
    assert back.history[:2] == here.history and written(0) == first
    assert sorted(n for n in os.listdir(tmp_path / "switch") if n.startswith("epoch_")) == ["epoch_0000", "epoch_0001", "epoch_0002"]
    assert back.checkpoint in {str(tmp_path / "switch" / f"epoch_{e:04d}") for e in range(3)}


def test_a_relaunch_under_a_runs_name_with_another_spec_or_other_data_is_refused(movielens_subset, tmp_path):
    """It went on from the old run's weights and optimizer (or failed in load_state_dict); a
    finished run relaunched on other data returned the old result."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from rayload.errors import SpecError

    def launch(path, **model):
        return fit(job(path, model={"hidden": [16], **model}, resources={"workers": 1},
                       train={"epochs": 1, "run_name": "nightly", "storage_path": str(tmp_path)}), evaluate_test=False)

    first = launch(movielens_subset)
    with pytest.raises(SpecError, match=r"model.hidden: \[16\] -> \[32\]: run 'nightly' was trained with \[16\]"):
        launch(movielens_subset, hidden=[32])
    table = pq.read_table(movielens_subset)
    other = str(tmp_path / "other.parquet")  # the same columns and IDs, other ratings
    pq.write_table(table.set_column(table.schema.get_field_index("rating"), "rating", pc.subtract(6.0, table["rating"])), other)
    with pytest.raises(SpecError, match=r"data_hash: \w+ -> \w+: run 'nightly' was trained on other data"):
        launch(other)
    copy = str(tmp_path / "copy.parquet")  # the same bytes elsewhere: the same run, finished
    pq.write_table(table, copy)
    assert launch(copy).checkpoint == first.checkpoint


def test_more_workers_than_the_cluster_has_is_refused_before_preprocessing(movielens_subset, tmp_path, monkeypatch):
    from rayload.train import trainer

    monkeypatch.setattr(trainer, "preprocess", lambda *a, **k: pytest.fail("preprocessed before the resource check"))
    with pytest.raises(RayloadError, match=r"3 worker\(s\) with CPU=1 each, but the cluster has CPU=2"):
        fit(job(movielens_subset, resources={"workers": 3}, train={"storage_path": str(tmp_path)}))


def test_a_one_worker_gpu_job_the_machine_cannot_hold_is_refused_in_process_too(movielens_subset, tmp_path):
    """One worker without an address trains in this process; it trained on the CPU without a
    word when the machine had no GPU for it."""
    spec = job(movielens_subset, resources={"workers": 1, "gpus_per_worker": 64}, train={"storage_path": str(tmp_path)})
    with pytest.raises(RayloadError, match=r"1 worker\(s\) with CPU=1, GPU=64 each, but the cluster has CPU=2, GPU=\d+ in total"):
        fit(spec)
    assert not os.listdir(tmp_path)


def test_two_gloo_workers_learn_elastically_with_what_the_cluster_holds(movielens_subset, tmp_path):
    """workers: {min: 1, max: 2} on a 2-CPU Ray starts 2 gloo workers, and they learn."""
    res = fit(job(movielens_subset, resources={"workers": {"min": 1, "max": 2}}, train={"storage_path": str(tmp_path)}))
    assert res.history[-1]["world_size"] == 2
    assert res.metrics["val_auc"] > 0.65 and res.test["auc"] > 0.65
    assert res.metrics["val_rows"] == res.preprocessed.counts["written"]["val"]  # exact, no dropped rows
    assert os.path.exists(os.path.join(res.checkpoint, "model.pt"))


def test_an_elastic_group_starts_with_fewer_workers_on_a_partly_busy_cluster(movielens_subset, tmp_path):
    """Another actor holds one of the 2 CPUs: {min: 1, max: 2} trains with 1 worker. Ray Train's
    elastic policy sized the group from the cluster's totals and timed out waiting for 2."""
    import ray

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self):
            return 1

    holder = Holder.remote()
    ray.get(holder.ping.remote())
    try:
        res = fit(job(movielens_subset, model={"hidden": [16]}, resources={"workers": {"min": 1, "max": 2}, "placement_timeout_s": 10},
                      train={"epochs": 1, "storage_path": str(tmp_path)}), evaluate_test=False)
    finally:
        ray.kill(holder)
    assert res.history[-1]["world_size"] == 1 and res.metrics["val_auc"] > 0.6


def test_kfold_reports_mean_and_std_over_folds(movielens_subset, tmp_path):
    from rayload.train.trainer import kfold

    spec = job(movielens_subset, resources={"workers": 1}, train={"epochs": 1, "storage_path": str(tmp_path)},
               model={"hidden": [16]})
    result = kfold(spec, 2)
    assert len(result.folds) == 2
    aucs = [f.metrics["val_auc"] for f in result.folds]
    # kfold's std is the sample standard deviation (ddof=1): for two folds, |a - b| / sqrt(2)
    assert result.mean["val_auc"] == pytest.approx(statistics.mean(aucs))
    assert result.std["val_auc"] == pytest.approx(statistics.stdev(aucs))
    # the best checkpoint of each fold on the test rows held out from every fold
    tests = [f.test["auc"] for f in result.folds]
    assert result.mean["test_auc"] == pytest.approx(sum(tests) / 2) and result.folds[0].test["rows"] == result.folds[1].test["rows"] > 0
    assert result.folds[0].preprocessed.out_dir != result.folds[1].preprocessed.out_dir  # a split per fold
    assert all(f.test["rows"] == f.preprocessed.counts["written"]["test"] for f in result.folds)  # the held-out test rows


def test_controller_env_polls_often_and_drops_the_preemption_watcher_only_where_one_node_holds_the_group(ray_local, monkeypatch):
    from rayload.spec import ResourcesSpec
    from rayload.train.trainer import _controller_env

    key, poll = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(poll, raising=False)
    res = ResourcesSpec(workers=2, placement_timeout_s=42)
    with _controller_env(res):  # the local 2-CPU Ray holds both workers
        assert os.environ[key] == "0" and os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "42.0"
        assert os.environ[poll] == "0.5"
    assert key not in os.environ and poll not in os.environ  # set for the one call only
    # more than the node has (3 workers, an elastic maximum of 3, a GPU): other nodes must join
    for bigger in (ResourcesSpec(workers=3), ResourcesSpec(workers={"min": 1, "max": 3}), ResourcesSpec(workers=1, gpus_per_worker=1)):
        with _controller_env(bigger):
            assert key not in os.environ
    monkeypatch.setenv(key, "1")
    monkeypatch.setenv(poll, "3")
    with _controller_env(res):
        assert os.environ[key] == "1" and os.environ[poll] == "3"  # the user's settings win


def _controller_killer(seconds: float):
    """Kill Ray Train's controller process with SIGKILL once its worker group is placed."""
    import signal
    import threading

    import ray
    from ray.util.placement_group import placement_group_table

    def kill():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [a for a in ray._private.state.actors().values() if a["ActorClassName"] == "TrainController" and a["State"] == "ALIVE"]
            if alive and any(i["state"] == "CREATED" for i in placement_group_table().values()):
                time.sleep(seconds)
                os.kill(alive[0]["Pid"], signal.SIGKILL)
                return

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_embedded_ray_runs_without_the_cleaner_and_a_dead_controllers_group_is_removed(ray_local, tmp_path):
    """The embedded Ray's TorchTrainer has no PlacementGroupCleaner (one process and a failing
    State API poll a second fewer); a controller killed mid-run leaves no placement group
    behind, so the next fit in this process places its workers."""
    import ray
    import ray.train
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.util.placement_group import placement_group_table

    from rayload.train.trainer import _placement_groups_removed_on_error, _trainer_class

    def sleeper(config):
        time.sleep(120)

    def noop(config):
        open(os.path.join(config["folder"], f"rank{ray.train.get_context().get_world_rank()}"), "w").close()

    def trainer(fn, name):
        return _trainer_class()(fn, train_loop_config={"folder": str(tmp_path)}, scaling_config=ray.train.ScalingConfig(num_workers=2),
                                run_config=ray.train.RunConfig(storage_path=str(tmp_path), name=name))

    first = trainer(sleeper, "killed")
    assert type(first).__name__ == "EmbeddedTorchTrainer"
    assert not any(isinstance(c, PlacementGroupCleanerCallback) for c in first._create_default_callbacks())
    killer = _controller_killer(1.0)
    with pytest.raises(ray.exceptions.RayActorError):
        with _placement_groups_removed_on_error():
            first.fit()
    killer.join(5)
    assert all(info["state"] == "REMOVED" for info in placement_group_table().values())
    with _placement_groups_removed_on_error():
        result = trainer(noop, "next").fit()
    assert result.error is None and (tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()


def test_validation_batches_are_the_same_from_local_shards_and_from_ray_data(movielens_subset, tmp_path):
    """Workers read local validation shards with pyarrow (no Ray Data read tasks) and remote
    ones through Ray Data: both give the same batches in the same order, so ranks striding
    over them gather every row once either way."""
    import numpy as np

    from rayload.data.pipeline import LocalShards, preprocess
    from rayload.train.loop import loader_options
    from rayload.train.local_session import LocalSession
    from rayload.train.trainer import training_datasets

    import pyarrow.parquet as pq

    table = pq.read_table(movielens_subset)
    parts = []
    for i in range(3):  # three input files: three shards per split
        parts.append(str(tmp_path / f"part-{i}.parquet"))
        pq.write_table(table.slice(i * 10_000, 10_000), parts[-1])
    # A training shuffle buffer must not shuffle validation (ranks would stride different orders).
    spec = job(movielens_subset, data={"source": {"kind": "parquet", "path": parts}}, train={"shuffle_buffer": 1000})
    pre = preprocess(spec)
    files = pre.files["val"]
    assert len(files) >= 2  # batches cross file boundaries
    datasets = training_datasets(pre, cache=False)
    # The training reads ask for no CPU, so their concurrency is bounded by the cluster's CPUs
    # instead (unbounded, an 80M-row split started 190 read processes at once and ran out of memory).
    import ray

    for ds in datasets.values():
        read_op = ds._logical_plan.dag
        assert read_op.ray_remote_args["num_cpus"] == 0
        assert read_op.compute.size == max(2, int(ray.cluster_resources()["CPU"])), read_op.compute

    def read(val_files):
        loader = dict(loader_options(spec, pre.features), val_files=val_files)
        session = LocalSession(loader, datasets, str(tmp_path / f"run{bool(val_files)}"), 1, "val_auc", "max")
        assert (session._local_val() is not None) == bool(val_files)
        batches = list(session.val_batches(997))
        return [len(b) for b in batches], np.concatenate([b.label.numpy() for b in batches]), np.concatenate([b.sparse.numpy() for b in batches])

    local, ray_data = read(files), read(None)
    assert local[0] == ray_data[0] and sum(local[0]) == pre.counts["written"]["val"]
    assert np.array_equal(local[1], ray_data[1]) and np.array_equal(local[2], ray_data[2])
    assert LocalShards.on_this_machine([*files, str(tmp_path / "gone.parquet")]) is None
    assert LocalShards.on_this_machine(["s3://bucket/val-0.parquet"]) is None


def test_materialised_training_rows_are_split_once_for_a_fixed_group_on_one_node(movielens_subset, tmp_path, caplog):
    """train/shards.py: equal, disjoint parts per rank from a split made before the group starts;
    Ray's streaming_split where that cannot be used (another group size, an elastic group, rows
    read from Parquet every epoch); the validation split is whole on every rank either way."""
    import copy
    import logging
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    import ray
    import ray.train
    from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator
    from ray.util.placement_group import placement_group, remove_placement_group

    from rayload.data.pipeline import preprocess
    from rayload.train.shards import PresplitDataConfig, ingest
    from rayload.train.trainer import training_datasets

    pre = preprocess(job(movielens_subset))
    datasets = training_datasets(pre)

    def rows(iterator):
        return Counter(repr(sorted(r.items())) for b in iterator.iter_batches(batch_format="pandas", batch_size=None)
                       for r in b.to_dict("records"))

    config, given = ingest(datasets, 2)
    assert isinstance(config, PresplitDataConfig) and given["val"] is datasets["val"]
    # Ray Train configures one dataset name at a time, in its DatasetManager actor.
    with caplog.at_level(logging.INFO, logger="rayload.train.shards"):
        ranks = config.configure({"train": given["train"]}, 2, None, None)
        vals = config.configure({"val": given["val"]}, 2, None, None)
    assert "streaming_split instead" not in caplog.text
    parts = [rows(r["train"]) for r in ranks]
    total = pre.counts["written"]["train"]
    assert sum(parts[0].values()) == sum(parts[1].values()) == total // 2  # equal, as DDP needs
    assert parts[0] + parts[1] <= rows(datasets["train"].iterator())  # disjoint: no row twice
    assert rows(given["train"].iterator()) == parts[0] + parts[1]  # the Trainer holds the parts, not a copy
    assert sum(rows(vals[1]["val"]).values()) == pre.counts["written"]["val"]  # val is not split
    # every rank keeps every 2nd val batch of the same ordered stream: Ray Train's ingest
    # defaults (preserve_order off) must not replace val's ordering
    assert config._resolve_execution_options("val").preserve_order
    assert not config._resolve_execution_options("train").preserve_order
    restarted = copy.deepcopy(config).configure({"train": given["train"]}, 2, None, None)  # a new group
    assert rows(restarted[1]["train"]) == parts[1]

    with caplog.at_level(logging.INFO, logger="rayload.train.shards"):
        other = config.configure({"train": given["train"]}, 3, None, None)  # another size: Ray's streaming split
    assert "split for 2 workers, the group has 3" in caplog.text
    assert all(isinstance(r["train"], StreamSplitDataIterator) for r in other)
    ray.kill(other[0]["train"]._coord_actor)
    for plain, _ in (ingest(datasets, (1, 2)), ingest(training_datasets(pre, cache=False), 2)):
        assert type(plain) is ray.train.DataConfig and plain._resolve_execution_options("val").preserve_order
    # Every CPU held (here by a placement group): the split's 1-CPU tasks could not run, so stream.
    held = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
    ray.get(held.ready(), timeout=60)
    pool = ThreadPoolExecutor(1)
    try:  # a split attempted anyway would wait for a CPU forever: fail in a minute instead
        busy, given_busy = pool.submit(ingest, datasets, 2).result(timeout=60)
        assert type(busy) is ray.train.DataConfig and given_busy is datasets
    finally:
        remove_placement_group(held)
        pool.shutdown(wait=False)
