"""Tensor (and sequence) parallelism in the planner: what TP shards, its checks, its collectives.

The layout is torch's DTensor TP of a transformers Llama (issue 29; torchtitan's plan): q, k, v,
gate and up `ColwiseParallel` (weight and bias split on dim 0, the output features), o and down
`RowwiseParallel` (weight split on dim 1; a bias stays whole), the embedding vocabulary-parallel
(rows, dim 0), the LM head column-parallel (dim 0) with the loss computed vocabulary-parallel,
RMSNorm weights replicated (SequenceParallel shards the norms' activations, not their weights).
LoRA adapters follow their base: a column-parallel base splits lora_B on dim 0 and keeps lora_A
whole; a row-parallel base splits lora_A on dim 1 and keeps lora_B whole. FSDP2 then shards each
TP-local tensor on dim 0 over the data-parallel shard group. Imports no torch.

Collectives per decoder layer and micro-batch, S = e·b·s·h bytes (the activation at full
length; Korthikanti et al. 2022 §4.2.2): with sequence parallelism an all-gather before attention
and before the MLP and a reduce-scatter after o and after down (forward), the same four swapped
in backward (g and ḡ); without it an all-reduce after o and after down (forward) and one for
each block's input gradient (backward). Full AC re-runs the forward's four in backward. The
embedding's output is all-reduced whole (parallel/tp.py: HF builds the mask and rotary tables
from it) and layer 0 takes its sequence shard locally (an all-gather of its gradient in backward).
"""
from __future__ import annotations

from dataclasses import replace

from shardtune.errors import UserError
from shardtune.plan.params import Architecture, ParamShape

TP_DEGREES = (1, 2, 4, 8)  # plan --fit's search
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")


def tp_dim(name: str) -> int | None:
    """The dim TP splits parameter `name` on (module doc), or None when every TP rank holds it."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    parts = name.split(".")
    if "lora_A" in parts or "lora_B" in parts:
        module = parts[parts.index("lora_A" if "lora_A" in parts else "lora_B") - 1]
        if module in _COLWISE and "lora_B" in parts:
            return 0
        if module in _ROWWISE and "lora_A" in parts:
            return 1
        return None
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _COLWISE:
        return 0
    if module in _ROWWISE and parts[-1] == "weight":
        return 1
    return None


def tp_local_shapes(shapes: list[ParamShape], tp: int) -> list[ParamShape]:
    """Each parameter's TP-local shape on any TP rank (the splits are even: `check_tp_arch`)."""
    if tp == 1:
        return shapes
    out = []
    for p in shapes:
        d = tp_dim(p.name)
        if d is None:
            out.append(p)
        else:
            shape = list(p.shape)
            shape[d] //= tp
            out.append(replace(p, shape=tuple(shape)))
    return out


def check_tp_arch(arch: Architecture, config: dict, tp: int, ep: int = 1) -> None:
    """The trainer's rule (rules.tp.check_tp_model: tp divides the heads, KV heads, the MLP
    width and the vocabulary, no tied embeddings); a MoE model needs ep > 1 (its experts are not
    tp-split: docs/moe.md). One-line UserError."""
    from shardtune.rules.tp import check_tp_model

    if tp > 1 and arch.num_experts and ep <= 1:
        raise UserError(f"--tp {tp}: tensor parallelism of a MoE model ({arch.model_type}) needs expert parallelism "
                        "(its experts are not tp-split): add --ep N, or use --tp 1")
    check_tp_model(tp, config)


def tp_collectives(arch: Architecture, tokens: int, tp: int, sp: bool, elem_bytes: int, ac: str,
                   ac_every: int = 2) -> list[tuple[str, int, str, int, str]]:
    """(op, payload bytes, phase, calls, what) of one micro-batch's TP collectives (module doc).

    Payload: `calls` × nccl-tests' whole buffer of one call, e·T·h (the all-gather's output,
    the reduce-scatter's input, the all-reduce's buffer). Per layer 2 forward + 2 backward of
    each kind with SP (2 all-reduces each way without); the embedding and the LM head add theirs
    (module doc), and with SP the 2L + 1 norm weights' partial grads are all-reduced (h
    elements each); AC re-runs the forward's collectives of each recomputed layer (op AC too: the
    gathered inputs of the matmuls it keeps are not kept). The loss's all-reduces over [T]
    (max, sum of exp, target logit: 3 × 4·T bytes) ride beside them."""
    if tp == 1:
        return []
    L = arch.num_layers
    payload = elem_bytes * tokens * arch.hidden_size
    recomputed = {"none": 0, "full": L, "op": L}.get(ac, -(-L // max(1, ac_every)))
    raw: list[tuple[str, int, str, int, str]] = []
    out = raw
    if sp:
        # the layers' pair of each kind; the head's input all-gather (reduce-scatter back), the
        # embedding's all-reduce and layer 0's local slice (its gradient all-gathered back)
        out += [("all_gather", payload, "forward", 2 * L + 1, "TP activations (sequence parallel)"),
                ("reduce_scatter", payload, "forward", 2 * L, "TP activations (sequence parallel)"),
                ("all_reduce", payload, "forward", 1, "TP embedding output"),
                ("all_gather", payload, "backward", 2 * L + 1, "TP activation grads"),
                ("reduce_scatter", payload, "backward", 2 * L + 1, "TP activation grads"),
                # each rank saw a slice of the sequence: the norm weights' grads are partial sums
                ("all_reduce", elem_bytes * arch.hidden_size, "backward", 2 * L + 1, "SP norm weight grads")]
        if recomputed:
            out += [("all_gather", payload, "backward", 2 * recomputed, "TP recompute (AC)"),
                    ("reduce_scatter", payload, "backward", 2 * recomputed, "TP recompute (AC)")]
    else:
        out += [("all_reduce", payload, "forward", 2 * L + 1, "TP activations"),
                ("all_reduce", payload, "backward", 2 * L + 1, "TP activation grads")]
        if recomputed:
            out.append(("all_reduce", payload, "backward", 2 * recomputed, "TP recompute (AC)"))
    out.append(("all_reduce", 4 * tokens, "forward", 3, "loss parallel (max, sum exp, target)"))
    return [(op, size * calls, phase, calls, what) for op, size, phase, calls, what in raw]


def tied_tp_embedding_grad_bytes(arch: Architecture, elem_bytes: int) -> int:
    """A tied embedding under tp (one vocabulary-split weight for the embedding and the head): its
    backward holds the embedding's gradient over the whole vocabulary, e·V·h, beside the two local
    gradients `memory.tied_backward_bytes` counts. Calibrated on one real run (SmolLM2-135M cut to 2
    layers, tp 3, fp32: measured peak 400.55 MiB = planned; without it 292.55): tests/e2e/
    test_tied_export.py checks it."""
    return elem_bytes * arch.vocab_size * arch.hidden_size


def tp_embedding_grad_bytes(arch: Architecture, tp: int, elem_bytes: int) -> int:
    """Bytes the vocabulary-parallel embedding's backward adds at the end of backward beyond its
    own shard's gradient: torch makes the embedding's gradient over the whole vocabulary (V, h)
    on every TP rank before it is sharded, e·V·h·(1 − 1/tp). Measured by `plan --simulate`
    (FSDPMemTracker's unsharded grads at the end of backward: (1 + tp)·e/2 bytes per local root
    element at tp 2, 4 and 8; docs/planner.md)."""
    if tp == 1:
        return 0
    return elem_bytes * arch.vocab_size * arch.hidden_size * (tp - 1) // tp

