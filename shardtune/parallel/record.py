"""What parallel/ applied to a model, one record (`Applied`) written by each `apply_*` as it applies
(parallel/fsdp.py, ac.py, build.py, tp.py, cp.py, ep.py) and read by train/core/effective.py, the step and
the loss (tp). docs/DESIGN.md "What ran" says which effective facts come from it and which are read
back from the built objects instead."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

_ATTR = "_shardtune_applied"  # on the model (the one a DDP wrapper holds): its Applied


@dataclass
class Applied:
    """The techniques applied to one model, as applied (not as asked)."""
    ac: str = "none"  # parallel.activation_checkpointing applied: none, full, layer, op
    ac_layers: list[int] = field(default_factory=list)  # the checkpointed decoder layers, this model's (a
    # pipeline stage's: its own) indices
    compile: bool = False  # every decoder layer's training forward torch.compile'd (build.py apply_compile)
    fsdp: bool = False  # fully_shard on the decoder layers and the root (fsdp.py apply_fsdp)
    reshard_after_forward: bool | None = None  # fsdp: zero3 / hsdp (True) or zero2 (False)
    param_dtype: torch.dtype | None = None  # fsdp: the MixedPrecisionPolicy's compute dtype (None: the params')
    offload: str = "none"  # fsdp: parallel.offload (all: CPUOffloadPolicy)
    tp: int = 1  # tensor-parallel degree (tp.py apply_tp)
    sequence_parallel: bool = False  # tp: the norms' activations sharded over the sequence
    cp: int = 1  # context-parallel degree (cp.py apply_cp)
    ep: int = 1  # expert-parallel degree (ep.py apply_ep)


def applied(model: nn.Module) -> Applied:
    """`model`'s record (or the record of the model a DDP wrapper holds); an empty one, not stored,
    for a model parallel/ never touched."""
    return getattr(getattr(model, "module", model), _ATTR, None) or Applied()


def record(model: nn.Module) -> Applied:
    """`model`'s record to write to, made on first use (the apply_* functions call it)."""
    rec = getattr(model, _ATTR, None)
    if rec is None:
        rec = Applied()
        setattr(model, _ATTR, rec)
    return rec
