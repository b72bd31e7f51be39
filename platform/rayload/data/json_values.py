"""Raw JSON values (a request's, a JSONL file's, a logged exposure's) as a column: one Arrow
type only where it keeps every value's text, and a value that cannot be one of the column's
(a list in a one-valued column, a list of lists in a bag, a lone surrogate) named row by row."""

from __future__ import annotations

import json

import pyarrow as pa

from ..hashing import value_text


def python_array(values: list) -> pa.Array:
    """Raw JSON values (a request's, a JSONL file's) as one Arrow column: typed when Arrow's one
    type keeps every value's text, text otherwise (`json_texts`), so a value's text, and with it
    its ID, bucket and target statistics, never depends on the other rows of its request or file."""
    kinds = {type(v) for v in values if v is not None}
    if not _respells(kinds, values):
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            pass  # an integer past int64 (10**22), or mixed types (3 and "x"): compare as text, as a CSV would be
    return json_texts(values)


def read_values(values: list, col: dict) -> tuple[list, list[str | None]]:
    """A column's raw JSON values as every reader takes them (a request's, a JSONL file's, a
    logged exposure's), with why each one cannot be a value of the column (None where it can): a
    list or an object in a single-valued column, an object or a list of lists in a bag. Such a
    value is refused row by row, so whether a row is accepted never depends on its neighbours
    (alone, a list made the column a list column and the whole request a 422; beside a string it
    was read as its JSON text). A bag's arrays are joined to their text (`bag_values`)."""
    bag = col["role"] == "multi_categorical"
    why = [_not_a_value(v, bag) for v in values]
    if any(why):
        values = [None if w else v for v, w in zip(values, why)]
    return (bag_values(values, col.get("separator") or "|") if bag else values), why


def _not_a_value(value, bag: bool) -> str | None:
    if isinstance(value, str):
        return None if value.isascii() or _utf8(value) else "not valid Unicode text (a lone surrogate, JSON's \\ud800 escape)"
    if isinstance(value, dict):
        return "a JSON object is not a value"
    if isinstance(value, list):
        if not bag:
            return "a list is not a value of a single-valued column (lists: declare it multi_categorical)"
        if any(isinstance(e, (list, dict)) for e in value):
            return "a multi_categorical value is a list of values or a text, not a list of lists or objects"
        if any(isinstance(e, str) and not (e.isascii() or _utf8(e)) for e in value):
            return "not valid Unicode text (a lone surrogate, JSON's \\ud800 escape)"
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def bag_values(values: list, separator: str) -> list:
    """Raw JSON values of a multi_categorical column with its arrays in their text form: each
    element's own text (`json_texts`), missing and empty ones dropped, the rest joined by the
    separator (an empty array is missing, as "" is); other values as they are. So a request or
    a JSONL line may send a bag as ["a", "b"] or as "a|b", and both are the same tokens. An
    element holding the separator is split as the text would be."""
    if not any(isinstance(v, list) for v in values):
        return values
    out = list(values)
    for i, v in enumerate(values):
        if isinstance(v, list):
            texts = [t for t in json_texts(v).to_pylist() if t]
            out[i] = separator.join(texts) if texts else None
    return out


def _respells(kinds: set, values: list) -> bool:
    """Whether the one type Arrow unifies these values to would change a value's text: a bool
    beside numbers (`pa.array([2.5, True])` is a double column, True the text "1"), or an
    integer past 2**53 beside floats (rounded to a double). An integer up to 2**53 beside floats
    keeps its text, as a whole-number float is spelled as its integer (`value_text`), and so
    a numeric column, the usual mix of 3 and 2.5, stays typed (its text path is 35x slower)."""
    if bool in kinds and len(kinds) > 1:
        return True
    return float in kinds and int in kinds and any(type(v) is int and abs(v) > 2**53 for v in values)


def json_texts(values: list) -> pa.Array:
    """Raw JSON values as text, each spelled as `value_text` spells it alone (True -> "true",
    3.0 -> "3", 1e10 -> "10000000000", 10**22 -> "10000000000000000000000"; lists and objects
    as JSON), so a value's text does not depend on the values beside it (the other rows of a
    request, the other lines of a file).

    A NaN is missing (None), as a column of numbers reads it (`as_string`), not the text "nan".

    Values of one Python type are cast together: a cast is per element, and one cast per type
    instead of one per value keeps a large mixed JSONL column fast."""
    out = list(values)
    by_type: dict[type, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, (list, dict)):
            out[i] = json.dumps(v)
        elif isinstance(v, float) and v != v:
            out[i] = None
        elif v is not None and not isinstance(v, str):
            by_type.setdefault(type(v), []).append(i)
    for where in by_type.values():
        try:
            texts = value_text(pa.array([values[i] for i in where])).to_pylist()
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
            texts = [_text(values[i]) for i in where]  # e.g. ints past int64 beside smaller ones
        for i, t in zip(where, texts):
            out[i] = t
    return pa.array(out, pa.string())


def _text(value) -> str | None:
    try:
        return value_text(pa.array([value]))[0].as_py()
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return str(value)
