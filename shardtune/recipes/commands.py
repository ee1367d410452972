"""`shardtune recipes [ls]` and `shardtune recipes cp NAME DEST` (torchtune's `tune ls` / `tune cp`)."""
from __future__ import annotations

import os
from pathlib import Path

import typer

from shardtune.errors import UserError, suggest


def list_recipes() -> str:
    from shardtune.recipes import recipe_files, summary

    files = recipe_files()
    width = max(map(len, files), default=4)
    lines = [f"{'RECIPE':<{width}}  WHAT"] + [f"{name:<{width}}  {summary(p)}" for name, p in files.items()]
    return "\n".join(lines + ["", "copy one to edit: shardtune recipes cp NAME my-recipe.yaml"])


def copy_recipe(name: str, dest: str) -> tuple[Path, list[str]]:
    """Copy shipped recipe `name` to `dest` (a file, or a folder: DEST/NAME.yaml); never overwrites.
    Relative paths that would not exist from the new folder are rewritten to the same files (their
    path from the new folder, or the absolute one outside it). Returns the new file and a line each."""
    from shardtune.recipes import recipe_files

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
    from shardtune.config import load_recipe
    from shardtune.config.paths import recipe_paths

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


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="List the shipped recipes, or copy one to edit (like torchtune's tune ls / tune cp).",
                        invoke_without_command=True, no_args_is_help=False)

    @group.callback()
    def _default(ctx: typer.Context) -> None:
        """List the shipped recipes (no subcommand), or copy one with `cp`."""
        if ctx.invoked_subcommand is None:
            print(list_recipes())

    @group.command("ls")
    def ls() -> None:
        """List the shipped recipes: name and what each trains."""
        print(list_recipes())

    @group.command("cp")
    def cp(name: str = typer.Argument(..., metavar="NAME", help="A shipped recipe, e.g. tiny-cpu"),
           dest: str = typer.Argument(..., metavar="DEST", help="New file, or a folder (DEST/NAME.yaml)")) -> None:
        """Copy a shipped recipe to DEST to edit it; then `shardtune train DEST`."""
        out, notes = copy_recipe(name, dest)
        print(f"copied {name} to {out}")
        for line in notes:
            print(line)

    app.add_typer(group, name="recipes")
