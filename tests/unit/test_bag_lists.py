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


def test_a_jsonl_reader_without_the_schema_keeps_arrays_as_their_json_text():
    table, _ = parse_jsonl(b'{"t": ["a", "b"]}\n{"t": "c"}\n', ["t"], "f.jsonl")
    assert table.column("t").to_pylist() == ['["a", "b"]', "c"]
    table, _ = parse_jsonl(b'{"t": ["a", "b"]}\n{"t": "c"}\n', ["t"], "f.jsonl", {"t": "|"})
    assert table.column("t").to_pylist() == ["a|b", "c"]


@pytest.mark.parametrize("encode", ["vocab", "hash"])
def test_drift_counts_a_bag_sent_as_a_list_as_its_text(encode):
    features, _ = fit_features(frame(1500, seed=1), {"categorical": {"tags": {"encode": encode, "buckets": 32}}})
    bins = next(b for b in drift.bins_for(features) if b.feature == "tags")
    texts = frame(300, seed=4)["tags"].tolist() + ["", None]
    lists = [_as_list(t) for t in texts[:-2]] + [[], None]
    assert np.array_equal(bins.index(lists), bins.index(texts))
