"""What online RL (`train.objective: grpo`, docs/rl.md) adds to a plan. Imports no torch.

Generation (train/core/rl_generate.py) gathers every FSDP2 unit once for the decode and samples one
prompt's group of G completions at a time with the model's KV cache, so at its peak a rank holds:
- `memory.generation_weights`: the whole model in the compute dtype (the unsharded parameters, Ψ/tp),
- `memory.kv_cache`: keys and values of one group, G × 1 prompt × (prompt + max_new_tokens) ×
  layers × 2 × kv_heads/tp × head_dim × compute bytes (the prompt bounded by train.seq_len),
beside the parameter shards and the optimizer states (the gradients were freed at the step's start).
Its time (`generation_time_s`, in the step time; docs/rl.md "Generation's time"): the gather once a
step on the shard group's link, each group's prefill at the training MFU, and its decode, memory-bound:
every decode forward reads the gathered weights and the group's KV cache so far from HBM.
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
    return tokens * kv_bytes_per_token(arch, tp, compute_bytes)


def generation_weights_bytes(num_params: int, tp: int, compute_bytes: int) -> int:
    """The gathered model a rank decodes with (its TP share)."""
    return -(-num_params // tp) * compute_bytes


def training_rows(inp):
    """`inp` as the training forward sees a grpo micro-batch (other objectives: unchanged)."""
    if inp.objective != "grpo":
        return inp
    return replace(inp, micro_batch=inp.micro_batch * inp.num_generations, seq_len=inp.seq_len + inp.max_new_tokens)


def kv_bytes_per_token(arch, tp: int, compute_bytes: int) -> int:
    """Keys and values of one token, every layer, this rank's heads."""
    return arch.num_layers * 2 * (-(-arch.num_kv_heads // tp)) * arch.head_dim * compute_bytes


def generation_time_s(arch, num_params: int, *, prompts: int, num_generations: int, prompt_tokens: int,
                      max_new_tokens: int, tp: int, compute_bytes: int, peak_flops_per_s: float, mfu: float,
                      hbm_bytes_per_s: float, gather_s: float) -> float:
    """Seconds of a step's generation on one rank: `prompts` groups of G completions, each a prefill of
    G × prompt_tokens tokens (2 FLOPs a parameter a token, at peak × mfu) and max_new_tokens decode
    forwards; forward t (0-based) reads the weights (Ψ/tp in the compute dtype) and G × (prompt + t)
    tokens' keys and values. Every completion is priced at its full length (an early EOS is faster)."""
    weights = -(-num_params // tp) * compute_bytes
    prefill = 2.0 * (num_params / tp) * num_generations * prompt_tokens / (peak_flops_per_s * mfu)
    n = max_new_tokens
    kv_read = num_generations * kv_bytes_per_token(arch, tp, compute_bytes) * (n * prompt_tokens + n * (n - 1) // 2)
    decode = (n * weights + kv_read) / hbm_bytes_per_s
    return gather_s + prompts * (prefill + decode)
