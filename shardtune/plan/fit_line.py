"""`plan --fit`'s pick as a `shardtune train` command that runs as printed. It reads recipes through
shardtune.config, which the rest of plan/ may not import: its own row of the layer table, above
config (docs/DESIGN.md). Imports no torch.

The command (one node: `shardtune train`; more: `shardtune launch slurm`) names a recipe (the one
planned, else the repository's recipe whose model.name or model.architecture is the model, else
the Llama-3-8B one with `model.name=`), then the train flags and `key=value` overrides for every
planner input whose value differs from the recipe's: `resolve_config` on it gives a RunConfig
whose `plan_inputs()` are the pick's (tests/unit/test_fit.py pastes it).
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from shardtune.config import load_recipe
from shardtune.config.flags import TRAIN_FLAGS
from shardtune.config.plan_keys import PLAN_KEYS
from shardtune.plan.fit import Candidate
from shardtune.plan.validate import PlanInputs
from shardtune.strategies import STRATEGY

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FALLBACK_RECIPE = "llama-3-8b-8xh100.yaml"  # a GPU recipe (nccl, bf16-mixed) for any catalogue model
# every planner input a recipe holds → (train flag or None, recipe key): the recipe key is the one
# table's (config/plan_keys.py), the flag the trainer's own for that key (config/flags.py)
_RECIPE_KEY = {"strategy": "parallel.strategy", **PLAN_KEYS}  # a recipe runs one strategy; plan compares several
_FLAG = {f.key: f.option for f in TRAIN_FLAGS}
_KEYS = {field: (_FLAG.get(key), key) for field, key in _RECIPE_KEY.items()}
_TARGETS = ("lora_target_modules", "lora_target_parameters")  # None: the planner's default, as the recipe's
# what `--fit` chooses (the pick's value); every other input is the user's (kept, as planned)
_PICKED = ("micro_batch", "grad_accum", "precision", "optimizer", "optimizer_impl", "ac", "offload", "strategy",
           "tp", "cp", "activation_offload", "ep", "pp", "pp_layers")


def _shown(path: Path) -> str:
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except ValueError:
        return str(path)


def _base_recipe(model: str) -> str:
    for path in sorted(RECIPES.glob("*.yaml")):
        try:
            named = load_recipe(str(path)).model
            if model in (named.name, named.architecture):
                return _shown(path)
        except Exception:  # a broken repository recipe is not this command's business
            continue
    return _shown(RECIPES / FALLBACK_RECIPE)


def _model_name(model) -> str | None:
    """The trainer's model.name for the planner's MODEL: a catalogue name or a model folder."""
    if not isinstance(model, str):
        return None  # an HF config dict (Python API): nothing to name
    return str(Path(model).parent) if model.endswith(".json") else model


def train_line(best: Candidate, base: PlanInputs, recipe: str | None = None) -> str | None:
    """The `shardtune train ...` command (several nodes: `shardtune launch slurm ...`) that runs
    `best`; None when there is no model (--params)."""
    if recipe is None:
        model = _model_name(base.model)
        if model is None:
            return None
        recipe = _base_recipe(model)
    else:
        model = load_recipe(recipe).model.plan_name()
    want = {field: getattr(base, field) for field in PLAN_KEYS} | {field: getattr(best, field) for field in _PICKED}
    want |= dict(model=model, hsdp_shard_size=best.hsdp_shard_size if STRATEGY[best.strategy].hybrid else None)
    cfg = load_recipe(recipe)
    have = cfg.plan_inputs()
    have["strategy"] = cfg.parallel.strategy
    # sequence parallelism: no effect at tp 1; a tp the search chose plans it on (plan.strategy_plan.with_tp)
    want["sequence_parallel"] = ((base.sequence_parallel if base.tp > 1 else True) if best.tp > 1
                                 else have["sequence_parallel"])
    one_node = base.nodes == 1  # else `shardtune launch slurm`, which takes overrides only
    argv = (["shardtune", "train", recipe, "--nproc", str(base.gpus)] if one_node else
            ["shardtune", "launch", "slurm", recipe, "--nodes", str(base.nodes), "--gpus-per-node",
             str(base.gpus_per_node)])
    flags, overrides = [], []
    for key, (flag, recipe_key) in _KEYS.items():
        if want[key] == have[key] or (key == "ac_every" and want["ac"] != "layer") or (
                key == "model" and want[key] == cfg.model.architecture) or (
                key in _TARGETS and (not want["lora_rank"] or want[key] is None)):
            continue
        if flag and one_node:
            flags += [flag, str(want[key])]
        else:
            value = want[key]
            value = ("null" if value is None else str(value).lower() if isinstance(value, bool) else
                     f"[{','.join(map(str, value))}]" if isinstance(value, list) else value)
            overrides.append(f"{recipe_key}={value}")
            if key == "model":  # the recipe's folder facts are not the new model's
                overrides += [f"model.{k}=null" for k in ("architecture", "download") if getattr(cfg.model, k)]
    return shlex.join(argv + flags + overrides)
