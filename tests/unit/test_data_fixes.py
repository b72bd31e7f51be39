"""Data-plane defects: each test failed on the code before its fix."""

import pyarrow as pa
import pytest

from rayload.data.readers import parse_csv
from rayload.errors import DataError

NAMES = ["user", "price", "y"]


def test_a_quoted_newline_is_part_of_its_value_and_never_splits_a_row():
    data = b'user,price,y\nu1,1.5,1\n"New York\nNY",3.5,0\nu2,2.5,1\n'
    table, bad = parse_csv(data, NAMES, "f.csv")
    assert table.column("user").to_pylist() == ["u1", "New York\nNY", "u2"] and not bad
    # a row with a quoted newline and one column too many: quarantined, no half of it accepted
    data = b'user,price,y\nu1,1.5,1\nx,"New York\nNY",3.5,0\nu2,2.5,1\n'
    table, bad = parse_csv(data, NAMES, "f.csv")
    assert table.column("user").to_pylist() == ["u1", "u2"]
    assert all("NY" not in str(v) for v in table.column("price").to_pylist()) and len(bad) == 2
    # a stray quote in a column that is not declared still quarantines only its own line
    data = b"user,note,price,y\n" + b"".join(b"u%d,n,%d,1\n" % (i, i) for i in range(20))
    data = data.replace(b"u5,n,", b'u5,"n,')
    table, bad = parse_csv(data, NAMES, "f.csv")
    assert table.num_rows == 19 and len(bad) == 1 and bad[0][0] == 'u5,"n,5,1' and "line 7" in bad[0][1]


def test_every_csv_reason_names_the_physical_line_and_the_header_error_names_the_file():
    lines = [b"user,price,y"] + [b"user-number-%08d,%d.5,%d" % (i, i, i % 2) for i in range(200_000)]
    lines[150_001] = b"broken,row"  # line 150002, far past pyarrow's first block
    table, bad = parse_csv(b"\n".join(lines) + b"\n", NAMES, "big.csv")
    assert table.num_rows == 199_999 and bad == [("broken,row", "malformed CSV line 150002: expected 3 columns, got 2")]
    rows = [b"user,price,y"] + [b"u%d,%d.5,%d" % (i, i, i % 2) for i in range(20)]
    rows[3] = b"u\xff,1.0,1"  # line 4: not UTF-8
    rows[10] = b"short,row"  # line 11: still line 11 after line 4 is set aside
    rows[12] = b'"u9,9.5,1'  # line 13: a stray quote
    table, bad = parse_csv(b"\n".join(rows[:6] + [b"", b""] + rows[6:]) + b"\n", NAMES, "x.csv")  # and two blank lines
    assert [r.split(":")[0] for _, r in bad] == ["line 4 is not UTF-8 text (invalid start byte at byte 1)",
                                                  "malformed CSV line 13", "malformed CSV line 15"]
    assert table.num_rows == 17
    with pytest.raises(DataError, match="h.csv: the header line"):
        parse_csv(b"us\xffer,price,y\nu1,1,1\n", NAMES, "h.csv")


def test_an_error_in_a_ray_read_task_reaches_the_user_as_the_data_error_it_is():
    from ray.exceptions import RayTaskError

    from rayload.data.pipeline import user_error

    cause = DataError("/data/b.csv: declared columns ['user', 'price', 'y'] are not all in the CSV header: 'user,y'")
    wrapped = RayTaskError("map_batches", "Traceback ...", cause).as_instanceof_cause()
    try:
        raise RuntimeError("Ray Data stopped") from wrapped
    except RuntimeError as exc:
        found = user_error(exc)
    assert found is cause and "/data/b.csv" in str(found)
    assert user_error(RuntimeError("a bug")) is None


def test_an_empty_csv_shard_among_good_ones_gives_no_rows(tmp_path, monkeypatch):
    from rayload.data.pipeline import preprocess
    from rayload.spec import JobSpec

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.csv").write_text("")  # sorted first: the pre-check reads the next file
    (src / "b.csv").write_text("user,price,y\n" + "".join(f"u{i},{i}.5,{i % 2}\n" for i in range(60)))
    spec = JobSpec.model_validate({"name": "t", "data": {"source": {"kind": "csv", "path": str(src)},
                                   "columns": [{"name": "user", "role": "categorical"}, {"name": "price", "role": "numeric"}],
                                   "label": {"column": "y"}}})
    result = preprocess(spec, out=str(tmp_path / "out"), engine="local")
    assert result.counts["good"] == 60 and result.counts["quarantined"] == 0


def test_a_data_error_in_a_pass_comes_back_from_its_task_as_a_row_and_is_raised_on_the_driver():
    from rayload.data.pipeline import _guarded, raise_task_error

    def failing(batch, plan):
        raise DataError("/data/b.csv: declared columns ['price'] not found")

    rows = _guarded(failing, pa.table({"x": [1]}), plan=None).to_pylist()
    with pytest.raises(DataError, match="/data/b.csv: declared columns"):
        raise_task_error(rows)
    assert raise_task_error([{"split": "train"}]) == [{"split": "train"}]


def _spec(path, kind, columns=({"name": "user", "role": "categorical"}, {"name": "price", "role": "numeric"}), **sections):
    from rayload.spec import JobSpec

    return JobSpec.model_validate({"name": "t", "data": {"source": {"kind": kind, "path": str(path)}, "columns": list(columns),
                                   "label": {"column": "y"}}, **sections})


def test_an_optional_jsonl_column_absent_from_the_first_lines_is_not_refused(tmp_path, monkeypatch):
    import json

    from rayload.data.checks import check_data_schema
    from rayload.data.pipeline import preprocess

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"user": f"u{i}", "y": i % 2, **({"price": i + 0.5} if i >= 150 else {})}) + "\n"
                            for i in range(300)))
    result = preprocess(_spec(path, "jsonl"), out=str(tmp_path / "out"), engine="local")
    assert result.counts["good"] == 300
    # the label absent from a whole (small) file is still refused before anything runs
    small = tmp_path / "b.jsonl"
    small.write_text('{"user": "u1", "price": 1}\n')
    with pytest.raises(DataError, match=r"\['y'\] not found in .*b.jsonl"):
        check_data_schema(_spec(small, "jsonl"))


def test_a_csv_with_a_utf8_byte_order_mark_is_read(tmp_path, monkeypatch):
    from rayload.data.pipeline import preprocess

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    rows = "".join(f"u{i},{i}.5,{i % 2}\n" for i in range(60))
    path = tmp_path / "a.csv"
    path.write_bytes("\ufeffuser,price,y\n".encode() + rows.encode())
    assert preprocess(_spec(path, "csv"), out=str(tmp_path / "out"), engine="local").counts["good"] == 60
    # the record-by-record reader too (a stray quote sends the file there)
    table, bad = parse_csv("\ufeffuser,price,y\n".encode() + rows.encode() + b'"u,1,1\n', NAMES, "a.csv")
    assert table.num_rows == 60 and len(bad) == 1


def test_downsampling_under_a_group_split_decides_per_row_not_per_group(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from rayload.data.pipeline import preprocess

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    n = 4000
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"user": [f"u{i % 4}" for i in range(n)], "price": [float(i) for i in range(n)],
                             "y": [int(i % 10 == 0) for i in range(n)]}), path)
    spec = _spec(path, "parquet", split={"kind": "group", "group": "user", "train": 0.5, "val": 0.5, "test": 0.0, "seed": 0},
                 rebalance={"method": "downsample", "target_ratio": 1.0, "seed": 0})
    out = tmp_path / "out"
    result = preprocess(spec, out=str(out), engine="local")
    y = pq.read_table(out / "train").column("label").to_numpy()
    pos = result.counts["train_labels"]["1.0"]
    assert pos == (y == 1).sum() and 0.7 * pos < (y == 0).sum() < 1.3 * pos  # about as many negatives kept, not 0 or all


def test_a_decimal_parquet_column_is_numeric(tmp_path, monkeypatch):
    """Spark's and databases' Parquet exports write prices and rates as decimal128: read as the
    float64 every numeric feature is, not refused."""
    import decimal

    import pyarrow.parquet as pq

    from rayload.data.pipeline import preprocess

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    n = 120
    prices = pa.array([decimal.Decimal(f"{i}.25") for i in range(n)], pa.decimal128(10, 2))
    pq.write_table(pa.table({"user": [f"u{i % 7}" for i in range(n)], "price": prices, "y": [i % 2 for i in range(n)]}),
                   tmp_path / "a.parquet")
    result = preprocess(_spec(tmp_path / "a.parquet", "parquet"), out=str(tmp_path / "out"), engine="local")
    assert result.counts["good"] == n
    stats = next(s for s in result.features.numeric if s.name == "price").stats
    assert stats["min"] == pytest.approx(0.25) and stats["max"] == pytest.approx(n - 1 + 0.25)


@pytest.mark.parametrize("kind, write", [("csv", lambda df, f: df.to_csv(f, index=False)),
                                         ("jsonl", lambda df, f: df.to_json(f, orient="records", lines=True))])
def test_compressed_text_shards_in_a_folder_are_read_like_the_others(tmp_path, kind, write):
    """part-1.csv.gz beside part-0.csv was skipped without a word (read when named directly)."""
    import bz2
    import gzip

    from helpers import frame, job

    from rayload.data.pipeline import preprocess

    df = frame(300, seed=2)
    folder = tmp_path / "data"
    folder.mkdir()
    with open(folder / f"part-0.{kind}", "w") as f:
        write(df.iloc[:100], f)
    with gzip.open(folder / f"part-1.{kind}.gz", "wt") as f:
        write(df.iloc[100:200], f)
    with bz2.open(folder / f"part-2.{kind.upper()}.bz2", "wt") as f:
        write(df.iloc[200:], f)
    res = preprocess(job(str(folder), kind=kind), out=str(tmp_path / "out"), engine="local")
    assert res.counts["input"] == 300


def test_an_empty_or_cut_off_parquet_shard_is_named(tmp_path):
    """A 0-byte part file (a writer that died) raised Arrow's 'Parquet file size is 0 bytes',
    naming no file."""
    from helpers import frame, job

    from rayload.data.pipeline import preprocess

    folder = tmp_path / "data"
    folder.mkdir()
    frame(50, seed=1).to_parquet(folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"b\.parquet: not a readable Parquet file \(.*0 bytes.*\); remove it"):
        preprocess(job(str(folder)), out=str(tmp_path / "out"), engine="local")
    (folder / "b.parquet").write_bytes((folder / "a.parquet").read_bytes()[:100])
    with pytest.raises(DataError, match=r"b\.parquet: not a readable Parquet file"):
        preprocess(job(str(folder)), out=str(tmp_path / "out2"), engine="local")


def test_a_csv_file_without_a_header_line_is_named():
    """Old Mac \\r line ends (or a binary file named .csv) raised the csv module's error, naming no file."""
    import tempfile

    from helpers import job

    from rayload.data.checks import check_data_schema

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/old-mac.csv"
        with open(path, "w", newline="") as f:
            f.write("user,item,tags,price,age,label\ru1,3,a,1.5,30,1\r")
        with pytest.raises(DataError, match=r"old-mac\.csv: no CSV header line \(.*\); CSV lines end with"):
            check_data_schema(job(path, kind="csv"))


# ---------------------------------------------------------------- ingestion review (2026-11-27)


@pytest.mark.parametrize("name", ["a.jsonl", "z.jsonl"])
def test_a_bad_jsonl_shard_is_quarantined_whatever_it_is_called(tmp_path, monkeypatch, name):
    """Only the first file was checked: a truncated one-line shard stopped the job with "no JSON
    objects" when it sorted first and was quarantined when it sorted last; a small shard whose
    one row lacks the label (JSON writers leave null keys out) likewise."""
    import json

    from rayload.data.pipeline import preprocess

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "b.jsonl").write_text("".join(json.dumps({"user": f"u{i}", "price": i, "y": i % 2}) + "\n" for i in range(200)))
    (folder / name).write_text('{"user":"u1","price":1,"ts":17000\n')
    (folder / f"{name[0]}2.jsonl").write_text('{"user": "u1", "price": 1}\n')
    spec = _spec(folder, "jsonl")
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"max_bad_fraction": 0.1})})
    out = preprocess(spec, out=str(tmp_path / "out"), engine="local")
    assert (out.counts["good"], out.counts["quarantined"]) == (200, 2)


def test_jsonl_files_none_of_which_holds_an_object_or_the_label_are_refused_before_reading(tmp_path):
    from rayload.data.checks import check_data_schema

    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "a.jsonl").write_text("[1, 2]\n")
    (folder / "b.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match=r"a.jsonl: no JSON objects in the first lines"):
        check_data_schema(_spec(folder, "jsonl"))
    (folder / "c.jsonl").write_text('{"user": "u1", "price": 1}\n')
    with pytest.raises(DataError, match=r"\['y'\] not found in .*c.jsonl"):
        check_data_schema(_spec(folder, "jsonl"))
    (folder / "d.jsonl").write_text('{"user": "u1", "price": 1, "y": 0}\n')
    check_data_schema(_spec(folder, "jsonl"))


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_declared_column_named_twice_in_the_file_is_a_data_error_naming_it(tmp_path, kind):
    """A Parquet file (or the schema check of a CSV header) naming a column twice raised Arrow's
    KeyError: a traceback, exit 1, no file named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayload.data.checks import check_data_schema

    path = tmp_path / f"d.{kind}"
    if kind == "csv":
        path.write_text("user,price,user,y\nu1,1,u2,0\n")
    else:
        pq.write_table(pa.Table.from_arrays([pa.array(["u1"]), pa.array([1.0]), pa.array(["u2"]), pa.array([0])],
                                            names=["user", "price", "user", "y"]), path)
    with pytest.raises(DataError, match=r"d\.%s: .*\['user'\] more than once" % kind):
        check_data_schema(_spec(path, kind))


def test_a_csv_row_longer_than_arrows_block_is_read(tmp_path):
    """A 3 MB value straddled two of Arrow's blocks and stopped the whole file ("try to increase block size")."""
    data = b"user,price,y\n" + b"".join(b"u%d,%d,1\n" % (i, i) for i in range(1000)) + b"x" * 3_000_000 + b",5,0\nu,6,1\n"
    table, bad = parse_csv(data, NAMES, "a.csv")
    assert table.num_rows == 1002 and bad == [] and len(table.column("user")[1000].as_py()) == 3_000_000
    # quoted, spanning lines, beside a bad row: read record by record, past the csv module's field limit
    data = b"user,price,y\nu1,1,0\n\"" + b"x" * 1_500_000 + b"\n" + b"y" * 1_500_000 + b'",5,0\nshort,1\nu,6,1\n'
    table, bad = parse_csv(data, NAMES, "a.csv")
    assert table.num_rows == 3 and len(table.column("user")[1].as_py()) == 3_000_001
    assert [reason for _, reason in bad] == ["malformed CSV line 5: expected 3 columns, got 2"]


def test_the_bad_fraction_stop_names_each_examples_file_and_quarantined_rows_are_valid_json(tmp_path, monkeypatch):
    """The examples named a line but not its shard; a quarantined inf was written as Infinity,
    which JSON parsers other than Python's refuse."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayload.data.pipeline import preprocess

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "d"
    folder.mkdir()
    for name in ("a", "b"):
        (folder / f"{name}.csv").write_text("user,price,y\n" + "".join(f"u{i},{i},{i % 2}\n" for i in range(20)))
    (folder / "c.csv").write_text("user,price,y\nu1,1\nu2,2,0,9\n")
    with pytest.raises(DataError, match=r"examples:\n  - \S*c\.csv: malformed CSV line 2"):
        preprocess(_spec(folder, "csv"), out=str(tmp_path / "out"), engine="local")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"user": ["u1", "u2"] * 20, "price": [float("inf")] + [1.0] * 39, "y": [0, 1] * 20}), path)
    spec = _spec(path, "parquet")
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"max_bad_fraction": 0.5})})
    preprocess(spec, out=str(tmp_path / "out2"), engine="local")
    rows = pq.read_table(str(tmp_path / "out2" / "quarantine")).column("row").to_pylist()
    assert len(rows) == 1 and json.loads(rows[0], parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))["price"] == "inf"
