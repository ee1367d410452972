"""What preference tuning (`train.objective: dpo`, docs/dpo.md) adds to a plan. Imports no torch.

- The reference model's bytes per GPU (`memory.reference`): a full fine-tune with a live reference
  holds a frozen copy sharded like the policy (FSDP2 per decoder layer: Ψ/N padded elements; ddp and
  zero1 whole) in the compute dtype (2 B/param under bf16-mixed and bf16, 4 under fp32): 2Ψ/N in bf16.
  LoRA uses its base with the adapters off and `reference: precompute` frees the copy before
  training: 0.
- FLOPs: a live reference adds one forward (2N per token, plus its attention) to every micro-batch.
- Tokens: a pair's chosen and rejected share one seq_len row (train/data/preference.py), so a row
  costs what an SFT row of the same seq_len costs; a pair of two L-token sides needs seq_len 2L.
- Disk (`reference: precompute`): train/core/dpo_ref.py saves one float64 log-prob per example,
  two a pair, as ref_logps.npy (numpy's format: a 128-byte header for a 1-D array, then the data):
  128 + 16·pairs bytes, beside a meta.json of the cache key's inputs (1-2 KiB; not counted).
"""
from __future__ import annotations

from shardtune.plan.memory import dtypes, local_numels
from shardtune.rules.preference import (  # noqa: F401  (the planner's callers read them from here)
    OBJECTIVES,
    REFERENCES,
    check_objective,
    holds_reference,
    reference_forward,
)


def reference_bytes(shapes, num_params: int, strategy: str, world_size: int, shard_degree: int, precision: str,
                    objective: str, reference: str, lora_rank: int, rl_beta: float = 0.0) -> int:
    """Bytes per GPU of the frozen reference copy (rank 0's padded FSDP2 shard; 0 when none is held)."""
    if not holds_reference(objective, reference, lora_rank, rl_beta):
        return 0
    per = dtypes(precision).compute
    if shapes is None:  # a bare --params count
        from shardtune.strategies import STRATEGY

        return -(-num_params // shard_degree) * per if STRATEGY[strategy].fsdp else num_params * per
    return local_numels(shapes, strategy, world_size, shard_degree)[0] * per


NPY_HEADER_BYTES = 128  # numpy/lib/format.py: v1.0 preamble + header dict padded to 64 B (any 1-D shape)
CACHE_BYTES_PER_PAIR = 16  # the chosen and rejected sides' summed log-probs, float64


def reference_cache_bytes(pairs: int) -> int:
    """ref_logps.npy's bytes on disk for `pairs` pairs (its meta.json apart)."""
    return NPY_HEADER_BYTES + CACHE_BYTES_PER_PAIR * pairs


def reference_disk(objective: str, reference: str) -> dict:
    """plan.json's `disk` of a dpo plan: the precompute cache's size ({} when no cache is written)."""
    if objective != "dpo" or reference != "precompute":
        return {}
    return {"reference_cache_bytes_per_1k_pairs": reference_cache_bytes(1000),
            "reference_cache_bytes": f"{NPY_HEADER_BYTES} + {CACHE_BYTES_PER_PAIR} x pairs (+ meta.json, 1-2 KiB)"}
