"""Typed run config: YAML recipe + `key.path=value` overrides → validated `RunConfig`.

Each section is a small pydantic model; functions take the narrowest section they need
(`build_parallel_model(meta_model, cfg.parallel, mesh, ...)`), never the whole config. Checks that need more
than the config's own fields (model folder, dataset, world size, run folder) are
train/preflight.py `validate_for_launch`. Imports no torch (and nothing from plan/ or train/), so
`shardtune train` validates a recipe before any process starts.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardtune.errors import UserError
from shardtune.strategies import (
    FSDP_STRATEGIES,
    LORA_TARGETS,
    STRATEGY,
    check_combination,
    normalize_ac,
    normalize_offload,
    normalize_optimizer_impl,
    normalize_precision,
    normalize_strategy,
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_counts(cls, data):
        """`max_steps: true` is not 1: a boolean is accepted only where the field is a boolean."""
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key)
                if isinstance(value, bool) and field is not None and field.annotation is not bool:
                    raise ValueError(f"{key} = {str(value).lower()} is a boolean; give a number or a name "
                                     "(booleans are not counts)")
        return data


class ModelConfig(_Section):
    name: str = Field("tiny-llama", description="Catalogue name (e.g. llama-3-8b, tiny-llama) or a local HF "
                                                "model folder.")
    init: Literal["auto", "random", "pretrained"] = Field(
        "auto", description="auto: load safetensors weights when `name` is a folder that has them, else seeded "
                            "random init.")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the model folder. Off "
                                                       "unless you ask.")


class DataConfig(_Section):
    path: str | None = Field(
        None, description="JSONL file: `text`, or `prompt`+`response`, or chat `messages` per line. None or "
                          "'generated': the built-in generated dataset (shardtune/train/data/datagen.py).")
    format: Literal["auto", "text", "prompt_response", "chat"] = Field(
        "auto", description="auto: each line's keys decide (messages → chat, prompt+response → prompt_response, "
                            "text → text); otherwise every line must have that format.")
    tokenizer: Literal["auto", "byte", "hf"] = Field(
        "auto", description="auto: the model folder's tokenizer if it has one, else the built-in byte-level "
                            "tokenizer; byte: always bytes; hf: the folder's tokenizer or an error.")
    template: Literal["auto", "chat", "plain"] = Field(
        "auto", description="How prompt/response and chat examples become text. auto: the tokenizer's chat "
                            "template if it has one, else plain; plain: bos+prompt+response+eos, chat turns "
                            "as '<|role|>\\n' + content.")
    packing: bool = Field(
        True, description="Pack several examples into each seq_len row (position ids restart per example; no "
                          "attention across examples, see train/data/dataset.py). False: one example per row, "
                          "padded.")
    shuffle: bool = Field(True, description="Shuffle the rows each epoch (seeded by train.seed).")
    generated_examples: int = Field(4000, ge=1, description="Size of the built-in generated dataset.")
    generated_seed: int = Field(1234, description="Seed of the built-in generated dataset (independent of "
                                                  "train.seed, so runs with different seeds see the same data).")


class ParallelConfig(_Section):
    strategy: str = Field("zero3", description="ddp | zero1 | zero2 | zero3 | hsdp (FSDP1 names FULL_SHARD, "
                                               "SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD accepted).")
    hsdp_shard_size: int | None = Field(None, ge=1, description="hsdp: ranks per shard group (must divide the "
                                                                "world size). None: processes per node.")
    precision: str = Field("bf16-mixed", description="bf16-mixed (bf16 compute, fp32 master weights and "
                                                     "gradient reduction) | bf16 | fp32.")
    activation_checkpointing: str = Field("none", description="none | full (every decoder layer) | selective "
                                                              "(every `ac_every`-th layer).")
    ac_every: int = Field(2, ge=1, description="selective AC: checkpoint every k-th decoder layer.")
    offload: str = Field("none", description="none | all (FSDP2 CPUOffloadPolicy: params, grads and optimizer "
                                             "on CPU; FSDP strategies only).")

    _norm = field_validator("strategy")(lambda v: normalize_strategy(v))
    _prec = field_validator("precision")(lambda v: normalize_precision(v))
    _ac = field_validator("activation_checkpointing")(lambda v: normalize_ac(v))
    _off = field_validator("offload")(lambda v: normalize_offload(v))

    @model_validator(mode="after")
    def _check(self):
        if self.offload == "optimizer":
            raise ValueError("offload 'optimizer' is a planner-only mode (DeepSpeed's); the trainer offers "
                             "offload 'all' (FSDP2 CPUOffloadPolicy)")
        if self.offload == "all" and not STRATEGY[self.strategy].fsdp:
            raise ValueError(f"offload 'all' needs an FSDP strategy ({', '.join(FSDP_STRATEGIES)}), "
                             f"not {self.strategy!r}")
        if self.hsdp_shard_size is not None and not STRATEGY[self.strategy].hybrid:
            raise ValueError(f"parallel.hsdp_shard_size {self.hsdp_shard_size} applies to hsdp only and would be "
                             f"ignored by {self.strategy!r}; drop it or use parallel.strategy=hsdp")
        if self.ac_every != 2 and self.activation_checkpointing != "selective":
            raise ValueError(f"parallel.ac_every {self.ac_every} applies to activation_checkpointing=selective only "
                             f"and would be ignored with {self.activation_checkpointing!r}; drop it or set "
                             "parallel.activation_checkpointing=selective")
        return self


class OptimConfig(_Section):
    name: Literal["adamw", "adamw-8bit"] = Field(
        "adamw", description="adamw: torch.optim.AdamW | adamw-8bit: bitsandbytes' AdamW8bit (m and v in 8 bits, "
                             "blockwise: 2 B/param instead of 8; needs bitsandbytes; ddp and zero1 only, it does "
                             "not take FSDP2's DTensor parameters).")
    implementation: str = Field(
        "auto", description="torch AdamW kernel: auto (torch's choice: foreach on CUDA, for-loop on CPU) | "
                            "foreach (a temporary the size of the rank's states) | fused (no temporary) | "
                            "for-loop (temporaries of the largest tensor only) | bf16-stochastic (pure bf16 "
                            "only: the update in fp32, weights rounded stochastically, train/core/optim.py). "
                            "See docs/planner.md.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.95))
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0: no clipping).")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of `lr`.")

    _impl = field_validator("implementation")(lambda v: normalize_optimizer_impl(v))

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas {list(v)} must each be in [0, 1) (Adam's moment decay rates)")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.name == "adamw-8bit":
            if self.implementation != "auto":
                raise ValueError("optim.implementation applies to torch's AdamW; leave it 'auto' with adamw-8bit")
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ValueError("optim.name 'adamw-8bit' needs bitsandbytes (pip install bitsandbytes); "
                                 "it is not installed")
        return self


class TrainConfig(_Section):
    micro_batch: int = Field(4, ge=1, description="Sequences per rank per forward/backward.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step. Global batch = micro_batch "
                                                 "× grad_accum × data-parallel ranks.")
    seq_len: int = Field(128, ge=2, description="Tokens per sequence.")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; None: derived from `epochs`.")
    epochs: float = Field(1.0, gt=0, description="Used when max_steps is None.")
    seed: int = Field(0, description="Seeds init, data order and dropout.")
    log_every: int = Field(1, ge=1, description="Write metrics every k optimizer steps.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl with CUDA, else gloo.")
    timeout_s: float = Field(600.0, gt=0, description="Process-group timeout: a rank that waits longer on a "
                                                      "collective fails instead of hanging.")
    gpu: str = Field("h100-80gb", description="GPU catalogue name for MFU and the plan (ignored for the device "
                                              "itself).")
    max_bad_steps: int = Field(5, ge=1, description="Stop after this many consecutive steps with a non-finite "
                                                    "loss or gradient norm (each is skipped: no optimizer step).")


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="Save every N optimizer steps (0: only at the end).")
    keep: int = Field(2, ge=1, description="Keep the newest K complete checkpoints.")
    resume: str = Field("auto", description="auto (newest complete checkpoint in the run folder) | never | a "
                                            "checkpoint path.")
    export_hf: bool = Field(False, description="Export a Hugging Face folder at the end of training.")
    save_final: bool = Field(True, description="Save a checkpoint after the last step.")


class LoraConfig(_Section):
    """PEFT LoRA (Hu et al. 2021): W x + (alpha / rank) · B A x on each target nn.Linear; the base
    weights are frozen (no grads, no optimizer state), as plan/params.py `model_shapes` assumes."""
    rank: int = Field(0, ge=0, le=65_536, description="LoRA rank r (0: off, full fine-tuning).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input (0: none; the run is then "
                                                        "the same on any layout).")
    target_modules: list[str] = Field(list(LORA_TARGETS), description="Names of the nn.Linear modules that get "
                                      "adapters (default: attention and MLP projections).")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v or any(not t.replace("_", "").isalnum() for t in v):
            raise ValueError(f"{v!r} must be a non-empty list of module names such as {list(LORA_TARGETS[:2])}")
        return v


class RunConfig(_Section):
    name: str = Field("run", description="Run name; the run folder defaults to runs/<name>.")
    output_dir: str | None = Field(None, description="Run folder (default runs/<name>).")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    lora: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _check(self):
        par = self.parallel
        check_combination(par.strategy, precision=par.precision, offload=par.offload, optimizer=self.optim.name,
                          optimizer_impl=self.optim.implementation, lora_rank=self.lora.rank,
                          hsdp_shard_size=par.hsdp_shard_size, activation_checkpointing=par.activation_checkpointing,
                          ac_every=par.ac_every)
        if self.optim.name == "adamw-8bit" and STRATEGY[self.parallel.strategy].fsdp:
            # measured (bitsandbytes 0.50.2, torch 2.13): "optimizer_update_8bit_blockwise got
            # mixed torch.Tensor and DTensor" on FSDP2's sharded parameters
            ddp_like = " or ".join(s.name for s in STRATEGY.values() if not s.fsdp)
            raise ValueError(f"optim.name 'adamw-8bit' runs under {ddp_like} only: bitsandbytes does "
                             f"not take FSDP2's DTensor parameters (strategy {self.parallel.strategy!r})")
        if self.optim.implementation == "bf16-stochastic" and self.parallel.precision != "bf16":
            raise ValueError("optim.implementation 'bf16-stochastic' rounds bf16 weights: it needs "
                             f"parallel.precision bf16, not {self.parallel.precision!r}")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or os.path.join("runs", self.name))

    def plan_inputs(self) -> dict:
        """The planner's inputs (plan/validate.py `Inputs`) for exactly this run, bar the world
        size and layout: `shardtune plan RECIPE` and the run's plan.json both use it."""
        return dict(
            model=self.model.name, gpu=self.train.gpu, seq_len=self.train.seq_len,
            micro_batch=self.train.micro_batch, grad_accum=self.train.grad_accum,
            precision=self.parallel.precision, optimizer=self.optim.name,
            optimizer_impl=self.optim.implementation, ac=self.parallel.activation_checkpointing,
            ac_every=self.parallel.ac_every, offload=self.parallel.offload,
            hsdp_shard_size=self.parallel.hsdp_shard_size, lora_rank=self.lora.rank)


def _all_keys(model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.append(prefix + name)  # the section itself, so `modle:` suggests `model`
            keys += _all_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _unknown_key_message(key: str) -> str:
    keys = _all_keys(RunConfig)
    leaf = key.rsplit(".", 1)[-1]
    # the right name in the wrong section first (`train.lr` → `optim.lr`), then a near spelling
    close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1] or difflib.get_close_matches(
        key, keys, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
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
    """Read a YAML recipe (None: all defaults), apply `key.path=value` overrides, validate."""
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
    for item in overrides:
        apply_override(data, item)
    return build_config(data)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (written to the run folder)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
