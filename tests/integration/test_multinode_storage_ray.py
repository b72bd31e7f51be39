"""Checkpoint storage on a real two-node Ray cluster (two raylets on this machine, Ray's own
cluster_utils): a local folder is refused before anything trains, with the fix named; a
shared one is accepted; and two workers, one per node, train to object storage (a real S3
endpoint, moto's server) and the result is read back by URI."""

import os
import re
import socket

import helpers
import pyarrow.fs as pafs
import pytest
import yaml

import rayload
from rayload.errors import RayloadError
from rayload.paths import join_uri
from rayload.spec import JobSpec
from rayload.train.resources import alive_nodes, check_storage
from rayload.train.trainer import fit

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_nodes(bucket):
    import ray
    from ray.cluster_utils import Cluster

    # Redis holds 6379 on this machine. Not bind(0): its ports are in the kernel's ephemeral range,
    # where one of Ray's own random binds (the other pytest worker's Ray too) can take it first
    import random

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    port = next(p for p in random.sample(range(20000, 30000), 200) if free(p))
    # cluster_utils names its head in /tmp/ray/ray_current_cluster (and deletes that file when it
    # shuts down), which every other `ray.init()` on this machine would then join: the other
    # pytest worker's module Ray and the CLI's embedded Ray included. This cluster is reached by
    # its address only.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
        patch.setattr(ray._common.utils, "reset_ray_address", lambda *a, **k: None)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "gcs_server_port": port, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield cluster
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def subset(two_nodes, tmp_path_factory):
    """The data and the shard cache, declared as a mount every node reaches (the two raylets
    share this machine's disk)."""
    from rayload.paths import cache_root

    folder = tmp_path_factory.mktemp("ml")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYLOAD_SHARED_PATHS", os.pathsep.join([str(folder), cache_root()]))
        yield helpers.movielens_subset(folder, 20_000)


def test_data_on_this_machines_disk_only_is_refused_before_anything_runs(subset, tmp_path, monkeypatch):
    from rayload.data.pipeline import preprocess
    from rayload.errors import DataError

    monkeypatch.setenv("RAYLOAD_SHARED_PATHS", str(tmp_path))  # neither the data nor the cache
    with pytest.raises(DataError, match=r"the cluster has 2 nodes, but .*subset.parquet.* are on this machine's disk only.*RAYLOAD_CACHE"):
        preprocess(job(subset), out=str(tmp_path / "shards"))
    assert not os.path.exists(tmp_path / "shards")


def job(path: str, epochs: int = 1, **train) -> JobSpec:
    return helpers.movielens_job(path, "ml-nodes", 2, epochs, train=train)  # one 1-CPU worker per node


def test_a_local_folder_is_refused_with_the_fix_and_a_declared_shared_one_is_accepted(bucket, subset, tmp_path, monkeypatch):
    assert len(alive_nodes()) == 2
    with pytest.raises(RayloadError) as info:
        fit(job(subset, storage_path=str(tmp_path / "ckpts")))
    msg = str(info.value)
    assert "train.storage_path" in msg and "2 nodes" in msg and "RAYLOAD_STORAGE_PATH" in msg
    assert not os.path.exists(tmp_path / "ckpts")  # refused before training started
    with pytest.raises(RayloadError, match="is a local folder"):  # a file:// URI is no more shared than its path
        check_storage(f"file://{tmp_path / 'ckpts'}")
    base = tmp_path / "job.yaml"
    base.write_text(yaml.safe_dump(job(subset).model_dump(mode="json", exclude_defaults=True)))
    search = tmp_path / "search.yaml"
    search.write_text(yaml.safe_dump({"name": "s", "base": str(base), "space": {"train.lr": {"loguniform": [1e-3, 1e-2]}},
                                      "num_samples": 2}))
    with pytest.raises(RayloadError) as info:
        rayload.tune(str(search))
    assert "the search's run folder" in str(info.value) and "RAYLOAD_HOME" in str(info.value)
    monkeypatch.setenv("RAYLOAD_SHARED_PATHS", str(tmp_path))  # a mount every node reaches, declared
    check_storage(str(tmp_path / "ckpts"))
    check_storage(f"file://{tmp_path / 'ckpts'}")
    monkeypatch.setenv("RAYLOAD_SHARED_PATHS", "")  # nothing declared: the storage is refused before preprocessing reads anything
    with pytest.raises(RayloadError, match="is a local folder"):
        fit(job(subset, storage_path=str(tmp_path / "ckpts")))
    with pytest.raises(RayloadError, match="on this machine's disk only"):  # shared storage: then the local data is refused
        fit(job(subset, storage_path=join_uri(bucket, "refused")))


def test_two_workers_on_two_nodes_checkpoint_to_s3(bucket, subset, tmp_path, monkeypatch):
    """The workers write the checkpoints to the bucket, and everything after training (history,
    test metrics, loading, serving) reads them back by URI."""
    import numpy as np
    import ray

    from rayload.paths import localize
    from rayload.serve.scorer import Scorer

    monkeypatch.chdir(tmp_path)  # a storage URI joined as a local path would show up here as ./s3:
    storage = join_uri(bucket, "nodes")
    res = fit(job(subset, epochs=2, storage_path=storage, run_name="spread"))
    assert res.run_dir == join_uri(bucket, "nodes", "spread")
    assert res.checkpoint.startswith("s3://rayload/nodes/spread/") and res.checkpoint.endswith("?" + bucket.partition("?")[2])
    name = res.checkpoint.partition("?")[0].removeprefix("s3://")
    fs, _ = pafs.FileSystem.from_uri(bucket)
    written = {i.path for i in fs.get_file_info(pafs.FileSelector("rayload/nodes/spread", recursive=True))}
    assert {f"{name}/{f}" for f in ("model.pt", "train_state.pt", "features.json", "model.json", "manifest.json", "history.json")} <= written
    assert [h["epoch"] for h in res.history] == [0, 1] and res.test["auc"] > 0.6, (res.history, res.test)  # read back from S3
    assert not os.path.exists(tmp_path / "s3:")
    scorer = Scorer.load("a", res.checkpoint)  # what a Serve replica on any node does with the URI
    assert scorer.version.startswith(f"spread/{os.path.basename(name)}@")
    rows = [{"userId": 1, "movieId": 31, "genres": "Drama", "year": 1995}, {"userId": 7, "movieId": 1, "genres": "Comedy|Drama", "year": 1990}]
    assert rayload.load_checkpoint(res.checkpoint).manifest["spec"]["train"]["storage_path"] == storage
    np.testing.assert_allclose(scorer.score(rows), Scorer.load("b", localize(res.checkpoint)).score(rows), atol=1e-7)
    placed = {a["Address"]["NodeID"] for a in ray._private.state.actors().values() if a["ActorClassName"] == "RayTrainWorker"}
    assert len(placed) == 2  # one rank per node: neither could have read the other's local disk
    cleaners = [a for a in ray._private.state.actors().values() if a["ActorClassName"] == "PlacementGroupCleaner"]
    assert cleaners  # a joined cluster outlives this driver: Ray Train's own cleaner stays (train.trainer._trainer_class)
    assert rayload.load_checkpoint(res.checkpoint).config["name"] == "deepfm"


def test_a_search_keeps_its_trials_checkpoints_on_object_storage(bucket, subset, tmp_path, monkeypatch):
    """With RAYLOAD_STORAGE_PATH on object storage a search runs on nodes whose disks the driver
    cannot see: each trial uploads its checkpoints as it writes them and the study names them
    by URI; the driver's run folder (study, best.yaml, plots) stays local. (Which node a trial
    lands on is Tune's choice: a short trial's actor may be reused for the next one.)"""
    monkeypatch.setenv("RAYLOAD_STORAGE_PATH", join_uri(bucket, "searches"))
    base = tmp_path / "job.yaml"
    base.write_text(yaml.safe_dump(job(subset, epochs=2, keep_checkpoints=1).model_dump(mode="json", exclude_defaults=True)))
    search = tmp_path / "search.yaml"
    search.write_text(yaml.safe_dump({"name": "s3search", "base": str(base), "strategy": "random", "num_samples": 2,
                                      "max_concurrent": 2, "space": {"train.lr": {"loguniform": [1e-3, 1e-2]}}}))
    res = rayload.tune(str(search))
    assert res.counts() == {"complete": 2}
    root = re.match(rf"s3://rayload/searches/tune/{res.run_name}-[0-9a-f]{{8}}/trials/", res.trials[0]["checkpoint"])
    assert root and all(t["checkpoint"].startswith(root.group(0)) for t in res.trials), [t["checkpoint"] for t in res.trials]
    assert rayload.load_checkpoint(res.best["checkpoint"]).config["name"] == "deepfm"
    fs, _ = pafs.FileSystem.from_uri(bucket)
    for t in res.trials:  # train.keep_checkpoints holds on the bucket too: the older epoch was removed there
        folder = t["checkpoint"].partition("?")[0].removeprefix("s3://").rsplit("/", 1)[0]
        kept = [i.base_name for i in fs.get_file_info(pafs.FileSelector(folder)) if i.type == pafs.FileType.Directory]
        assert kept == [t["checkpoint"].partition("?")[0].rsplit("/", 1)[1]], kept
    assert os.path.exists(res.best_spec) and res.run_dir.startswith(os.environ["RAYLOAD_HOME"])


def test_a_two_worker_trial_reports_its_checkpoint_by_uri(bucket, subset, tmp_path, monkeypatch):
    """A trial that starts a TorchTrainer (one worker per node here): Ray Train writes the
    checkpoints to the bucket and the study gets their URI, not Ray's scheme-less path."""
    monkeypatch.setenv("RAYLOAD_STORAGE_PATH", join_uri(bucket, "searches"))
    base = tmp_path / "job.yaml"
    base.write_text(yaml.safe_dump(job(subset).model_dump(mode="json", exclude_defaults=True)))
    search = tmp_path / "search.yaml"
    search.write_text(yaml.safe_dump({"name": "wide", "base": str(base), "strategy": "random", "num_samples": 1,
                                      "trial_resources": {"workers": 2, "cpus_per_worker": 0.9},
                                      "space": {"train.lr": {"loguniform": [1e-3, 1e-2]}}}))
    res = rayload.tune(str(search))
    assert res.counts() == {"complete": 1}
    assert res.best["checkpoint"].startswith(f"s3://rayload/searches/tune/{res.run_name}-"), res.best["checkpoint"]
    assert rayload.load_checkpoint(res.best["checkpoint"]).config["name"] == "deepfm"
