"""Which preference objectives (`train.objective`, docs/dpo.md) hold a reference model and run its
forward: the planner's (plan/preference.py) and the simulator's (verify/simulate.py) one rule.
Imports no torch.
"""
from __future__ import annotations

from shardtune.errors import UserError

OBJECTIVES = ("sft", "dpo", "simpo", "grpo")  # simpo: no reference; grpo: one when rl.beta > 0
REFERENCES = ("live", "precompute")


def check_objective(objective: str, reference: str) -> None:
    if objective not in OBJECTIVES:
        raise UserError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if reference not in REFERENCES:
        raise UserError(f"unknown reference {reference!r}; choose one of {', '.join(REFERENCES)}")


def holds_reference(objective: str, reference: str, lora_rank: int, rl_beta: float = 0.0) -> bool:
    """A frozen reference copy lives on the GPUs during training (grpo: when rl.beta > 0; LoRA: never, its
    reference is the base with the adapters off)."""
    return not lora_rank and ((objective == "dpo" and reference == "live") or (objective == "grpo" and rl_beta > 0))


def reference_forward(objective: str, reference: str, rl_beta: float = 0.0) -> bool:
    """Every micro-batch runs a reference forward (a copy's, or LoRA's base with adapters off)."""
    return (objective == "dpo" and reference == "live") or (objective == "grpo" and rl_beta > 0)
