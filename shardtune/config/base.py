"""The base of every recipe section: unknown keys, inf/nan and booleans-as-counts refused."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_counts(cls, data):
        """`max_steps: true` is not 1: a boolean is accepted only where the field is a boolean."""
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                if isinstance(value, bool) and field is not None and field.annotation is not bool:
                    raise ValueError(f"{key} = {str(value).lower()} is a boolean; give a number or a name "
                                     "(booleans are not counts)")
        return data
