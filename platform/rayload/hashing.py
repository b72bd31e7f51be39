"""Stable hashes: identical in every process, on every machine, across restarts.

Python's `hash()` is salted per process, so it must never decide a bucket, a split or an arm.
pandas' `hash_array` is SipHash-2-4 with a fixed key, vectorised in C.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pandas.util import hash_array

_MISSING = "\x00<missing>"


def seed_key(seed: int, salt: str = "") -> str:
    """The 16-character SipHash key for a seed (and an optional purpose salt)."""
    return hashlib.blake2b(f"{salt}:{seed}".encode(), digest_size=8).hexdigest()


def as_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous Array (a table column may arrive in chunks); no copy for one chunk."""
    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def as_strings(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One string Array: dictionary columns decoded, numbers and booleans cast to their text
    (what validation does to a categorical column), so a lookup by text finds them."""
    arr = as_array(column)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if not pa.types.is_string(arr.type):
        arr = value_text(arr)
    return arr


def value_text(arr: pa.Array) -> pa.Array:
    """Numbers and booleans as the text a categorical value is known by (3.0 -> "3", True ->
    "true"); a floating NaN is missing (null), as a numeric column reads it, never the text "nan":
    NaN is how a float column (pandas', numpy's) holds a gap, an integer ID column's with gaps too.

    A whole-number float below 2**63 is spelled as the integer it holds (12345678901.0 ->
    "12345678901", 1e10 -> "10000000000", -0.0 -> "0"): an integer ID column with a gap is
    float64, and Arrow's own spelling from 1e10 up ("1.2345678901e+10") is not the text the
    same ID has in a JSON request. Other floats keep Arrow's shortest round-trip text."""
    if not pa.types.is_floating(arr.type):
        return pc.cast(arr, pa.string())
    text = pc.cast(arr, pa.string())
    x = arr.cast(pa.float64())  # exact from float32 and float16
    in_range = pc.and_(pc.greater_equal(x, -(2.0**63)), pc.less(x, 2.0**63))
    whole = pc.fill_null(pc.and_(pc.equal(pc.floor(x), x), in_range), False)  # NaN and inf are not whole
    if pc.any(whole).as_py():
        ints = pc.if_else(whole, x, 0.0).cast(pa.int64(), safe=False)
        text = pc.if_else(whole, ints.cast(pa.string()), text)
    return pc.if_else(pc.is_nan(x), pa.scalar(None, pa.string()), text)


def hash_strings(values: pa.Array | pa.ChunkedArray, key: str) -> np.ndarray:
    """uint64 hash per element of a string array; nulls hash like the missing token.

    Dictionary-encodes first so each distinct value is hashed once: categorical columns repeat.
    """
    values = pc.fill_null(as_array(values), _MISSING)
    encoded = pc.dictionary_encode(values)
    uniques = encoded.dictionary.to_numpy(zero_copy_only=False).astype(object)
    hashed = hash_array(uniques, hash_key=key, categorize=False)
    return hashed[encoded.indices.to_numpy(zero_copy_only=False)]


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Order-dependent mix of two uint64 hash arrays (boost::hash_combine, 64-bit)."""
    with np.errstate(over="ignore"):
        return a ^ (b + np.uint64(0x9E3779B97F4A7C15) + (a << np.uint64(6)) + (a >> np.uint64(2)))


def to_unit(h: np.ndarray) -> np.ndarray:
    """uint64 hashes to floats uniform in [0, 1) (top 53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def digest(obj) -> str:
    """Short content hash of a JSON-able object (spec sections, file fingerprints)."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kept_lists(offsets: np.ndarray, values: pa.Array, keep: np.ndarray) -> pa.ListArray:
    """Lists of `values` (row i holds values[offsets[i]:offsets[i + 1]]) with only the values
    `keep` marks: a bag's tokens less its empty or missing ones."""
    rows = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    counts = np.bincount(rows[keep], minlength=len(offsets) - 1)
    return pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)), values.filter(pa.array(keep)))
