"""Typed run config: YAML recipe + `key.path=value` overrides → validated `RunConfig`.

Each section is a small pydantic model; functions take the narrowest section they need
(`build_parallel_model(meta_model, cfg.parallel, mesh, ...)`), never the whole config. Checks that need more
than the config's own fields (model folder, dataset, world size, run folder) are
train/launcher/preflight.py `validate_for_launch`. Imports no torch (and nothing from plan/ or train/), so
`shardtune train` validates a recipe before any process starts.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from shardtune.config.base import _Section
from shardtune.config.data import DataConfig
from shardtune.config.keys import all_keys, closest_key
from shardtune.config.lora import LoraConfig
from shardtune.config.model import ModelConfig
from shardtune.config.optim import OptimConfig
from shardtune.config.parallel import ParallelConfig
from shardtune.config.paths import resolve_recipe_paths
from shardtune.config.plan_keys import PLAN_KEYS, read_key
from shardtune.config.rl import RLConfig
from shardtune.config.train import CheckpointConfig, TrainConfig
from shardtune.errors import UserError
from shardtune.rules.combination import check_combination
from shardtune.rules.pipeline import check_pp_schedule
from shardtune.rules.rl import check_grpo

__all__ = ["CheckpointConfig", "DataConfig", "LoraConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
           "RLConfig", "RunConfig", "TrainConfig", "apply_override", "build_config", "dump_config", "load_recipe"]


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


class RunConfig(_Section):
    name: str = Field("run", description="Run name; the run folder defaults to runs/<name>.")
    output_dir: str | None = Field(None, description="Run folder (default runs/<name>).")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = Field(default_factory=TrainConfig)  # built at load: it reads SHARDTUNE_WATCHDOG_S
    checkpoint: CheckpointConfig = CheckpointConfig()
    lora: LoraConfig = LoraConfig()
    rl: RLConfig = RLConfig()
    _recipe_paths: dict = PrivateAttr(default_factory=dict)  # config/paths.py: {key: (written, resolved)}

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        """A run name is a folder name under runs/: no path, no control characters."""
        if not v.strip() or v in (".", "..") or "/" in v or v.startswith("-") or _has_control(v):
            raise ValueError(f"{v!r} is not a run name: give a folder name (no '/', '..', leading '-', line breaks "
                             "or control characters), or set output_dir for a path")
        return v

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, v: str | None) -> str | None:
        if v is not None and _has_control(v):
            raise ValueError(f"{v!r} holds a line break or control character; give a plain path")
        return v

    @model_validator(mode="after")
    def _check(self):
        par = self.parallel
        check_combination(par.strategy, precision=par.precision, offload=par.offload, optimizer=self.optim.name,
                          optimizer_impl=self.optim.implementation, lora_rank=self.lora.rank,
                          hsdp_shard_size=par.hsdp_shard_size, activation_checkpointing=par.activation_checkpointing,
                          ac_every=par.ac_every, quantize_base=self.lora.quantize_base,
                          compile=self.train.compile, loss_chunks=self.train.loss_chunks, tp=par.tp, cp=par.cp,
                          activation_offload=par.activation_offload, seq_len=self.train.seq_len,
                          sequence_parallel=par.sequence_parallel, objective=self.train.objective, ep=par.ep,
                          lora_experts=bool(self.lora.target_parameters))
        check_pp_schedule(par.pp, par.pp_schedule, par.pp_virtual_stages, self.train.grad_accum)
        if par.pp_layers is not None and par.pp == 1:
            raise UserError("parallel.pp_layers splits the layers over pipeline stages: it needs parallel.pp > 1")
        if self.train.objective == "grpo":
            check_grpo(par.strategy, tp=par.tp, cp=par.cp, pp=par.pp, ep=par.ep, quantize_base=self.lora.quantize_base,
                       activation_offload=par.activation_offload, compile=self.train.compile, offload=par.offload,
                       activation_checkpointing=par.activation_checkpointing)
            if not self.rl.reward:
                raise UserError("train.objective grpo needs rewards: rl.reward, e.g. [{name: regex, pattern: "
                                "'\\d+'}] (docs/rl.md)")
        elif changed := sorted(k for k in self.rl.model_fields_set  # a run folder's config.yaml holds the defaults
                               if getattr(self.rl, k) != getattr(RLConfig(), k)):
            raise UserError(f"rl.{changed[0]} is set but the rl section acts under "
                            f"train.objective grpo only (this run: {self.train.objective}); remove it, or set "
                            "train.objective grpo")
        return self  # once, here; the heads and the world are the layout's (preflight, Layout.check_model)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or os.path.join("runs", self.name))

    def plan_inputs(self) -> dict:
        """The planner's inputs (plan/validate.py `PlanInputs`) for exactly this run, bar the world
        size and layout: `shardtune plan RECIPE` and the run's plan.json both use it. One table
        (config/plan_keys.py) says which recipe key each input is read from."""
        out = {field: read_key(self, key) for field, key in PLAN_KEYS.items()}
        out["model"] = self.model.plan_name()
        return out


def _unknown_key_message(key: str) -> str:
    close = closest_key(key, all_keys(RunConfig))
    hint = f" (did you mean {close!r}?)" if close else ""
    return f"unknown recipe key {key!r}{hint}"


def apply_override(data: dict, item: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (3e-4, true, [1,2])."""
    if "=" not in item:
        raise UserError(f"override {item!r} is not key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise UserError(_unknown_key_message(key))
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        node[parts[-1]] = raw


def _format_validation_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return _unknown_key_message(loc)
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:
        return f"recipe: {msg}"
    value = err.get("input")
    if err["type"].startswith(("greater_than", "less_than", "literal_error")) or (
            isinstance(value, (str, int, float)) and err["type"] != "value_error"):
        # name the value the user gave: "recipe key 'train.micro_batch' = 0: ..."
        return f"recipe key {loc!r} = {value!r}: {msg[:1].lower()}{msg[1:]}"
    return f"recipe key {loc!r}: {msg}"


def build_config(data: dict) -> RunConfig:
    """Validate a recipe dict; a bad value is a one-line UserError naming the key."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(_format_validation_error(e)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (line {key_node.start_mark.line + 1}); keep one",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML recipe (None: all defaults), apply `key.path=value` overrides, validate. Relative
    paths in the recipe are read against its folder (config/paths.py), those of overrides against the
    current folder."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"recipe {str(path)!r} does not exist; give a YAML recipe such as recipes/tiny-cpu.yaml")
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"recipe {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); save it "
                            "as UTF-8") from None
        except OSError as e:
            raise UserError(f"recipe {str(path)!r} cannot be read ({e.strerror or e})") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        except yaml.YAMLError as e:
            raise UserError(f"recipe {str(path)!r} is not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(data, dict):
            raise UserError(f"recipe {str(path)!r} must be a YAML mapping of sections")
        data.setdefault("name", p.stem)
        written = resolve_recipe_paths(data, p.parent.resolve())  # relative paths: against the recipe's folder
    else:
        written = {}
    for item in overrides:
        apply_override(data, item)
        written.pop(item.split("=", 1)[0].strip(), None)  # the command line's own path: against the cwd
    cfg = build_config(data)
    cfg._recipe_paths = written
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (written to the run folder)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
