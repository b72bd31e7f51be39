"""The preprocessing passes end to end in one process (engine="local"), without Ray."""

import json

import numpy as np
import os

import pyarrow.parquet as pq
import pytest

from helpers import frame, job
from rayload.data.pipeline import load_result, preprocess
from rayload.errors import DataError


def write_sources(tmp_path, df):
    parquet = tmp_path / "pq"
    parquet.mkdir()
    half = len(df) // 2
    df.iloc[:half].to_parquet(parquet / "a.parquet")
    df.iloc[half:].to_parquet(parquet / "b.parquet")
    csv = tmp_path / "data.csv"
    df.to_csv(csv, index=False)
    jsonl = tmp_path / "data.jsonl"
    df.to_json(jsonl, orient="records", lines=True)
    return str(parquet), str(csv), str(jsonl)


def test_parquet_csv_and_jsonl_give_the_same_splits_and_features(tmp_path):
    df = frame(1200, seed=4)
    results = []
    for path, kind in zip(write_sources(tmp_path, df), ("parquet", "csv", "jsonl")):
        spec = job(path, kind, split={"kind": "random", "seed": 5, "key": ["user", "item", "ts"]})
        results.append(preprocess(spec, out=str(tmp_path / f"out-{kind}"), engine="local"))
    ref = results[0]
    assert ref.counts["good"] == 1200 and ref.counts["quarantined"] == 0
    for other in results[1:]:
        assert other.counts["split_rows"] == ref.counts["split_rows"]
        assert other.features.categorical == ref.features.categorical
        for a, b in zip(other.features.numeric, ref.features.numeric):
            assert a.offset == pytest.approx(b.offset) and a.divisor == pytest.approx(b.divisor)


def test_bad_rows_are_quarantined_and_conserved(tmp_path):
    lines = ["user,item,tags,price,age,ts,y"] + [f"u{i},{i % 7},a|b,{i}.5,30,{1600000000 + i},{i % 2}" for i in range(500)]
    lines[10] = "u9,1,a,not-a-number,30,1600000009,1"
    lines[20] = "u19,1,a,1.0,30"  # too few columns
    lines[30] = "u29,1,a,1.0,30,1600000029,7"  # label outside {0, 1}
    path = tmp_path / "d.csv"
    path.write_text("\n".join(lines) + "\n")
    res = preprocess(job(str(path), "csv"), out=str(tmp_path / "out"), engine="local")
    c = res.counts
    assert (c["input"], c["good"], c["quarantined"]) == (500, 497, 3)
    assert sum(c["written"][s] for s in ("train", "val", "test")) == 497
    q = pq.read_table(str(tmp_path / "out" / "quarantine")).to_pylist()
    reasons = sorted(r["reason"] for r in q)
    assert reasons[0].startswith("malformed CSV line") and "price: cannot parse as a number" in reasons
    assert all(r["source"] == str(path) for r in q)
    files = json.loads((tmp_path / "out" / "summary.json").read_text())["files"]
    assert set(files) == {"train", "val", "test", "quarantine"}


def test_too_many_bad_rows_stop_with_counts_and_examples(tmp_path):
    lines = ["user,item,tags,price,age,ts,y"] + [f"u{i},1,a,{'x' if i % 10 == 0 else i},30,{i},1" for i in range(100)]
    (tmp_path / "d.csv").write_text("\n".join(lines))
    with pytest.raises(DataError) as info:
        preprocess(job(str(tmp_path / "d.csv"), "csv"), out=str(tmp_path / "out"), engine="local")
    msg = str(info.value)
    assert "10 of 100 rows" in msg and "max_bad_fraction=0.01" in msg
    assert msg.count("price: cannot parse as a number: ") == 3


def test_second_run_reuses_shards_and_a_changed_spec_does_not(tmp_path):
    path = write_sources(tmp_path, frame(600))[0]
    first = preprocess(job(path), engine="local")
    again = preprocess(job(path), engine="local")
    assert again.cached and again.out_dir == first.out_dir and again.features == first.features
    changed = preprocess(job(path, split={"seed": 9}), engine="local")
    assert not changed.cached and changed.out_dir != first.out_dir
    assert load_result(first.out_dir).cache_key == first.cache_key


def test_missing_path_and_missing_column_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        preprocess(job(str(tmp_path / "nothing")), engine="local")
    df = frame(50).drop(columns=["age"])
    df.to_parquet(tmp_path / "x.parquet")
    with pytest.raises(DataError, match=r"\['age'\] not found"):
        preprocess(job(str(tmp_path / "x.parquet")), engine="local")


def test_glob_selects_files(tmp_path):
    df = frame(400)
    for i in range(4):
        df.iloc[i * 100:(i + 1) * 100].to_parquet(tmp_path / f"part-{i}.parquet")
    res = preprocess(job(str(tmp_path / "part-[01].parquet")), engine="local")
    assert res.counts["input"] == 200


def test_rebalance_and_class_weights_reach_the_output(tmp_path):
    path = write_sources(tmp_path, frame(3000))[0]
    down = preprocess(job(path, rebalance={"method": "downsample"}), engine="local")
    y = pq.read_table(down.files["train"]).column("label").to_numpy()
    assert abs(y.mean() - 0.5) < 0.05
    assert down.counts["written"]["val"] == down.counts["split_rows"]["val"]  # only train changes
    weighted = preprocess(job(path, rebalance={"method": "class_weights"}), engine="local")
    w = weighted.features.label.class_weights
    assert w["1.0"] > 1.0 > w["0.0"]


def test_filesystem_uris_for_source_glob_and_output(tmp_path):
    df = frame(300)
    (tmp_path / "in").mkdir()
    for i in range(3):
        df.iloc[i * 100:(i + 1) * 100].to_parquet(tmp_path / "in" / f"part-{i}.parquet")
    res = preprocess(job(f"file://{tmp_path}/in/part-*.parquet"), out=f"file://{tmp_path}/out", engine="local")
    assert res.counts["input"] == 300
    assert (tmp_path / "out" / "features.json").exists() and (tmp_path / "out" / "_SUCCESS").exists()
    assert load_result(f"file://{tmp_path}/out").cache_key == res.cache_key


def test_movielens_as_regression(tmp_path):
    from rayload.spec import JobSpec

    spec = JobSpec.model_validate({
        "name": "ml-reg",
        "data": {"source": {"kind": "movielens"}, "label": {"column": "rating", "task": "regression", "domain": [0.5, 5.0]}},
        "split": {"kind": "group", "group": "userId"},
    })
    res = preprocess(spec, engine="local")
    assert res.counts["input"] == 100_004 and res.counts["quarantined"] == 0
    y = pq.read_table(res.files["val"], columns=["label"]).column("label").to_numpy()
    assert set(np.unique(y)) <= {x / 2 for x in range(1, 11)} and len(np.unique(y)) == 10
    assert res.features.label.positive_rate is None


def test_local_shards_read_every_row_of_a_split_without_ray(tmp_path):
    """`batches(split)` on local shards: what evaluation and the compression gate read, every
    row once in file order, in batches of at most the size asked, and no Ray started."""
    import sys

    import pyarrow as pa

    from rayload.data.pipeline import LocalShards

    parquet, _, _ = write_sources(tmp_path, frame(1500, seed=6))
    res = preprocess(job(parquet, "parquet"), out=str(tmp_path / "out"), engine="local")
    for split in ("train", "val", "test"):
        shards = res.batches(split)
        assert isinstance(shards, LocalShards) and shards.files == res.files[split]
        tables = list(shards.iter_batches(batch_size=100))
        assert all(t.num_rows <= 100 for t in tables)
        assert pa.concat_tables(tables).equals(pa.concat_tables([pq.read_table(f) for f in res.files[split]]))
        assert sum(t.num_rows for t in tables) == res.counts["written"][split]
    with pytest.raises(ValueError, match="pyarrow tables only"):
        next(res.batches("val").iter_batches(batch_format="pandas"))
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


_SHARED_CACHE_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from helpers import job
from rayload.data.pipeline import preprocess
res = preprocess(job({path!r}), engine="local")
print(json.dumps({{"cached": res.cached, "out_dir": res.out_dir, "written": res.counts["written"]}}))
"""


def test_two_processes_sharing_one_cache_write_an_entry_once(tmp_path):
    """RAYLOAD_CACHE shared by two run folders: processes started together both get the entry,
    one writes it, the other waits on its lock and reuses it (no half-written shards)."""
    import subprocess
    import sys

    path = write_sources(tmp_path, frame(20_000, seed=2))[0]
    code = _SHARED_CACHE_RUN.format(tests=os.path.dirname(os.path.dirname(__file__)), path=path)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RAYLOAD_HOME=str(tmp_path / f"home{i}"), RAYLOAD_CACHE=str(tmp_path / "shared")))
             for i in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert sorted(o["cached"] for o in outs) == [False, True]
    assert outs[0]["out_dir"] == outs[1]["out_dir"] and outs[0]["out_dir"].startswith(str(tmp_path / "shared"))
    assert outs[0]["written"] == outs[1]["written"]
    entry = load_result(outs[0]["out_dir"])
    assert sum(pq.read_metadata(f).num_rows for split in ("train", "val", "test") for f in entry.files[split]) == 20_000
    assert not (tmp_path / "home0" / "cache").exists() and not (tmp_path / "home1" / "cache").exists()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the label sum, on purpose
def test_a_fit_that_features_json_cannot_hold_is_refused_before_any_shard(tmp_path):
    """features.json refused inf only after every shard was written."""
    df = frame(300, seed=6)
    df["price"] = np.resize([1.0, 2.0, 1e200], len(df))
    src = tmp_path / "src"
    src.mkdir()
    df.to_parquet(src / "a.parquet")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"features.numeric.price: .* overflow the scale=none transform"):
        preprocess(job(str(src), features={"numeric": {"price": {"scale": "none"}}}), out=str(out), engine="local")
    assert not list(out.rglob("*.parquet"))
    df["price"], df["y"] = 1.0, np.resize([1e308, 1.5e308], len(df))  # target statistics' label sums overflow
    df.to_parquet(src / "a.parquet")
    spec = job(str(src), features={"categorical": {"user": {"target_stats": True}}})
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"label": spec.data.label.model_copy(update={"task": "regression"})})})
    with pytest.raises(DataError, match=r"holds inf at target\.0\.[\w.]+ of features.json.*no shards were written"):
        preprocess(spec, out=str(out), engine="local")
    assert not list(out.rglob("*.parquet"))


def test_training_rows_are_written_in_a_seeded_order_not_the_input_order(tmp_path):
    """Inputs are often sorted (here by label and price): the first epoch streams the training
    shards as written, so their rows are written shuffled, the same way for the same seed."""
    df = frame(800, seed=6).sort_values(["y", "price"]).reset_index(drop=True)
    df.to_parquet(tmp_path / "sorted.parquet")
    spec = job(str(tmp_path / "sorted.parquet"), "parquet", split={"kind": "random", "seed": 3})
    ours = [preprocess(spec, out=str(tmp_path / f"out{i}"), engine="local") for i in range(2)]
    labels = [np.concatenate([pq.read_table(f).column("label").to_numpy() for f in r.files["train"]]) for r in ours]
    assert np.array_equal(labels[0], labels[1])  # deterministic
    first_half = labels[0][: len(labels[0]) // 2]
    assert 0.2 < first_half.mean() < 0.8 and 0.2 < labels[0].mean() < 0.8  # not all the 0s, then all the 1s
    val = np.concatenate([pq.read_table(f).column("label").to_numpy() for f in ours[0].files["val"]])
    assert (np.diff(val) >= 0).all()  # validation keeps its order: nothing shuffles what no one trains on


def test_parquet_quarantine_rows_name_their_file_and_a_data_column_named_path_is_kept(tmp_path):
    """Quarantined Parquet rows said "parquet" as their source; they now name the file (the
    reader adds each row's path, as Ray Data's include_paths does), unless the data has its
    own `path` column, which stays the data's."""
    df = frame(300, seed=2)
    df.loc[[3, 200], "price"] = np.inf
    folder = tmp_path / "pq"
    folder.mkdir()
    df.iloc[:150].to_parquet(folder / "a.parquet")
    df.iloc[150:].to_parquet(folder / "b.parquet")
    res = preprocess(job(str(folder)), out=str(tmp_path / "out"), engine="local")
    q = pq.read_table(str(tmp_path / "out" / "quarantine")).to_pylist()
    assert sorted(r["source"] for r in q) == [str(folder / "a.parquet"), str(folder / "b.parquet")]
    assert res.counts["quarantined"] == 2 and res.counts["good"] == 298
    from helpers import COLUMNS

    (folder / "a.parquet").unlink()
    df.iloc[150:].assign(path=[f"/shop/{i}" for i in range(150)]).to_parquet(folder / "b.parquet")
    own = job(str(folder), data={"source": {"kind": "parquet", "path": str(folder)}, "label": {"column": "y"},
                                 "columns": [*COLUMNS, {"name": "path", "role": "categorical"}]})
    res = preprocess(own, out=str(tmp_path / "own"), engine="local")
    assert "path" in res.features.sparse_columns and res.counts["quarantined"] == 1
    assert pq.read_table(str(tmp_path / "own" / "quarantine")).column("source").to_pylist() == ["parquet"]


def test_val_and_test_rows_scaled_past_what_a_model_scores_are_quarantined_with_the_feature_named(tmp_path):
    """A review found a test row with x = 1e39 written into the shard as inf (x fitted on small
    values, z-scored), which every model scored NaN, read as a diverged model; short of inf, a
    row at 1e30 scored 1.0 by an MLP and 0.0 by DLRM. The same values in a request get a 422."""
    import pandas as pd

    n = 100
    x = (np.arange(n) % 10).astype(float)
    x[85], x[95], x[96] = 1e30, 1e39, 1e6  # a val row, a test row (the latest times), and an ordinary large value
    src = tmp_path / "src"
    src.mkdir()
    pd.DataFrame({"x": x, "t": 1.6e9 + np.arange(n), "y": np.arange(n) % 2}).to_parquet(src / "p.parquet")
    raw = {"name": "t", "data": {"source": {"kind": "parquet", "path": str(src)},
                                 "columns": [{"name": "x", "role": "numeric"}, {"name": "t", "role": "timestamp"}],
                                 "label": {"column": "y"}, "max_bad_fraction": 0.05},
           "split": {"kind": "temporal"}, "features": {"numeric": {"x": {"scale": "zscore"}}}}
    from rayload.spec import JobSpec

    res = preprocess(JobSpec.model_validate(raw), out=str(tmp_path / "out"), engine="local")
    c = res.counts
    assert (c["input"], c["good"], c["quarantined"]) == (100, 98, 2)
    assert c["split_rows"] == {"train": 80, "val": 9, "test": 9} and c["written"] == {"train": 80, "val": 9, "test": 9, "quarantine": 2}
    q = pq.read_table(str(tmp_path / "out" / "quarantine")).to_pylist()
    assert sorted(json.loads(r["row"])["x"] for r in q) == [1e30, 1e39]
    assert all(r["reason"].startswith("x: a value not finite or past 1e+12 once scaled (scale=zscore): too far outside") for r in q)
    assert all(r["source"] == str(src / "p.parquet") for r in q)
    assert sum(c["reasons"].values()) == 2
    for split in ("val", "test"):
        values = pq.read_table(str(tmp_path / "out" / split)).column("x").to_numpy()
        assert np.isfinite(values).all() and len(values) == 9
    assert np.abs(pq.read_table(str(tmp_path / "out" / "test")).column("x").to_numpy()).max() > 1e4  # 1e6 kept
    # over data.max_bad_fraction, the job stops, as for rows refused by validation
    with pytest.raises(DataError, match=r"2 of 100 rows \(2.00%\) are bad, more than data.max_bad_fraction=0.01"):
        preprocess(JobSpec.model_validate({**raw, "data": {**raw["data"], "max_bad_fraction": 0.01}}), out=str(tmp_path / "o2"),
                   engine="local")
    # a request with either value is refused naming the row and the feature
    with pytest.raises(DataError, match=r"request row 1: x: the value 1e\+39 is inf once scaled \(scale=zscore\), past 1e\+12: too far"):
        res.features.transform_rows([{"x": 3.0}, {"x": 1e39}])
    assert res.features.transform_rows([{"x": 1e6}]).num_rows == 1


def _x_job(src, max_bad=0.5, split=None, **train):
    from rayload.spec import JobSpec

    return JobSpec.model_validate({"name": "t", "data": {"source": {"kind": "parquet", "path": str(src)},
                                                          "columns": [{"name": "x", "role": "numeric"}], "label": {"column": "y"},
                                                          "max_bad_fraction": max_bad},
                                   "split": split or {"kind": "random", "seed": 1}, **({"train": train} if train else {})})


def _x_source(folder, x):
    import pandas as pd

    folder.mkdir()
    pd.DataFrame({"x": x, "y": np.arange(len(x)) % 2}).to_parquet(folder / "p.parquet")
    return folder


def test_a_column_not_scaled_keeps_its_own_large_values(tmp_path):
    """`scale: none` over millisecond timestamps (~1.7e12): every val/test row was quarantined as
    far (past 1e12) and every request refused; the limit is 1,000 times the column's own largest
    transformed training value where that is more."""
    from rayload.spec import JobSpec

    x = 1.7e12 + np.arange(200) * 1000.0
    src = _x_source(tmp_path / "src", x)
    spec = JobSpec.model_validate({**_x_job(src).model_dump(), "features": {"numeric": {"x": {"scale": "none"}}}})
    res = preprocess(spec, out=str(tmp_path / "out"), engine="local")
    assert res.counts["quarantined"] == 0
    assert res.features.transform_rows([{"x": 1.8e12}]).column("x").to_pylist() == [pytest.approx(1.8e12, rel=1e-6)]
    with pytest.raises(DataError, match=r"request row 0: x: the value 1e\+17 is 1e\+17 once scaled \(scale=none\), past 1.7e\+15"):
        res.features.transform_rows([{"x": 1e17}])


def test_training_rows_scaled_by_another_fit_are_checked_too(tmp_path):
    """With train.init_from the rows are scaled by the checkpoint's fit, which never saw them: a
    training value of 1e39 was written as inf (this data's own fit only refuses values that
    overflow it) while the same value in val/test was quarantined."""
    import shutil

    first = preprocess(_x_job(_x_source(tmp_path / "a", (np.arange(200) % 10).astype(float))), out=str(tmp_path / "outa"),
                       engine="local")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(os.path.join(first.out_dir, "features.json"), ckpt / "features.json")
    x = (np.arange(200) % 10).astype(float)
    x[::7] = 1e39
    res = preprocess(_x_job(_x_source(tmp_path / "b", x), init_from=str(ckpt)), out=str(tmp_path / "outb"), engine="local")
    assert res.counts["quarantined"] == 29 and res.counts["written"]["quarantine"] == 29
    assert sum(res.counts["split_rows"].values()) == 171 and res.counts["written"]["train"] == res.counts["split_rows"]["train"]
    assert np.isfinite(pq.read_table(str(tmp_path / "outb" / "train")).column("x").to_numpy()).all()


def test_a_val_split_emptied_by_far_rows_is_reported(tmp_path, caplog):
    """The split checks ran before the write pass only: a val split whose every row was
    quarantined passed preprocessing without a word, and training failed later saying only that
    val had no rows."""
    import logging

    x = (np.arange(100) % 10).astype(float)
    x[80:90] = 1e30  # the val rows of a temporal split
    src = tmp_path / "src"
    import pandas as pd

    src.mkdir()
    pd.DataFrame({"x": x, "t": 1.6e9 + np.arange(100), "y": np.arange(100) % 2}).to_parquet(src / "p.parquet")
    from rayload.spec import JobSpec

    spec = JobSpec.model_validate({"name": "t", "data": {"source": {"kind": "parquet", "path": str(src)},
                                                          "columns": [{"name": "x", "role": "numeric"}, {"name": "t", "role": "timestamp"}],
                                                          "label": {"column": "y"}, "max_bad_fraction": 0.2}, "split": {"kind": "temporal"}})
    with caplog.at_level(logging.WARNING, logger="rayload"):
        res = preprocess(spec, out=str(tmp_path / "out"), engine="local")
    assert res.counts["split_rows"] == {"train": 80, "val": 0, "test": 10}
    assert any("the val split is empty although one was asked for" in r.getMessage() for r in caplog.records)


def test_a_timestamp_column_in_milliseconds_gives_the_calendar_parts_of_seconds(tmp_path):
    """The same instants as epoch seconds and as epoch milliseconds (unit: ms) fit the same
    derived features and transform a request alike; before `unit`, the milliseconds were read as
    seconds (every `hour` NaN) and no error said so."""
    from helpers import COLUMNS
    from rayload.spec import JobSpec

    df = frame(600, seed=3)
    df_ms = df.assign(ts=df["ts"] * 1000 + 250)
    fitted = {}
    for name, data, unit in (("s", df, {}), ("ms", df_ms, {"unit": "ms"})):
        path = tmp_path / f"{name}.parquet"
        data.to_parquet(path)
        columns = [dict(c, **unit) if c["name"] == "ts" else c for c in COLUMNS]
        spec = JobSpec.model_validate({"name": "t", "data": {"source": {"kind": "parquet", "path": str(path)}, "columns": columns,
                                                              "label": {"column": "y"}},
                                       "split": {"kind": "random", "key": ["user", "item", "price"]},  # rows split alike
                                       "features": {"derived": {"hour": {"source": "ts", "part": "hour"}}}})
        fitted[name] = preprocess(spec, out=str(tmp_path / f"out-{name}"), engine="local").features
    assert [c.get("unit") for c in fitted["ms"].columns if c["name"] == "ts"] == ["ms"]
    hour_s, hour_ms = (next(n for n in f.numeric if n.name == "hour") for f in fitted.values())
    assert hour_ms.offset == pytest.approx(hour_s.offset) and hour_ms.divisor == pytest.approx(hour_s.divisor)
    row = {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in df.iloc[0].to_dict().items() if k != "y"}
    row = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
    a = fitted["s"].transform_rows([row]).column("hour").to_pylist()
    b = fitted["ms"].transform_rows([dict(row, ts=row["ts"] * 1000 + 250)]).column("hour").to_pylist()
    assert a == b and not np.isnan(a[0])
    with pytest.raises(DataError, match="set unit: ms"):
        fitted["s"].transform_rows([dict(row, ts=row["ts"] * 1000)])


@pytest.mark.parametrize("split", [{"kind": "random", "key": ["user"]}, {"kind": "group", "group": "user"}])
def test_target_statistics_out_of_fold_are_real_values_when_the_split_keeps_users_whole(tmp_path, split):
    """Folds hashed the split key: with split.key [user] (or a group split by user) a user's rows
    all shared one fold, so out of fold every training row's user statistic was the prior, 0,
    while serving fed the real per-user values."""
    df = frame(2000, seed=5)
    df["y"] = (df["user"].str[1:].astype(int) % 3 == 0).astype(int)  # the label follows the user
    path = tmp_path / "d.parquet"
    df.to_parquet(path)
    spec = job(str(path), split=split, features={"categorical": {"user": {"target_stats": True}}})
    res = preprocess(spec, out=str(tmp_path / "out"), engine="local")
    train = pq.read_table(res.files["train"]).column("user__te").to_numpy()
    assert len(np.unique(train)) > 20 and np.abs(train).max() > 0.3
