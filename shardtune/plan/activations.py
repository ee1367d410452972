"""Activation memory of a Llama-style decoder, derived from Korthikanti et al. 2022.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), eq. (1):
a GPT layer at 16-bit stores s·b·h·(34 + 5·a·s/h) bytes — attention 11sbh + 5as²b (QKᵀ input,
softmax, its dropout mask, V, output projection input, dropout mask), MLP 19sbh (input 2, GeLU
input 8, down-projection input 8, dropout mask 1), two LayerNorms 4sbh.

What a transformers Llama / Mistral / Qwen2 layer saves for backward instead, with T = b·s
tokens, h hidden, h_kv = KV heads × head dim (GQA), I intermediate size, n query heads, and
e = 2 bytes per activation element (bf16; 4 for fp32):
  RMSNorm (×2)  HF's LlamaRMSNorm upcasts: the fp32 copy of its input (4·T·h, for pow and mul),
                the fp32 rsqrt of the variance (4·T) and the normalised tensor multiplied by the
                weight (e·T·h)                                                  → 2·((4 + e)·h + 4)·T
  q/k/v input   the normalised hidden states                                    → e·T·h
  attention     SDPA (flash / memory-efficient) keeps q, k, v after RoPE, its output and the
                fp32 log-sum-exp, and no s×s matrix (no 5as²b term); GQA K/V are h_kv wide
                (transformers passes them unrepeated when no mask is given) → e·T·(2h + 2h_kv) + 4·T·n
  o_proj input  the attention output, the same storage as SDPA's output          → 0
  MLP input     the normalised hidden states                                    → e·T·h
  SwiGLU        gate output (SiLU input), SiLU output, up output, their product
                (down_proj input)                                               → 4·e·T·I
  dropout       none (Llama trains with p = 0, so no masks)
Per layer: T·(2(4 + e)·h + 8 + 4e·h + 2e·h_kv + 4e·I + 4n) bytes; at e = 2:
T·(20h + 4h_kv + 8I + 4n + 8). Checked tensor by tensor against torch's saved-tensor hooks on a
transformers Llama layer (tests/unit/test_memory.py): equal to the byte.
MoE (Mixtral): the router input (shared with the MLP input), fp32 router logits (4·T·E), and for
each of the k routed copies of a token its gathered input and weighted output (2e·h) and the
SwiGLU tensors (4e·I): T·(e·h + 4·E + k·(2e·h + 4e·I)) instead of the dense MLP's T·(e·h + 4e·I).

After the last layer: the final RMSNorm ((4 + e)·h + 4)·T, the LM head input e·T·h, and the logits:
the e-byte logits (kept in the model output), their fp32 upcast inside transformers'
ForCausalLMLoss and the fp32 log-softmax cross-entropy keeps for backward: (e + 4 + 4)·T·V at
e = 2 (the upcast is a no-op at fp32: 8·T·V). With a 128,256-word vocabulary this term is
10·T·V = 1.28 MB per token, more than three Llama-3-70B layers (0.38 MB each).

Once per model: RoPE's cos and sin (e·T·head_dim each; shared by all layers).

Activation checkpointing (torch.utils.checkpoint, non-reentrant, per decoder layer):
  none       L · layer
  full       each layer keeps only its input (e·T·h), plus one layer recomputed in backward
  selective  every k-th layer (layer indices i with i % k == 0, ceil(L/k) layers) is
             checkpointed; the others keep everything.
The embedding lookup keeps only the token ids.

Calibrated against the trainer's own step traced on fake tensors (`plan --simulate`,
docs/calibration.md), `calibrated=True` (what `plan` uses) adds what the trainer really does:
  masked attention  the trainer packs several examples per row with position ids restarting per
                    example, so transformers builds a block-diagonal mask
                    (masking_utils.find_packed_sequence_indices); with a mask it repeats K and V
                    to every query head (sdpa_attention.use_gqa_in_sdpa / repeat_kv) and torch's
                    SDPA converts the boolean mask to an additive one in the compute dtype, saved
                    for backward: attention saves e·T·(h + 4·h_q + s) + 4·T·n instead of
                    e·T·(h + 2h_q + 2h_kv) + 4·T·n (+8 % per layer for Llama-3-8B at s = 2048).
  autocast          ddp/zero1 with bf16-mixed run the fp32 model under torch.autocast: the
                    residual stream and RMSNorm stay fp32 (the embedding output is fp32), so each
                    norm saves its fp32 normalised output (4h, not e·h), and every linear casts
                    its input to bf16 separately (q, k, v: 3·e·h; gate, up: 2·e·h): +10h per
                    token per layer and +2h in the head at e = 2 (FSDP2 casts the parameters
                    instead and computes in bf16 throughout).
  AC peak           the head's saved tensors (the logits among them: train_step drops its own
                    reference once the loss is computed) are freed by its backward before the
                    last checkpointed layer is recomputed: body + max(head, recompute), not
                    their sum.
Imports no torch.
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


def head_activation_bytes(arch: Architecture, tokens: int, elem_bytes: int = 2, autocast: bool = False) -> int:
    """Final norm, LM-head input and the logits/loss tensors over the vocabulary (module doc)."""
    e, h, V = elem_bytes, arch.hidden_size, arch.vocab_size
    logits = (e + 4 + 4) * V if e != 4 else 8 * V
    return tokens * ((4 + (4 if autocast else e)) * h + 4 + e * h + logits)


def activation_bytes(arch: Architecture, micro_batch: int, seq_len: int, elem_bytes: int = 2,
                     ac: str = "none", ac_every: int = 2, calibrated: bool = False,
                     autocast: bool = False) -> int:
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
    elif ac == "full":
        checkpointed = L
    else:
        checkpointed = ceil(L / ac_every)
    body = checkpointed * kept_input + (L - checkpointed) * layer
    recompute = layer if checkpointed else 0  # one checkpointed layer re-materialised in backward
    rope = 2 * stream * tokens * arch.head_dim  # cos, sin
    head = head_activation_bytes(arch, tokens, elem_bytes, autocast)
    if calibrated and recompute:
        return body + rope + max(head, recompute)
    return body + recompute + rope + head
