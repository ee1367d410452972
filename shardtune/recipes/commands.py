"""`shardtune recipes [ls]` and `shardtune recipes cp NAME DEST` (torchtune's `tune ls` / `tune cp`)."""
from __future__ import annotations

import shutil
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
    Returns the new file and a note per relative path in it that does not exist from its new folder."""
    from shardtune.recipes import recipe_files

    files = recipe_files()
    stem = name.removesuffix(".yaml").removesuffix(".yml")
    if stem not in files:
        raise UserError(f"no shipped recipe {name!r}{suggest(stem, files)}; `shardtune recipes` lists them")
    out = Path(dest).expanduser()
    if out.is_dir():
        out = out / f"{stem}.yaml"
    if out.exists():
        raise UserError(f"{str(out)!r} exists; give a new file name (recipes cp never overwrites)")
    if not out.parent.is_dir():
        raise UserError(f"folder {str(out.parent)!r} does not exist; create it or give another destination")
    shutil.copyfile(files[stem], out)
    return out, _dangling(files[stem], out)


def _dangling(src: Path, out: Path) -> list[str]:
    """Relative paths that resolved next to the shipped recipe but not next to the copy."""
    from shardtune.config import load_recipe
    from shardtune.config.paths import recipe_paths

    notes = []
    for key, (written, resolved) in recipe_paths(load_recipe(src)).items():
        if Path(resolved).exists() and not (out.parent / written).exists():
            notes.append(f"note: {key} {written!r} is read against the recipe's folder; from {str(out.parent)!r} it "
                         f"does not exist (the shipped one's is {resolved!r}): edit it")
    return notes


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
