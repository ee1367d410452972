"""The trainer's flags, declared once: `shardtune train` (typer, train/commands.py), `python -m
shardtune.train` (argparse, train/__main__.py), `flag_overrides` and `torchrun_command` all read
`TRAIN_FLAGS`. A flag is a shorthand for one recipe key. The rows marked `launch` (the job's layout:
strategy and parallel degrees) are also options of `shardtune launch torchrun|slurm|k8s`
(launch/commands.py, `flag_options`), passed to every node's trainer as the same overrides; a new
degree is one row here. Imports no torch (the CLI path).
"""
from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

import typer

from shardtune.strategies import PRECISIONS, STRATEGIES


@dataclass(frozen=True)
class Flag:
    name: str  # python name; the option is --name-with-dashes
    key: str  # the recipe key it overrides
    type: type  # str or int
    help: str
    metavar: str  # what help shows after the option: `[a|b|c]` for fixed choices, as plan's flags do
    launch: bool = False  # the job's layout: also an option of each launch command

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


def _choices(names) -> str:
    return "[" + "|".join(names) + "]"


# the choices are the config's (strategies.py); the recipe's validation refuses anything else in one line
# (and accepts the seed's FSDP1 aliases such as FULL_SHARD, which the help does not list)
TRAIN_FLAGS: tuple[Flag, ...] = (
    Flag("strategy", "parallel.strategy", str, "Sharding strategy (parallel.strategy).", _choices(STRATEGIES),
         launch=True),
    Flag("precision", "parallel.precision", str, "Training precision (parallel.precision).", _choices(PRECISIONS)),
    Flag("max_steps", "train.max_steps", int, "Optimizer steps (train.max_steps).", "N"),
    Flag("seed", "train.seed", int, "Random seed: weight init, data order (train.seed).", "N"),
    Flag("output_dir", "output_dir", str, "Run folder (default runs/<recipe name>).", "DIR"),
    Flag("checkpoint_every", "checkpoint.every", int, "Save a checkpoint every N steps (checkpoint.every).", "N"),
    Flag("keep", "checkpoint.keep", int, "Keep the newest K checkpoints of this run (checkpoint.keep).", "K"),
    Flag("resume", "checkpoint.resume", str, "auto: the newest complete checkpoint that verifies; never: a fresh "
         "start; or a checkpoints/step_N folder (checkpoint.resume).", "[auto|never|PATH]"),
    Flag("tp", "parallel.tp", int, "Tensor-parallel degree (parallel.tp), inside a node: data-parallel degree = "
         "processes / tp.", "T", launch=True),
    Flag("cp", "parallel.cp", int, "Context-parallel degree (parallel.cp): each sequence split over C ranks; "
         "data-parallel degree = processes / (tp x cp).", "C", launch=True),
    Flag("ep", "parallel.ep", int, "Expert-parallel degree (parallel.ep; MoE models): each layer's experts split "
         "over E data-parallel ranks, which must divide them and dp_shard x cp.", "E", launch=True),
    Flag("pp", "parallel.pp", int, "Pipeline-parallel degree (parallel.pp): the decoder layers split into P stages "
         "(across nodes, tp inside one); data-parallel degree = processes / (pp x tp x cp).", "P", launch=True),
    Flag("lora_rank", "lora.rank", int,
         "LoRA rank on q/k/v/o/gate/up/down (lora.rank; 0: full fine-tune), as `shardtune plan --lora-rank`.", "R"),
)
FLAG_BY_NAME = {f.name: f for f in TRAIN_FLAGS}
LAUNCH_FLAGS = tuple(f for f in TRAIN_FLAGS if f.launch)


def flag_overrides(**flags) -> list[str]:
    """`--strategy zero2` → `parallel.strategy="zero2"` (JSON is YAML: strings stay strings)."""
    return [f"{FLAG_BY_NAME[k].key}={json.dumps(v)}" for k, v in flags.items() if v is not None]


def flag_argv(flags: dict) -> list[str]:
    """The flags given, back as command-line arguments (`--max-steps 5`), in table order."""
    return [a for f in TRAIN_FLAGS if flags.get(f.name) is not None for a in (f.option, str(flags[f.name]))]


def add_argparse_flags(parser: argparse.ArgumentParser) -> None:
    for f in TRAIN_FLAGS:
        parser.add_argument(f.option, dest=f.name, type=f.type, help=f.help, metavar=f.metavar)


def flag_parameters(flags: tuple[Flag, ...] = TRAIN_FLAGS) -> list[inspect.Parameter]:
    """One typer option per flag (default None: the recipe's value), for an explicit signature."""
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type | None,
                              default=typer.Option(None, f.option, help=f.help, metavar=f.metavar))
            for f in flags]


def with_flags(fn: Callable, params: list[inspect.Parameter], flags: tuple[Flag, ...] = TRAIN_FLAGS) -> Callable:
    """`fn(**kwargs)` with the signature `params` + `flags`' options, which typer reads."""
    def command(**kwargs):
        return fn(**kwargs)

    command.__signature__ = inspect.Signature(params + flag_parameters(flags))
    command.__doc__ = fn.__doc__
    return command


def flag_options(flags: tuple[Flag, ...]) -> Callable[[Callable], Callable]:
    """Decorator: a command `fn(..., **flags)` whose `**flags` become one option per flag of `flags`."""
    def decorate(fn: Callable) -> Callable:
        params = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
        return with_flags(fn, params, flags)
    return decorate
