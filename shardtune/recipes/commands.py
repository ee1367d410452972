"""`shardtune recipes [ls]` and `shardtune recipes cp NAME DEST` (torchtune's `tune ls` / `tune cp`)."""
from __future__ import annotations

import typer

from shardtune.recipes import list_recipes


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
        from shardtune.recipes.copy import copy_recipe  # reads config/: only when copying

        out, notes = copy_recipe(name, dest)
        print(f"copied {name} to {out}")
        for line in notes:
            print(line)

    app.add_typer(group, name="recipes")
