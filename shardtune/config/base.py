"""The base of every recipe section: unknown keys, inf/nan, booleans and quoted text as counts refused."""
from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ConfigDict, model_validator


def _is_count(annotation) -> bool:
    """An int field (or int | None): a count, where `"8"` is text, not 8."""
    if annotation is int:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = set(typing.get_args(annotation)) - {type(None)}
        return args == {int}
    return False


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_counts(cls, data):
        """`max_steps: true` is not 1: a boolean is accepted only where the field is a boolean."""
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                off = value is False and (field and field.json_schema_extra or {}).get("false_is_off")
                if isinstance(value, bool) and field is not None and field.annotation is not bool and not off:
                    raise ValueError(f"{key} = {str(value).lower()} is a boolean; give a number or a name "
                                     "(booleans are not counts)")
                # floats stay lax: PyYAML reads 3e-4 (no dot) as the string '3e-4'
                if isinstance(value, str) and field is not None and _is_count(field.annotation) and _numeric(value):
                    raise ValueError(f"{key} = {value!r} is quoted text; give a whole number without quotes")
        return data
