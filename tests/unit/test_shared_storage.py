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
