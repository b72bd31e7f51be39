"""train.storage_path (and RAYLOAD_STORAGE_PATH) is resolved once, before either training path
uses it: `~` expanded, a relative path made absolute, URIs as given."""

import os

from rayload.paths import shared_storage, storage_location


def test_a_local_storage_path_is_expanded_and_made_absolute_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert shared_storage("~/ckpts") == str(tmp_path / "home" / "ckpts")
    assert shared_storage("ckpts") == str(tmp_path / "ckpts")
    assert shared_storage("./a/../b") == str(tmp_path / "b")
    monkeypatch.setenv("RAYLOAD_STORAGE_PATH", "cluster-ckpts")  # the cluster's default, resolved the same way
    assert shared_storage(None) == str(tmp_path / "cluster-ckpts")


def test_storage_uris_are_left_as_given(monkeypatch):
    monkeypatch.delenv("RAYLOAD_STORAGE_PATH", raising=False)
    for uri in ("s3://bucket/runs?endpoint_override=host:9000", "gs://b/x", "file:///shared/runs", "file://relative"):
        assert shared_storage(uri) == uri
    assert shared_storage(None) is None and storage_location("") == ""
    assert os.path.isabs(storage_location("x"))
