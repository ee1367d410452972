"""Paths in a recipe are read against the recipe's folder; model ids in the local Hugging Face cache.

`resolve_recipe_paths(data, folder)` rewrites each relative path value of a recipe dict (before
validation, before command-line overrides, which stay relative to the current folder) to an
absolute path under the recipe's folder, and returns {key: (as written, as resolved)} so that an
error can name both. A relative value that does not exist under the folder but reads as a name
(a catalogue model, a Hub id `owner/name`) is left as written. Absolute paths make a run folder's
config.yaml read back the same from anywhere."""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path

# (section, key, kind): "name" may also be a catalogue name or a Hub id; "file" must be a path;
# "folder" may not exist yet (it is created)
PATH_KEYS = (
    ("", "output_dir", "folder"), ("model", "name", "name"), ("data", "path", "name"),
    ("data", "val_path", "name"), ("data", "chat_template", "jinja"), ("data", "cache_dir", "folder"),
    ("checkpoint", "resume", "file"),
)
KEEP = {None, "", "auto", "never", "generated"}
_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".arrow", ".txt", ".yaml", ".safetensors")


def _resolve(value, kind: str, folder: Path):
    """(value to use, resolved path or None when left as written)."""
    if not isinstance(value, str) or value in KEEP or value.startswith(("/", "~")):
        return value, None
    if kind == "jinja" and not value.endswith(".jinja"):
        return value, None  # a named template or the template's own text
    resolved = os.path.normpath(folder / value)
    exists = glob.glob(resolved) if any(c in value for c in "*?[") else os.path.exists(resolved)
    if not exists and kind == "name" and _NAME.fullmatch(value) and not value.lower().endswith(_DATA_SUFFIXES):
        return value, None  # a catalogue name or a Hub id (model or dataset), looked up by name later
    return resolved, resolved


def resolve_recipe_paths(data: dict, folder: Path) -> dict[str, tuple[str, str]]:
    """Rewrite `data`'s relative paths against `folder` in place; {key: (written, resolved)}."""
    folder = Path(os.path.realpath(folder))  # `..` as the OS reads it, after a linked folder
    seen: dict[str, tuple[str, str]] = {}
    for section, key, kind in PATH_KEYS:
        node = data.get(section) if section else data
        if isinstance(node, dict) and key in node:
            written = node[key]
            node[key], resolved = _resolve(written, kind, folder)
            if resolved:
                seen[f"{section}.{key}" if section else key] = (written, resolved)
    sources = (data.get("data") or {}).get("sources") if isinstance(data.get("data"), dict) else None
    for i, src in enumerate(sources if isinstance(sources, list) else []):
        if isinstance(src, dict) and "path" in src:
            written = src["path"]
            src["path"], resolved = _resolve(written, "name", folder)
            if resolved:
                seen[f"data.sources[{i}].path"] = (written, resolved)
    rewards = (data.get("rl") or {}).get("reward") if isinstance(data.get("rl"), dict) else None
    for i, r in enumerate(rewards if isinstance(rewards, list) else []):  # 'file.py:function': the file
        name = r.get("name") if isinstance(r, dict) else None
        if isinstance(name, str) and ":" in name and not name.startswith(("/", "~")):
            written, fn = name.rsplit(":", 1)
            resolved = os.path.normpath(folder / written)
            r["name"] = f"{resolved}:{fn}"
            seen[f"rl.reward[{i}].name"] = (written, resolved)
    return seen


def recipe_paths(cfg) -> dict[str, tuple[str, str]]:
    """The {key: (written, resolved)} of the relative paths `load_recipe` resolved for `cfg`."""
    return dict(getattr(cfg, "_recipe_paths", None) or {})


def check_recipe_paths(cfg, prefix: str = "") -> None:
    """A relative path of the recipe that does not exist (output and cache folders aside) is one
    line naming it as written and as resolved against the recipe's folder."""
    from shardtune.errors import UserError

    for key, (written, resolved) in recipe_paths(cfg).items():
        if key in ("output_dir", "data.cache_dir") or not key.startswith(prefix):
            continue
        found = glob.glob(resolved) if any(c in written for c in "*?[") else os.path.exists(resolved)
        if not found:
            raise UserError(f"{key} {written!r} does not exist: relative paths in a recipe are read against the "
                            f"recipe's folder, here {resolved!r}; fix the path (or give an absolute one)")


def hub_cache_dir() -> Path:
    """huggingface_hub's cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def cached_model_folder(repo_id: str, revision: str = "main") -> str | None:
    """The snapshot folder of model `repo_id` in the local Hugging Face cache (offline: the layout
    huggingface_hub writes, models--OWNER--NAME/{refs/REV, snapshots/HASH/}), or None."""
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo_id):
        return None
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snap = repo / "snapshots" / commit
    return str(snap) if (snap / "config.json").is_file() else None
