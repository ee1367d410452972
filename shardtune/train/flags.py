"""The trainer's flags, declared once: `shardtune train` (typer, train/commands.py), `python -m
shardtune.train` (argparse, train/__main__.py), `flag_overrides` and `torchrun_command` all read
`TRAIN_FLAGS`. A flag is a shorthand for one recipe key. Imports no torch (the CLI path).
"""
from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

import typer


@dataclass(frozen=True)
class Flag:
    name: str  # python name; the option is --name-with-dashes
    key: str  # the recipe key it overrides
    type: type  # str or int
    help: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


TRAIN_FLAGS: tuple[Flag, ...] = (
    Flag("strategy", "parallel.strategy", str, "ddp | zero1 | zero2 | zero3 | hsdp"),
    Flag("precision", "parallel.precision", str, "bf16-mixed | bf16 | fp32"),
    Flag("max_steps", "train.max_steps", int, "Optimizer steps."),
    Flag("seed", "train.seed", int, "Random seed (train.seed)."),
    Flag("output_dir", "output_dir", str, "Run folder (default runs/<recipe name>)."),
    Flag("checkpoint_every", "checkpoint.every", int, "Save a checkpoint every N steps (checkpoint.every)."),
    Flag("keep", "checkpoint.keep", int, "Keep the newest K checkpoints (checkpoint.keep)."),
    Flag("resume", "checkpoint.resume", str, "auto (newest complete checkpoint) | never | a checkpoints/step_N path."),
    Flag("lora_rank", "lora.rank", int,
         "LoRA rank on q/k/v/o/gate/up/down (lora.rank; 0: full fine-tune), as `shardtune plan --lora-rank`."),
)
FLAG_BY_NAME = {f.name: f for f in TRAIN_FLAGS}


def flag_overrides(**flags) -> list[str]:
    """`--strategy zero2` → `parallel.strategy="zero2"` (JSON is YAML: strings stay strings)."""
    return [f"{FLAG_BY_NAME[k].key}={json.dumps(v)}" for k, v in flags.items() if v is not None]


def flag_argv(flags: dict) -> list[str]:
    """The flags given, back as command-line arguments (`--max-steps 5`), in table order."""
    return [a for f in TRAIN_FLAGS if flags.get(f.name) is not None for a in (f.option, str(flags[f.name]))]


def add_argparse_flags(parser: argparse.ArgumentParser) -> None:
    for f in TRAIN_FLAGS:
        parser.add_argument(f.option, dest=f.name, type=f.type, help=f.help)


def flag_parameters() -> list[inspect.Parameter]:
    """One typer option per flag (default None: the recipe's value), for an explicit signature."""
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type | None,
                              default=typer.Option(None, f.option, help=f.help)) for f in TRAIN_FLAGS]


def with_flags(fn: Callable, params: list[inspect.Parameter]) -> Callable:
    """`fn(**kwargs)` with the signature `params` + the table's flags, which typer reads."""
    def command(**kwargs):
        return fn(**kwargs)

    command.__signature__ = inspect.Signature(params + flag_parameters())
    command.__doc__ = fn.__doc__
    return command
