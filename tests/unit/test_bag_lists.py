"""A multi_categorical (bag) value may be a list, as JSON and Parquet naturally hold one: a
request or JSONL line sending ["a", "b"], or a Parquet list column, reads as the text "a|b"
does (serving refused a list for a bag feature, a JSONL array became the single token
'["a", "b"]', a Parquet list column stopped the job). Drift counts a list as its text (no Ray)."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import fit_features, frame, job

from rayload.data.pipeline import preprocess
from rayload.data.readers import parse_jsonl
from rayload.data.validate import bag_values, join_bag
from rayload.errors import DataError
from rayload.serve import drift


def _as_list(text):
    return None if text is None else [t for t in text.split("|") if t]


def test_a_requests_bag_as_a_list_transforms_as_its_text():
    features, _ = fit_features(frame(1500, seed=1), {})
    rows = frame(40, seed=2).drop(columns=["y"]).to_dict("records")
    listed = [dict(r, tags=_as_list(r["tags"])) for r in rows]
    assert features.transform_rows(listed).equals(features.transform_rows(rows))
    odd = [{**rows[0], "tags": [1, True, 2.0, None, "", " a "]}, {**rows[0], "tags": []}]
    texts = [{**rows[0], "tags": "1|true|2| a "}, {**rows[0], "tags": ""}]
    assert features.transform_rows(odd).equals(features.transform_rows(texts))


def test_bag_values_and_join_bag_give_the_text_form():
    assert bag_values([["a", "b"], "c|d", None, [], [3, False, 1.0]], "|") == ["a|b", "c|d", None, None, "3|false|1"]
    column = pa.array([["a", "b"], None, [], ["x", None, ""], ["1", "2"]], pa.list_(pa.string()))
    assert join_bag(column, ";", "t").to_pylist() == ["a;b", None, None, "x", "1;2"]
    assert join_bag(pa.array([[1, 2], [3]], pa.large_list(pa.int64())), "|", "t").to_pylist() == ["1|2", "3"]
    with pytest.raises(DataError, match="lists of lists"):
        join_bag(pa.array([[["a"]]]), "|", "t")


def _files(tmp_path, df):
    """The frame as JSONL with tags as text and as arrays, and as Parquet with a list column."""
    text, listed = tmp_path / "text.jsonl", tmp_path / "listed.jsonl"
    records = df.to_dict("records")
    for r in records:
        r.update({k: None for k in ("price", "age") if r[k] != r[k]})
    text.write_text("".join(json.dumps(r) + "\n" for r in records))
    listed.write_text("".join(json.dumps(dict(r, tags=_as_list(r["tags"]))) + "\n" for r in records))
    table = pa.Table.from_pandas(df, preserve_index=False)
    table = table.set_column(table.schema.get_field_index("tags"), "tags",
                             pa.array([_as_list(t) for t in df["tags"]], pa.list_(pa.string())))
    pq.write_table(table, tmp_path / "listed.parquet")
    return str(text), str(listed), str(tmp_path / "listed.parquet")


def test_jsonl_arrays_and_a_parquet_list_column_preprocess_as_the_text_does(tmp_path):
    df = frame(1200, seed=3)
    text, listed, parquet = _files(tmp_path, df)
    runs = [preprocess(job(path, kind), out=str(tmp_path / f"pre-{i}"), engine="local")
            for i, (path, kind) in enumerate([(text, "jsonl"), (listed, "jsonl"), (parquet, "parquet")])]
    assert all(r.counts["good"] == 1200 for r in runs)
    tags = [next(c for c in r.features.categorical if c.name == "tags") for r in runs]
    assert tags[0].vocab == tags[1].vocab == tags[2].vocab and len(tags[0].vocab) == 5
    shards = [pa.concat_tables(pq.read_table(f) for f in r.files["train"]).column("tags").to_pylist() for r in runs]
    assert shards[0] == shards[1] == shards[2]


def test_a_jsonl_array_is_a_bag_only_where_the_column_is_one_elsewhere_its_line_is_quarantined():
    data = b'{"t": ["a", "b"]}\n{"t": "c"}\n{"t": {"k": 1}}\n{"t": [["a"], "b"]}\n'
    table, bad = parse_jsonl(data, ["t"], "f.jsonl")  # t takes one value: a list there was read as its JSON text
    assert table.column("t").to_pylist() == ["c"]
    assert [reason for _, reason in bad] == [
        "line 1: t: a list is not a value of a single-valued column (lists: declare it multi_categorical)",
        "line 3: t: a JSON object is not a value",
        "line 4: t: a list is not a value of a single-valued column (lists: declare it multi_categorical)"]
    assert bad[0][0] == '{"t": ["a", "b"]}'  # the line itself goes to quarantine
    table, bad = parse_jsonl(data, ["t"], "f.jsonl", {"t": "|"})
    assert table.column("t").to_pylist() == ["a|b", "c"]
    assert [reason for _, reason in bad] == ["line 3: t: a JSON object is not a value",
                                             "line 4: t: a multi_categorical value is a list of values or a text, not a list of lists or objects"]


def test_a_list_where_a_request_column_takes_one_value_is_refused_alone_or_beside_other_rows():
    """Alone, the list made the column a list column and the request a 422; batched beside a
    string (Serve batches different clients' requests) it was scored as the text '["a", "b"]'."""
    from rayload.data.validate import validate_request

    cols = [{"name": "city", "role": "categorical"}, {"name": "tags", "role": "multi_categorical", "separator": "|"}]
    why = "city: a list is not a value of a single-valued column (lists: declare it multi_categorical)"
    for rows, bad_row in ([{"city": ["a", "b"]}], 0), ([{"city": "c"}, {"city": ["a", "b"]}], 1), ([{"city": ["a"]}, {"city": "c"}], 0):
        with pytest.raises(DataError) as info:
            validate_request(rows, cols)
        assert str(info.value) == f"request row {bad_row}: {why}"
    with pytest.raises(DataError, match=r"request row 1: tags: a multi_categorical value is a list of values or a text, not a list of lists"):
        validate_request([{"city": "c", "tags": ["x"]}, {"city": "c", "tags": [["x"], "y"]}], cols)
    assert validate_request([{"city": "c", "tags": ["x", 1]}, {"city": 7, "tags": "y|z"}], cols).to_pylist() == [
        {"city": "c", "tags": "x|1"}, {"city": "7", "tags": "y|z"}]


def test_a_fixed_size_list_column_is_a_bag_too():
    column = pa.array([["a", "b"], ["c", None]], pa.list_(pa.string(), 2))
    assert join_bag(column, "|", "t").to_pylist() == ["a|b", "c"]


def test_a_null_list_with_values_behind_it_joins_as_missing():
    """Arrow may keep values behind a null list (flatten() skips them): the offsets then counted
    them and join_bag failed with an IndexError."""
    column = pa.ListArray.from_arrays(pa.array([0, 1, 3, 4], pa.int32()), pa.array(["a", "x", "y", "b"]), mask=pa.array([False, True, False]))
    assert join_bag(column, "|", "t").to_pylist() == ["a", None, "b"]
    assert join_bag(column.slice(1), "|", "t").to_pylist() == [None, "b"]


@pytest.mark.parametrize("encode", ["vocab", "hash"])
def test_drift_counts_a_bag_sent_as_a_list_as_its_text(encode):
    features, _ = fit_features(frame(1500, seed=1), {"categorical": {"tags": {"encode": encode, "buckets": 32}}})
    bins = next(b for b in drift.bins_for(features) if b.feature == "tags")
    texts = frame(300, seed=4)["tags"].tolist() + ["", None]
    lists = [_as_list(t) for t in texts[:-2]] + [[], None]
    assert np.array_equal(bins.index(lists), bins.index(texts))
