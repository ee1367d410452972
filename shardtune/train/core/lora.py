"""LoRA adapters (PEFT) on the meta-built model, their seeded init, and the merge for export.

Hu et al. 2021 (LoRA) eq. (3): h = W x + (alpha / r) · B A x, A (r, in), B (out, r). PEFT's
`inject_adapter_in_model` replaces each target nn.Linear by a `lora.Linear` in place (no
PeftModel wrapper): the model keeps its HF class, `_no_split_modules` and `.config`, so
`parallel/layers.decoder_layers` still finds the decoder layers and FSDP2 shards each layer's
adapters with the layer. Parameter names become `<proj>.base_layer.weight` (the frozen W) and
`<proj>.lora_A.default.weight` / `<proj>.lora_B.default.weight` (PEFT's names, as
plan/params.py `lora_shapes` counts them). Every base weight is frozen (requires_grad False):
no grads, no optimizer state, exactly what plan/memory.py assumes.

The adapter config travels in the HF config.json of each checkpoint (`config.shardtune_lora`),
with a pointer to the base (`base_pointer`): checkpoints hold the adapters and their optimizer
state only (train/durable/checkpoint.py), and resume and export rebuild the frozen base from the pointer
(the folder's safetensors, or the seeded init), which `check_same_base` guards.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardtune.errors import UserError

if TYPE_CHECKING:
    from shardtune.config import LoraConfig

ADAPTER = "default"  # PEFT's adapter name, part of every parameter name
CONFIG_KEY = "shardtune_lora"  # key in the HF config.json of a checkpoint


def is_adapter(name: str) -> bool:
    """True for a LoRA A or B parameter name."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """'...q_proj.base_layer.weight' → '...q_proj.weight', '...experts.base_layer.base_layer.down_proj'
    → '...experts.down_proj' (PEFT nests one ParamWrapper per target parameter): the HF name."""
    return re.sub(r"\.base_layer(?=\.)", "", name)


def scaling(lora: dict) -> float:
    """alpha / r (LoRA eq. 3; PEFT's `scaling` without rslora)."""
    return float(lora["alpha"]) / int(lora["rank"])


def settings(lora_cfg: LoraConfig) -> dict:
    """The adapter settings a checkpoint's config.json keeps (`CONFIG_KEY`)."""
    return {"rank": lora_cfg.rank, "alpha": lora_cfg.alpha, "dropout": lora_cfg.dropout,
            "target_modules": list(lora_cfg.target_modules), "target_parameters": list(lora_cfg.target_parameters)}


def peft_config(lora: dict | LoraConfig, **extra):
    """The peft.LoraConfig of `settings` (no bias, no rslora, PEFT's default init). target_parameters:
    PEFT's ParamWrapper on 3-D expert weights (docs/moe.md "LoRA on the experts")."""
    lora = lora if isinstance(lora, dict) else settings(lora)
    from peft import LoraConfig as PeftLoraConfig  # noqa: PLC0415 lazy here and below: peft is an optional extra

    return PeftLoraConfig(r=int(lora["rank"]), lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                          target_modules=list(lora["target_modules"]) or None,
                          target_parameters=list(lora.get("target_parameters") or []) or None,
                          bias="none", task_type="CAUSAL_LM", **extra)


def inject(model: nn.Module, lora: dict) -> nn.Module:
    """PEFT's adapters into `model` in place (meta: made on meta); unknown targets: one UserError line."""
    from peft import inject_adapter_in_model  # noqa: PLC0415 optional extra (peft)

    targets = f"lora.target_modules {list(lora['target_modules'])}"
    if lora.get("target_parameters"):
        targets += f" / lora.target_parameters {list(lora['target_parameters'])}"
    try:  # low_cpu_mem_usage: adapters are made on meta like the rest (filled by init_model_weights)
        inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except ValueError as e:
        raise UserError(f"{targets}: {str(e).splitlines()[0].rstrip('.')}; name nn.Linear modules of the model "
                        "(e.g. q_proj, v_proj) or 3-D expert weights (experts.gate_up_proj)") from None
    wrapped = {f"{base_name(n + '.x')[:-2]}.{m.parameter_name}" for n, m in model.named_modules()
               if hasattr(m, "parameter_name")}
    missing = [t for t in lora.get("target_parameters") or [] if not any(w.endswith(f".{t}") for w in wrapped)]
    if missing:
        raise UserError(f"{targets}: no parameter of the model matches {missing}; name 3-D expert weights such as "
                        "experts.gate_up_proj, experts.down_proj")
    for name, m in model.named_modules():
        if hasattr(m, "parameter_name") and getattr(m.get_base_layer(), "is_transposed", False):
            raise UserError(f"{targets}: {name} keeps its experts transposed (GPT-OSS); LoRA on such experts "
                            "is not built: target the attention only")
    return model


def apply_lora(model: nn.Module, lora_cfg: LoraConfig) -> nn.Module:
    """Inject adapters in place (call on the meta model, before build_parallel_model) and freeze every
    other parameter. Returns the same model. Unknown target names are a one-line UserError."""
    inject(model, settings(lora_cfg))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))  # the routers too: frozen unless a target names them
    model.config.update({CONFIG_KEY: settings(lora_cfg)})
    return model


def adapter_full_tensors(model: nn.Module, seed: int, tensor_seed: Callable[[int, str], int]
                         ) -> Iterator[tuple[str, Callable[..., torch.Tensor]]]:
    """(name, make) per adapter parameter, like train/core/model.py's `random_full_tensors`: A as PEFT
    inits it (kaiming_uniform_(a=√5) = U(-1/√in, 1/√in), microsoft/LoRA loralib), from one
    generator seeded by (seed, name), so every layout gets the same values; B zeros."""
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue

        def make(rows: slice | None = None, name=name, shape=tuple(p.shape)) -> torch.Tensor:
            if ".lora_B." in name:
                full = torch.zeros(shape)
            else:
                gen = torch.Generator().manual_seed(tensor_seed(seed, name))
                full = torch.empty(shape)
                nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
            return full if rows is None else full[rows]

        yield name, make


@torch.no_grad()
def delta(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int = 0) -> torch.Tensor:
    """B A (fp32). `experts` E > 0: PEFT's ParamWrapper on a 3-D [E, out, in] weight (Mixtral's,
    Qwen3-MoE's layout) keeps A as [E·r, in] (expert e's rows e·r..e·r+r-1) and B as [out, r·E]
    (column j·E + e: rank j of expert e), and expert e's delta is B_e A_e (docs/moe.md)."""
    a, b = lora_a.float(), lora_b.float()
    if not experts:
        return b @ a
    r = a.shape[0] // experts
    return torch.einsum("ore,eri->eoi", b.view(b.shape[0], r, experts), a.view(experts, r, a.shape[1]))


@torch.no_grad()
def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale · B A in fp32 (PEFT's `merge`, per expert for a 3-D W), returned in W's dtype."""
    experts = weight.shape[0] if weight.ndim == 3 else 0
    return (weight.float() + scale * delta(lora_a, lora_b, experts)).to(weight.dtype)


def write_adapter_config(lora: dict, base_model: str, folder) -> None:
    """adapter_config.json for `PeftModel.from_pretrained`, written by PEFT itself."""
    peft_config(lora, base_model_name_or_path=base_model).save_pretrained(str(folder))


def adapted_weights(model: nn.Module) -> dict[str, str]:
    """Adapter module name → the HF name of the weight its adapters change: '<m>.weight' for a
    lora.Linear, '<experts>.<parameter>' for a ParamWrapper (which of the nested wrappers holds which
    parameter is PEFT's choice: read here, not assumed)."""
    return {name: base_name(f"{name}.{getattr(m, 'parameter_name', 'weight')}") for name, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def split_adapters(entries: list[tuple], targets: dict[str, str] | None = None
                   ) -> tuple[list[tuple], dict[str, dict[str, tuple]]]:
    """Split export entries (DCP key, HF name, shape, dtype): the base tensors under their plain
    HF names ('q_proj.base_layer.weight' → 'q_proj.weight'), and per base weight name its
    adapters {"A": entry, "B": entry}; `targets` (`adapted_weights`) names the weights of
    ParamWrapper adapters (default '<module>.weight')."""
    base, pairs = [], {}
    for k, name, shape, dt in entries:
        if is_adapter(name):
            module, rest = name.split(".lora_", 1)  # rest: 'A.default.weight'
            pairs.setdefault((targets or {}).get(module, f"{module}.weight"), {})[rest[0]] = (k, name, shape, dt)
        else:
            base.append((k, base_name(name), shape, dt))
    return base, pairs


def peft_saved_name(name: str) -> str:
    """Our adapter name → the key PEFT saves in adapter_model.safetensors ('base_model.model.'
    prefix, no adapter name: peft.utils.get_peft_model_state_dict)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def check_same_base(saved_hf_config: dict, model: nn.Module) -> None:
    """A LoRA checkpoint's adapters only make sense on the base they were trained on."""
    saved = (saved_hf_config.get(CONFIG_KEY) or {}).get("base")
    now = (getattr(model.config, CONFIG_KEY, None) or {}).get("base")
    if saved is not None and saved != now:
        raise UserError(f"this LoRA checkpoint was trained on base {saved}, but the run builds {now}; "
                        "resume with the same model.name, model.init and train.seed")
