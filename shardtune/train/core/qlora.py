"""QLoRA (Dettmers et al. 2023): the frozen base weights of the LoRA target modules stored as
torchao's NF4Tensor (4-bit NormalFloat codes, per-64 absmax scales double-quantised to int8 per
256 scales), the adapters trainable as in plain LoRA (docs/qlora.md).

Order (parallel/build.py): meta build → adapters → precision → `quantize_base` (on meta: each
quantisable target weight becomes a meta NF4Tensor of its stored dtype) → FSDP2 `fully_shard`
(NF4Tensor implements the split/new_zeros/all-gather hooks FSDP2 needs, as torchtune's QLoRA
uses it) → `to_empty` → fill: `fill_nf4` quantises the FULL tensor once and keeps this rank's
row chunk, so every layout holds the same codes and the same tensor-wide scaler mean
(quantising a shard alone would not).

Which weights: a target base weight of n elements is stored in NF4 when n is a multiple of
64 · 256 · S and its rows of S, S the FSDP shard-group size (1 for ddp/zero1): torchao's blocks
and scaler blocks must not straddle shards. Others stay in their dtype (plan/params.py counts
the same rule). Embeddings, norms and the head are never quantised.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

# torchao is imported only by a QLoRA run (an optional extra): every trainer imports this module
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"

BLOCK = 64  # torchao's default block_size: one absmax scale per 64 weights
SCALER_BLOCK = 256  # scaler_block_size: one fp quantisation factor per 256 int8 scales


def quantizable(shape: tuple[int, ...], shard: int) -> bool:
    """The rule of the module doc: whole blocks and scaler blocks on every one of `shard` shards."""
    numel = 1
    for s in shape:
        numel *= int(s)
    return len(shape) == 2 and shape[0] % shard == 0 and numel % (BLOCK * SCALER_BLOCK * shard) == 0


def _is_nf4_tensor(t: torch.Tensor) -> bool:
    """An NF4Tensor; False without a torchao import (then none exists)."""
    cls = getattr(sys.modules.get(_NF4_MODULE), "NF4Tensor", None)
    return cls is not None and isinstance(t, cls)


def _to_nf4(t: torch.Tensor) -> NF4Tensor:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: PLC0415 optional extra (torchao)

    return to_nf4(t, BLOCK, SCALER_BLOCK)


def is_nf4(param: torch.Tensor) -> bool:
    """True for an NF4 parameter, plain or the local tensor of an FSDP2 DTensor."""
    return _is_nf4_tensor(getattr(param, "_local_tensor", param))


def quantize_base(model: nn.Module, shard: int) -> list[str]:
    """Replace each quantisable LoRA base weight (PEFT's `<proj>.base_layer.weight`, frozen) by a
    frozen NF4 parameter, on meta (no memory). Returns the names. ddp/zero1 (shard 1): DDP is told
    to leave them out of its start-up broadcast (every rank fills the same codes)."""
    names = []
    for mname, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Linear) or not quantizable(tuple(base.weight.shape), shard):
            continue
        base.weight = nn.Parameter(_to_nf4(base.weight.detach()), requires_grad=False)
        names.append(f"{mname}.base_layer.weight")
    model._ddp_params_and_buffers_to_ignore = list(names)
    return names


@torch.no_grad()
def nf4_of(full: torch.Tensor, dtype: torch.dtype) -> NF4Tensor:
    """The NF4 codes of a full weight stored in `dtype` (what training holds)."""
    return _to_nf4(full.to(dtype).contiguous())


@torch.no_grad()
def fill_nf4(param: torch.Tensor, full: torch.Tensor) -> None:
    """Fill an NF4 parameter (after `to_empty`) from the full weight: quantise it whole, keep this
    rank's dim-0 chunk (FSDP2's Shard(0) chunking). `to_empty` leaves the scaler mean and the
    16-value table on meta (torchao's empty_like only makes the sharded inner tensors): set them."""
    local = getattr(param, "_local_tensor", param)  # the object FSDP2 all-gathers, not a view
    q = nf4_of(full, param.dtype).to(local.quantized_data.device)
    if local is not param:
        mesh = param.device_mesh
        shard_dim = mesh.ndim - 1  # hsdp: (replicate, shard)
        q = torch.chunk(q, mesh.size(shard_dim), dim=0)[mesh.get_local_rank(shard_dim)]
    local.copy_(q)
    local.scaler_mean = q.scaler_mean.clone()
    local.nf4 = q.nf4.clone()


def dequantized(full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight the training forward used: NF4 of `full` in `dtype`, dequantised (export)."""
    return nf4_of(full, dtype).get_original_weight()


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's own storages: an NF4Tensor's five inner tensors (torchao's
    `__tensor_flatten__`), a DTensor's local part, or a plain tensor's elements."""
    t = getattr(t, "_local_tensor", t)
    if _is_nf4_tensor(t):
        return sum(tensor_bytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()
