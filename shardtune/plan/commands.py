"""`shardtune plan`: per-GPU memory, fit and communication of every strategy. Imports no torch.

The planner's options are generated from config/plan_keys.py `PLAN_OPTIONS` (one row per
`plan.validate.PlanInputs` field: its type and default come from the field), so a new planner
input is a field and a row, not a hand-written option here; a recipe key that sets it goes in
PLAN_KEYS (tests/unit/test_key_table.py checks all three agree). This module holds the command's
own options (--list, --wide, --json, --simulate, --fit, --fit-batch) and the glue.
"""
from __future__ import annotations

import inspect
import json
import sys

import typer

from shardtune.config.plan_keys import PLAN_KEYS, PLAN_OPTIONS
from shardtune.errors import UserError
from shardtune.plan.validate import PlanInputs

_D = PlanInputs()  # the defaults, in one place
_RENAMED = {o.param: o.field for o in PLAN_OPTIONS if o.param != o.field}  # option name → PlanInputs field


def _is_recipe(model: str | None) -> bool:
    return bool(model) and model.endswith((".yaml", ".yml"))


def recipe_inputs(path: str, given: set[str], overrides: list[str] = ()) -> dict:
    """Planner inputs taken from a training recipe (YAML) and its `key=value` overrides, except those
    given on the command line: `shardtune plan recipes/tiny-cpu.yaml --gpus 8` plans exactly what
    `shardtune train` would run."""
    from shardtune.config import load_recipe

    cfg = load_recipe(path, overrides)
    if cfg.model.plan_name() != cfg.model.name:
        print(f"note: model folder {cfg.model.name!r} is not on this machine; planned as its architecture "
              f"{cfg.model.architecture!r}", file=sys.stderr)
    return {k: v for k, v in cfg.plan_inputs().items() if k not in given}


def _given_on_command_line(ctx: typer.Context) -> set[str]:
    return {name for name in ctx.params
            if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"}


def plan_input_values(params: dict) -> dict:
    """The PlanInputs fields among a command's parameters (each option is named as its field)."""
    fields = set(PlanInputs.__dataclass_fields__)
    values = {_RENAMED.get(k, k): v for k, v in params.items() if _RENAMED.get(k, k) in fields}
    values["strategies"] = values.get("strategies") or None
    return values


def kept_fields(ctx: typer.Context, overrides: list[str]) -> frozenset[str]:
    """The PlanInputs fields the user set (an option, or a `key=value` override of a PLAN_KEYS key):
    `--fit` keeps them and searches only the rest."""
    by_key = {key: field for field, key in PLAN_KEYS.items()}
    named = {_RENAMED.get(p, p) for p in _given_on_command_line(ctx)}
    named |= {by_key[o.split("=", 1)[0].strip()] for o in overrides if o.split("=", 1)[0].strip() in by_key}
    return frozenset(named & set(PlanInputs.__dataclass_fields__))


def _plan(ctx: typer.Context, model: str | None, overrides: list[str] | None, list_models: bool, wide: bool,
          as_json: bool, simulate: bool, fit: bool, fit_batch: bool, **_options) -> None:
    """Per-GPU memory (params, grads, optimizer, activations, buffers), fit and communication of
    every strategy: ddp, zero1, zero2, zero3, hsdp (with --tp: beside tensor parallelism)."""
    if list_models:
        _print_catalogue()
        return
    from shardtune.plan import plan

    overrides = list(overrides or [])
    recipe = model if _is_recipe(model) else None
    if overrides and recipe is None:
        raise UserError(f"{overrides[0]!r}: key=value overrides apply to a recipe (shardtune plan RECIPE.yaml "
                        "key=value); for a catalogue model give the flags (shardtune plan -h)")
    values = plan_input_values(ctx.params)
    if recipe:
        values.update(recipe_inputs(recipe, _given_on_command_line(ctx) - {"model"}, overrides))
    inputs = PlanInputs(**values)
    if fit or fit_batch:
        _fit(inputs, as_json, recipe, fit_batch, kept_fields(ctx, overrides))
        return
    result = plan(inputs)
    if simulate:
        from shardtune.verify.compare import mark_untraced

        if not mark_untraced(result):  # torch is imported only here (verify/simulate.py)
            from shardtune.verify.simulate import attach_simulation

            attach_simulation(result, inputs.model)
    if as_json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from shardtune.plan.report import render_text

    mark = None
    if recipe:
        from shardtune.config import load_recipe

        mark = load_recipe(recipe, overrides).parallel.strategy  # its row is marked: the strategy the recipe runs
    render_text(result, wide=wide, mark=mark)
    if simulate:
        from shardtune.verify.compare import render_simulated

        render_simulated(result)


def _param(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, default=default)


def _planner_option(row) -> inspect.Parameter:
    """A PLAN_OPTIONS row as a typer option: the PlanInputs field's type and default."""
    import typing

    hint = typing.get_type_hints(PlanInputs)[row.field]
    default = getattr(_D, row.field)
    decls = row.flag.split("/") if "/" in row.flag else [row.flag]
    option = (typer.Option(default, "/".join(decls), help=row.help) if row.metavar is None else
              typer.Option(default, row.flag, metavar=row.metavar, help=row.help))
    return _param(row.param, hint, option)


# the command's own options, each after the planner option it follows in help
_OWN_OPTIONS = {
    "strategies": [
        ("list_models", bool, typer.Option(False, "--list", help="List the catalogue's models and GPUs, then exit.")),
        ("wide", bool, typer.Option(False, "--wide", help="Every table column, whatever the terminal's width "
                                    "(default: compact tables below 112 columns; COLUMNS is honoured, piped too).")),
        ("as_json", bool, typer.Option(False, "--json", help="Print one JSON object (the plan.json format).")),
        ("simulate", bool, typer.Option(
            False, "--simulate", help="Also trace the trainer's real step on fake tensors at world size --gpus "
            "(needs torch) and show it beside the analytic numbers.")),
    ],
    "tokens": [
        ("fit", bool, typer.Option(
            False, "--fit", help="Search strategy × tp × AC × offload × micro-batch × shard size × precision for "
            "the fastest config that fits (every option given is kept; the global batch and sequence are kept).")),
        ("fit_batch", bool, typer.Option(
            False, "--fit-batch", help="With --fit: also search the micro-batch (the global batch then changes; "
            "each candidate says so).")),
    ],
}


def _build_plan_cmd():
    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        _param("model", str | None, typer.Argument(
            None, metavar="MODEL",
            help="Catalogue name (shardtune plan --list), HF config.json, model folder, or a training recipe "
            "(YAML: its model and settings).")),
        _param("overrides", list[str] | None, typer.Argument(
            None, metavar="OVERRIDES", help="With a recipe: key.path=value overrides, as train and launch take them "
            "(e.g. train.seq_len=8192).")),
    ]
    for row in PLAN_OPTIONS:
        params.append(_planner_option(row))
        params += [_param(name, ann, opt) for name, ann, opt in _OWN_OPTIONS.get(row.field, ())]

    def plan_cmd(ctx: typer.Context, **kwargs) -> None:
        return _plan(ctx, **kwargs)

    plan_cmd.__signature__ = inspect.Signature(params)
    plan_cmd.__doc__ = _plan.__doc__
    return plan_cmd


plan_cmd = _build_plan_cmd()


def _fit(inputs: PlanInputs, as_json: bool, recipe: str | None, fit_batch: bool = False,
         keep: frozenset[str] = frozenset()) -> None:
    from shardtune.plan.fit import render_fit, search
    from shardtune.plan.fit_line import train_line
    from shardtune.plan.fit_pp import trainer_gap
    from shardtune.plan.validate import resolve_inputs

    result = search(inputs, fit_batch=fit_batch, keep=keep)
    gap = trainer_gap(result.best, resolve_inputs(inputs)) if result.best else None
    if gap:  # a layout the planner prices but the trainer does not run yet: no command that it would refuse
        result.notes.append(f"planned only, no train command: {gap}")
    use = train_line(result.best, resolve_inputs(inputs), recipe) if result.best and not gap else None
    if as_json:
        json.dump(dict(result.to_dict(), train_command=use), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from shardtune.plan.report import make_console

    render_fit(result, make_console(), use)


def _print_catalogue() -> None:
    from shardtune.catalog.gpus import GPUS
    from shardtune.catalog.models import MODELS

    print("models: " + ", ".join(MODELS))
    print("gpus:   " + ", ".join(GPUS))


def register(app: typer.Typer) -> None:
    app.command("plan", context_settings={"allow_interspersed_args": True})(plan_cmd)
