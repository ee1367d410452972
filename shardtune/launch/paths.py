"""The recipe's paths a multi-node job reads or writes, and whether its nodes will see them.

A launch writes a file that runs elsewhere: on SLURM or torchrun nodes a relative path resolves
in whatever folder the job starts in, and a path that does not exist here is usually a
placeholder (`/path/to/model`) or a folder of this machine only. Each such path is one warning
line (`--strict`: one refusing line, exit 2). On Kubernetes the pods see only the image and their
volumes, so input paths not already on the claim are moved onto it (`CLAIM/inputs/NAME`) and a
note says what to copy there.

Which keys hold paths is config/paths.py's `PATH_KEYS` (what `load_recipe` resolves against the
recipe's folder; overrides on the command line stay relative to the current folder, as on the
nodes); a value is a path unless a catalogue model or an `owner/name` id of the local Hugging
Face cache that does not exist as a path (train/data/sources.py `_load_hf`'s rule).
"""
from __future__ import annotations

import glob
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

from shardtune.catalog.models import MODELS
from shardtune.config import RunConfig
from shardtune.config.paths import KEEP, PATH_KEYS
from shardtune.errors import UserError
from shardtune.train.data.sources import BUILDERS, JSONL


@dataclass(frozen=True)
class RecipePath:
    key: str  # the recipe key: data.path, data.sources[1].path, output_dir, ...
    value: str
    output: bool = False  # the run writes it (created when missing)

    @property
    def exists(self) -> bool:
        v = str(Path(self.value).expanduser())
        return bool(glob.glob(v)) if any(c in v for c in "*?[") else os.path.exists(v)


def _looks_like_path(spec: str) -> bool:
    """As train/data/sources.py `_load_hf` tells a path from a cached dataset id."""
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or any(c in spec for c in "*?[")
            or Path(spec).suffix.lower() in (*BUILDERS, *JSONL[:-1]))


def _path(key: str, value, kind: str) -> list[RecipePath]:
    """`value` of `key` as a RecipePath if the trainer reads it as a path (config/paths.py kinds)."""
    if not isinstance(value, str) or value in KEEP:
        return []
    p = RecipePath(key, value, output=kind == "folder")
    if kind == "jinja" and not value.endswith(".jinja"):
        return []  # a named template or the template's text
    if kind == "name" and not p.exists:
        if key == "model.name" and value in MODELS:
            return []
        if not _looks_like_path(value) and "/" in value:  # a Hub id of the local cache (model or dataset)
            return []
    return [p]


def recipe_paths(cfg: RunConfig) -> list[RecipePath]:
    """Every path of the resolved recipe that a node opens or writes (config/paths.py PATH_KEYS, the
    data sources), and the run folder even when the recipe leaves it to the default."""
    found: list[RecipePath] = []
    for section, key, kind in PATH_KEYS:
        node = getattr(cfg, section) if section else cfg
        found += _path(f"{section}.{key}" if section else key, getattr(node, key, None), kind)
    for i, src in enumerate(cfg.data.sources or []):
        found += _path(f"data.sources[{i}].path", src.path, "name")
    if cfg.output_dir is None:
        found.append(RecipePath("output_dir", str(cfg.run_dir), output=True))
    return found


def node_problems(cfg: RunConfig) -> list[str]:
    """One sentence per path that the nodes of a SLURM or torchrun job will not see as here."""
    out = []
    for p in recipe_paths(cfg):
        shown = f"{p.key} {p.value!r}"
        if not posixpath.isabs(p.value) and not p.value.startswith("~"):
            what = "writes to it" if p.output else "reads it"
            out.append(f"{shown} is relative: each node {what} from the folder its job starts in, not this one; "
                       "give an absolute path on a filesystem every node mounts")
        elif not p.output and not p.exists:
            out.append(f"{shown} does not exist on this machine: every node must have it at that path")
    return out


def check_node_paths(cfg: RunConfig, strict: bool) -> list[str]:
    """Warning lines for a SLURM / torchrun job; with `strict`, the first problem as a UserError."""
    problems = node_problems(cfg)
    if strict and problems:
        more = f"; {len(problems) - 1} more path problem(s)" if len(problems) > 1 else ""
        raise UserError(f"{problems[0]} (--strict{more})")
    return [f"warning: {p}" for p in problems]


def claim_moves(cfg: RunConfig, mount: str) -> list[tuple[RecipePath, str]]:
    """(input path, where the pods read it on the claim) for each input not already under `mount`."""
    mount = mount.rstrip("/") or "/"
    moves, used = [], set()
    for p in recipe_paths(cfg):
        norm = posixpath.normpath(p.value)
        if p.output or norm == mount or norm.startswith(mount + "/"):
            continue
        base = posixpath.basename(norm) or "input"
        target, k = f"{mount}/inputs/{base}", 1
        while target in used:  # two inputs of one name (train/data.jsonl, val/data.jsonl)
            k += 1
            target = f"{mount}/inputs/{k}-{base}"
        used.add(target)
        moves.append((p, target))
    return moves


def claim_notes(cfg: RunConfig, mount: str, claim: str, strict: bool) -> list[str]:
    """A note per moved input (what to copy where); with `strict`, a UserError instead."""
    moves = claim_moves(cfg, mount)
    if strict and moves:
        p, _ = moves[0]
        more = f"; {len(moves) - 1} more" if len(moves) > 1 else ""
        raise UserError(f"{p.key} {p.value!r} is not on the claim mounted at {mount}: the pods cannot see it; put it "
                        f"there and give that path (--strict{more})")
    return [f"note: {p.key} {p.value!r} is not in the pods: the job reads {target} on claim "
            f"{claim}; copy it there before applying" for p, target in moves]


def onto_claim(cfg: RunConfig, mount: str) -> RunConfig:
    """`cfg` with every input path replaced by its place on the claim (claim_moves)."""
    new = {p.key: target for p, target in claim_moves(cfg, mount)}
    if not new:
        return cfg
    model = cfg.model.model_copy(update={"name": new.get("model.name", cfg.model.name)})
    sources = [s.model_copy(update={"path": new.get(f"data.sources[{i}].path", s.path)})
               for i, s in enumerate(cfg.data.sources or [])] or cfg.data.sources
    data = cfg.data.model_copy(update={
        "path": new.get("data.path", cfg.data.path), "val_path": new.get("data.val_path", cfg.data.val_path),
        "chat_template": new.get("data.chat_template", cfg.data.chat_template), "sources": sources})
    return cfg.model_copy(update={"model": model, "data": data})
