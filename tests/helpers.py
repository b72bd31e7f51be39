"""Small data sets and spec builders shared by the tests."""

from __future__ import annotations

import contextlib
import os
import uuid

import numpy as np
import pandas as pd

from rayload.spec import JobSpec

COLUMNS = [
    {"name": "user", "role": "categorical"},
    {"name": "item", "role": "categorical"},
    {"name": "tags", "role": "multi_categorical", "separator": "|"},
    {"name": "price", "role": "numeric"},
    {"name": "age", "role": "numeric"},
    {"name": "ts", "role": "timestamp"},
]


def frame(n: int = 2000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    tags = ["a", "b", "c", "d", "e"]
    price = rng.lognormal(3, 1, n)
    price[rng.random(n) < 0.1] = np.nan
    age = rng.integers(18, 80, n).astype(float)
    age[rng.random(n) < 0.05] = np.nan
    user = rng.zipf(1.5, n) % 300
    return pd.DataFrame({
        "user": [f"u{u}" for u in user],
        "item": rng.integers(0, 50, n),
        "tags": ["|".join(rng.choice(tags, rng.integers(0, 4), replace=False)) for _ in range(n)],
        "price": price,
        "age": age,
        "ts": 1_600_000_000 + rng.integers(0, 10_000_000, n),
        "y": (rng.random(n) < 0.3).astype(int),
    })


def job(path: str, kind: str = "parquet", **sections) -> JobSpec:
    raw = {
        "name": "t",
        "data": {"source": {"kind": kind, "path": path}, "columns": COLUMNS, "label": {"column": "y"}},
        **sections,
    }
    return JobSpec.model_validate(raw)


MOVIELENS_COLUMNS = [{"name": "userId", "role": "categorical"}, {"name": "movieId", "role": "categorical"},
                     {"name": "genres", "role": "multi_categorical"}, {"name": "year", "role": "numeric"}]


def movielens_job(path: str, name: str, workers: int = 2, epochs: int = 1, **sections) -> JobSpec:
    """A tiny DeepFM on a MovieLens subset file (`movielens_subset`); each of `sections` updates
    that section of the spec, key by key (`train={"lr": 0.01}` keeps the other train fields)."""
    raw = {
        "name": name,
        "data": {"source": {"kind": "parquet", "path": path}, "columns": MOVIELENS_COLUMNS,
                 "label": {"column": "rating", "threshold": 4.0}},
        "model": {"name": "deepfm", "embedding_dim": 4, "hidden": [16]},
        "train": {"epochs": epochs, "batch_size": 512, "lr": 0.005},
        "resources": {"workers": workers},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return JobSpec.model_validate(raw)


def movielens_subset(folder, rows: int) -> str:
    """The first `rows` MovieLens ratings (the built-in source, materialised in the cache) as
    `folder`/subset.parquet; returns its path."""
    import pyarrow.parquet as pq

    from rayload.data.builtin import materialize
    from rayload.paths import cache_root

    source = JobSpec.model_validate({"name": "x", "data": {"source": {"kind": "movielens"}}}).data.source
    src = materialize(source, cache_root())[0]
    path = os.path.join(str(folder), "subset.parquet")
    pq.write_table(pq.read_table(src).slice(0, rows), path)
    return path


def prepared_features(folder, seed: int, name: str = "data"):
    """The features `preprocess` fits on `frame(600, seed)` (written to `folder`/`name`.parquet)."""
    from rayload.data.pipeline import preprocess

    src = folder / f"{name}.parquet"
    frame(600, seed=seed).to_parquet(src)
    return preprocess(job(str(src)), out=str(folder / f"prep-{name}"), engine="local").features


def tiny_checkpoint(path, features, seed: int) -> str:
    """An untrained tiny DeepFM (weights from `seed`) saved with `features` as a checkpoint at `path`."""
    import torch

    from rayload.models import InputShape, build_model
    from rayload.spec import ModelSpec
    from rayload.train import checkpoint as ckpt

    torch.manual_seed(seed)
    config = ModelSpec.model_validate({"name": "deepfm", "embedding_dim": 4, "hidden": [8]}).model_dump()
    model = build_model(config, InputShape.from_features(features))
    ckpt.save(str(path), model, features, config, {"state": ckpt.TrainState(), "optimizers": []}, {})
    return str(path)


FRAME_LABEL = {"column": "y", "task": "binary", "threshold": None, "domain": None}


def frame_schema():
    """The validation schema of `frame`'s columns, none of them required."""
    from rayload.data.validate import Schema

    return Schema(tuple(dict(c, required=False, separator=c.get("separator", "|")) for c in COLUMNS), FRAME_LABEL)


def fit_features(df: pd.DataFrame, features: dict, chunks: int = 1):
    """(fitted features, validated table) of a `frame`, its statistics gathered in `chunks` parts."""
    import pyarrow as pa

    from rayload._feature_fit import FitPlan, finalize, merge_stats, partial_stats
    from rayload.data.validate import validate_table
    from rayload.spec import FeatureSpec

    schema = frame_schema()
    good, bad = validate_table(pa.Table.from_pandas(df, preserve_index=False), schema)
    assert bad.num_rows == 0
    plan = FitPlan.from_spec(FeatureSpec.model_validate(features), schema)
    bounds = np.linspace(0, good.num_rows, chunks + 1).astype(int)
    parts = [partial_stats(good.slice(a, b - a), plan) for a, b in zip(bounds[:-1], bounds[1:])]
    return finalize(merge_stats(parts), plan), good


PG = os.environ.get("RAYLOAD_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@contextlib.contextmanager
def pg_database(prefix: str):
    """A fresh database on the machine's PostgreSQL for one test (its URL), dropped afterwards."""
    import sqlalchemy as sa

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield PG.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


@contextlib.contextmanager
def s3_bucket(bucket: str = "rayload"):
    """A real S3 endpoint on loopback (moto's server) with one bucket; yields the base URI of
    the bucket in the form pyarrow and Ray Train read (endpoint and scheme in the query).
    Credentials go to the environment, which Ray processes started afterwards inherit."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _, port = server.get_host_and_port()
        uri = f"s3://{bucket}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        fs, _ = pafs.FileSystem.from_uri(uri + "&allow_bucket_creation=true")
        fs.create_dir(bucket)
        yield uri
    finally:
        server.stop()
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


class JsonReplies:
    """A mixin for http.server handlers of stub servers: `_send(code, body)` answers with JSON
    bytes (or none) and the headers a client needs; request logging stays quiet."""

    def _send(self, code: int, body: bytes = b""):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

