"""`optim:` — optimizer, its kernel and the learning-rate schedule."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shardtune.config.base import _Section
from shardtune.strategies import normalize_optimizer_impl


class OptimConfig(_Section):
    name: Literal["adamw", "adamw-8bit"] = Field(
        "adamw", description="adamw: torch.optim.AdamW | adamw-8bit: m and v in 8 bits, blockwise (2 B/param "
                             "instead of 8): torchao's AdamW8bit under zero2/zero3/hsdp (FSDP2's DTensors), "
                             "bitsandbytes' under ddp/zero1 (the `8bit` extra).")
    implementation: str = Field(
        "auto", description="torch AdamW kernel: auto (torch's fused kernel, CUDA and CPU) | "
                            "foreach (a temporary the size of the rank's states) | fused (no temporary) | "
                            "for-loop (temporaries of the largest tensor only) | bf16-stochastic (pure bf16 "
                            "only: the update in fp32, weights rounded stochastically, train/core/optim.py). "
                            "See docs/planner.md.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's decay rates of m and v.")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon (added to sqrt(v)).")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0: no clipping).")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from 0 to `lr`.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of `lr`.")

    _impl = field_validator("implementation")(lambda v: normalize_optimizer_impl(v))

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas {list(v)} must each be in [0, 1) (Adam's moment decay rates)")
        return v
