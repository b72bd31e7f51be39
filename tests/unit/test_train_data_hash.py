"""The data hash a checkpoint's manifest records is a digest of the prepared data's bytes,
computed once when the preprocessing cache entry is written: the same rows read from another
path (or a touched file) give the same hash, other rows another; the cache key stays beside it."""

import json
import os
import shutil

import pytest

from helpers import frame, job
from rayload.data import pipeline, result
from rayload.data.pipeline import load_result, preprocess


def _source(tmp_path, name: str, flip: bool = False) -> str:
    df = frame(600, seed=3)
    if flip:
        df["y"] = 1 - df["y"]
    path = tmp_path / name
    df.to_parquet(path)
    return str(path)


def _spec(path: str):
    return job(path, split={"kind": "random", "seed": 1, "key": ["user", "item", "ts"]})


def test_the_same_bytes_at_another_path_or_touched_give_the_same_data_hash(tmp_path):
    a = _source(tmp_path, "a.parquet")
    b = str(tmp_path / "copy" / "b.parquet")
    os.makedirs(os.path.dirname(b))
    shutil.copyfile(a, b)
    first, moved = preprocess(_spec(a), engine="local"), preprocess(_spec(b), engine="local")
    assert first.cache_key != moved.cache_key and first.out_dir != moved.out_dir  # two cache entries
    assert first.data_hash == moved.data_hash and len(first.data_hash) == 64
    os.utime(b, (1, 1))  # same bytes, another modification time: another cache key, the same data
    touched = preprocess(_spec(b), engine="local")
    assert touched.cache_key != moved.cache_key and touched.data_hash == first.data_hash
    other = preprocess(_spec(_source(tmp_path, "flipped.parquet", flip=True)), engine="local")
    assert other.data_hash != first.data_hash


def test_a_cache_hit_reads_the_digest_kept_with_the_entry_instead_of_hashing_again(tmp_path, monkeypatch):
    spec = _spec(_source(tmp_path, "a.parquet"))
    made = preprocess(spec, engine="local")
    assert json.load(open(os.path.join(made.out_dir, "summary.json")))["data_hash"] == made.data_hash

    def no_hashing(*args, **kwargs):
        raise AssertionError("hashed the shards again on a cache hit")

    monkeypatch.setattr(pipeline, "content_digest", no_hashing)
    monkeypatch.setattr(result, "content_digest", no_hashing)
    again = preprocess(spec, engine="local")
    assert again.cached and again.data_hash == made.data_hash


def test_an_entry_written_before_the_digest_was_kept_gets_it_once(tmp_path, monkeypatch):
    made = preprocess(_spec(_source(tmp_path, "a.parquet")), engine="local")
    summary_path = os.path.join(made.out_dir, "summary.json")
    summary = json.load(open(summary_path))
    del summary["data_hash"]
    json.dump(summary, open(summary_path, "w"))
    assert load_result(made.out_dir).data_hash == made.data_hash
    assert json.load(open(summary_path))["data_hash"] == made.data_hash


def test_the_manifest_keeps_the_content_hash_and_the_cache_key_apart(tmp_path):
    from rayload.train.trainer import manifest

    spec = _spec(_source(tmp_path, "a.parquet"))
    pre = preprocess(spec, engine="local")
    m = manifest(spec, pre)
    assert (m["data_hash"], m["cache_key"]) == (pre.data_hash, pre.cache_key)
    assert m["data_hash"] != m["cache_key"]


def test_the_digest_covers_every_split_and_the_fitted_features(tmp_path):
    pre = preprocess(_spec(_source(tmp_path, "a.parquet")), engine="local")
    features = open(os.path.join(pre.out_dir, "features.json")).read()
    assert result.content_digest(pre.out_dir, pre.files, features) == pre.data_hash
    assert result.content_digest(pre.out_dir, pre.files, features + " ") != pre.data_hash
    without_test = {k: v for k, v in pre.files.items() if k != "test"}
    assert pre.files.get("test") and result.content_digest(pre.out_dir, without_test, features) != pre.data_hash
    with pytest.raises(FileNotFoundError):
        result.content_digest(pre.out_dir, {"train": [pre.files["train"][0] + ".gone"]}, features)
