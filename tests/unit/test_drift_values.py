"""Drift bins read a categorical value as the model's transform does (serving's
validate_request, then the vocabulary lookup): booleans, whole-number floats and mixed types
land in the bin of the ID the model gives them, never in a separate out-of-vocabulary bin."""

import numpy as np
import pytest

from rayload.data.validate import validate_request
from rayload.features import FIRST_ID, MISSING_ID, OOV_ID, CategoricalState, encode_ids
from rayload.serve import drift


def _state(name, vocab, multi=False):
    st = CategoricalState(name=name, encode="vocab", multi=multi, separator="|")
    st.vocab = vocab
    st.stats = {"count": 1000, "null_rate": 0.0, "coverage": 1.0, "top_values": vocab[:1], "top_shares": [0.5]}
    return st


def _model_ids(st, values):
    table = validate_request([{st.name: v} for v in values], [{"name": st.name, "role": "categorical"}])
    return encode_ids(st, table.column(st.name).chunk(0))


@pytest.mark.parametrize("vocab, values", [
    (["true", "false"], [True, False, None, True]),
    (["5", "6"], [5.0, 6.0, 7.0, None]),
    (["5", "6"], [5, 6, 8]),
    (["5", "6", "x"], [5, "6", "x", "y", None, ""]),  # mixed types: text, as serving reads them
])
@pytest.mark.parametrize("repeat", [1, 100])  # a request's worth (dict lookup) and a large batch (Arrow lookup)
def test_categorical_bins_agree_with_the_model_ids(vocab, values, repeat):
    values = values * repeat
    st = _state("c", vocab)
    b = drift._categorical_bins(st)
    ids = _model_ids(st, values)
    bins = b.index(values)
    oov, missing = len(b.labels) - 1, 0
    assert ((bins == oov) == (ids == OOV_ID)).all(), (bins, ids)
    assert ((bins == missing) == (ids == MISSING_ID)).all(), (bins, ids)
    known = [st.vocab[m - FIRST_ID] for m in ids if m >= FIRST_ID]
    assert [b.labels[i] for i, m in zip(bins, ids) if m >= FIRST_ID] == [v if v in b.top else "other (in vocabulary)" for v in known]


def test_boolean_traffic_from_the_training_distribution_is_not_flagged():
    b = drift._categorical_bins(_state("is_mobile", ["true", "false"]))
    counts = np.bincount(b.index([True, False] * 500), minlength=len(b.labels))
    row, = drift.report([b], {"counts": {"is_mobile": counts.tolist()}})
    assert row["oov_rate"] == 0.0 and not row["flagged"]


def test_bag_tokens_are_split_and_trimmed_as_the_model_reads_them():
    b = drift._categorical_bins(_state("tags", ["a", "b"], multi=True))
    labels = ["a", "other (in vocabulary)", "out of vocabulary", "a"]
    assert [b.labels[i] for i in b.index(["a| b", None, "", "c|a|"])] == labels
    assert [b.labels[i] for i in b.index(["a| b", None, "", "c|a|"] * 100)] == labels * 100


def test_missing_only_bins_count_blank_and_null_as_missing():
    st = CategoricalState(name="h", encode="hash", multi=False, separator="|")
    st.buckets, st.stats = 16, {"null_rate": 0.1}
    b = drift._categorical_bins(st)
    assert b.index([None, "", "x", 0, False]).tolist() == [0, 0, 1, 1, 1]



@pytest.mark.parametrize("encode, max_bag", [("vocab", 16), ("vocab", 2), ("hash", 16), ("onehot", 16)])
def test_counts_read_off_the_model_ids_equal_counts_of_the_raw_values(encode, max_bag):
    """A scorer hands drift the rows' transform too (serve/scorer.py): bins read off the IDs
    must count exactly what the raw values count: in and out of vocabulary, missing, mixed
    types, bags cut at max_bag (whose tokens past the cut still count), and a slice of a larger
    table (the A/B batch gives each arm its slice)."""
    from helpers import fit_features as fit, frame

    df = frame(800, seed=2)
    features, _ = fit(df, {"categorical": {c: {"encode": encode, "max_bag": max_bag, "top_k": 20} for c in ("user", "item", "tags")}})
    rows = [{k: r[k] for k in ("user", "item", "tags", "price", "age")} for r in frame(60, seed=9).to_dict("records")]
    rows[0].update(user=None, item="zz-unseen", tags="")  # missing, out of vocabulary, an empty bag
    rows[1].update(user="", item=True, tags=" a | b |c|d|e|a ")  # blank, a boolean, a bag past any max_bag
    rows[2].update(item=7.0, tags=None)  # a whole-number float reads as "7"
    for r in rows:
        r["price"] = None if r["price"] != r["price"] else r["price"]  # JSON has no NaN
        r["age"] = None if r["age"] != r["age"] else r["age"]
    table = features.transform_rows(rows)
    for start, n in [(0, 60), (0, 3), (5, 20), (59, 1)]:
        by_ids, by_raw = drift.DriftCounter(features), drift.DriftCounter(features)
        by_ids.observe(rows[start:start + n], table.slice(start, n))
        by_raw.observe(rows[start:start + n])
        assert by_ids.snapshot() == by_raw.snapshot(), (start, n)
    used = [b for b in drift.DriftCounter(features).bins.values() if b.ids]
    assert bool(used) == (encode == "vocab")  # the ID path ran where it applies


def test_a_value_on_a_numeric_edge_is_counted_in_the_bin_its_label_names():
    from rayload.features import NumericState

    st = NumericState("x", 0.0, None, None, False, "none")
    st.stats = {"count": 100, "null_rate": 0.0, "histogram": {"edges": [1.0, 2.0], "shares": [0.3, 0.3, 0.4]}}
    b = drift._numeric_bins(st)
    assert [b.labels[i] for i in b.index([0.5, 1.0, 1.5, 2.0, 9.0, None])] == ["< 1", ">= 1", ">= 1", ">= 2", ">= 2", "missing"]
