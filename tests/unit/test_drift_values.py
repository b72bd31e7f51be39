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
