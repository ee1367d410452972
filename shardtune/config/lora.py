"""`lora:` — PEFT LoRA adapters."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardtune.config.base import _Section
from shardtune.rules.lora import check_lora_targets
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
                                      "adapters (default: attention and MLP projections; [] with target_parameters).")
    target_parameters: list[str] = Field([], description="PEFT's target_parameters: 3-D expert weights that get one "
                                         "adapter per expert, e.g. [experts.gate_up_proj, experts.down_proj] "
                                         "(Mixtral, Qwen3-MoE; docs/moe.md).")

    @field_validator("target_parameters")
    @classmethod
    def _parameters(cls, v: list[str]) -> list[str]:
        if any(not t.replace("_", "").replace(".", "").isalnum() or "." not in t for t in v):
            raise ValueError(f"{v!r} must be a list of '<module>.<parameter>' names such as "
                             "['experts.gate_up_proj', 'experts.down_proj']")
        return v

    @model_validator(mode="after")
    def _some_target(self):
        check_lora_targets(self.rank, self.target_modules, self.target_parameters)
        if not self.target_modules and not self.target_parameters:
            raise ValueError("lora.target_modules and lora.target_parameters are both empty: name what gets adapters")
        if self.target_parameters and self.dropout:
            raise ValueError(f"lora.dropout {self.dropout} with lora.target_parameters: PEFT's expert adapters "
                             "cannot drop their input (the delta is folded into the weight); set lora.dropout 0")
        if self.target_parameters and self.quantize_base != "none":
            raise ValueError("lora.quantize_base nf4 with lora.target_parameters: QLoRA of 3-D expert weights is "
                             "not built (docs/moe.md); drop one of them")
        return self
