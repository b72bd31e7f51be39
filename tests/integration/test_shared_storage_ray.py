"""Training on a cluster's shared object storage (train.storage_path / RAYLOAD_STORAGE_PATH
set to s3://, as cluster.yaml does): in-process runs mirror their checkpoints to a real S3
endpoint (moto's server on loopback) and everything after training (history, test metrics,
compression, transfer, the pipeline's train stage) reads them by URI. Ray Train's workers
writing to the bucket: test_multinode_storage_ray.py, one worker per node."""

import json
import os
import re

import helpers
import pyarrow.fs as pafs
import pytest

import rayload
from rayload.errors import RayloadError
from rayload.paths import cache_root, join_uri
from rayload.paths import read_text as localize_text
from rayload.train.trainer import fit

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def subset(bucket, ray_local, tmp_path_factory):
    return helpers.movielens_subset(tmp_path_factory.mktemp("ml"), 20_000)


def job(path: str, workers: int = 2, epochs: int = 2, **train):
    return helpers.movielens_job(path, "ml-s3", workers, epochs, train=train)


def keys(bucket: str, prefix: str) -> set[str]:
    fs, _ = pafs.FileSystem.from_uri(bucket)
    return {i.path for i in fs.get_file_info(pafs.FileSelector(f"rayload/{prefix}", recursive=True, allow_not_found=True))}


def test_one_worker_in_process_trains_locally_then_uploads(bucket, subset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = fit(job(subset, workers=1, storage_path=join_uri(bucket, "solo"), run_name="one"), evaluate_test=False)
    assert res.run_dir == join_uri(bucket, "solo", "one") and res.checkpoint.startswith("s3://rayload/solo/one/epoch_000")
    name = res.checkpoint.partition("?")[0].removeprefix("s3://")
    assert f"{name}/model.pt" in keys(bucket, "solo")
    local = [d for d, _, files in os.walk(os.path.join(os.environ["RAYLOAD_HOME"], "train", "remote")) if os.path.basename(d) == "one"]
    assert len(local) == 1  # the local run a relaunch resumes, in a folder of this remote run's own
    assert not os.path.exists(tmp_path / "s3:")
    assert rayload.load_checkpoint(res.checkpoint).features.label.column == "rating"
    # The same run name on other storage is another run (a pipeline's stages all call theirs "run").
    fetched = os.path.join(cache_root(), "checkpoints")
    before_other = sorted(os.listdir(fetched)) if os.path.isdir(fetched) else []
    other = fit(job(subset, workers=1, epochs=1, storage_path=join_uri(bucket, "solo2"), run_name="one"))
    assert other.checkpoint.startswith("s3://rayload/solo2/one/") and [h["epoch"] for h in other.history] == [0]
    assert other.test["auc"] > 0.55  # evaluated from the copy it trained in: nothing was downloaded for it
    assert (sorted(os.listdir(fetched)) if os.path.isdir(fetched) else []) == before_other
    # The other readers of a checkpoint take the URI too: compression (its gate) and transfer learning.
    # The compressed copy goes back beside the original on the bucket, where any node's
    # serving replicas reach it; the filesystem options (the query) stay on its URI.
    small = rayload.compress(res.checkpoint, "int8", max_auc_drop=0.05)
    head, _, query = res.checkpoint.partition("?")
    assert small.checkpoint == f"{head}-int8?{query}", small.checkpoint
    uploaded = {k.rsplit("/", 1)[-1] for k in keys(bucket, head.split("/", 3)[3] + "-int8")}
    assert uploaded == {"model.pt", "model.json", "features.json", "manifest.json"}, uploaded
    served = rayload.load_checkpoint(small.checkpoint)  # fetched from the bucket as serving loads it
    assert served.manifest["compression"]["source"] == res.checkpoint  # provenance: the URI, not the cache copy
    assert served.manifest["compression"]["method"] == "int8"
    elsewhere = rayload.compress(res.checkpoint, "prune", amount=0.1, max_auc_drop=0.05, out=join_uri(bucket, "small"))
    assert elsewhere.checkpoint == join_uri(bucket, "small") and "rayload/small/model.pt" in keys(bucket, "small")
    with pytest.raises(RayloadError, match="is the checkpoint being compressed"):
        rayload.compress(res.checkpoint, "int8", out=res.checkpoint)
    warm = fit(job(subset, workers=1, epochs=1, init_from=res.checkpoint, freeze=["embeddings"], run_name="warm"), evaluate_test=False)
    before, after = rayload.load_checkpoint(res.checkpoint).model, rayload.load_checkpoint(warm.checkpoint).model
    frozen = [k for k in before.state_dict() if k.startswith("embed.")]
    assert frozen and all(before.state_dict()[k].equal(after.state_dict()[k]) for k in frozen)


def test_a_run_relaunched_on_another_machine_resumes_from_the_bucket(bucket, subset, tmp_path, monkeypatch):
    """In-process runs on object storage mirror each checkpoint as it is written: a relaunch
    with the same storage and run name on a machine whose disk has none of the run (another
    RAYLOAD_HOME here) fetches the latest checkpoint and goes on from the next epoch."""
    storage = join_uri(bucket, "roam")
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "machine-a"))
    first = fit(job(subset, workers=1, epochs=1, storage_path=storage, run_name="r", keep_checkpoints=1), evaluate_test=False)
    assert first.checkpoint.startswith("s3://rayload/roam/r/epoch_0000")
    assert "rayload/roam/r/checkpoints.json" in keys(bucket, "roam")
    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "machine-b"))
    second = fit(job(subset, workers=1, epochs=3, storage_path=storage, run_name="r", keep_checkpoints=1))
    assert [h["epoch"] for h in second.history] == [0, 1, 2] and second.test["auc"] > 0.55, second.test
    assert second.history[0] == first.history[0]  # epoch 0 was not trained again
    state = json.loads(localize_text(join_uri(storage, "r", "checkpoints.json")))
    # keep_checkpoints=1 on the bucket too: the best and the latest are left, and the index names them
    best = second.checkpoint.partition("?")[0].rsplit("/", 1)[-1]
    loaded = rayload.load_checkpoint(second.checkpoint)  # fetched from the bucket: the best epoch's own files
    assert best == f"epoch_{loaded.manifest['epoch']:04d}"
    assert loaded.manifest["metrics"] == second.metrics == second.history[loaded.manifest["epoch"]]
    names = {e["name"] for e in state}
    assert best in names and "epoch_0002" in names and len(names) <= 2
    assert {k.split("/")[3] for k in keys(bucket, "roam/r") if k.count("/") > 3} == names
    resumed = [h.get("restarts") for h in second.history]
    assert resumed[-1] == 1, second.history


def test_a_pipeline_train_stage_keeps_its_run_on_the_cluster_storage(bucket, subset, tmp_path, monkeypatch):
    """RAYLOAD_STORAGE_PATH (cluster.yaml sets it): the stage's run goes to
    <storage>/pipelines/<run id>/<stage>/run instead of the stage folder on the driver's disk,
    which a multi-node cluster's workers could not reach."""
    import yaml

    monkeypatch.setenv("RAYLOAD_STORAGE_PATH", join_uri(bucket, "shared"))
    path = tmp_path / "ml_s3.yaml"
    path.write_text(yaml.safe_dump(job(subset, workers=1).model_dump(mode="json", exclude_defaults=True)))
    out = rayload.run(str(path), run_id="nightly")
    assert out.ok, [(s.name, s.outcome) for s in out.stages]
    checkpoint = out.outputs("train")["checkpoint"]
    assert re.match(r"s3://rayload/shared/pipelines/nightly/train-[0-9a-f]{8}/run/epoch_000", checkpoint), checkpoint
    assert rayload.load_checkpoint(checkpoint).config["name"] == "deepfm"
    again = rayload.run(str(path), run_id="nightly")  # same inputs, same storage: skipped
    assert [s.outcome for s in again.stages] == ["skipped"] and again.outputs("train")["checkpoint"] == checkpoint
    monkeypatch.setenv("RAYLOAD_STORAGE_PATH", join_uri(bucket, "moved"))  # the run's place is an input
    moved = rayload.run(str(path), run_id="nightly")
    assert [s.outcome for s in moved.stages] == ["ok"]
    assert moved.outputs("train")["checkpoint"].startswith("s3://rayload/moved/pipelines/nightly/train-")
    # A forced re-run starts a new run (a new token): Ray Train never restores the old one's checkpoints.
    forced = rayload.run(str(path), run_id="nightly", force=("train",))
    old_run, new_run = (r.outputs("train")["checkpoint"].split("/run/")[0] for r in (moved, forced))
    assert [s.outcome for s in forced.stages] == ["ok"] and new_run != old_run


def test_a_file_uri_storage_is_a_folder_on_this_machine(subset, tmp_path, monkeypatch):
    """file:// names a local folder like its path: the run and a compressed copy land in that
    folder, not under a relative 'file:' directory of the working directory."""
    monkeypatch.chdir(tmp_path)
    where = tmp_path / "disk"
    res = fit(job(subset, workers=1, epochs=1, storage_path=f"file://{where}", run_name="f"), evaluate_test=False)
    assert res.checkpoint.startswith(str(where / "f" / "epoch_")), res.checkpoint
    small = rayload.compress(f"file://{res.checkpoint}", "int8", max_auc_drop=0.05)
    assert small.checkpoint == f"{res.checkpoint}-int8" and os.path.isfile(os.path.join(small.checkpoint, "model.pt"))
    assert not os.path.exists(tmp_path / "file:")


def test_shards_prepared_into_the_bucket_are_read_back_through_ray_data(bucket, ray_local, tmp_path, monkeypatch):
    """Named by URIs with the endpoint's query options, several shards of a split failed in Ray
    Data: it takes one file system from the first path and kept the query inside the later keys."""
    from helpers import frame
    from helpers import job as frame_job
    from rayload.data.pipeline import preprocess

    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    data = tmp_path / "in"
    data.mkdir()
    for i in range(2):  # one shard per input file and split
        frame(300, seed=i).to_csv(data / f"part-{i}.csv", index=False)
    base, query = bucket.split("?", 1)
    res = preprocess(frame_job(str(data), "csv"), out=f"{base}/prepared?{query}", engine="local")
    assert len(res.files["val"]) == 2
    for split in ("train", "val", "test"):
        assert res.dataset(split).count() == res.counts["split_rows"][split]
