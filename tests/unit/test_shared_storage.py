"""Checkpoints on shared object storage: URIs built the way Ray Train names its checkpoints,
and checkpoint folders fetched from a real S3 endpoint (moto's server on loopback)."""

import os

import helpers
import pyarrow.fs as pafs
import pytest

from rayload.paths import is_remote, join_uri, localize, read_text, uri_for


def test_uris_keep_their_filesystem_options_after_the_path():
    base = "s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    assert join_uri(base, "job-1", "checkpoint_0") == "s3://bucket/runs/job-1/checkpoint_0?endpoint_override=127.0.0.1:9000&scheme=http"
    assert join_uri("s3://bucket/", "x") == "s3://bucket/x"
    assert join_uri("/data/runs", "job", "c") == "/data/runs/job/c"
    # Ray Train's Checkpoint.path on S3 is the bucket path without the scheme.
    assert uri_for(base, "bucket/runs/job-1/checkpoint_0") == "s3://bucket/runs/job-1/checkpoint_0?endpoint_override=127.0.0.1:9000&scheme=http"
    assert uri_for("gs://b/r", "b/r/j/c") == "gs://b/r/j/c"
    assert uri_for("/data/runs", "/data/runs/j/c") == "/data/runs/j/c"
    assert uri_for("hdfs://namenode:8020/runs", "/runs/j/c") == "hdfs://namenode:8020/runs/j/c"  # host-based: absolute paths
    assert is_remote(base) and is_remote("gs://b") and not is_remote("file:///x") and not is_remote("/x")


def test_a_checkpoint_on_s3_is_fetched_once_into_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    assert localize(str(tmp_path)) == str(tmp_path) and localize(f"file://{tmp_path}") == str(tmp_path)
    with helpers.s3_bucket() as bucket:
        fs, _ = pafs.FileSystem.from_uri(bucket)
        files = {"model.json": b'{"config": {}}', "model.pt": os.urandom(4096), "features.json": b"{}"}
        for name, data in files.items():
            with fs.open_output_stream(f"rayload/runs/job-1/checkpoint_0/{name}") as f:
                f.write(data)
        uri = join_uri(bucket, "runs", "job-1", "checkpoint_0")
        local = localize(uri)
        assert local.startswith(str(tmp_path / "cache")) and local.endswith(os.path.join("job-1", "checkpoint_0"))
        assert {n: open(os.path.join(local, n), "rb").read() for n in files} == files
        assert not [p for p in os.listdir(os.path.dirname(local)) if ".tmp-" in p]  # no half-finished copy left
        assert localize(uri) == local  # the finished copy is reused
        with fs.open_output_stream("rayload/runs/job-1/checkpoint_0/model.pt") as f:  # written again, same name
            f.write(b"new weights")
        again = localize(uri)
        assert again != local and open(os.path.join(again, "model.pt"), "rb").read() == b"new weights"
        with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
            localize(join_uri(bucket, "runs", "job-1", "missing"))


def test_one_small_file_is_read_from_s3_without_fetching_its_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "h.json").write_text("[1]")
    assert read_text(str(tmp_path / "h.json")) == "[1]" and read_text(f"file://{tmp_path}/h.json") == "[1]"
    with helpers.s3_bucket() as bucket:
        fs, _ = pafs.FileSystem.from_uri(bucket)
        with fs.open_output_stream("rayload/runs/job-1/checkpoint_0/history.json") as f:
            f.write(b'[{"epoch": 0}]')
        assert read_text(join_uri(bucket, "runs", "job-1", "checkpoint_0", "history.json")) == '[{"epoch": 0}]'
        assert not os.path.exists(tmp_path / "cache")  # nothing downloaded into the checkpoint cache
        with pytest.raises(FileNotFoundError, match="no file at"):
            read_text(join_uri(bucket, "runs", "job-1", "checkpoint_0", "train_state.pt"))


def test_an_object_key_that_leaves_the_checkpoint_folder_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    """A checkpoint on another party's bucket holding a key with ../ in it: the download joined
    the key's parts onto the local folder and wrote the file wherever they led."""
    import posixpath

    import boto3

    from rayload.errors import RayloadError

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    prefix = "/".join(f"d{i}" for i in range(12)) + "/job/ckpt"
    with helpers.s3_bucket() as bucket:
        fs, _ = pafs.FileSystem.from_uri(bucket)
        for name, data in {"model.json": b'{"config": {}}', "model.pt": b"w", "features.json": b"{}"}.items():
            with fs.open_output_stream(f"rayload/{prefix}/{name}") as f:
                f.write(data)
        port = bucket.split("endpoint_override=127.0.0.1:")[1].split("&")[0]
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
        # the copy is made in <cache>/checkpoints/<16 hex>/job/ckpt.tmp-XXXXXXXX/; x/ one deeper
        ups = len(os.path.join(str(tmp_path / "cache"), "checkpoints", "h" * 16, "job", "ckpt.tmp-x", "x").strip("/").split("/"))
        evil = f"{prefix}/x/" + "../" * ups + str(tmp_path).strip("/") + "/escaped.txt"
        for key in (evil, posixpath.normpath(evil)):  # listed under the checkpoint; what the client's normalised GET reads
            s3.put_object(Bucket="rayload", Key=key, Body=b"outside the cache")
        with pytest.raises(RayloadError, match=r"holds an object whose key leaves the folder"):
            localize(join_uri(bucket, *prefix.split("/")))
    assert not (tmp_path / "escaped.txt").exists()
    assert not [p for p, _, files in os.walk(tmp_path / "cache") for f in files]  # no partial copy kept either


def test_checkpoint_records_naming_a_path_outside_the_run_are_left_out(tmp_path):
    """The names in a run's checkpoint index (on object storage: another party's to write) were
    joined into the local run folder."""
    import json

    from rayload.train import record

    (tmp_path / "checkpoints.json").write_text(json.dumps([{"name": "epoch_0000", "metrics": {"epoch": 0}},
                                                           {"name": "../../elsewhere", "metrics": {"epoch": 1}}]))
    assert [e["name"] for e in record.entries(str(tmp_path))] == ["epoch_0000"]


def test_shards_written_to_object_storage_are_named_by_their_uris(tmp_path, monkeypatch):
    """A preprocess --out on object storage handed back its shards as the file system names them
    (bucket/out/val/part-...parquet, no scheme), read as local files that do not exist."""
    import pyarrow.parquet as pq

    from helpers import frame, job
    from rayload.data.pipeline import preprocess

    monkeypatch.setenv("RAYLOAD_HOME", str(tmp_path / "runs"))
    source = tmp_path / "events.csv"
    frame(300, seed=1).to_csv(source, index=False)
    with helpers.s3_bucket() as base:
        bucket, query = base.split("?", 1)
        out = f"{bucket}/out?{query}"
        fresh = preprocess(job(str(source), "csv"), out=out, engine="local")
        again = preprocess(job(str(source), "csv"), out=out, engine="local")
        assert again.cached and again.files == fresh.files
        for split in ("train", "val", "test"):
            rows = 0
            for uri in fresh.files[split]:
                assert uri.startswith(f"{bucket}/out/{split}/part-") and query in uri
                fs, where = pafs.FileSystem.from_uri(uri)
                rows += pq.read_table(where, filesystem=fs).num_rows
            assert rows == fresh.counts["split_rows"][split]
