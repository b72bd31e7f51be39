"""The fitted preprocessor: a JSON artifact and one transform for batches and for requests.

`transform_table` works on a validated pyarrow Table (numeric columns float64, categorical
columns string). `transform_rows` turns request dicts into such a table with the same
validation code and then calls `transform_table`, so serving and training cannot disagree.

Output columns: dense features are float32 (`dense_columns`), single IDs are int64
(`sparse_columns`, with their cardinalities, for nn.Embedding), multi-valued IDs are
list<int64> (`bag_columns`, for nn.EmbeddingBag), and the label is `label` (float32).

ID layout of a vocabulary encoding: 0 = missing, 1 = out of vocabulary, 2.. = vocabulary in
order of frequency. Hash encodings map every value, missing included, into [0, buckets).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import target_stats
from ._far_values import EXTREME_SCALED, _collect_far, far_limit, far_reason  # noqa: F401  (EXTREME_SCALED, far_limit: public here)
from ._memo import Memo
from .derived import derive
from .errors import DataError
from .hashing import as_array, as_strings, combine, hash_strings, kept_lists, seed_key
from .target_stats import TargetState, onehot_name

MISSING_ID, OOV_ID, FIRST_ID = 0, 1, 2
FORMAT_VERSION = 1
_HASH_KEY = seed_key(0, "features")


@dataclass
class NumericState:
    name: str
    impute_value: float
    clip_low: float | None
    clip_high: float | None
    log: bool
    scale: str  # none | minmax | zscore
    offset: float = 0.0
    divisor: float = 1.0
    boundaries: list[float] | None = None  # bucketised: an ID column instead of a dense one
    # count, null_rate, mean, std, min, max, quantiles: drift's reference, not the transform (not compared)
    stats: dict = field(default_factory=dict, compare=False)
    # Every training value was one value after imputation, clip and log (or every one missing):
    # the model's weights on the column never saw it vary, so every value, served ones too,
    # transforms to 0 (a bucketised column has one bucket). Absent from older files: False.
    constant: bool = False

    @property
    def cardinality(self) -> int:
        return len(self.boundaries) + 1 if self.boundaries is not None else 0


@dataclass
class CategoricalState(Memo):
    name: str
    encode: str  # vocab | hash | onehot
    multi: bool = False
    separator: str = "|"
    vocab: list[str] | None = None
    buckets: int = 0
    max_bag: int = 16
    # count, null_rate, distinct, coverage, unseen_share, top_values/shares: drift's reference, not the transform (not compared)
    stats: dict = field(default_factory=dict, compare=False)

    @property
    def cardinality(self) -> int:
        return self.buckets if self.encode == "hash" else len(self.vocab) + FIRST_ID


@dataclass
class CrossState:
    columns: list[str]
    buckets: int

    @property
    def name(self) -> str:
        return "x_" + "_".join(self.columns)


@dataclass
class LabelState:
    column: str
    task: str
    threshold: float | None = None
    domain: list[float] | None = None
    # training's, not the transform's: not compared (`rayload compress` checks the data transforms alike)
    class_weights: dict[str, float] | None = field(default=None, compare=False)
    positive_rate: float | None = field(default=None, compare=False)


@dataclass
class FittedFeatures:
    numeric: list[NumericState]
    categorical: list[CategoricalState]
    crosses: list[CrossState]
    label: LabelState
    columns: list[dict]  # the validated input schema (name, role, separator, required)
    target: list[TargetState] = field(default_factory=list)
    derived: dict[str, dict] = field(default_factory=dict)  # name -> source, part, minus
    version: int = FORMAT_VERSION
    # Whether the target statistics were fitted on the rows being transformed: only then does a
    # training row carry its own label in them, and is encoded out of fold. Features fixed from
    # a checkpoint (train.init_from) were fitted on other rows, so every row of the new data is
    # encoded with all of them, as serving encodes a request. A fact about this run, not about
    # the transform: not in features.json, not compared.
    fitted_here: bool = field(default=True, compare=False, repr=False)

    # ------------------------------------------------------------ outputs

    @property
    def dense_columns(self) -> list[str]:
        out = [n.name for n in self.numeric if n.boundaries is None]
        for c in self.categorical:
            if c.encode == "onehot":
                out += [onehot_name(c.name, i) for i in range(len(c.vocab) + 1)]
        for t in self.target:
            out += t.outputs
        return out

    @property
    def sparse_columns(self) -> dict[str, int]:
        out = {n.name: n.cardinality for n in self.numeric if n.boundaries is not None}
        out.update({c.name: c.cardinality for c in self.categorical if c.encode != "onehot" and not c.multi})
        out.update({x.name: x.buckets for x in self.crosses})
        return out

    @property
    def bag_columns(self) -> dict[str, int]:
        return {c.name: c.cardinality for c in self.categorical if c.multi}

    # ------------------------------------------------------------ JSON

    def to_json(self) -> str:
        raw = asdict(self)
        raw.pop("fitted_here")
        return json.dumps(raw, indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str, source: str = "features.json") -> "FittedFeatures":
        """The artifact back; a file this version did not write (NaN or Infinity, which
        `to_json` never writes, an unknown or a missing field, another version) is a DataError
        naming `source`, the field and the supported version."""
        def refuse(token: str):
            raise DataError(f"{source}: {token} is not a number a features.json holds (version {FORMAT_VERSION} writes finite "
                            "numbers only); the file was edited or written by another tool: fit the features again")

        try:
            raw = json.loads(text, parse_constant=refuse)
        except ValueError as exc:
            raise DataError(f"{source} is not JSON ({exc}); fit the features again") from exc
        version = raw.get("version") if isinstance(raw, dict) else None
        if version != FORMAT_VERSION:
            raise DataError(f"{source}: features.json version {version} is not supported (this rayload reads version "
                            f"{FORMAT_VERSION}); fit the features again with this version")
        _check_fields(cls, raw, source, "", skip={"fitted_here"})
        return cls(
            numeric=[_build(NumericState, n, source, f"numeric[{i}]") for i, n in enumerate(raw["numeric"])],
            categorical=[_build(CategoricalState, c, source, f"categorical[{i}]") for i, c in enumerate(raw["categorical"])],
            crosses=[_build(CrossState, x, source, f"crosses[{i}]") for i, x in enumerate(raw["crosses"])],
            label=_build(LabelState, raw["label"], source, "label"),
            columns=raw["columns"],
            target=[_build(TargetState, t, source, f"target[{i}]") for i, t in enumerate(raw.get("target", []))],
            derived=raw.get("derived", {}),
        )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "FittedFeatures":
        with open(path) as f:
            return cls.from_json(f.read(), source=path)

    # ------------------------------------------------------------ transforms

    def transform_table(self, table: pa.Table, training: bool = False, far: dict | None = None) -> pa.Table:
        """Validated rows in, model-ready columns out (label included when present).

        training=True encodes target statistics out of fold (training rows only, and only when
        the statistics were fitted on them: `fitted_here`). With `far` (a dict), the rows whose
        scaled numeric value no model can score are collected in it: {row: (state, value)}, the
        first such feature of each row (`far_limit`)."""
        table = derive(table, self.derived)
        cols: dict[str, pa.Array] = {}
        for num in self.numeric:
            out = transform_numeric(num, table.column(num.name))
            if far is not None and num.boundaries is None and not num.constant:
                _collect_far(num, out[num.name], far)
            cols.update(out)
        for cat in self.categorical:
            cols.update(transform_categorical(cat, table.column(cat.name)))
        for cross in self.crosses:
            cols[cross.name] = transform_cross(cross, [table.column(c) for c in cross.columns])
        for target in self.target:
            cols.update(target_stats.transform(target, table, out_of_fold=training and self.fitted_here))
        if self.label.column in table.column_names:
            cols["label"] = pc.cast(table.column(self.label.column), pa.float32())
        return pa.table(cols)

    def transform_rows(self, rows: list[dict]) -> pa.Table:
        """Request dicts (raw feature values, no label needed) to the same columns.

        Raises DataError naming the row and column when a value cannot be used.
        """
        from .data.validate import validate_request

        far: dict = {}
        out = self.transform_table(validate_request(rows, self.columns, self.derived_sources), far=far)
        if far:
            j = min(far)
            raise DataError(f"request row {j}: {far_reason(far[j], rows[j].get(far[j][0].name, '(derived)'))}")
        return out

    @property
    def derived_sources(self) -> set[str]:
        """The raw columns derived features are computed from (a request carries them)."""
        return {d["source"] for d in self.derived.values()}


# Fields added to format version 1 after its first files were written (their defaults are what
# those files meant): NumericState.constant, FittedFeatures.target and .derived, TargetState.spread
_ADDED_IN_VERSION_1 = frozenset({"constant", "target", "derived", "spread"})


def _check_fields(kind, raw, source: str, where: str, skip=frozenset()) -> None:
    """Unknown and missing fields of one features.json object, as a DataError."""
    at = f" {where}" if where else ""
    if not isinstance(raw, dict):
        raise DataError(f"{source}:{at or ' the top level'} must be a JSON object, got {type(raw).__name__} "
                        f"(features.json version {FORMAT_VERSION})")
    known = [f for f in fields(kind) if f.init and f.name not in skip]
    unknown = sorted(set(raw) - {f.name for f in known})
    # Every field but those version 1 files written before they existed lack: to_json writes them
    # all, and a default taken for a missing one changed the features without a word (no
    # `multi`: a bag read as one unknown token; no `offset`: no z-score)
    missing = [f.name for f in known if f.name not in raw and f.name not in _ADDED_IN_VERSION_1]
    if unknown or missing:
        parts = ([f"unknown field(s) {unknown}"] if unknown else []) + ([f"missing field(s) {missing}"] if missing else [])
        raise DataError(f"{source}:{at} has {' and '.join(parts)}, which features.json version {FORMAT_VERSION} does not "
                        "write; the file was edited or written by another rayload: fit the features again")


def _build(kind, raw, source: str, where: str):
    _check_fields(kind, raw, source, where)
    return kind(**raw)


def clip_log(x: np.ndarray, low: float | None, high: float | None, log: bool) -> np.ndarray:
    """The value transform before scaling or bucketing: clip, then the optional log.

    Fitting uses it too (on raw values, sketches and the imputed value), so the statistics
    describe exactly what the transform produces."""
    if low is not None or high is not None:
        x = np.clip(x, low, high)
    return signed_log1p(x) if log else x


def _numeric_values(state: NumericState, column) -> np.ndarray:
    x = np.asarray(pc.fill_null(column, state.impute_value).to_numpy(), dtype=np.float64)
    return clip_log(x, state.clip_low, state.clip_high, state.log)


def signed_log1p(x: np.ndarray) -> np.ndarray:
    """log1p for x >= 0, mirrored for negatives, so it is defined and monotone everywhere."""
    return np.sign(x) * np.log1p(np.abs(x))


def transform_numeric(state: NumericState, column) -> dict[str, pa.Array]:
    if state.constant:
        return {state.name: pa.array(np.zeros(len(column), np.int64 if state.boundaries is not None else np.float32))}
    x = _numeric_values(state, column)
    if state.boundaries is not None:
        return {state.name: pa.array(np.searchsorted(state.boundaries, x, side="right").astype(np.int64))}
    with np.errstate(over="ignore"):  # past float32 is inf, refused row by row (_far_values.far_limit)
        return {state.name: pa.array(((x - state.offset) / state.divisor).astype(np.float32))}


# Up to this many values are looked up one by one in a dict (a request's few rows); more go
# through Arrow's vectorised index_in, which builds a hash table of the vocabulary per call.
SMALL_LOOKUP = 256


def _vocab_lookup(state: CategoricalState) -> tuple[dict[str, int], pa.Array]:
    """The vocabulary as a value -> ID dict and as an Arrow array, built once per state
    (rebuilding them per call cost milliseconds per request on a 9,000-value vocabulary)."""

    def build():
        ids: dict[str, int] = {}
        for i, v in enumerate(state.vocab):
            ids.setdefault(v, i + FIRST_ID)  # the first occurrence, as index_in finds it
        return ids, pa.array(state.vocab, pa.string())

    return state._memo(build, state.vocab)


def encode_ids(state: CategoricalState, values: pa.Array) -> np.ndarray:
    """Strings (with nulls) to int64 IDs by vocabulary or stable hash."""
    values = as_strings(values)  # a raw (unvalidated) table's integer IDs: their text, as validation gives it
    if state.encode == "hash":
        return (hash_strings(values, _HASH_KEY) % np.uint64(state.buckets)).astype(np.int64)
    index, value_set = _vocab_lookup(state)
    if len(values) <= SMALL_LOOKUP:
        return np.fromiter((MISSING_ID if v is None else index.get(v, OOV_ID) for v in values.to_pylist()),
                           dtype=np.int64, count=len(values))
    ids = pc.fill_null(pc.add(pc.index_in(values, value_set=value_set), FIRST_ID), OOV_ID).to_numpy().astype(np.int64)
    ids[values.is_null().to_numpy(zero_copy_only=False)] = MISSING_ID
    return ids


def transform_categorical(state: CategoricalState, column) -> dict[str, pa.Array]:
    values = as_array(column)
    if state.multi:
        return {state.name: _bags(state, values)}
    ids = encode_ids(state, values)
    if state.encode != "onehot":
        return {state.name: pa.array(ids)}
    # one-hot slot 0 holds missing and out-of-vocabulary values alike.
    slot = np.maximum(ids - 1, 0)
    return {onehot_name(state.name, i): pa.array((slot == i).astype(np.float32)) for i in range(len(state.vocab) + 1)}


def split_bag(state: CategoricalState, values: pa.Array) -> pa.ListArray:
    """Multi-valued strings to lists of tokens; missing and empty become an empty list."""
    parts = pc.split_pattern(pc.fill_null(values, ""), state.separator)
    tokens = pc.utf8_trim_whitespace(parts.flatten())
    keep = pc.not_equal(tokens, "")
    offsets = np.concatenate([[0], np.cumsum(pc.list_value_length(parts).to_numpy())])
    return kept_lists(offsets, tokens, np.asarray(keep.to_numpy(zero_copy_only=False), dtype=bool))


def _bags(state: CategoricalState, values: pa.Array) -> pa.Array:
    lists = split_bag(state, values)
    ids = encode_ids(state, lists.values) if len(lists.values) else np.zeros(0, np.int64)
    offsets = lists.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    position = np.arange(len(ids)) - np.repeat(offsets[:-1], lengths)
    kept = position < state.max_bag
    # An empty bag holds the missing ID so every row has at least one embedding to pool.
    counts = np.maximum(np.minimum(lengths, state.max_bag), 1)
    out_offsets = np.concatenate([[0], np.cumsum(counts)])
    empty_id = MISSING_ID if state.encode != "hash" else int(encode_ids(state, pa.nulls(1, pa.string()))[0])
    flat = np.full(int(out_offsets[-1]), empty_id, dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)[kept]
    flat[out_offsets[rows] + position[kept]] = ids[kept]
    return pa.ListArray.from_arrays(pa.array(out_offsets.astype(np.int32)), pa.array(flat))


def transform_cross(state: CrossState, columns) -> pa.Array:
    hashes = [hash_strings(as_strings(c), _HASH_KEY) for c in columns]
    h = hashes[0]
    for other in hashes[1:]:
        h = combine(h, other)
    return pa.array((h % np.uint64(state.buckets)).astype(np.int64))
