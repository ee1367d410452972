"""The model's decoder layers: what every technique of parallel/ applies per layer (TP, CP, AC,
compile, FSDP's `fully_shard`)."""
from __future__ import annotations

from torch import nn

from shardtune.errors import UserError


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, in order: the modules whose class HF lists in `_no_split_modules`
    (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(f"{type(model).__name__} declares no decoder layer class (_no_split_modules); "
                        "use a Llama, Mistral or Qwen2 style causal LM")
    return layers
