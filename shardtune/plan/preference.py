"""What preference tuning (`train.objective: dpo`, docs/dpo.md) adds to a plan. Imports no torch.

- The reference model's bytes per GPU (`memory.reference`): a full fine-tune with a live reference
  holds a frozen copy sharded like the policy (FSDP2 per decoder layer: Ψ/N padded elements; ddp and
  zero1 whole) in the compute dtype (2 B/param under bf16-mixed and bf16, 4 under fp32): 2Ψ/N in bf16.
  LoRA uses its base with the adapters off and `reference: precompute` frees the copy before
  training: 0.
- FLOPs: a live reference adds one forward (2N per token, plus its attention) to every micro-batch.
- Tokens: a pair's chosen and rejected share one seq_len row (train/data/preference.py), so a row
  costs what an SFT row of the same seq_len costs; a pair of two L-token sides needs seq_len 2L.
"""
from __future__ import annotations

from shardtune.errors import UserError
from shardtune.plan.memory import dtypes, local_numels

OBJECTIVES = ("sft", "dpo", "simpo")  # simpo: no reference
REFERENCES = ("live", "precompute")


def check_objective(objective: str, reference: str) -> None:
    if objective not in OBJECTIVES:
        raise UserError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if reference not in REFERENCES:
        raise UserError(f"unknown reference {reference!r}; choose one of {', '.join(REFERENCES)}")


def holds_reference(objective: str, reference: str, lora_rank: int) -> bool:
    """A frozen reference copy lives on the GPUs during training."""
    return objective == "dpo" and reference == "live" and not lora_rank


def reference_forward(objective: str, reference: str) -> bool:
    """Every micro-batch runs a reference forward (a copy's, or LoRA's base with adapters off)."""
    return objective == "dpo" and reference == "live"


def reference_bytes(shapes, num_params: int, strategy: str, world_size: int, shard_degree: int, precision: str,
                    objective: str, reference: str, lora_rank: int) -> int:
    """Bytes per GPU of the frozen reference copy (rank 0's padded FSDP2 shard; 0 when none is held)."""
    if not holds_reference(objective, reference, lora_rank):
        return 0
    per = dtypes(precision).compute
    if shapes is None:  # a bare --params count
        from shardtune.strategies import STRATEGY

        return -(-num_params // shard_degree) * per if STRATEGY[strategy].fsdp else num_params * per
    return local_numels(shapes, strategy, world_size, shard_degree)[0] * per
