"""Preprocessing on a local Ray: MovieLens end to end, synthetic-ctr at 1M rows, layouts."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rayload
from helpers import frame, job
from rayload.data.pipeline import preprocess
from rayload.spec import JobSpec

pytestmark = pytest.mark.integration


def test_movielens_end_to_end(ray_local):
    # Every ID gets a vocabulary entry here (the shipped job keeps only frequent ones).
    spec = rayload.load_spec("jobs/movielens_deepfm.yaml", ["features.categorical.userId.min_count=1",
                                                            "features.categorical.movieId.min_count=2"])
    res = rayload.preprocess(spec)
    c = res.counts
    assert c["input"] == 100_004 and c["quarantined"] == 0
    assert sum(c["written"][s] for s in ("train", "val", "test")) == 100_004
    assert abs(c["written"]["train"] / 100_004 - spec.split.train) < 0.01
    f = res.features
    assert f.sparse_columns["userId"] == 671 + 2  # every user appears in train
    assert 3000 < f.sparse_columns["movieId"] <= 9066 + 2
    assert set(f.bag_columns) == {"genres"}
    assert {"year", "rated_year", "movie_age", "userId__te", "movieId__te_raw"} <= set(f.dense_columns)
    assert 0.4 < f.label.positive_rate < 0.6
    # Shards stream through Ray Data with the declared output columns.
    val = res.dataset("val")
    assert val.count() == c["written"]["val"]
    batch = next(iter(val.iter_batches(batch_size=256, batch_format="numpy")))
    assert set(batch) == {*f.dense_columns, "userId", "movieId", "genres", "label"}
    assert batch["year"].dtype == np.float32 and batch["userId"].dtype == np.int64
    # Served requests get exactly the training transform: re-derive val rows from the raw data.
    raw = pd.read_parquet(res_raw_path())
    sample = raw.sample(200, random_state=0)
    served = f.transform_rows(sample.to_dict("records"))
    good, _ = rayload_validate(spec, sample)
    assert served.drop(["label"] if "label" in served.column_names else []).equals(f.transform_table(good).drop(["label"]))
    again = rayload.preprocess(spec)
    assert again.cached and again.out_dir == res.out_dir


def res_raw_path():
    from rayload.paths import cache_root

    return f"{cache_root()}/builtin/movielens/ratings.parquet"


def rayload_validate(spec, df):
    from rayload.data.validate import Schema, validate_table

    return validate_table(pa.Table.from_pandas(df, preserve_index=False), Schema.from_spec(spec.data))


def test_ray_and_local_engines_write_the_same_rows_for_any_file_layout(ray_local, tmp_path):
    # 2,000 rows keep every batch under the quantile sketch size, so statistics are exact
    # and only float summation order may differ between layouts.
    df = frame(2000, seed=11)
    df.loc[[5, 1500], "price"] = np.inf  # quarantined: in p0 and p5 of the seven files
    one, many = tmp_path / "one", tmp_path / "many"
    one.mkdir(), many.mkdir()
    df.to_parquet(one / "all.parquet")
    for i, rows in enumerate(np.array_split(np.arange(len(df)), 7)):
        df.iloc[rows].to_parquet(many / f"p{i}.parquet")
    split = {"kind": "stratified", "seed": 3}
    runs = {
        "ray-one": preprocess(job(str(one), split=split), out=str(tmp_path / "o1")),
        "ray-many": preprocess(job(str(many), split=split), out=str(tmp_path / "o2")),
        "local-many": preprocess(job(str(many), split=split), out=str(tmp_path / "o3"), engine="local"),
    }

    def rows(res, split_name):
        t = pq.read_table(res.files[split_name]).to_pandas()
        t["tags"] = t["tags"].map(tuple)
        return t.sort_values(["user", "item", "tags", "label", "age", "price"]).reset_index(drop=True)

    ref = runs["ray-one"]
    # Quarantined rows name their own file (Ray Data's include_paths; the local engine's reader)
    sources = {name: sorted(pq.read_table(res.out_dir + "/quarantine").column("source").to_pylist()) for name, res in runs.items()}
    assert sources["ray-one"] == [str(one / "all.parquet")] * 2
    assert sources["ray-many"] == sources["local-many"] == [str(many / "p0.parquet"), str(many / "p5.parquet")]
    for name, res in runs.items():
        assert res.counts["quarantined"] == 2 and res.counts["written"] == ref.counts["written"], name
        assert res.features.categorical == ref.features.categorical, name
        for s in ("train", "val", "test"):
            pd.testing.assert_frame_equal(rows(res, s), rows(ref, s), rtol=1e-9)


def test_a_column_also_named_in_a_folder_keeps_its_own_values_on_both_engines(ray_local, tmp_path):
    """Ray Data's default hive partitioning replaced a column's values with a k=v folder's text
    (dt=2024-06-01/ lost every row's hour) on the ray engine only."""
    df = frame(400, seed=5)
    for i, rows in enumerate(np.array_split(np.arange(len(df)), 2)):
        folder = tmp_path / "data" / f"item=from-folder-{i}"
        folder.mkdir(parents=True)
        df.iloc[rows].to_parquet(folder / "part-0.parquet")
    spec = job(str(tmp_path / "data"))
    ray_run, local_run = preprocess(spec, out=str(tmp_path / "r")), preprocess(spec, out=str(tmp_path / "l"), engine="local")
    vocab = {c.name: c.vocab for c in ray_run.features.categorical}["item"]
    assert vocab and not any(v.startswith("from-folder") for v in vocab)
    assert ray_run.features.categorical == local_run.features.categorical and ray_run.data_hash == local_run.data_hash


def test_synthetic_ctr_one_million_rows(ray_local):
    spec = JobSpec.model_validate({
        "name": "synth1m",
        "data": {"source": {"kind": "synthetic-ctr", "rows": 1_000_000, "shard_rows": 125_000, "seed": 1}},
        "features": {"categorical": {f"C{i}": {"encode": "hash", "buckets": 10_000} for i in range(14, 27)}},
    })
    res = preprocess(spec)
    c = res.counts
    assert c["input"] == 1_000_000 and c["quarantined"] == 0
    assert sum(c["written"][s] for s in ("train", "val", "test")) == 1_000_000
    f = res.features
    assert len(f.dense_columns) == 13 and len(f.sparse_columns) == 26
    assert all(f.sparse_columns[f"C{i}"] == 10_000 for i in range(14, 27))
    assert 0.2 < f.label.positive_rate < 0.3
    # Heavy-tailed counts, z-scored: roughly zero mean and unit variance on train.
    train = res.dataset("train").select_columns(["I1", "I2"]).to_pandas()
    assert abs(train["I1"].mean()) < 0.01 and abs(train["I1"].std() - 1) < 0.01
