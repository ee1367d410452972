"""Activation memory of a Llama-style decoder, derived from Korthikanti et al. 2022 eq. (1).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022):
s·b·h·(34 + 5·a·s/h) bytes per GPT layer at 16 bit. A transformers Llama / Mistral / Qwen2 layer
saves instead, with T = b·s tokens, e bytes per element, h_kv = KV width, I intermediate, n heads:
  per layer  T·(2(4 + e)·h + 8 + 4e·h + 2e·h_kv + 4e·I + 4n)  (SDPA keeps no s×s matrix);
  head       final RMSNorm ((4 + e)·h + 4)·T + e·T·h + logits (e + 4 + 4)·T·V;
  AC         none: L layers; full: each layer's input + one recomputed layer; layer (old name
             selective): every k-th layer (i % k == 0) checkpointed; op: each layer's input and
             matmul/SDPA outputs + one layer's recomputed rest (docs/ac.md).
`calibrated=True` adds what the trainer does beyond the paper (packed-row mask, autocast casts,
the AC peak). Checked tensor by tensor against saved-tensor hooks (tests/unit/test_memory.py).
Derivation, MoE and calibration: docs/planner.md "Activations: derivation". Imports no torch.
"""
from __future__ import annotations

from math import ceil

from shardtune.plan.params import Architecture


def korthikanti_layer_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int) -> float:
    """Korthikanti et al. 2022 eq. (1): s·b·h·(34 + 5·a·s/h) bytes per GPT layer at 16-bit."""
    s, b, h, a = seq_len, micro_batch, hidden, heads
    return s * b * h * (34 + 5 * a * s / h)


def layer_activation_bytes(arch: Architecture, tokens: int, elem_bytes: int = 2, mask_seq_len: int = 0,
                           autocast: bool = False) -> int:
    """Bytes one decoder layer saves for backward over `tokens` = b·s tokens (module doc)."""
    e, h, I = elem_bytes, arch.hidden_size, arch.intermediate_size
    h_kv = arch.num_kv_heads * arch.head_dim
    h_q = arch.num_heads * arch.head_dim
    normed = 4 if autocast else e  # the normalised output's bytes (module doc: autocast)
    norms = 2 * ((4 + normed) * h + 4)  # at e = 4 the upcast is a no-op and the fp32 input itself is saved
    qkv_in = (3 if autocast else 1) * e * h
    attn = qkv_in + e * (2 * h_q + 2 * h_kv) + 4 * arch.num_heads
    if mask_seq_len:  # masked attention (module doc): K, V repeated to h_q, the additive mask
        attn = qkv_in + e * (4 * h_q + mask_seq_len) + 4 * arch.num_heads
    if arch.num_experts:
        k = arch.experts_per_token
        mlp = e * h + 4 * arch.num_experts + k * (2 * e * h + 4 * e * I)
    else:
        mlp = (2 if autocast else 1) * e * h + 4 * e * I
    return tokens * (norms + attn + mlp)


def head_activation_bytes(arch: Architecture, tokens: int, elem_bytes: int = 2, autocast: bool = False,
                          loss_chunks: int = 1) -> int:
    """Final norm, LM-head input and the logits/loss tensors over the vocabulary (module doc).
    K = `loss_chunks` > 1 (train/core/chunked_loss.py): one chunk of ⌈T/K⌉ rows' logits (e) and
    their fp32 upcast (4) at a time, plus a 4-byte log-sum-exp a token (docs/loss.md)."""
    e, h, V = elem_bytes, arch.hidden_size, arch.vocab_size
    logits = (e + 4 + 4) * V if e != 4 else 8 * V
    norm_and_input = tokens * ((4 + (4 if autocast else e)) * h + 4 + e * h)
    if loss_chunks > 1:
        chunk_row = (e + 4) * V if e != 4 else 4 * V
        return norm_and_input + 4 * tokens + ceil(tokens / loss_chunks) * chunk_row
    return norm_and_input + tokens * logits


def op_kept_layer_bytes(arch: Architecture, tokens: int, elem_bytes: int = 2) -> tuple[int, int]:
    """op AC, one layer: (bytes its matmul and SDPA outputs keep beyond the layer's input, the part
    of them backward saves anyway: SDPA's output and log-sum-exp, the gate and up outputs) —
    docs/ac.md. Dense: e·T·(2h_q + 2h_kv + 2h + 2I) + 4·T·n (q, k, v, SDPA out, o, gate, up,
    down; fp32 lse per head). MoE: the router logits and k experts' three matmuls (unchecked)."""
    e, h, I, n = elem_bytes, arch.hidden_size, arch.intermediate_size, arch.num_heads
    h_q, h_kv = n * arch.head_dim, arch.num_kv_heads * arch.head_dim
    k = arch.experts_per_token if arch.num_experts else 1
    router = e * arch.num_experts if arch.num_experts else 0
    kept = e * (2 * h_q + 2 * h_kv + h) + router + k * e * (2 * I + h) + 4 * n
    shared = e * h_q + 4 * n + k * 2 * e * I
    return tokens * kept, tokens * shared


def activation_bytes(arch: Architecture, micro_batch: int, seq_len: int, elem_bytes: int = 2,
                     ac: str = "none", ac_every: int = 2, calibrated: bool = False,
                     autocast: bool = False, loss_chunks: int = 1) -> int:
    """Peak saved activations of one micro-batch on one rank, with activation checkpointing.
    `calibrated`: the trainer's masked attention and AC peak; `autocast`: an fp32 model under
    torch.autocast (ddp/zero1 with bf16-mixed), whose residual stream stays fp32 (module doc)."""
    tokens = micro_batch * seq_len
    layer = layer_activation_bytes(arch, tokens, elem_bytes, seq_len if calibrated else 0, autocast)
    stream = 4 if autocast else elem_bytes  # the residual stream's (and RoPE cos/sin's) bytes
    kept_input = stream * tokens * arch.hidden_size
    L = arch.num_layers
    if ac == "none":
        checkpointed = 0
    elif ac in ("full", "op"):
        checkpointed = L
    else:  # layer (old name selective): every k-th layer
        checkpointed = ceil(L / ac_every)
    body = checkpointed * kept_input + (L - checkpointed) * layer
    recompute = layer if checkpointed else 0  # one checkpointed layer re-materialised in backward
    if ac == "op":  # + each layer's matmul/SDPA outputs; the recompute rebuilds the rest (docs/ac.md)
        kept, shared = op_kept_layer_bytes(arch, tokens, elem_bytes)
        body += L * kept
        recompute = layer - shared
    rope = 2 * stream * tokens * arch.head_dim  # cos, sin
    head = head_activation_bytes(arch, tokens, elem_bytes, autocast, loss_chunks)
    if calibrated and recompute:
        return body + rope + max(head, recompute)
    return body + recompute + rope + head
