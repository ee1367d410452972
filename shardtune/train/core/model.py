"""Build a transformers causal LM on the meta device, shard it, then materialise and fill it.

Fixed skeleton (torchtitan, torchtune, nanochat): meta build → shard → `to_empty` → load or init
weights, one tensor at a time (the order: parallel/build.py `build_parallel_model`). No rank ever
holds the whole model: each rank makes (random init) or reads (safetensors) one full tensor, keeps
its own slice and drops the rest.
Model code stays free of distributed code: sharding is applied from outside (parallel/).
"""
from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.catalog.models import resolve_model_config, safetensors_files
from shardtune.errors import UserError
from shardtune.parallel.build import build_parallel_model
from shardtune.parallel.ep import ep_rows
from shardtune.parallel.mesh import sub_mesh
from shardtune.strategies import STRATEGY
from shardtune.train.core.hub_layout import hub_sources, read_rows
from shardtune.train.core.lora import adapter_full_tensors, apply_lora, base_name, is_adapter
from shardtune.train.core.moe import EXPERTS_IMPLEMENTATION, attention_implementation, num_experts, prepare_moe
from shardtune.train.core.qlora import fill_nf4, is_nf4, quantize_base

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardtune.config import LoraConfig, ModelConfig, ParallelConfig


def build_hf_config(model_cfg: ModelConfig):
    """The transformers config for a catalogue name, config.json or model folder."""
    cfg = resolve_model_config(model_cfg.name)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise UserError(f"model {model_cfg.name!r}: config has no model_type; give an HF config.json")
    cfg.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **cfg)


def build_meta_model(model_cfg: ModelConfig) -> nn.Module:
    """The causal LM with every parameter on the meta device (no memory), SDPA attention (GPT-OSS:
    eager, train/core/moe.py `attention_implementation`), in fp32:
    a Hub folder's `torch_dtype: bfloat16` must not decide the training precision (bf16-mixed keeps
    fp32 masters); `parallel.build` casts to what `parallel.precision` says, weights are cast per
    tensor while loading."""
    config = build_hf_config(model_cfg)
    # MoE: experts as one grouped GEMM per layer, router in fp32 (train/core/moe.py)
    experts = {"experts_implementation": EXPERTS_IMPLEMENTATION} if num_experts(config) else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention_implementation(config),
            trust_remote_code=model_cfg.trust_remote_code, **experts)
    model.to(torch.float32)  # free on meta
    prepare_moe(model)
    model.config.use_cache = False
    return model


def uses_pretrained(model_cfg: ModelConfig) -> bool:
    """auto: load when the model folder has safetensors; pretrained: must; random: never."""
    files = safetensors_files(model_cfg.name)
    if model_cfg.init == "pretrained" and not files:
        raise UserError(f"model.init is 'pretrained' but {model_cfg.name!r} has no *.safetensors; "
                        "give an HF model folder with weights or set model.init=random")
    return model_cfg.init != "random" and bool(files)


def describe_weights(model_cfg: ModelConfig) -> str:
    """Where the weights come from, for the start-up line: "pretrained FOLDER (safetensors, bf16)"
    (the stored dtype of the first tensor) or "seeded random init"."""
    if not uses_pretrained(model_cfg):
        return "seeded random init"
    files = safetensors_files(model_cfg.name)
    with safe_open(str(files[0]), framework="pt") as h:
        stored = h.get_slice(next(iter(h.keys()))).get_dtype().lower()
    return f"pretrained {files[0].parent} ({len(files)} safetensors file(s), {stored})"


def _tensor_seed(seed: int, name: str) -> int:
    """One generator seed per tensor from (seed, name): the same on every rank and in every layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def random_full_tensors(model: nn.Module, seed: int) -> Iterator[tuple[str, Callable[..., torch.Tensor]]]:
    """(name, make) per parameter: `make(rows=None)` returns the fp32 CPU tensor (its dim-0 `rows`)
    of HF's init scheme (Linear/Embedding weights and MoE routers' and experts' 2-D / 3-D weights
    ~ N(0, initializer_range), biases 0, norms 1)."""
    std = float(getattr(model.config, "initializer_range", 0.02))
    owners = {f"{mn}.{pn}" if mn else pn: m for mn, m in model.named_modules()
              for pn, _ in m.named_parameters(recurse=False)}
    for model_name, p in model.named_parameters():
        if is_adapter(model_name):
            continue  # train/core/lora.py makes the adapters
        owner = owners[model_name]
        name = base_name(model_name)  # a LoRA-wrapped weight gets the same values as the plain one

        ep = ep_rows(model, model_name)  # expert parallelism: the full tensor holds every rank's experts
        shape = (ep[1], *p.shape[1:]) if ep else tuple(p.shape)

        def make(rows: slice | None = None, name=name, shape=shape, owner=owner) -> torch.Tensor:
            if name.endswith("bias"):
                full = torch.zeros(shape)
            elif len(shape) < 2 and not isinstance(owner, (nn.Linear, nn.Embedding)):
                full = torch.ones(shape)  # RMSNorm / LayerNorm scales
            else:  # the full tensor, whatever the slice: the values must not depend on the layout
                gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
                full = torch.empty(shape).normal_(0.0, std, generator=gen)
            return full if rows is None else full[rows]

        yield model_name, make


def pretrained_full_tensors(model: nn.Module, files: list[Path]) -> Iterator[tuple[str, Callable[..., torch.Tensor]]]:
    """(name, make) per parameter, `make(rows=None)` reading that one tensor (only its dim-0
    `rows` when given: a rank reads its own shard) from the safetensors files."""
    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            where.update({k: f for k in h.keys()})
            shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    named = [(n, base_name(n)) for n, _ in model.named_parameters() if not is_adapter(n)]  # adapters: lora.py
    # a Hub folder's per-expert tensors (or other names transformers converts at load): hub_layout.py
    hub = hub_sources(model.config, shapes) if any(name not in where for _, name in named) else {}
    for model_name, name in named:
        if name not in where and name not in hub:
            raise UserError(f"weights {files[0].parent} lack tensor {name!r}; give a checkpoint of "
                            f"the same architecture ({type(model).__name__})")

        def make(rows: slice | None = None, name=name) -> torch.Tensor:
            if name in hub:
                return read_rows(hub[name], where, rows)
            with safe_open(str(where[name]), framework="pt") as h:
                return h.get_tensor(name) if rows is None else h.get_slice(name)[rows]

        yield model_name, make


def _local_rows(param: torch.Tensor) -> slice | None:
    """The dim-0 rows this rank holds of a DTensor sharded on dim 0 only (FSDP2, hsdp), else None."""
    if not isinstance(param, DTensor) or param.ndim == 0 or not all(
            isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in param.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return slice(offset[0], offset[0] + shape[0])


@torch.no_grad()
def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, keeping only this rank's slice for a DTensor."""
    if tuple(full.shape) != tuple(param.shape):
        raise UserError(f"tensor shape {tuple(full.shape)} does not match the model's {tuple(param.shape)}")
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so slice locally, no comm.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def reset_rotary_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent rotary `inv_freq` buffers, garbage after `to_empty`
    (transformers 5 has no rope_init_fn: rebuild the rotary module from the config)."""
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "config"):
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)


def init_model_weights(model: nn.Module, model_cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter (random with `seed`, or from the folder's safetensors) and the rotary
    buffers, one tensor at a time. Works on a plain, DDP-to-be or FSDP-sharded model alike."""
    files = safetensors_files(model_cfg.name)
    source = pretrained_full_tensors(model, files) if uses_pretrained(model_cfg) else random_full_tensors(model, seed)
    params = dict(model.named_parameters())
    for name, make in itertools.chain(source, adapter_full_tensors(model, seed, _tensor_seed)):
        param = params[name]
        if is_nf4(param):  # QLoRA: quantise the full tensor, keep this rank's chunk
            fill_nf4(param, make())
            continue
        rows = _local_rows(param)
        if (ep := ep_rows(model, name)) is not None:  # expert parallelism: this rank's experts, rows of the full tensor
            rows = slice(ep[0] + (rows.start if rows else 0), ep[0] + (rows.stop if rows else param.shape[0]))
        if rows is None:
            _copy_full_into(param, make())
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        part = make(rows)
        if tuple(part.shape) != tuple(local.shape):
            raise UserError(f"tensor {name!r}: rows {tuple(part.shape)} do not match the model's shard "
                            f"{tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(part.to(device=local.device, dtype=local.dtype))
    reset_rotary_buffers(model)


def base_pointer(model_cfg, seed: int, dtype: torch.dtype) -> dict:
    """Where the frozen base comes from: a model folder's safetensors (absolute path) or the
    seeded init of a catalogue architecture, and the `dtype` it is stored in while training."""
    pretrained = uses_pretrained(model_cfg)
    folder = Path(model_cfg.name).expanduser()
    return {"model": str(folder.resolve()) if folder.exists() else model_cfg.name,
            "init": "pretrained" if pretrained else "random", "seed": None if pretrained else seed,
            "dtype": str(dtype).removeprefix("torch.")}


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, mesh: DeviceMesh,
                device: torch.device, seed: int, lora_cfg: LoraConfig | None = None,
                compile: bool = False) -> nn.Module:
    """The model to train: meta build → LoRA adapters (if lora_cfg.rank; before sharding, so each
    decoder layer's adapters shard with it, train/core/lora.py) → `build_parallel_model` (precision,
    AC, compile per decoder layer if `compile` (train.compile), shard, materialise on `device`, fill
    with `init_model_weights`; DDP after the fill)."""
    model = build_meta_model(model_cfg)
    lora = lora_cfg is not None and lora_cfg.rank > 0
    quantize = None
    if lora:
        apply_lora(model, lora_cfg)
        if lora_cfg.quantize_base == "nf4":  # QLoRA: shard size S of train/core/qlora.py's rule
            shard = sub_mesh(mesh, "fsdp").size() if STRATEGY[parallel_cfg.strategy].fsdp else 1
            if STRATEGY[parallel_cfg.strategy].fsdp and shard == 1:  # FSDP2 skips NF4's all-gather hooks
                raise UserError(f"lora.quantize_base nf4 under {parallel_cfg.strategy} needs 2 or more ranks "
                                "per shard group (FSDP2 on one rank fails in torchao's NF4 post-all-gather); "
                                "use parallel.strategy ddp for one process")
            model.config.shardtune_lora.update(quantize_base="nf4", nf4_shard=shard)
            quantize = lambda m: quantize_base(m, shard)  # noqa: E731
    model = build_parallel_model(model, parallel_cfg, mesh, device,
                                 fill=lambda m: init_model_weights(m, model_cfg, seed), compile=compile,
                                 quantize=quantize)
    if lora:  # the frozen params' dtype as stored (apply_precision), which a resume must match
        hf = unwrap(model)
        frozen = next(p.dtype for p in hf.parameters() if not p.requires_grad)
        hf.config.shardtune_lora["base"] = base_pointer(model_cfg, seed, frozen)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model under a DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)
