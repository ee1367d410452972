"""The frozen base of a LoRA run rebuilt for a merged export: from the pointer a checkpoint saves
(train/core/model.py `base_pointer`), one tensor at a time, never the whole model. Apart from
lora.py (adapters), so that model.py imports lora.py and nothing imports back."""
from __future__ import annotations

import torch
from torch import nn

from shardtune.catalog.models import safetensors_files
from shardtune.config import ModelConfig
from shardtune.train.core.lora import adapted_weights, inject
from shardtune.train.core.model import build_meta_model, pretrained_full_tensors, random_full_tensors


def base_tensors(lora: dict, ckpt_hf_dir) -> dict[str, tuple]:
    """HF name → (shape, dtype, read) of every frozen base tensor, rebuilt from the checkpoint's
    pointer (`base_pointer`) for a merged export: read one tensor at a time from the folder's
    safetensors, or regenerate it from the seeded init of the architecture in `ckpt_hf_dir`."""
    base = lora["base"]
    dtype = getattr(torch, base["dtype"])
    if base["init"] == "pretrained":
        source_cfg = ModelConfig(name=base["model"], init="pretrained")
        files = safetensors_files(source_cfg.name)
        meta = build_meta_model(source_cfg)
        made = pretrained_full_tensors(meta, files)
    else:
        meta = build_meta_model(ModelConfig(name=str(ckpt_hf_dir), init="random"))
        made = random_full_tensors(meta, int(base["seed"]))
    shapes = {n: p.shape for n, p in meta.named_parameters()}
    out = {name: (shapes[name], dtype, lambda make=make: make().to(dtype)) for name, make in made}
    if lora.get("quantize_base") == "nf4":  # QLoRA: the base the forward saw, NF4 codes dequantised
        from shardtune.train.core.qlora import dequantized, quantizable  # noqa: PLC0415 lazy: torchao only for QLoRA

        targets = {f"{n.split('.lora_A.')[0]}.weight" for n in _adapter_names(lora, meta)}
        for name in targets:
            shape, _, read = out[name]
            if quantizable(tuple(shape), int(lora["nf4_shard"])):
                out[name] = (shape, dtype, lambda read=read: dequantized(read(), dtype))
    return out


def _adapter_names(lora: dict, meta: nn.Module) -> list[str]:
    """The lora_A names PEFT would give `meta` for this run's target modules."""
    names = {m.rsplit(".", 1)[-1] for m, _ in meta.named_modules()}
    wanted = set(lora["target_modules"]) & names
    return [f"{m}.lora_A.default.weight" for m, mod in meta.named_modules()
            if isinstance(mod, nn.Linear) and m.rsplit(".", 1)[-1] in wanted]


def adapter_targets(lora: dict, ckpt_hf_dir) -> dict[str, str] | None:
    """Adapter module → the HF weight it changes, for a run with expert adapters (PEFT's nested
    ParamWrappers, read from the meta model with the same injection); None without them."""
    if not lora.get("target_parameters"):
        return None
    meta = build_meta_model(ModelConfig(name=str(ckpt_hf_dir), init="random"))
    return adapted_weights(inject(meta, lora))
