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
                if isinstance(value, bool) and name in cls.model_fields:
                    kinds = _top_kinds(cls.model_fields[name].annotation)
                    if bool not in kinds and (int in kinds or float in kinds):
                        raise FieldValueError(name, "a number, not true or false", value)
        return data


def _top_kinds(tp) -> set:
    """The types a field takes at its top level (the members of a union, Annotated unwrapped)."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _top_kinds(typing.get_args(tp)[0])
    if origin is Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        return set().union(*(_top_kinds(a) for a in typing.get_args(tp)))
    return {tp}
