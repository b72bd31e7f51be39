"""The categorical half of fitting the preprocessor (`_feature_fit`): value counts per batch,
their merge, and the final vocabulary or hash state, with the training shares drift
monitoring compares served traffic against (serve/drift.py)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import DataError
from .features import CategoricalState, split_bag
from .hashing import as_array
from .spec import CategoricalFeature

log = logging.getLogger(__name__)

TOP_SHARES = 20  # categorical values whose training share features.json keeps (drift monitoring)


def value_counts(column, multi: bool, sep: str) -> dict:
    values = as_array(column)
    nulls = values.null_count
    if multi:
        values = split_bag(CategoricalState(name="", encode="vocab", separator=sep), values).values
    counts = pc.value_counts(values.drop_null())
    return {"nulls": nulls, "counts": pa.table({"value": counts.field("values"), "count": counts.field("counts")})}


# A hash-encoded column has no vocabulary, and may have more distinct values than a vocabulary
# would keep: a batch hands on only its HEAVY most frequent values, with how many non-null values
# it counted and the count of the first value it left out (`slack`). Summed over batches, a
# value's count is then a lower bound off by at most the summed slack (Misra-Gries), which is
# enough to name the column's heavy hitters, the values drift monitoring bins (serve/drift.py).
HEAVY = 512


def heavy_counts(column) -> dict:
    part = value_counts(column, False, "|")
    counts = part["counts"]
    counted = int(pc.sum(counts.column("count")).as_py() or 0)
    slack = 0
    if counts.num_rows > HEAVY:
        order = pc.sort_indices(counts, sort_keys=[("count", "descending")])
        slack = int(counts.column("count")[order[HEAVY].as_py()].as_py())
        counts = counts.take(order[:HEAVY])
    return {**part, "counts": counts, "counted": counted, "slack": slack}


def merge_categorical(acc: dict, part: dict) -> None:
    acc["nulls"] += part["nulls"]
    for key in ("counted", "slack"):
        if key in acc:
            acc[key] += part[key]
    if acc.get("counts") is not None:
        acc["counts"].append(part["counts"])


def final_categorical(name: str, cfg: CategoricalFeature, multi: bool, sep: str, acc: dict, rows: int) -> CategoricalState:
    state = CategoricalState(name, cfg.encode, multi, sep, max_bag=cfg.max_bag)
    stats = {"count": rows, "null_rate": acc["nulls"] / max(rows, 1)}
    if cfg.encode == "hash":
        if acc.get("counts"):
            stats.update(_heavy_hitters(acc))
        state.buckets, state.stats = cfg.buckets, stats
        return state
    values, freq, order = _ranked(acc)
    keep = order[freq[order] >= cfg.min_count]
    if cfg.top_k is not None:
        keep = keep[: cfg.top_k]
    if cfg.encode == "onehot" and len(keep) > cfg.max_onehot:
        raise DataError(
            f"features.categorical.{name}: encode=onehot allows at most max_onehot={cfg.max_onehot} values, "
            f"the training split has {len(keep)}; use encode: vocab or hash, set top_k, or raise max_onehot"
        )
    state.vocab = [str(v) for v in values[keep]]
    _warn_float_text(name, state.vocab)
    total = float(freq.sum())
    stats.update({"distinct": int(len(values)), "vocab_size": len(state.vocab), "coverage": float(freq[keep].sum() / total) if total else 0.0})
    # The share of fresh values the training split never saw (Good-Turing: the share of values
    # seen exactly once). `coverage` is measured on the rows the vocabulary was fitted on, so
    # its OOV share understates what new traffic of a long-tailed column shows (serve/drift.py).
    stats["unseen_share"] = float(np.count_nonzero(freq == 1) / total) if total else 0.0
    # The most frequent values' shares: the reference for served traffic's drift (PSI).
    top = keep[:TOP_SHARES]
    stats.update({"top_values": [str(v) for v in values[top]], "top_shares": [float(f / total) for f in freq[top]] if total else []})
    state.stats = stats
    return state


def _ranked(acc: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batches' merged counts: (values, counts, order), the order most frequent first,
    ties by value, so the result does not depend on how the rows were batched."""
    counts = pa.concat_tables(acc["counts"]).group_by("value").aggregate([("count", "sum")])
    values = counts.column("value").to_numpy(zero_copy_only=False)
    freq = counts.column("count_sum").to_numpy()
    # ties by the exact text: NumPy's fixed-width strings (astype(str)) drop trailing NULs, so "a"
    # and "a\x00" tied, in the batches' order
    order = pc.sort_indices(counts, sort_keys=[("count_sum", "descending"), ("value", "ascending")]).to_numpy()
    return values, freq, order.astype(np.int64)


def _heavy_hitters(acc: dict) -> dict:
    """A hashed column's most frequent values (up to TOP_SHARES) and their shares of its
    non-null values, for drift monitoring: only values whose count is known within 10% (at
    least ten times the batches' summed slack; every value when no batch left one out)."""
    values, freq, order = _ranked(acc)
    order = order[:TOP_SHARES]
    top = order[freq[order] >= 10 * acc["slack"]] if acc["slack"] else order
    total = float(acc["counted"])
    return {"top_values": [str(v) for v in values[top]], "top_shares": [float(f / total) for f in freq[top]] if total else []}


# Text is the user's data and is kept verbatim: "12345.0" in a CSV is not the category "12345"
# (a category "1.0" may well differ from "1"). But a vocabulary made mostly of whole-number
# float text is what a float ID column (pandas' integers with a gap) written to CSV looks like,
# and requests sending the IDs as JSON integers ("12345") would all be out of vocabulary.
_FLOAT_TEXT = re.compile(r"-?\d+\.0+|-?\d(?:\.\d+)?[eE][+-]?\d+")


def _warn_float_text(name: str, vocab: list[str]) -> None:
    top = vocab[:1000]  # most frequent first
    capital = [v for v in top if v in ("True", "False")]
    if capital:  # pandas' to_csv writes booleans so; JSON's true reads as "true", out of vocabulary
        log.warning("features.categorical.%s: the vocabulary holds %s, Python's text of a boolean (pandas' to_csv writes "
                    "booleans so); the text is kept as it is, so a request's JSON true (\"true\") does not match it. Write "
                    "booleans as true/false (df[col].map({True: 'true', False: 'false'})) or send the text %r",
                    name, " and ".join(repr(v) for v in capital), capital[0])
    floats = [v for v in top if _FLOAT_TEXT.fullmatch(v)]
    if floats and 2 * len(floats) > len(top):
        log.warning("features.categorical.%s: %d of the %d most frequent values are whole-number float text (%r, ...); "
                    "the text is kept as it is, so a request sending %r must send that text, not the integer. Write "
                    "integer IDs as integers (pandas: df[col].astype('Int64') before to_csv)", name, len(floats), len(top),
                    floats[0], floats[0])
