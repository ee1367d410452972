"""The one place that applies a strategy, activation checkpointing, offload and precision.

`apply_parallelism(model, parallel_cfg, mesh)` takes the mesh as an argument and does no I/O, so the
simulator can call it on a meta-device model inside FakeTensorMode with a fake process group.

Order (and why):
  1. precision cast (`apply_precision`): before sharding, so FSDP shards bf16 storage and DDP
     buckets bf16 gradients. Pure bf16: everything. bf16-mixed keeps fp32 master weights for what
     trains (FSDP: MixedPrecisionPolicy; DDP/zero1: torch.autocast in the step, see
     `autocast_dtype`) and casts the frozen ones (LoRA's base) to bf16: a frozen weight gets no
     update, so an fp32 master copy of it buys nothing and costs 2 B/param more (FSDP2 needs one
     original dtype among a group's trainable params only, `_init_mp_dtypes`).
  2. activation checkpointing per decoder layer: before sharding, so FSDP's pre/post-forward hooks
     wrap the checkpointed region and the recompute in backward re-gathers parameters
     (torchtitan's order: TP → AC → compile → FSDP).
  3. sharding: FSDP2 `fully_shard` on every decoder layer, then on the root (the root owns the
     embeddings, final norm and head; the seed's transformer_auto_wrap_policy), or DDP around the
     whole model. DDP broadcasts rank 0's parameters when it is built, so ddp/zero1 need
     materialised parameters: call this after init for them (FSDP strategies: on the meta model,
     before `to_empty`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shardtune.errors import UserError
from shardtune.strategies import FSDP_STRATEGIES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardtune.config import ParallelConfig


def hsdp_shard_degree(parallel_cfg: ParallelConfig, world_size: int, local_world_size: int) -> int:
    """Ranks per hsdp shard group (default: the processes of one node); must divide the world."""
    shard = parallel_cfg.hsdp_shard_size or local_world_size
    if shard < 1 or world_size % shard:
        raise UserError(
            f"parallel.hsdp_shard_size {shard} does not divide the world size {world_size}; "
            f"choose a divisor of {world_size}")
    return shard


def build_mesh(parallel_cfg: ParallelConfig, world_size: int, local_world_size: int,
               device_type: str) -> DeviceMesh:
    """1-D mesh ("dp",) for ddp/zero1/zero2/zero3; 2-D ("replicate", "shard") for hsdp.

    Needs an initialised default process group (real or fake)."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel_cfg.strategy == "hsdp":
        shard = hsdp_shard_degree(parallel_cfg, world_size, local_world_size)
        return init_device_mesh(device_type, (world_size // shard, shard),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, in order: the modules whose class HF lists in `_no_split_modules`
    (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(f"{type(model).__name__} declares no decoder layer class (_no_split_modules); "
                        "use a Llama, Mistral or Qwen2 style causal LM")
    return layers


def checkpointed_layer_indices(num_layers: int, mode: str, every: int) -> list[int]:
    """Which decoder layers recompute their activations: full → all; selective → every k-th layer,
    layers 0, k, 2k, ... (⌈L/k⌉ layers, as plan/activations.py and plan/compute.py count them;
    torchtitan's `ac_freq` picks k-1, 2k-1, ... instead); none → []."""
    if mode == "full":
        return list(range(num_layers))
    if mode == "selective":
        return [i for i in range(num_layers) if i % every == 0]
    return []


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """Non-reentrant checkpoint per chosen decoder layer (composable API: parameter names stay
    the same, so state dicts keep HF names)."""
    from torch.distributed._composable import checkpoint

    layers = decoder_layers(model)
    for i in checkpointed_layer_indices(len(layers), mode, every):
        checkpoint(layers[i])


def autocast_dtype(parallel_cfg: ParallelConfig) -> torch.dtype | None:
    """The dtype the step autocasts to: bf16 for bf16-mixed under ddp/zero1 (FSDP strategies cast
    inside fully_shard instead), else None."""
    if parallel_cfg.precision == "bf16-mixed" and parallel_cfg.strategy not in FSDP_STRATEGIES:
        return torch.bfloat16
    return None


def apply_precision(model: nn.Module, parallel_cfg: ParallelConfig) -> None:
    """Cast parameters to their stored dtype (module doc, step 1); on meta or real tensors alike."""
    if parallel_cfg.precision == "bf16":
        model.to(torch.bfloat16)
    elif parallel_cfg.precision == "bf16-mixed":
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)


def _apply_fsdp(model: nn.Module, parallel_cfg: ParallelConfig, mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if parallel_cfg.precision == "bf16-mixed" else MixedPrecisionPolicy())
    # pin_memory needs an accelerator; on a CPU-only build it raises (PYTORCH-NOTES traps).
    offload = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
               if parallel_cfg.offload == "all" else OffloadPolicy())
    # zero2 keeps parameters gathered from forward to backward; zero3 and hsdp free them.
    reshard = parallel_cfg.strategy != "zero2"
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if any(p.is_meta for p in model.parameters()):
        raise ValueError("ddp/zero1: apply_parallelism needs materialised parameters (DDP "
                         "broadcasts them when built); call it after init")
    from torch._subclasses.fake_tensor import FakeTensor

    first = next(model.parameters())
    device_ids = [first.device.index] if first.device.type == "cuda" else None
    # init_sync checks shapes and broadcasts rank 0's values: real data that fake tensors (the
    # simulator) lack; our init is identical on every rank anyway (train/core/model.py).
    return DDP(model, process_group=mesh.get_group(), device_ids=device_ids,
               gradient_as_bucket_view=True, init_sync=not isinstance(first, FakeTensor))


def apply_parallelism(model: nn.Module, parallel_cfg: ParallelConfig, mesh: DeviceMesh) -> nn.Module:
    """Apply precision, AC and the strategy (order in the module docstring); returns the model to
    train (the same object for FSDP strategies, a DDP wrapper for ddp/zero1; zero1's optimizer
    sharding is built with the optimizer, `train.step.build_optimizer`)."""
    if hasattr(model, "config"):
        model.config.use_cache = False  # with the KV cache on, AC saves far less (PYTORCH-NOTES)
    apply_precision(model, parallel_cfg)
    apply_activation_checkpointing(model, parallel_cfg.activation_checkpointing, parallel_cfg.ac_every)
    if parallel_cfg.strategy in FSDP_STRATEGIES:
        if (parallel_cfg.strategy == "hsdp") != (mesh.ndim == 2):
            raise ValueError(f"strategy {parallel_cfg.strategy} needs a {'2' if parallel_cfg.strategy == 'hsdp' else '1'}-D mesh, got {mesh.ndim}-D")
        _apply_fsdp(model, parallel_cfg, mesh)
        return model
    return _apply_ddp(model, mesh)
