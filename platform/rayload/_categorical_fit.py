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
    truncated = cfg.top_k is not None and len(keep) > cfg.top_k
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
    # The share of fresh traffic that leaves the vocabulary beyond the training split's own OOV
    # share (1 - coverage), by Good-Turing: values with training count r recur at about the rate of
    # those seen r + 1 times, so the values below the vocabulary's cut m take the mass of those at
    # m, m * N_m / total (N_m: kept values seen exactly m times). With every value kept (m = 1) it
    # is the share of values seen once, the fresh values never seen. It was that share whatever the
    # cut: with min_count or top_k the singletons were already in 1 - coverage, counted twice, and
    # traffic from the training distribution read as drift (PSI ~0.2 at top_k 100, flagged in half
    # the draws). `coverage` is measured on the rows the vocabulary was fitted on, so its OOV share
    # understates what new traffic of a long-tailed column shows (serve/drift.py).
    stats["unseen_share"] = _unseen_share(freq, freq[keep], cfg.min_count, truncated) if total else 0.0
    # The most frequent values' shares: the reference for served traffic's drift (PSI).
    top = keep[:TOP_SHARES]
    stats.update({"top_values": [str(v) for v in values[top]], "top_shares": [float(f / total) for f in freq[top]] if total else []})
    state.stats = stats
    return state


def _unseen_share(freq: np.ndarray, kept: np.ndarray, min_count: int, truncated: bool) -> float:
    """Good-Turing's m * N_m / total at the vocabulary's cut m (min_count, or the last kept value's
    count when top_k cut the vocabulary), N_m the values seen m times. Above m = 5 the N_r are
    sparse (a top_k cut among frequent values has one value at its count, and moving that value's
    whole share out of the vocabulary is not what new traffic does): N_m is then the mean of N_r
    over [m/2, 2m], as Simple Good-Turing smooths them."""
    if not len(kept):
        return 0.0
    m = int(kept.min()) if truncated else int(min_count)
    if m <= 5:
        n_m = float(np.count_nonzero(freq == m))
    else:
        lo, hi = (m + 1) // 2, 2 * m
        n_m = np.count_nonzero((freq >= lo) & (freq <= hi)) / (hi - lo + 1)
    return float(m * n_m / freq.sum())


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
