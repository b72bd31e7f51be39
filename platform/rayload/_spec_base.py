"""The base of every spec section: unknown keys refused, no inf or NaN, no bool for a number."""

from __future__ import annotations

import typing
from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, model_validator

from .errors import FieldValueError


class _Spec(BaseModel):
    # allow_inf_nan: no setting is infinite or NaN (train.lr=.inf trained, a NaN threshold made
    # every label 0)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data):
        """true/false for a number field (train.epochs=true read as 1 epoch) is refused; pydantic
        reads a bool as 0/1 where a field takes numbers and no bool. (A model validator: a
        field validator on every field would also sit on the discriminators, which pydantic refuses.)"""
        if isinstance(data, dict):
            for name, value in data.items():
                if name not in cls.model_fields:
                    continue
                annotation = cls.model_fields[name].annotation
                if isinstance(value, bool) and _numbers_only(_top_kinds(annotation)):
                    raise FieldValueError(name, "a number, not true or false", value)
                if isinstance(value, (list, tuple)):  # model.hidden=[true, 64] was [1, 64], clip quantiles [false, true] (0, 1)
                    for i, item in enumerate(value):
                        if isinstance(item, bool) and _numbers_only(_item_kinds(annotation, i)):
                            raise FieldValueError(f"{name}.{i}", "a number, not true or false", item)
        return data


def _numbers_only(kinds: set) -> bool:
    return bool not in kinds and (int in kinds or float in kinds)


def _item_kinds(tp, i: int) -> set:
    """The types item `i` of a list or tuple field takes (none for a field of no sequence)."""
    out: set = set()
    for member in _top_kinds(tp):
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin is list and args:
            out |= _top_kinds(args[0])
        elif origin is tuple and args:
            item = args[0] if len(args) == 2 and args[1] is Ellipsis else args[i] if i < len(args) else None
            out |= _top_kinds(item) if item is not None else set()
    return out


def _top_kinds(tp) -> set:
    """The types a field takes at its top level (the members of a union, Annotated unwrapped)."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _top_kinds(typing.get_args(tp)[0])
    if origin is Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        return set().union(*(_top_kinds(a) for a in typing.get_args(tp)))
    return {tp}
