"""`shardtune recipes cp NAME DEST`: a shipped recipe copied to edit, its relative paths rewritten so they
still name the same files. It reads the recipe through shardtune.config (its paths), so it sits above
config in the layer table, apart from shardtune/recipes/__init__.py (layer 1). Imports no torch."""
from __future__ import annotations

import os
from pathlib import Path

from shardtune.config import load_recipe
from shardtune.config.paths import recipe_paths
from shardtune.errors import UserError, suggest
from shardtune.recipes import recipe_files


def copy_recipe(name: str, dest: str) -> tuple[Path, list[str]]:
    """Copy shipped recipe `name` to `dest` (a file, or a folder: DEST/NAME.yaml); never overwrites.
    Relative paths that would not exist from the new folder are rewritten to the same files (their
    path from the new folder, or the absolute one outside it). Returns the new file and a line each."""
    files = recipe_files()
    stem = name.removesuffix(".yaml").removesuffix(".yml")
    if stem not in files:
        raise UserError(f"no shipped recipe {name!r}{suggest(stem, files)}; `shardtune recipes` lists them")
    out = Path(dest).expanduser()
    if out.is_dir():
        out = out / f"{stem}.yaml"
    if out.is_symlink() and not out.exists():  # as cp does: a link's target may be anywhere
        raise UserError(f"{str(out)!r} is a dangling symlink; not writing through it: give a new file name")
    if out.exists():
        raise UserError(f"{str(out)!r} exists; give a new file name (recipes cp never overwrites)")
    if not out.parent.is_dir():
        raise UserError(f"folder {str(out.parent)!r} does not exist; create it or give another destination")
    text, notes = _rewrite(files[stem], out)
    with open(out, "x", encoding="utf-8") as f:  # x: never through a link or over a file made meanwhile
        f.write(text)
    return out, notes


def _rewrite(src: Path, out: Path) -> tuple[str, list[str]]:
    """The recipe's text with each relative path that resolved next to the shipped recipe but not
    next to the copy rewritten to the same file; a line for each (a note where it cannot be)."""
    text, notes = src.read_text(encoding="utf-8"), []
    for key, (written, resolved) in recipe_paths(load_recipe(src)).items():
        if not Path(resolved).exists() or (out.parent / written).exists():
            continue
        new = os.path.relpath(resolved, out.parent.resolve())
        new = resolved if new.startswith("..") else new
        if text.count(written) == 1:
            text = text.replace(written, new)
            notes.append(f"{key}: {written!r} rewritten to {new!r} (relative paths are read against the recipe's "
                         "folder)")
        else:
            notes.append(f"note: {key} {written!r} is read against the recipe's folder; from {str(out.parent)!r} it "
                         f"does not exist (the shipped one's is {resolved!r}): edit it")
    return text, notes
