"""`lora:` — PEFT LoRA adapters."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shardtune.config.base import _Section
from shardtune.strategies import LORA_TARGETS


class LoraConfig(_Section):
    """PEFT LoRA (Hu et al. 2021): W x + (alpha / rank) · B A x on each target nn.Linear; the base
    weights are frozen (no grads, no optimizer state), as plan/params.py `model_shapes` assumes."""
    rank: int = Field(0, ge=0, le=65_536, description="LoRA rank r (0: off, full fine-tuning).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input (0: none; the run is then "
                                                        "the same on any layout).")
    quantize_base: Literal["none", "nf4"] = Field("none", description="nf4: store the frozen base in 4-bit NF4 "
                                                                      "(QLoRA, Dettmers et al. 2023).")
    target_modules: list[str] = Field(list(LORA_TARGETS), description="Names of the nn.Linear modules that get "
                                      "adapters (default: attention and MLP projections).")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v or any(not t.replace("_", "").isalnum() for t in v):
            raise ValueError(f"{v!r} must be a non-empty list of module names such as {list(LORA_TARGETS[:2])}")
        return v
