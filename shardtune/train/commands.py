"""`shardtune train RECIPE [--nproc N] [flags] [key.path=value ...]`: parse, then hand over to
train/launcher/supervise.py (validate everything before any process starts, exit code 2 and one
line for a bad input; torchrun under supervision). Imports no torch at module level.
"""
from __future__ import annotations

import inspect

import typer

from shardtune.config.flags import with_flags

__all__ = ["register"]


def _train(recipe: str, overrides: list[str] | None, nproc: int, max_restarts: int, move_aside: bool,
           **flags) -> int:
    """Fine-tune with a recipe on this machine (torchrun under the hood)."""
    from shardtune.train.launcher.supervise import train_command
    from shardtune.wiring import planner  # handed to the launch checks: the trainer imports no planner

    return train_command(recipe, overrides or [], nproc, max_restarts=max_restarts, move_aside=move_aside,
                         planner=planner(), **flags)


def _param(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, default=default)


def register(app: typer.Typer) -> None:
    """`shardtune train`: the arguments below, then one option per row of config/flags.py."""
    params = [
        _param("recipe", str, typer.Argument(..., help="YAML recipe, e.g. recipes/tiny-cpu.yaml")),
        _param("overrides", list[str] | None,
               typer.Argument(None, help="key.path=value overrides, e.g. optim.lr=1e-4")),
        _param("nproc", int, typer.Option(1, "--nproc", help="Processes on this machine (torchrun --nproc-per-node).",
                                          metavar="N")),
        _param("max_restarts", int, typer.Option(0, "--max-restarts", help="torchrun restarts of the whole group "
                                                 "after a failure; each resumes from the last checkpoint.",
                                                 metavar="N")),
        _param("move_aside", bool, typer.Option(False, "--move-aside", help="With --resume never in a folder "
                                                "that has checkpoints: move the earlier run's checkpoints, metrics "
                                                "and config into <run_dir>/previous-<time>/ first (nothing is "
                                                "deleted).")),
    ]
    app.command("train", context_settings={"allow_interspersed_args": True})(with_flags(_train, params))
