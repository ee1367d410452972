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

from shardtune.plan import oss
from shardtune.plan.moe import routed_mlp_bytes, routed_recompute_bytes
from shardtune.plan.params import Architecture
from shardtune.strategies import checkpointed_layers


def korthikanti_layer_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                            sp: bool = False) -> float:
    """Korthikanti et al. 2022 eq. (1): s·b·h·(34 + 5·a·s/h) bytes per GPT layer at 16-bit; with
    tensor parallelism t (eq. 2) s·b·h·(10 + 24/t + 5·a·s/(h·t)), with sequence parallelism too
    (eq. 4) s·b·h·(34/t + 5·a·s/(h·t)) (their Table 2)."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    if sp:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layer_activation_bytes(arch: Architecture, tokens: int, elem_bytes: int = 2, mask_seq_len: int = 0,
                           autocast: bool = False, tp: int = 1, sp: bool = False, seq_len: int = 0) -> int:
    """Bytes one decoder layer saves for backward over `tokens` = b·s tokens (module doc), on
    one of `tp` tensor-parallel ranks: heads and the MLP width split by tp; with `sp` the norms'
    tensors split along the sequence too; the inputs of q/k/v and of gate/up are whole on
    every rank (torch's DTensor saves the all-gathered input of a column-parallel matmul, where
    Megatron keeps its shard and gathers again in backward); the mask is whole (docs/planner.md).
    GPT-OSS (eager attention, plan/oss.py) saves its s × s scores: `seq_len` (or `mask_seq_len`) = s."""
    if tp == 1 and oss.eager_attention(arch):
        return oss.layer_bytes(arch, tokens, seq_len or mask_seq_len, elem_bytes, autocast)
    if tp > 1:
        return _tp_layer_bytes(arch, tokens, elem_bytes, mask_seq_len, tp, sp)
    e, h, I = elem_bytes, arch.hidden_size, arch.intermediate_size
    h_kv = arch.num_kv_heads * arch.head_dim
    h_q = arch.num_heads * arch.head_dim
    normed = 4 if autocast else e  # the normalised output's bytes (module doc: autocast)
    norms = 2 * ((4 + normed) * h + 4)  # at e = 4 the upcast is a no-op and the fp32 input itself is saved
    qkv_in = (3 if autocast else 1) * e * h
    attn = qkv_in + e * (2 * h_q + 2 * h_kv) + 4 * arch.num_heads
    if mask_seq_len:  # masked attention (module doc): K, V repeated to h_q, the additive mask
        attn = qkv_in + e * (4 * h_q + mask_seq_len) + 4 * arch.num_heads
    if getattr(arch, "qk_norm", False):  # Qwen3: an RMSNorm per query and key head (as the block's norms)
        attn += (4 + normed) * (h_q + h_kv) + 4 * (arch.num_heads + arch.num_kv_heads)
    if arch.num_experts:
        per_token, per_layer = routed_mlp_bytes(arch, e, autocast)
        return tokens * (norms + attn + per_token) + per_layer
    mlp = (2 if autocast else 1) * e * h + 4 * e * I
    return tokens * (norms + attn + mlp)


def head_activation_bytes(arch: Architecture, tokens: int, elem_bytes: int = 2, autocast: bool = False,
                          loss_chunks: int = 1, tp: int = 1, sp: bool = False) -> int:
    """Final norm, LM-head input and the logits/loss tensors over the vocabulary (module doc).
    K = `loss_chunks` > 1 (train/core/chunked_loss.py): one chunk of ⌈T/K⌉ rows' logits (e) and
    their fp32 upcast (4) at a time, plus a 4-byte log-sum-exp a token (docs/loss.md). Under
    tensor parallelism the loss is vocabulary-parallel: V/tp logits a token; with `sp` the final
    norm's tensors are split along the sequence, the head's gathered input is whole."""
    e, h, V = elem_bytes, arch.hidden_size, arch.vocab_size // tp
    logits = (e + 4 + 4) * V if e != 4 else 8 * V
    normed = 4 if autocast or oss.eager_attention(arch) else e  # GptOssRMSNorm saves fp32 (plan/oss.py)
    if tp > 1:  # loss_parallel's log-softmax keeps one more fp32 [T, V/tp] (calibrated: --simulate)
        logits += 4 * V
    norm_tokens = tokens // tp if sp else tokens
    norm_and_input = norm_tokens * ((4 + normed) * h + 4) + tokens * e * h
    if loss_chunks > 1:
        chunk_row = (e + 4) * V if e != 4 else 4 * V
        return norm_and_input + 4 * tokens + ceil(tokens / loss_chunks) * chunk_row
    return norm_and_input + tokens * logits


def _tp_layer_bytes(arch: Architecture, tokens: int, e: int, mask_seq_len: int, tp: int, sp: bool) -> int:
    """layer_activation_bytes under tensor parallelism (no autocast: TP runs under FSDP2 only)."""
    h, I, n = arch.hidden_size, arch.intermediate_size, arch.num_heads
    h_q, h_kv = n * arch.head_dim // tp, arch.num_kv_heads * arch.head_dim // tp
    norm_tokens = tokens // tp if sp else tokens
    norms = norm_tokens * 2 * ((4 + e) * h + 4)
    heads = e * (2 * h_q + 2 * h_kv) if not mask_seq_len else e * (4 * h_q + mask_seq_len)
    attn = tokens * (e * h + heads + 4 * n // tp)
    mlp = tokens * (e * h + 4 * e * I // tp)
    return norms + attn + mlp


def cp_layer_bytes(arch: Architecture, tokens: int, e: int = 2, autocast: bool = False, tp: int = 1,
                   sp: bool = False, seq_len: int = 0) -> int:
    """One decoder layer's saved bytes on a context-parallel rank over its `tokens` = b·s/cp
    (parallel/cp.py, DeepSpeed-Ulysses): no [s, s] mask (causal SDPA per document); SDPA saves
    q and K, V repeated to every query head over the whole row for H/cp heads (e·4·h_q per local
    token, as the masked path) and its log-sum-exp; o_proj saves the output brought back by the
    all-to-all, another tensor (e·h_q): the unmasked layer + e·(3h_q − 2h_kv) a token, per TP
    rank (docs/long-context.md; unmeasured until the trainer's memory.json). Eager attention
    (GPT-OSS, which the trainer refuses under cp): H/cp heads' scores over the whole row `seq_len`."""
    h_q, h_kv = arch.num_heads * arch.head_dim // tp, arch.num_kv_heads * arch.head_dim // tp
    return (layer_activation_bytes(arch, tokens, e, 0, autocast, tp, sp, seq_len)
            + tokens * e * (3 * h_q - 2 * h_kv))


def op_kept_layer_bytes(arch: Architecture, tokens: int, elem_bytes: int = 2, tp: int = 1) -> tuple[int, int]:
    """op AC, one layer: (bytes its matmul and SDPA outputs keep beyond the layer's input, the part
    of them backward saves anyway: SDPA's output and log-sum-exp, the gate and up outputs) —
    docs/ac.md. Dense: e·T·(2h_q + 2h_kv + 2h + 2I) + 4·T·n (q, k, v, SDPA out, o, gate, up,
    down; fp32 lse per head). MoE: the router logits and k experts' three matmuls (unchecked)."""
    e, h, I, n = elem_bytes, arch.hidden_size, arch.intermediate_size // tp, arch.num_heads // tp
    h_q, h_kv = n * arch.head_dim, arch.num_kv_heads * arch.head_dim // tp
    k = arch.experts_per_token if arch.num_experts else 1
    router = e * arch.num_experts if arch.num_experts else 0
    kept = e * (2 * h_q + 2 * h_kv + h) + router + k * e * (2 * I + h) + 4 * n
    shared = e * h_q + 4 * n + k * 2 * e * I
    return tokens * kept, tokens * shared


def activation_bytes(arch: Architecture, micro_batch: int, seq_len: int, elem_bytes: int = 2,
                     ac: str = "none", ac_every: int = 2, calibrated: bool = False,
                     autocast: bool = False, loss_chunks: int = 1, tp: int = 1, sp: bool = False,
                     cp: int = 1) -> int:
    """Peak saved activations of one micro-batch on one rank, with activation checkpointing.
    `calibrated`: the trainer's masked attention and AC peak; `autocast`: an fp32 model under
    torch.autocast (ddp/zero1 with bf16-mixed), whose residual stream stays fp32 (module doc).
    `tp`, `sp`: one tensor-parallel rank's share; AC keeps each layer's input, which sequence
    parallelism splits (the residual stream is sequence-sharded between the blocks). `cp`: one
    context-parallel rank's share (plan/cp.py): b·s/cp tokens; attention's H/cp heads over the
    whole sequence save as many bytes as H heads over s/cp (`cp_layer_bytes`)."""
    return activation_split(arch, micro_batch, seq_len, elem_bytes, ac, ac_every, calibrated, autocast,
                            loss_chunks, tp, sp, cp)[0]


def activation_split(arch: Architecture, micro_batch: int, seq_len: int, elem_bytes: int = 2,
                     ac: str = "none", ac_every: int = 2, calibrated: bool = False,
                     autocast: bool = False, loss_chunks: int = 1, tp: int = 1, sp: bool = False,
                     cp: int = 1, offload: bool = False, in_flight: float = 1.0,
                     head_in_flight: int = 1) -> tuple[int, int]:
    """(device bytes, host bytes) of `activation_bytes`; `offload` (train/core/offload.py's hooks
    around the micro-batch's forward): everything it saves for backward goes to host RAM — the
    layers' (with AC full their inputs), the head's, RoPE's tables; on the device one layer's
    of it at a time (the one brought back) beside the recompute, and the head and RoPE tables
    while their backward runs (counted as if kept: an upper bound by those few). A pipeline stage
    (plan/pipeline.py) keeps `in_flight` micro-batches of its layers' (and RoPE's) saved tensors
    and `head_in_flight` of the head's (0: not the last stage)."""
    tokens = micro_batch * seq_len // cp
    if cp > 1:
        layer = cp_layer_bytes(arch, tokens, elem_bytes, autocast, tp, sp, seq_len)
    else:
        layer = layer_activation_bytes(arch, tokens, elem_bytes, seq_len if calibrated else 0, autocast, tp, sp,
                                       seq_len)
    stream = 4 if autocast else elem_bytes  # the residual stream's (and RoPE cos/sin's) bytes
    kept_input = stream * (tokens // tp if sp else tokens) * arch.hidden_size
    L = arch.num_layers
    checkpointed = len(checkpointed_layers(L, ac, ac_every))  # the trainer's rule (strategies.py)
    body = checkpointed * kept_input + (L - checkpointed) * layer
    recompute = layer if checkpointed else 0  # one checkpointed layer re-materialised in backward
    if checkpointed and arch.num_experts:  # + the MoE recompute's last unsaved tensor (plan/moe.py)
        recompute += routed_recompute_bytes(arch, tokens)
    if ac == "op":  # + each layer's matmul/SDPA outputs; the recompute rebuilds the rest (docs/ac.md)
        kept, shared = op_kept_layer_bytes(arch, tokens, elem_bytes, tp)
        body += L * kept
        recompute = layer - shared
    rope = 2 * stream * tokens * arch.head_dim  # cos, sin
    head = head_activation_bytes(arch, tokens, elem_bytes, autocast, loss_chunks, tp, sp) * head_in_flight
    if in_flight != 1:
        body, rope = round(body * in_flight), round(rope * in_flight)
    host = 0
    if offload and L:
        host, body = body + head + rope, body // L
    if calibrated and recompute:
        return body + rope + max(head, recompute), host
    return body + recompute + rope + head, host
