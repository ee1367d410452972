"""docs/recipe.md, generated from the config schema: every key, its type, default and help.

    python -m shardtune.config.reference > docs/recipe.md

tests/unit/test_recipe_reference.py checks that the file in docs/ is this module's output."""
from __future__ import annotations

import json
import re
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

INTRO = """# Recipe reference

A recipe is a YAML file of the sections below; any key can also be given on the command line as
`key.path=value` (parsed as YAML: `optim.lr=3e-4`, `train.loggers=[tensorboard]`). Unknown keys are
refused with the closest known key. Relative paths in a recipe (model folder, data files, chat
template file, cache and output folders, a checkpoint to resume) are read against the recipe's own
folder; on the command line, against the current folder. `shardtune recipes` lists the shipped
recipes and `shardtune recipes cp NAME FILE` copies one to start from.

Generated from the schema (shardtune/config/) by `python -m shardtune.config.reference >
docs/recipe.md`; tests/unit/test_recipe_reference.py fails when it is out of date.
"""


def type_name(annotation) -> str:
    """`int`, `str | None`, `list[str]`, `'auto' | 'byte' | 'hf'` ..."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if annotation is type(None):
        return "null"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("|", "\\|")).strip()


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            continue
        rows.append(f"| `{prefix}{name}` | {type_name(ann)} | {_default(field)} | {_cell(field.description or '')} |")
    return rows


def _nested(model: type[BaseModel]):
    """(key, model) of list-of-section fields, e.g. data.sources → SourceConfig."""
    for name, field in model.model_fields.items():
        for arg in typing.get_args(field.annotation):
            for inner in typing.get_args(arg) or (arg,):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    yield name, inner


def render() -> str:
    from shardtune.config import RunConfig

    head = "| key | type | default | what it does |\n|---|---|---|---|"
    out = [INTRO, "## top level\n", head, *_rows(RunConfig, ""), ""]
    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        out += [f"## `{name}:`\n"]
        doc = (section.__doc__ or "").strip()
        if doc and not doc.startswith("!!"):
            out += [_cell(doc), ""]
        out += [head, *_rows(section, f"{name}."), ""]
        for key, inner in _nested(section):
            out += [f"### each of `{name}.{key}`\n", head, *_rows(inner, ""), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
