"""What a run's LoRA targets may be, for the recipe (config/lora.py) and the planner
(plan/validate.py) alike: module names as PEFT matches them, and only with a rank."""
from __future__ import annotations

from collections.abc import Sequence

from shardtune.errors import UserError
from shardtune.strategies import LORA_TARGETS


def check_lora_targets(rank: int, target_modules: Sequence[str], target_parameters: Sequence[str] = ()) -> None:
    """One line for module names that are not names, or for targets given without a LoRA rank."""
    if any(not t.replace("_", "").isalnum() for t in target_modules):
        raise UserError(f"lora.target_modules {list(target_modules)!r} must be module names such as "
                        f"{list(LORA_TARGETS[:2])} (--lora-target-modules)")
    if not rank and (set(target_modules) != set(LORA_TARGETS) or target_parameters):
        raise UserError("lora.target_modules / lora.target_parameters name what LoRA adapts: they need "
                        "lora.rank > 0 (--lora-rank R)")
