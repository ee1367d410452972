"""GPT-OSS in the activation plan: the tensors a GptOssDecoderLayer saves for backward in the
trainer's step, which runs it with transformers' eager attention (train/core/moe.py
`attention_implementation`: SDPA has no sink term). Derived from transformers 5.25's
`modeling_gpt_oss.py` (`eager_attention_forward`, `GptOssRMSNorm`, `GptOssExperts._apply_gate`) and
`integrations/moe.py` (`grouped_mm_experts_forward`): docs/planner.md "GPT-OSS: eager attention".
Pure Python, imports no torch.
"""
from __future__ import annotations


def eager_attention(arch) -> bool:
    """Whether the trainer runs `arch` with eager attention: GPT-OSS (model_type gpt_oss, the one
    model type with attention sinks; train/core/moe.py `attention_implementation`)."""
    return bool(getattr(arch, "attention_sinks", False))


def norm_bytes(arch) -> int:
    """Bytes a token one GptOssRMSNorm saves: its fp32 input (4h; the upcast copy below fp32), the
    fp32 rsqrt (4) and the fp32 normalised tensor the weight multiplies before the cast back
    (4h, whatever the compute dtype: Llama's casts first and saves e·h)."""
    return 8 * arch.hidden_size + 4


def eager_attention_bytes(arch, seq_len: int, e: int, autocast: bool = False) -> int:
    """Bytes a token eager attention saves over rows of `seq_len`: the q/k/v input (three casts under
    autocast), q after RoPE, K and V repeated to every query head (the K·Qᵀ and P·V matmuls' operands),
    the o_proj input (4·e·h_q), the int64 index of the max subtracted (8 per head) and the softmax
    output over s + 1 columns (the sink's), e bytes; under autocast the mask's add promotes the
    scores to fp32 (4 bytes, s + 1 columns) and P·V saves their bf16 cast (e, s columns).
    The sliding window is a mask on the full s × s scores: no saving."""
    n, s = arch.num_heads, seq_len
    h_q = n * arch.head_dim
    if autocast:
        return 3 * e * arch.hidden_size + 4 * e * h_q + 8 * n + 4 * n * (s + 1) + e * n * s
    return e * arch.hidden_size + 4 * e * h_q + 8 * n + e * n * (s + 1)


def routed_mlp_bytes(arch, e: int, autocast: bool = False) -> tuple[int, int]:
    """(bytes a token, bytes a layer) of GPT-OSS's fp32 router and biased, clamped experts: the
    router's fp32 input 4h, its logits (kept for the aux loss) and the aux loss's softmax 8E, the
    top-k's int64 indices and the softmax over those k 12k; per routed copy (k a token) four int64
    index buffers (the sort's gather, the weights' gather, the biases' gather, the unsort),
    the gathered input and the down output (2h), the gate_up output (2I), the sigmoid's output,
    the clamped gate, gate·σ, up + 1 and their product (5I), the fp32 routing weight (4); a layer:
    the int32 group offsets and, below fp32, the router weight's fp32 copy."""
    h, E, k, I = arch.hidden_size, arch.num_experts, arch.experts_per_token, arch.intermediate_size
    x = 4 if autocast else e  # the experts' dtype (grouped_mm is not autocast-enabled)
    per_token = 4 * h + 8 * E + 12 * k + k * (4 * 8 + x * (2 * h + 7 * I) + 4)
    return per_token, 4 * E + (4 * E * h if e != 4 and not autocast else 0)


def layer_bytes(arch, tokens: int, seq_len: int, e: int, autocast: bool = False) -> int:
    """One GPT-OSS decoder layer's saved bytes over `tokens` = b·s (two norms, eager attention, the
    router and experts)."""
    if seq_len <= 0:
        raise ValueError("eager attention's saved scores need the sequence length")
    per_token, per_layer = routed_mlp_bytes(arch, e, autocast)
    return tokens * (2 * norm_bytes(arch) + eager_attention_bytes(arch, seq_len, e, autocast) + per_token) + per_layer
