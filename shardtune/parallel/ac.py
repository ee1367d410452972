"""Activation checkpointing: per chosen decoder layer, whole (`checkpoint`) or op-level (torch's
selective checkpoint, docs/ac.md). `parallel/build.py` applies it before sharding."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from shardtune.parallel.layers import decoder_layers
from shardtune.parallel.pp import stage_span
from shardtune.parallel.record import record
from shardtune.strategies import checkpointed_layers


def _op_saved_ops() -> frozenset:
    """The ops whose outputs op AC keeps (docs/ac.md): the matmuls and SDPA's fused kernels,
    as torchtitan's `_save_list`; every other op is recomputed in backward."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


_OP_SAVED = _op_saved_ops()


def op_ac_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """op AC's policy: keep the outputs of `_op_saved_ops`, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if func in _OP_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def op_ac_context():
    """A fresh pair of contexts per checkpointed forward (torch's selective checkpoint API)."""
    return create_selective_checkpoint_contexts(op_ac_policy)


def _op_checkpoint_forward(layer: nn.Module) -> None:
    """op AC on one layer: its forward function runs under non-reentrant checkpoint with the op
    policy, inside the module call, so FSDP2's hooks (input casts, profiler ranges) stay outside
    the selective region in forward and in recompute alike (composable `checkpoint` re-runs them
    inside it, where SAC finds ops its forward never saw). No-grad forwards run plain."""
    inner = layer.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch_checkpoint(inner, *args, use_reentrant=False, context_fn=op_ac_context, **kwargs)

    layer.forward = forward


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """Non-reentrant checkpoint per chosen decoder layer (composable API: parameter names stay
    the same, so state dicts keep HF names); `op`: torch's selective checkpoint per layer."""
    layers = decoder_layers(model)
    # a pipeline stage (parallel/pp.py) holds layers first.. of the model's: the rule is the whole model's
    span = stage_span(model)  # a pipeline stage (parallel/pp.py: apply_pp runs first)
    first, total = (span.first_layer, sum(span.layers)) if span is not None else (0, len(layers))
    done = []
    for i in checkpointed_layers(total, mode, every):
        if not first <= i < first + len(layers):
            continue
        if mode == "op":
            _op_checkpoint_forward(layers[i - first])
        else:
            checkpoint(layers[i - first])
        done.append(i - first)
    record(model).ac, record(model).ac_layers = mode, done
