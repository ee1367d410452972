"""How a strategy holds the model: precision (stored dtypes, the mixed-precision policy), FSDP2's
`fully_shard` with its offload policy (zero2 / zero3 / hsdp, experts on their own mesh), or DDP
around the whole model (ddp / zero1). Each helper changes a model in place (or wraps it: DDP) and
does no I/O; `parallel/build.py` orders them. Meshes come from parallel/mesh.py's table."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardtune.parallel.layers import decoder_layers
from shardtune.parallel.mesh import dp_group, fsdp_mesh, sub_mesh
from shardtune.parallel.record import record
from shardtune.strategies import STRATEGY, autocasts

if TYPE_CHECKING:
    from shardtune.config import ParallelConfig


def autocast_dtype(parallel_cfg: ParallelConfig) -> torch.dtype | None:
    """The dtype the step autocasts to: bf16 for bf16-mixed under ddp/zero1 (FSDP strategies cast
    inside fully_shard instead), else None."""
    return torch.bfloat16 if autocasts(parallel_cfg.strategy, parallel_cfg.precision) else None


def apply_precision(model: nn.Module, parallel_cfg: ParallelConfig) -> None:
    """Cast parameters to their stored dtype, on meta or real tensors alike. Pure bf16: everything.
    bf16-mixed keeps fp32 master weights for what trains (FSDP: MixedPrecisionPolicy; DDP/zero1:
    torch.autocast in the step, `autocast_dtype`) and casts the frozen ones (LoRA's base) to bf16:
    a frozen weight gets no update, so an fp32 master copy of it buys nothing and costs 2 B/param
    more (FSDP2 needs one original dtype among a group's trainable params only, `_init_mp_dtypes`)."""
    if parallel_cfg.precision == "bf16":
        model.to(torch.bfloat16)
    elif parallel_cfg.precision == "bf16-mixed":
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)


def apply_fsdp(model: nn.Module, parallel_cfg: ParallelConfig, mesh: DeviceMesh) -> None:
    """FSDP2 `fully_shard` on every decoder layer, then on the root (it owns the embeddings, final
    norm and head; the seed's transformer_auto_wrap_policy); split experts first (`_shard_experts`).
    `mesh`: `build_mesh`'s; FSDP2 gets its "fsdp" (1-D) or, under hsdp, "hsdp" (2-D) sub-mesh."""
    s = STRATEGY[parallel_cfg.strategy]
    experts_mesh = sub_mesh(mesh, "efsdp")
    cp = sub_mesh(mesh, "cp")
    grad_divide = sub_mesh(mesh, "dp").size() * (cp.size() if cp is not None else 1)
    mesh = fsdp_mesh(mesh, s.hybrid)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if parallel_cfg.precision == "bf16-mixed" else MixedPrecisionPolicy())
    # pin_memory needs an accelerator; on a CPU-only build it raises (PYTORCH-NOTES traps).
    offload = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
               if parallel_cfg.offload == "all" else OffloadPolicy())
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=s.reshard_after_forward)
    for layer in decoder_layers(model):
        if experts_mesh is not None:
            _shard_experts(layer, experts_mesh, kwargs, grad_divide)
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    rec = record(model)
    rec.fsdp, rec.reshard_after_forward, rec.param_dtype = True, s.reshard_after_forward, mp.param_dtype
    rec.offload = "all" if isinstance(offload, CPUOffloadPolicy) else "none"


def _shard_experts(layer: nn.Module, experts_mesh: DeviceMesh, kwargs: dict, grad_divide: int) -> None:
    """Expert parallelism (docs/moe.md): the layer's split experts `fully_shard` on the expert-FSDP
    mesh first (the layer's own `fully_shard` then leaves them alone). Each expert's gradient already
    sums every data rank's tokens (the dispatch's backward), so it is divided by the whole
    data-parallel degree, as the other gradients are. Over 2+ expert-FSDP ranks, with a plain sum on
    the wire (FSDP2 would use NCCL's PREMUL_SUM, which gloo lacks) and the division after; over one,
    not (torch 2.13's one-rank path divides by the factor itself, and forced sums would divide twice)."""
    shard = experts_mesh["efsdp"].size()  # 2-D under hsdp or tp: (dp_replicate, efsdp)
    for experts in (m for m in layer.modules() if hasattr(m, "ep_group")):  # parallel/ep.py apply_ep
        fully_shard(experts, **(kwargs | {"mesh": experts_mesh}))
        experts.set_gradient_divide_factor(float(grad_divide))
        experts.set_force_sum_reduction_for_comms(shard > 1)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """DDP around the whole model over `build_mesh`'s "dp" group; the model must be materialised:
    DDP broadcasts it when built."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("ddp/zero1: DDP needs materialised parameters (it broadcasts them when built); "
                         "wrap after the fill")
    first = next(model.parameters())
    device_ids = [first.device.index] if first.device.type == "cuda" else None
    # init_sync checks shapes and broadcasts rank 0's values: real data that fake tensors (the
    # simulator) lack; our init is identical on every rank anyway (train/core/model.py).
    return DistributedDataParallel(model, process_group=dp_group(mesh), device_ids=device_ids,
                                   gradient_as_bucket_view=True, init_sync=not isinstance(first, FakeTensor))
