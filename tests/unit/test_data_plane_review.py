"""Data-plane review fixes (2026-11-27), in one process without Ray: split.group with a kind that
ignored it is refused; a quote inside an unquoted CSV value is read the same whatever the other
rows of its file; a header-only CSV without its newline has no rows; a declared column named
twice in a header is refused; two input files with the same rows keep both files' rows and
quarantines (the
train shard they share is listed once per file); synthetic-ctr settings its generator refuses are spec errors naming the field."""

import os

import pyarrow.parquet as pq
import pytest
import yaml

from helpers import COLUMNS, job
from rayload.data.pipeline import preprocess
from rayload.data.readers import parse_csv
from rayload.errors import DataError, SpecError
from rayload.spec import load_spec


@pytest.mark.parametrize("kind", ["random", "stratified"])
def test_a_group_with_a_kind_that_ignored_it_is_refused(tmp_path, kind):
    from rayload._spec_checks import check_job

    issues = check_job(job(str(tmp_path), split={"kind": kind, "group": "user"}))
    assert any(i.path == "split.group" and "only with kind: group" in i.render() for i in issues), issues
    issues = check_job(job(str(tmp_path), split={"kind": "group", "group": "user", "key": ["item"]}))
    assert any(i.path == "split.key" and "hashes the group column (user) alone" in i.render() for i in issues), issues
    assert check_job(job(str(tmp_path), split={"kind": "group", "group": "user"})) == []


def test_a_quote_inside_an_unquoted_value_reads_the_same_beside_a_bad_row():
    alone, bad_alone = parse_csv(b'user,y\n5" screen,1\nb,0\n', ["user", "y"], "f.csv")
    mixed, bad_mixed = parse_csv(b'user,y\n5" screen,1\nb,0\nc,0,extra\n10" tv,1\n', ["user", "y"], "g.csv")
    assert alone.column("user").to_pylist() == ['5" screen', "b"] and bad_alone == []
    assert mixed.column("user").to_pylist() == ['5" screen', "b", '10" tv'], bad_mixed
    assert [reason for _, reason in bad_mixed] == ["malformed CSV line 4: expected 2 columns, got 3"]
    # a quote that opens a value and never closes is still one bad line
    table, bad = parse_csv(b'user,y\na,"1\nb,0\n', ["user", "y"], "h.csv")
    assert table.column("user").to_pylist() == ["b"] and "line 2" in bad[0][1]


@pytest.mark.parametrize("data", [b"user,y", b"\xef\xbb\xbfuser,y", b"user,y\r"])
def test_a_header_only_csv_without_its_newline_has_no_rows(data):
    table, bad = parse_csv(data, ["user", "y"], "f.csv")
    assert table.num_rows == 0 and table.column_names == ["user", "y"] and bad == []


def test_a_declared_column_named_twice_in_the_header_is_refused_naming_file_and_column():
    with pytest.raises(DataError, match=r"f.csv: the CSV header names the column\(s\) \['user'\] more than once"):
        parse_csv(b"user,item,user,y\nalice,i1,bob,1\n", ["user", "item", "y"], "f.csv")
    table, _ = parse_csv(b"user,note,note,y\nalice,a,b,1\n", ["user", "y"], "f.csv")  # an undeclared column twice: not read
    assert table.column("user").to_pylist() == ["alice"]


def test_two_input_files_with_the_same_rows_keep_both_files_rows_and_quarantines(tmp_path):
    names = [c["name"] for c in COLUMNS] + ["y"]
    rows = [f"u{i},{i % 7},a|b,{i}.5,30,{1600000000 + i},{i % 2}" for i in range(300)] + ["u9,1,a,not-a-number,30,1600000009,1"]
    data = tmp_path / "data"
    data.mkdir()
    for day in ("day1.csv", "day2.csv"):
        (data / day).write_text("\n".join([",".join(names)] + rows) + "\n")
    res = preprocess(job(str(data), "csv", split={"kind": "random", "seed": 1}), out=str(tmp_path / "out"), engine="local")
    assert res.counts["good"] == 600 and res.counts["quarantined"] == 2
    written = sum(pq.read_table(f).num_rows for s in ("train", "val", "test") for f in res.files[s])
    assert written == 600 and res.counts["written"]["train"] + res.counts["written"]["val"] + res.counts["written"]["test"] == 600
    quarantine = pq.read_table(str(tmp_path / "out" / "quarantine")).to_pylist()
    assert sorted(os.path.basename(r["source"]) for r in quarantine) == ["day1.csv", "day2.csv"]
    assert len(res.files["quarantine"]) == len(set(res.files["quarantine"])) == 2
    # the same bytes: one train shard, listed (and so read) once per file
    assert len(res.files["train"]) == 2 * len(set(res.files["train"]))


@pytest.mark.parametrize("source, field, message", [
    ({"seed": -1}, "seed", "Input should be greater than or equal to 0"),
    ({"categorical": 2, "cardinalities": [10]}, "cardinalities", "one per categorical column: 2, got 1"),
    ({"categorical": 1, "cardinalities": [0]}, "cardinalities", r"each must be in \[1, 2\*\*32\)"),
    ({"numeric": 0, "categorical": 0}, "categorical", "numeric \\+ categorical must be > 0"),
])
def test_synthetic_settings_its_generator_refuses_are_spec_errors_naming_the_field(tmp_path, source, field, message):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"name": "s", "data": {"source": {"kind": "synthetic-ctr", **source}}}))
    with pytest.raises(SpecError, match=rf"data.source.{field}: {message}"):
        load_spec(str(tmp_path / "s.yaml"), [])
