"""What `train.objective: grpo` runs with (docs/rl.md): the trainer's and the planner's one rule.
Only what tests/e2e/test_grpo_cli.py and docs/rl.md's runs verified is allowed; the rest is one line.
Imports no torch.
"""
from __future__ import annotations

from shardtune.errors import UserError

GRPO_STRATEGIES = ("zero2", "zero3", "hsdp")  # verified: 2 ranks equal 1 (zero3, LoRA too; hsdp), the recipe's run


def check_grpo(strategy: str, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, quantize_base: str = "none",
               activation_offload: bool = False, compile: bool = False, offload: str = "none",
               activation_checkpointing: str = "none") -> None:
    """A grpo run on anything not verified is refused, naming the key."""
    runs = ", ".join(GRPO_STRATEGIES)
    refused = [(strategy not in GRPO_STRATEGIES, f"parallel.strategy {strategy} (grpo runs {runs})"),
               (tp > 1, "parallel.tp > 1"), (cp > 1, "parallel.cp > 1"), (pp > 1, "parallel.pp > 1"),
               (ep > 1, "parallel.ep > 1"), (quantize_base != "none", f"lora.quantize_base {quantize_base}"),
               (activation_offload, "parallel.activation_offload"), (compile, "train.compile"),
               (offload != "none", f"parallel.offload {offload}")]
    for bad, what in refused:
        if bad:
            raise UserError(f"train.objective grpo does not run with {what} yet (generation and the clipped loss "
                            "are verified on zero2 / zero3 / hsdp, full fine-tunes and LoRA, activation "
                            "checkpointing or not, docs/rl.md); change it or the objective")
