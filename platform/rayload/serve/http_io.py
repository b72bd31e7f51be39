"""The A/B router's HTTP boundary: request bodies (pydantic models whose values the event store
can keep), JSON in and out, and request IDs. serve/app.py routes; this module reads and writes.

JSON is read with orjson where orjson reads it as json.loads does, and with json.loads where it
would not (see `_loads`): at the router's few-hundred-byte bodies that is 0.45 us against 2.6 per
request, and writing an answer 0.15 us against 2.8, on the replica's busiest thread.
"""

import json
import os
import re
import reprlib
import time
from typing import Annotated, Any

import orjson
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictFloat, ValidationError, model_validator

from .events import exposures


def _storable(limit: int):
    """A validator: the value, as the string the event store keeps, fits its column (at most
    `limit` characters, as PostgreSQL's VARCHAR counts them), holds no NUL (PostgreSQL's text
    refuses it) and encodes as UTF-8 (JSON's \\ud800 escape decodes to a lone surrogate, which no
    database driver can bind)."""
    def check(value):
        text = str(value)
        if len(text) > limit:
            raise ValueError(f"at most {limit} characters, got {len(text)}")
        if "\x00" in text:  # PostgreSQL's text types refuse NUL ("cannot contain NUL (0x00) characters")
            raise ValueError(f"must not contain a NUL character (at position {text.index(chr(0))})")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"must be valid Unicode text: a lone surrogate {text[exc.start]!r} at position {exc.start}") from None
        return value
    return AfterValidator(check)


def _str_or_int(value):
    """A unit ID as the client sent it: JSON text or a whole number. Not a boolean or a float,
    which pydantic would take as 1 (true, 1.0) and so merge with unit 1."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        # reprlib: a repr of a list nested 1,000 deep raised RecursionError, a 500 instead of this 422
        raise ValueError(f"must be a string or an integer, got {type(value).__name__} {reprlib.repr(value)}")
    if isinstance(value, str) and not value.strip():
        # a client that lost its user's ID: all such traffic was one sticky unit, always in one arm, moving its CTR
        raise ValueError("must not be empty or blank: send the user's ID (each unit is assigned an arm by it)")
    return value


UnitId = Annotated[str | int, BeforeValidator(_str_or_int), _storable(exposures.c.unit_id.type.length)]
RequestId = Annotated[str, _storable(exposures.c.request_id.type.length)]


class PredictBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unit_id: UnitId = Field(description="the randomisation unit (user)")
    features: dict[str, Any] | None = None
    candidates: list[dict[str, Any]] | None = Field(default=None, description="feature dicts to rank; the top one is shown")

    @model_validator(mode="after")
    def _one_of(self):
        # both given was scored as the candidates alone, the features silently dropped
        if self.features is not None and self.candidates is not None:
            raise ValueError("give features (one item to score) or candidates (a list to rank), not both")
        return self


class AssignBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    unit_ids: list[UnitId] = Field(min_length=1, description="units whose arm to look up (bounded by max_body_bytes)")


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: RequestId
    event: str = Field(pattern=r"^(click|conversion)$")
    # strict: a JSON number only; lax mode read "2.5" and true as numbers, so a client that sent
    # the wrong type had it stored as a value it never meant
    value: StrictFloat = Field(default=1.0, allow_inf_nan=False, description="finite: the store keeps a number")


def _problem(status: int, detail) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def _ok(body: dict, finite: bool = True) -> Response:
    """A 200 answer serialised here, as JSONResponse would (UTF-8, no NaN): a dict returned to
    FastAPI goes through jsonable_encoder first, which walks it in Python (about 8 us per
    /predict answer, on the replica's busiest thread). orjson writes it (0.15 us against 2.8 for
    json.dumps); it would write a NaN as null, so a body with a non-finite number (`finite`
    False) goes through json.dumps, which refuses it (a 500, as before)."""
    if finite:
        return Response(orjson.dumps(body), media_type="application/json")
    return Response(json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(), media_type="application/json")


_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _loads(body: bytes) -> tuple[Any, bool]:
    """The body as json.loads reads it, and whether orjson read it (then its values re-encode
    with orjson exactly: see _features_json). orjson reads JSON as json.loads does (0.45 us
    against 2.6 for a /predict body) except where it refuses what json.loads accepts (NaN and
    Infinity literals, numbers that overflow a double, lone surrogates, nesting past 1024) and
    where it reads differently: an integer past 64 bits becomes a float. A body with a run of
    19 digits, or one orjson refuses, is read by json.loads, which keeps every integer exact and
    raises what the router answers 422 for."""
    if not _LONG_DIGITS.search(body):
        try:
            return orjson.loads(body), True
        except orjson.JSONDecodeError:
            pass
    return json.loads(body), False


def _features_json(row: dict, fast: bool) -> str:
    """An exposure's shown row as JSON text: orjson for a row orjson parsed (its values are
    finite floats, 64-bit integers and valid strings, which orjson writes as json.dumps reads
    them back), json.dumps otherwise (NaN, huge integers, escaped surrogates)."""
    if fast:
        try:
            return orjson.dumps(row).decode()
        except orjson.JSONEncodeError:  # not a row orjson parsed after all: json.dumps writes what it can
            pass
    return json.dumps(row)


def _validation_detail(exc: ValidationError) -> list[dict]:
    return [{"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]} for err in exc.errors(include_url=False)]


class RequestIds:
    """Request IDs laid out like UUIDv7: 48 bits of Unix time in milliseconds, then 80 random
    bits, as 32 hex digits. Time-ordered IDs append to the end of the event store's
    primary-key index instead of landing on random pages of it (with uuid4 the exposure inserts
    slowed as the table grew), and the random part keeps them unguessable. The random bytes come
    from os.urandom in blocks: uuid4 made one getrandom system call per request, and under load
    the event loop gave up the GIL on each and waited to get it back from Serve's HTTP thread
    (17-31 us of each request in a profile). Not thread-safe: one per event loop."""

    BLOCK = 256

    def __init__(self):
        self._buf, self._pos = b"", 0

    def next(self) -> str:
        if self._pos >= len(self._buf):
            self._buf, self._pos = os.urandom(10 * self.BLOCK), 0
        self._pos += 10
        return f"{time.time_ns() // 1_000_000:012x}{self._buf[self._pos - 10:self._pos].hex()}"


def rows_problem(rows, ranking: bool, max_candidates: int, feature_names: set[str]) -> JSONResponse | None:
    """A /predict body's rows checked before scoring: none, too many, or a feature no model knows (a 422)."""
    field = "candidates" if ranking else "features"
    if not rows:
        return _problem(422, [{"loc": ["body", field], "msg": "give features (one item) or a non-empty candidates list", "type": "missing"}])
    if len(rows) > max_candidates:
        return _problem(422, [{"loc": ["body", "candidates"], "msg": f"at most {max_candidates} candidates", "type": "too_long"}])
    for i, row in enumerate(rows):
        unknown = sorted(set(row) - feature_names)
        if unknown:
            # the name as it can be written back in UTF-8: JSON's \ud800 escape gives a lone surrogate
            name = unknown[0].encode("utf-8", "backslashreplace").decode("utf-8")
            loc = ["body", "candidates", i, name] if ranking else ["body", "features", name]
            return _problem(422, [{"loc": loc, "msg": f"unknown feature {name!r}; known: {sorted(feature_names)}", "type": "extra_forbidden"}])
    return None
