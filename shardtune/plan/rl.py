"""What online RL (`train.objective: grpo`, docs/rl.md) adds to a plan. Imports no torch.

Generation (train/core/rl_generate.py) gathers every FSDP2 unit once for the decode and samples one
prompt's group of G completions at a time with the model's KV cache, so at its peak a rank holds:
- `memory.generation_weights`: the whole model in the compute dtype (the unsharded parameters, Ψ/tp),
- `memory.kv_cache`: keys and values of one group, G × 1 prompt × (prompt + max_new_tokens) ×
  layers × 2 × kv_heads/tp × head_dim × compute bytes (the prompt bounded by train.seq_len),
beside the parameter shards and the optimizer states (the gradients were freed at the step's start).
The step's peak is then the larger of that and the training peak, whose rows are a prompt's G
completions, each prompt + max_new_tokens long (`training_rows`: activations and buffers as SFT's
for micro_batch × G rows of seq_len + max_new_tokens). β > 0 adds the frozen reference
(plan/preference.py: memory.reference) to both.
"""
from __future__ import annotations

from dataclasses import replace

PROMPTS_AT_ONCE = 1  # the trainer samples one prompt's group at a time (rl_generate.sample_group)


def kv_cache_bytes(arch, num_generations: int, prompt_tokens: int, max_new_tokens: int, tp: int,
                   compute_bytes: int) -> int:
    """Keys and values of one generation batch on one rank (attention heads split over tp)."""
    tokens = num_generations * PROMPTS_AT_ONCE * (prompt_tokens + max_new_tokens)
    return tokens * arch.num_layers * 2 * (-(-arch.num_kv_heads // tp)) * arch.head_dim * compute_bytes


def generation_weights_bytes(num_params: int, tp: int, compute_bytes: int) -> int:
    """The gathered model a rank decodes with (its TP share)."""
    return -(-num_params // tp) * compute_bytes


def training_rows(inp):
    """`inp` as the training forward sees a grpo micro-batch (other objectives: unchanged)."""
    if inp.objective != "grpo":
        return inp
    return replace(inp, micro_batch=inp.micro_batch * inp.num_generations, seq_len=inp.seq_len + inp.max_new_tokens)
