"""YAML reading, dotted overrides and error collection shared by every spec type."""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Callable, Sequence

import yaml
from pydantic import BaseModel, ValidationError

from .errors import FieldValueError, SpecError, SpecIssue

Check = Callable[[BaseModel], list[SpecIssue]]


class _UniqueKeys(yaml.SafeLoader):
    """safe_load that refuses a key written twice in one mapping: PyYAML keeps the last one,
    so the first value (a search range, a job setting) was lost without a word. Keys a merge
    (`<<: *anchor`) brings in may still be overridden, as YAML intends. Each mapping is checked as
    written, once, before PyYAML flattens its merges (flattening a mapping that merges another
    copies the other's merged keys into that other node, which a later check read as repeats)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node):
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._refuse_repeats(node)
        super().flatten_mapping(node)

    def _refuse_repeats(self, node) -> None:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the constructor says so
                continue
            seen[key] = key_node.start_mark.line + 1
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found the key {key!r} twice (first on line {first}); the first value would be lost", key_node.start_mark)


def read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise SpecError([SpecIssue("", f"spec file not found: {path}")], file=path)
    if os.path.isdir(path):
        raise SpecError([SpecIssue("", f"{path} is a folder, not a spec file")], file=path)
    try:
        with open(path, "rb") as f:  # bytes: YAML is UTF-8 (or -16/-32 with a BOM) whatever the locale says
            raw = yaml.load(f, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:  # a byte that is not UTF-8 is a yaml.reader.ReaderError, naming its position
        raise SpecError([SpecIssue("", f"not valid YAML: {exc}")], file=path) from None
    except OSError as exc:
        raise SpecError([SpecIssue("", f"cannot read the spec file: {exc.strerror or exc}")], file=path) from None
    if raw is None:  # it was read as a job spec missing name and data
        raise SpecError([SpecIssue("", "the file is empty (or only comments): a spec is a mapping of its sections")], file=path)
    if not isinstance(raw, dict):
        raise SpecError([SpecIssue("", "the top level must be a mapping of sections", raw, True)], file=path)
    return raw


def apply_overrides(raw: dict, overrides: Sequence[str], defaults: Callable[[], dict] | None = None,
                    model_cls: type[BaseModel] | None = None, keyed: dict[str, type[BaseModel] | None] | None = None) -> list[SpecIssue]:
    """Apply `a.b.c=value` in place (value parsed as YAML); return the malformed ones.
    `defaults`: see `_set_path`. `model_cls`: the spec's model; a value for one of its text
    fields is the text as given (`train.run_name=20240601` is the name 20240601, not a number;
    `yes` is not True). `keyed`: sections whose keys are themselves dotted paths (a search spec's
    `fixed` and `space`, keyed by job spec paths), each with the model those paths name (None:
    not typed): `fixed.train.lr=0.01` sets the key `train.lr` of `fixed`, not `fixed.train.lr`."""
    issues = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            issues.append(SpecIssue("--set", "overrides look like section.field=value", item, True))
            continue
        parts = keyed_path(raw, key.strip().split("."), keyed or {})
        try:
            value = yaml.load(text, Loader=_UniqueKeys) if text.strip() else ""  # noqa: S506 - a SafeLoader subclass
        except yaml.constructor.ConstructorError as exc:
            text_only = model_cls is not None and _text_field(_annotation_at(model_cls, parts, keyed or {}), {})
            if "twice" not in str(exc.problem) or text_only:
                value = text  # a text field takes the text as given ({a, a} included)
            else:  # a key written twice in a value, as in a file: the first was lost without a word
                issues.append(SpecIssue("--set", f"{exc.problem}", item, True))
                continue
        except yaml.YAMLError:
            value = text
        if model_cls is not None and not isinstance(value, str) and _text_field(_annotation_at(model_cls, parts, keyed or {}), value):
            value = text
        _set_path(raw, parts, value, issues, defaults)
    return issues


def keyed_path(raw: dict, parts: list[str], keyed) -> list[str]:
    """`parts` with the dotted key of a keyed section (see apply_overrides) joined into one
    part: the longest key the section already has that the path starts with (what follows is
    inside its value: `space.train.lr.loguniform`), else all of the rest (a new key)."""
    if len(parts) < 2 or parts[0] not in keyed:
        return parts
    section, rest = parts[0], parts[1:]
    existing = raw.get(section) if isinstance(raw.get(section), dict) else {}
    for n in range(len(rest), 0, -1):
        if ".".join(rest[:n]) in existing:
            return [section, ".".join(rest[:n]), *rest[n:]]
    return [section, ".".join(rest)]


def _annotation_at(model_cls: type[BaseModel], parts: list[str], keyed) -> object | None:
    """The type of the field at `parts` (a keyed section's key as one part), or None if unknown."""
    tp: object = model_cls
    if len(parts) > 1 and keyed.get(parts[0]) is not None:
        tp, parts = keyed[parts[0]], parts[1].split(".") + parts[2:]
    for part in parts:
        tp = _descend(tp, part)
        if tp is None:
            return None
    return tp


def _text_field(tp, value) -> bool:
    """Whether a field of type `tp` takes only text (str, a choice of words, or None), so that
    `value`, the YAML reading of what was given, should be the text instead; a YAML null stays
    None where None is allowed."""
    if tp is None:
        return False
    kinds = _candidates(tp)
    if not isinstance(value, (list, dict)):  # a scalar given for `str | list[str]` (a path, or several) is the path as given
        kinds = [k for k in kinds if typing.get_origin(k) not in (list, dict, tuple) and k not in (list, dict, tuple)]
    texts = [k for k in kinds if k is str or (typing.get_origin(k) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(k)))]
    if not texts or len(texts) + (type(None) in kinds) != len(kinds):
        return False
    return not (value is None and type(None) in kinds)


def dumped_defaults(model_cls: type[BaseModel], raw: dict) -> Callable[[], dict]:
    """`raw` as `model_cls` would dump it, defaults filled in, computed once when first asked
    ({} when `raw` is not valid yet)."""
    import copy
    import functools

    @functools.cache
    def dump() -> dict:
        try:
            return model_cls.model_validate(copy.deepcopy(raw)).model_dump(mode="json")
        except ValidationError:
            return {}

    return dump


def _set_path(node, parts: list[str], value, issues: list[SpecIssue], defaults: Callable[[], dict] | None = None) -> None:
    """Set `value` at the dotted path `parts` in `node`, making the sections on the way. An item
    of a list that `node` leaves out (model.hidden.0 when model.hidden is left at its default)
    starts from the list `defaults()` (the spec's dump) has there: made as a section, the list
    would be {'0': value}."""
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            if part not in node and parts[depth + 1].isdigit() and defaults is not None:
                default = _dumped_at(defaults(), parts[: depth + 1])
                if isinstance(default, list):
                    node[part] = default
            if node.get(part) is None:  # a section written `null` loads as one left out: a field inside it starts it
                node[part] = {}
            node = node[part]
        else:
            issues.append(_not_settable(node, parts, depth))
            return
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        issues.append(_not_settable(node, parts, len(parts) - 1))


def _not_settable(node, parts: list[str], depth: int) -> SpecIssue:
    """Why `parts[depth]` cannot be set inside `node`: an index past a list's end (model.hidden.5
    of a 2-item list) was reported as 'not a section'."""
    where = ".".join(parts[: depth + 1])
    if isinstance(node, list):
        parent = ".".join(parts[:depth])
        if parts[depth].isdigit():
            items = f"{len(node)} item(s), indices 0-{len(node) - 1}" if node else "no items"
            return SpecIssue(where, f"{parent} has {items}; to change its length, set the whole list: {parent}=[...]")
        return SpecIssue(where, f"{parent} is a list: name an item by its index ({parent}.0) or set the whole list")
    return SpecIssue(where, "cannot set a field inside a value that is not a section")


def _dumped_at(tree, parts: list[str]):
    """A deep copy of what the dumped `tree` holds at `parts`, or None."""
    import copy

    for part in parts:
        if isinstance(tree, dict):
            tree = tree.get(part)
        elif isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return None
    return copy.deepcopy(tree)


def spec_kind(raw: dict) -> str:
    """pipeline (stages:), search (space:), ab (arms:) or job."""
    for key, kind in (("stages", "pipeline"), ("space", "search"), ("arms", "ab")):
        if key in raw:
            return kind
    return "job"


_KIND_OF = {"JobSpec": "job", "SearchSpec": "search", "ABSpec": "ab"}
_KIND_KEY = {"pipeline": "stages", "search": "space", "ab": "arms"}
_KIND_USE = {"job": ("a job spec", "train it with `rayload train`"), "search": ("a search spec", "run it with `rayload tune`"),
             "ab": ("an A/B spec", "serve it with `rayload serve`"), "pipeline": ("a pipeline", "run it with `rayload run`")}


def check_kind(raw: dict, model_cls: type[BaseModel], path: str) -> None:
    """A spec of another kind is refused in one sentence that says what it is and which command
    takes it (a search spec given to `rayload train` listed 13 unknown or missing fields)."""
    want, got = _KIND_OF.get(model_cls.__name__), spec_kind(raw)
    if want is not None and got != want:
        has = f"it has `{_KIND_KEY[got]}:`" if got in _KIND_KEY else f"it has none of {', '.join(f'`{k}:`' for k in _KIND_KEY.values())}"
        raise SpecError([SpecIssue("", f"this is {_KIND_USE[got][0]} ({has}): {_KIND_USE[got][1]}; this command takes "
                                       f"{_KIND_USE[want][0]}")], file=path)


def load_model(model_cls: type[BaseModel], path: str, overrides: Sequence[str] = (), check: Check | None = None,
               keyed: dict[str, type[BaseModel] | None] | None = None):
    """`keyed`: see apply_overrides."""
    raw = read_yaml(path)
    check_kind(raw, model_cls, path)
    issues = apply_overrides(raw, overrides, dumped_defaults(model_cls, raw), model_cls, keyed)
    return validate_model(model_cls, raw, check, file=path, issues=issues)


def validate_model(model_cls: type[BaseModel], raw: dict, check: Check | None = None, file: str | None = None,
                   issues: list[SpecIssue] | None = None):
    """`raw` as a `model_cls`, then `check`; raises SpecError with every problem and its field path."""
    issues = list(issues or [])
    try:
        model = model_cls.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(issues + pydantic_issues(exc, model_cls), file=file) from None
    if check is not None:
        issues += check(model)
    if issues:
        raise SpecError(issues, file=file)
    return model


# pydantic's errors for a value that matches no type of a union: one per type, not about the value's content
_MISMATCH = {"int_type", "int_parsing", "int_from_float", "float_type", "float_parsing", "string_type", "bool_type",
             "bool_parsing", "list_type", "tuple_type", "dict_type", "model_type", "model_attributes_type", "literal_error"}


def _union_errors(errors: list[dict], model_cls: type[BaseModel]) -> list[dict]:
    """The errors with the union member tags pydantic puts in a location (`workers.int`,
    `workers.function-after[_order(), ElasticWorkers]`, `source.csv.path.str`) taken out, so
    each names a spec path, and for a value no member of a union took, only the errors of the
    members whose shape the value has: {min: 3, max: 2} for `int | ElasticWorkers` is
    ElasticWorkers' error, not also "should be a valid integer". When no member got past the
    type check, the members' type errors become one."""
    groups: dict[tuple, list] = {}  # (union's loc, member tag) of each error inside a union
    out = []
    for err in errors:
        loc, union_at, tag = _clean_loc(err["loc"], model_cls)
        err = dict(err, loc=tuple(loc), tagged_loc=err["loc"])
        if union_at is None:
            out.append(err)
        else:
            groups.setdefault(tuple(loc[:union_at]), []).append((tag, err))
    for at, members in groups.items():
        fitting = [e for _, e in members if e["type"] not in _MISMATCH or len(e["loc"]) > len(at)]
        if fitting:
            out.extend(fitting)
        else:  # one error: what the value could have been
            what = [e["msg"].removeprefix("Input should be ") for _, e in members]
            out.append(dict(members[0][1], msg="Input should be " + " or ".join(dict.fromkeys(what))))
    return out


def _clean_loc(loc, model_cls) -> tuple[list[str], int | None, str | None]:
    """(the location without union member tags, the index where the innermost one was, that tag)."""
    tp: object = model_cls
    out, union_at, tag = [], None, None
    for part in map(str, loc):
        members = [c for c in _candidates(tp) if c is not type(None)]
        branch = _member(members, part) if len(members) > 1 else None
        if branch is not None:
            union_at, tag = len(out), part
            tp = branch
            continue
        out.append(part)
        tp = _descend(tp, part) if tp is not None else None
    return out, union_at, tag


def _member(members: list, part: str):
    """The member of a union that pydantic's location tag `part` names, None if it names none."""
    for c in members:
        if isinstance(c, type) and issubclass(c, BaseModel):
            kinds = c.model_fields.get("kind")
            if part == c.__name__ or part.endswith(f", {c.__name__}]") or (
                    kinds is not None and part in typing.get_args(kinds.annotation)):
                return c
        elif typing.get_origin(c) in (list, dict, tuple):  # list[str], list[constrained-str]
            if part.startswith(typing.get_origin(c).__name__ + "["):
                return c
        elif part.removeprefix("constrained-") == (c.__name__ if isinstance(c, type) else str(c)):  # int with ge=1: constrained-int
            return c
    return None


def pydantic_issues(exc: ValidationError, model_cls: type[BaseModel]) -> list[SpecIssue]:
    out = []
    for err in _union_errors(exc.errors(include_url=False), model_cls):
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(model_cls, [str(p) for p in err.get("tagged_loc", loc)][:-1])  # the tags pick a union's member
            near = difflib.get_close_matches(loc[-1], allowed, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            msg = f"unknown field; allowed: {', '.join(allowed)}{hint}" if allowed else "unknown field"
            out.append(SpecIssue(path, msg))
            continue
        if isinstance(cause := (err.get("ctx") or {}).get("error"), FieldValueError):
            out.append(SpecIssue(".".join(loc + [cause.field]), str(cause), cause.value, True))
            continue
        has_value = err["type"] != "missing"
        out.append(SpecIssue(path, msg, err.get("input"), has_value))
    return out


def _fields_at(model_cls: type[BaseModel], loc: list[str]) -> list[str]:
    """Field names of the model found at `loc` (best effort through lists, dicts and unions)."""
    tp: object = model_cls
    for part in loc:
        tp = _descend(tp, part)
        if tp is None:
            return []
    # an optional section (`EarlyStopping | None`) has its model's fields; a union of models has none
    models = [c for c in _candidates(tp) if isinstance(c, type) and issubclass(c, BaseModel)]
    return sorted(models[0].model_fields) if len(models) == 1 else []


def _descend(tp, part: str):
    for cand in _candidates(tp):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            if part in cand.model_fields:
                return cand.model_fields[part].annotation
            kinds = cand.model_fields.get("kind")
            if kinds is not None and part in typing.get_args(kinds.annotation):
                return cand
        origin = typing.get_origin(cand)
        if origin in (list, tuple) and part.isdigit():
            return typing.get_args(cand)[0]
        if origin is dict:
            return typing.get_args(cand)[1]
    return _member([c for c in _candidates(tp) if c is not type(None)], part)  # a union member's tag


def _candidates(tp) -> list:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Annotated:
        return _candidates(args[0])
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType")):
        return [c for a in args for c in _candidates(a)]
    return [tp]
