"""Text shards and raw values that used to lose good rows or spell a value two ways."""

import json
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from rayload.data.readers import parse_csv, parse_jsonl
from rayload.data.validate import python_array
from rayload.errors import DataError


def test_a_stray_quote_quarantines_its_line_and_keeps_every_line_after_it():
    lines = [b"r%d,%d,1" % (i, i) for i in range(1000)]
    lines[950] = b'"r950,950,1'
    lines[970] = b'"r970,970,1'  # a second one in the lines parsed again
    table, bad = parse_csv(b"c,n,y\n" + b"\n".join(lines) + b"\n", ["c", "n", "y"], "f.csv")
    assert table.num_rows == 998 and len(bad) == 2
    assert [b[0] for b in bad] == ['"r950,950,1', '"r970,970,1'] and all("unterminated quote" in b[1] for b in bad)
    assert "malformed CSV line 952" in bad[0][1]  # the file's own line number (the header is line 1)
    assert set(table.column("c").to_pylist()) == {f"r{i}" for i in range(1000)} - {"r950", "r970"}
    # one stray quote alone: pyarrow reads it to the end of the file as one bad row
    table, bad = parse_csv(b"c,n,y\n" + b"\n".join(lines[:960]) + b"\n", ["c", "n", "y"], "f.csv")
    assert table.num_rows == 959 and len(bad) == 1
    # quoted commas still parse, and a clean file takes the fast path unchanged
    table, bad = parse_csv(b'c,n,y\n"a,b",1,0\nc,2,1\n', ["c", "n", "y"], "f.csv")
    assert table.column("c").to_pylist() == ["a,b", "c"] and not bad


def test_a_line_that_is_not_utf8_is_quarantined_and_the_others_kept():
    table, bad = parse_csv(b"c,y\na,1\nb\xff,0\nc,1\n", ["c", "y"], "f.csv")
    assert table.column("c").to_pylist() == ["a", "c"] and len(bad) == 1 and "line 3 is not UTF-8" in bad[0][1]
    table, bad = parse_jsonl(b'{"c": "a", "y": 1}\n{"c": "b\xff", "y": 0}\n{"c": "c", "y": 1}\n', ["c", "y"], "f.jsonl")
    assert table.column("c").to_pylist() == ["a", "c"] and len(bad) == 1 and "line 2 is not UTF-8" in bad[0][1]


def test_mixed_values_are_spelled_as_each_would_be_alone():
    assert python_array([True, "x"]).to_pylist() == ["true", "x"]
    assert python_array([3.0, "x", 2]).to_pylist() == ["3", "x", "2"]
    assert python_array([True]).cast("string").to_pylist() == ["true"]


def test_two_snapshots_of_the_same_users_keep_both_under_a_group_split(tmp_path, monkeypatch):
    """Shard files were named by the split key alone: two input files with the same users in the
    same order wrote the same names, and one day overwrote the other."""
    from rayload.data.pipeline import preprocess
    from rayload.spec import JobSpec

    monkeypatch.setenv("RAYLOAD_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for day in range(2):
        pd.DataFrame({"user": [f"u{i}" for i in range(50)], "x": rng.normal(size=50) + 10 * day,
                      "y": rng.integers(0, 2, 50)}).to_parquet(src / f"day{day}.parquet")
    spec = JobSpec.model_validate({"name": "t", "data": {"source": {"kind": "parquet", "path": str(src)},
                                   "columns": [{"name": "user", "role": "categorical"}, {"name": "x", "role": "numeric"}],
                                   "label": {"column": "y"}}, "split": {"kind": "group", "group": "user", "seed": 1},
                                   "features": {"numeric": {"x": {"scale": "none", "impute": "mean"}}}})
    result = preprocess(spec, out=str(tmp_path / "out"), engine="local")
    xs = np.concatenate([pq.read_table(f).column("x").to_numpy() for files in result.files.values() for f in files])
    assert len(xs) == 100 and int((xs > 5).sum()) == 50  # each day's 50 rows once
    assert all(len(set(files)) == len(files) for files in result.files.values())
    assert os.path.exists(tmp_path / "out")


def test_jsonl_values_are_read_as_serving_reads_them():
    """A JSONL column of mixed types fell back to str(): True -> "True", 3.0 -> "3.0", while a
    request (and a typed column) gives "true", "3": the served row missed the vocabulary."""
    from rayload.data.validate import validate_request

    rows = [{"c": 3.0, "y": 0}, {"c": True, "y": 1}, {"c": "x", "y": 0}, {"c": 7, "y": 1}, {"c": None, "y": 0},
            {"c": [1, "a"], "y": 1}, {"c": {"k": False}, "y": 0}]
    table, bad = parse_jsonl("\n".join(json.dumps(r) for r in rows).encode(), ["c", "y"], "f.jsonl")
    assert table.column("c").to_pylist() == ["3", "true", "x", "7", None]
    served = validate_request([{"c": r["c"]} for r in rows[:5]], [{"name": "c", "role": "categorical"}])
    assert served.column("c").to_pylist() == table.column("c").to_pylist()
    # a list or an object is no value of a one-valued column, on either path (validate.read_values)
    assert [reason.split(": ", 2)[2] for _, reason in bad] == [
        "a list is not a value of a single-valued column (lists: declare it multi_categorical)", "a JSON object is not a value"]
    for i in (5, 6):
        with pytest.raises(DataError, match=f"request row 1: c: {bad[i - 5][1].split(': ', 2)[2][:20]}"):
            validate_request([{"c": "x"}, {"c": rows[i]["c"]}], [{"name": "c", "role": "categorical"}])
    # each value is spelled as it is alone, whatever its neighbours
    assert [python_array([r["c"]]).cast("string")[0].as_py() for r in rows[:5]] == ["3", "true", "x", "7", None]


def test_jsonl_integer_past_int64_is_read_as_serving_reads_it():
    """OverflowError from pyarrow stopped the whole job; the request path reads it as a number."""
    from rayload.data.validate import Schema, validate_request, validate_table

    big = 10**22
    table, bad = parse_jsonl(b'{"x": 1, "y": 0}\n{"x": %d, "y": 1}\n' % big, ["x", "y"], "f.jsonl")
    assert not bad and table.column("x").to_pylist() == ["1", str(big)]
    schema = Schema(({"name": "x", "role": "numeric", "separator": "|", "required": False},),
                    {"column": "y", "task": "binary", "threshold": None, "domain": None})
    good, quarantined = validate_table(table, schema)
    assert quarantined.num_rows == 0 and good.column("x").to_pylist() == [1.0, 1e22]
    served = validate_request([{"x": 1}, {"x": big}], [{"name": "x", "role": "numeric"}])
    assert served.column("x").to_pylist() == good.column("x").to_pylist()
    table, bad = parse_jsonl(b'{"x": %d, "y": 1}\n' % big, ["x", "y"], "f.jsonl")  # alone in its file
    assert not bad and table.column("x").to_pylist() == [str(big)]


@pytest.mark.parametrize("tail", [b'2,"trunc\n', b'2,"trunc', b'2,"trunc\r\n'])
def test_a_csv_cut_off_inside_a_quoted_value_quarantines_its_last_record(tail):
    """pyarrow reads an unclosed quote on the last line to the end of the file: the right count of
    columns and of lines, so nothing sent the file to the record-by-record reader, and the cut
    value was a good row."""
    table, bad = parse_csv(b'id,text\n1,"hello"\n' + tail, ["id", "text"], "f.csv")
    assert table.to_pylist() == [{"id": "1", "text": "hello"}]
    assert len(bad) == 1 and bad[0][0] == '2,"trunc' and "line 3" in bad[0][1] and "unterminated quote" in bad[0][1]


def test_jsonl_keys_given_twice_are_quarantined_as_a_csv_header_is_refused():
    table, bad = parse_jsonl(b'{"id":1,"label":0,"label":1}\n{"id":2,"label":1,"note":"\\"label\\" twice"}\n{"id":3,"\xc3\xa9":1,"\\u00e9":2}\n',
                             ["id", "label", "\u00e9"], "f.jsonl")
    assert table.column("id").to_pylist() == [2]
    assert [b[1] for b in bad] == ["line 1 gives the key(s) ['label'] more than once; which value is meant is not clear",
                                  "line 3 gives the key(s) ['\u00e9'] more than once; which value is meant is not clear"]


def test_a_leading_blank_line_and_upper_case_extensions_are_read_and_a_mistyped_shard_is_named(tmp_path):
    """The schema check took line 1 as the header (empty) and refused a file the reader skips the
    blank line of; P6.CSV in a shard folder was skipped without a word; a mistyped column in one
    of three parquet shards was reported without the shard's name."""
    import pyarrow as pa

    from rayload.data.checks import check_data_schema
    from rayload.data.pipeline import preprocess
    from rayload.spec import JobSpec

    (tmp_path / "csv").mkdir()
    rows = "".join(f"{i},{i % 2}\n" for i in range(60))
    (tmp_path / "csv" / "a.csv").write_text("\nx,label\n" + rows)
    (tmp_path / "csv" / "B.CSV").write_text("x,label\n" + rows)

    def job(path, kind="csv"):
        return JobSpec.model_validate({"name": "t", "data": {"source": {"kind": kind, "path": str(path)},
                                                            "columns": [{"name": "x", "role": "numeric"}], "label": {"column": "label"}}})

    out = preprocess(job(tmp_path / "csv"), out=str(tmp_path / "pre"), engine="local")
    assert out.counts["input"] == 120 and out.counts["quarantined"] == 0
    (tmp_path / "pq").mkdir()
    for name in ("a", "b"):
        pq.write_table(pa.table({"x": [1.0, 2.0], "label": [0, 1]}), str(tmp_path / "pq" / f"{name}.parquet"))
    pq.write_table(pa.table({"x": [[1.0]], "label": [1]}), str(tmp_path / "pq" / "zz_bad.parquet"))
    with pytest.raises(DataError, match=r"zz_bad.parquet: column 'x' has type list"):
        check_data_schema(job(tmp_path / "pq", "parquet"))


@pytest.mark.parametrize("path, message", [("", "at least 1 character"), ([], "at least 1 item"), (["a.csv", " "], r"list\[constrained-str\]\.1\n  String should match pattern")])
def test_an_empty_source_path_is_a_spec_error(path, message):
    """[] failed in the reader (AttributeError on None); "" read every CSV under the working directory."""
    from rayload.spec import FileSource

    with pytest.raises(Exception, match=message):
        FileSource(kind="csv", path=path)


def test_jsonl_lines_end_at_newlines_and_a_line_nested_too_deep_is_quarantined():
    """splitlines() broke a line at a lone \\r (whitespace inside JSON): one line became two bad
    ones and every later line number was off by one; a line nested 1,200 deep raised
    RecursionError and stopped the whole job."""
    deep = b'{"a":' + b"[" * 1200 + b"]" * 1200 + b',"y":0}'
    data = b'{"a":1,\r"y":0}\r\n{"a":2,"y":1}\n' + deep + b'\n{"a":[1],"y":1}\n'
    table, bad = parse_jsonl(data, ["a", "y"], "f.jsonl")
    assert table.column("a").to_pylist() == [1, 2]
    assert [reason.split(":")[0] for _, reason in bad] == ["invalid JSON on line 3", "line 4"]
    assert bad[0][1] == "invalid JSON on line 3: nested too deeply"



def test_a_jsonl_file_whose_lines_hold_a_lone_cr_is_read_whole(tmp_path):
    """The schema pre-check still split the file's first lines at a lone \r and stopped the job
    with "no JSON objects in the first lines" before the reader, which reads them, ran."""
    from rayload.data.pipeline import preprocess
    from rayload.spec import JobSpec

    (tmp_path / "d.jsonl").write_bytes(b"".join(b'{"x":%d,\r"y":%d}\n' % (i, i % 2) for i in range(200)))
    spec = JobSpec.model_validate({"name": "t", "data": {"source": {"kind": "jsonl", "path": str(tmp_path / "d.jsonl")},
                                                        "columns": [{"name": "x", "role": "numeric"}], "label": {"column": "y"}}})
    out = preprocess(spec, out=str(tmp_path / "pre"), engine="local")
    assert (out.counts["good"], out.counts["quarantined"]) == (200, 0)


def test_a_csv_line_holding_an_empty_quoted_value_is_a_row():
    """A line `""` was taken for a blank line and dropped without a word (the record reader,
    which a ragged file takes); with one column it is a row of one empty value."""
    table, bad = parse_csv(b'a\n1\n""\n\n3\n', ["a"], "f.csv")
    assert table.column("a").to_pylist() == ["1", None, "3"] and bad == []
    table, bad = parse_csv(b'a,b\n1,2\n""\n3,4\n5\n', ["a", "b"], "f.csv")
    assert table.column("a").to_pylist() == ["1", "3"]
    assert [(text, reason) for text, reason in bad] == [('""', "malformed CSV line 3: expected 2 columns, got 1"),
                                                        ("5", "malformed CSV line 5: expected 2 columns, got 1")]


def test_reasons_are_counted_without_their_line_numbers_and_a_stop_after_the_write_shows_rows(tmp_path):
    """Each bad CSV line was its own reason (57 KB of counts and error for 1,000 ragged rows); the
    bad-fraction stop for rows the transform quarantined showed no example rows."""
    from rayload.data.pipeline import preprocess
    from rayload.spec import JobSpec

    def job(path, kind="csv", split=None, bad=0.5):
        return JobSpec.model_validate({"name": "t", "data": {"source": {"kind": kind, "path": str(path)}, "max_bad_fraction": bad,
                                                            "columns": [{"name": "x", "role": "numeric"}, {"name": "t", "role": "timestamp"}],
                                                            "label": {"column": "y"}}, **({"split": split} if split else {})})

    lines = ["x,t,y"] + [f"{i},{i},{i % 2}" if i % 2 else f"{i},{i},{i % 2},extra" for i in range(400)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    out = preprocess(job(tmp_path / "d.csv"), out=str(tmp_path / "pre"), engine="local")
    assert out.counts["reasons"] == {"malformed CSV line N: expected 3 columns, got 4": 200}
    quarantine = pq.read_table(str(tmp_path / "pre" / "quarantine")).column("reason").to_pylist()
    assert sorted(quarantine)[0].startswith("malformed CSV line 1") and len(set(quarantine)) == 200  # each row keeps its line
    # the last rows (temporal: test) are scaled past anything a model can score: quarantined by the transform
    lines = ["x,t,y"] + [f"{1e13 if i >= 380 else i % 7},{i},{i % 2}" for i in range(400)]
    (tmp_path / "far.csv").write_text("\n".join(lines) + "\n")
    split = {"kind": "temporal", "train": 0.8, "val": 0.1, "test": 0.1}
    with pytest.raises(DataError, match=r"20 of 400 rows .* are bad[\s\S]*examples:\n  - .*far.csv: x: ") as info:
        preprocess(job(tmp_path / "far.csv", split=split, bad=0.01), out=str(tmp_path / "pre2"), engine="local")
    assert str(info.value).count("\n  - ") == 3
