"""The `apply_*` steps of a strategy, and the mesh it runs on.

Each helper changes a model in place (or wraps it: DDP) and does no I/O; `parallel/build.py`
orders them (precision → AC → shard → materialise → fill) for the trainer and the simulator
alike. The mesh is `layout.Layout`'s shape on its `mesh_axes`.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from shardtune.errors import UserError
from shardtune.layout import Layout
from shardtune.parallel.pp import stage_span
from shardtune.parallel.record import record
from shardtune.strategies import STRATEGY, autocasts, checkpointed_layers

if TYPE_CHECKING:
    from shardtune.config import ParallelConfig


def build_layout(parallel_cfg: ParallelConfig, world_size: int, local_world_size: int) -> Layout:
    """The run's `Layout` (the one place degrees are derived and checked)."""
    return Layout.of_config(parallel_cfg, world_size, local_world_size)


def build_mesh(parallel_cfg: ParallelConfig, world_size: int, local_world_size: int,
               device_type: str) -> DeviceMesh:
    """The layout's mesh, named by `Layout.mesh_axes`: 1-D ("dp",) for ddp/zero1/zero2/zero3, 2-D
    ("replicate", "shard") for hsdp, 3-D ("dp_replicate", "dp_shard", "tp") with tp > 1, 4-D
    ("dp_replicate", "dp_shard", "cp", "tp") with cp > 1 (`Layout.build` checks the degrees); its
    sub-meshes by name (`sub_mesh`) are made here, once, on every rank alike (making a group is a
    collective). Needs an initialised default process group."""
    layout = build_layout(parallel_cfg, world_size, local_world_size)
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=layout.mesh_axes)
    table = _sub_meshes(mesh)
    if layout.ep > 1:
        ep_mesh = _expert_mesh(layout, device_type)
        table |= {"ep": ep_mesh["ep"], "efsdp": ep_mesh["dp_replicate", "efsdp"]
                  if layout.strategy.hybrid or layout.tp > 1 else ep_mesh["efsdp"]}
    return mesh


def _expert_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """torchtitan's dp2ep: the ranks of each tp index as (dp_replicate, efsdp, ep), ep innermost of
    dp_shard x cp (consecutive data ranks, its cp ranks included). With tp > 1 the tp ranks hold the
    same experts (not tp-split) and route different tokens: they join dp_replicate (the experts' HSDP
    replicas), ranks (r, t, f, e) of the world's (dp_replicate, efsdp, ep, tp) numbering."""
    shape = (layout.dp_replicate, layout.expert_fsdp_degree, layout.ep)
    names = ("dp_replicate", "efsdp", "ep")
    if layout.tp == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    ranks = torch.arange(layout.world_size // layout.pp).view(*shape, layout.tp).permute(0, 3, 1, 2)
    return DeviceMesh(device_type, ranks.reshape(shape[0] * layout.tp, *shape[1:]), mesh_dim_names=names)


_SUB = "_shardtune_sub_meshes"  # on a mesh: its sub-meshes by name, made once (`_sub_meshes`)
SUB_MESHES = ("dp", "fsdp", "hsdp", "tp", "cp", "pp", "ep", "efsdp")


def _sub_meshes(mesh: DeviceMesh) -> dict[str, DeviceMesh | None]:
    """The one place that reads the mesh's dimension names: "dp" (the data-parallel ranks, 1-D: ranks
    of one tp and cp group read the same rows), "fsdp" (what zero2/zero3 shard over: the data ranks
    without cp, dp_shard x cp flattened with it, as torchtitan's "dp_shard_cp"), "hsdp" (FSDP2's 2-D
    replicate x shard mesh), "tp", "cp" and "pp" (1-D, None at degree 1); "ep" and "efsdp" (the experts'
    FSDP mesh, 2-D under hsdp or tp) are `build_mesh`'s, None without expert parallelism."""
    if (table := getattr(mesh, _SUB, None)) is not None:
        return table
    names = mesh.mesh_dim_names or ()
    size = lambda n: mesh[n].size() if n in names else 1  # noqa: E731
    with warnings.catch_warnings():  # torch 2.13 asks to keep the flattened meshes rather than slice them by name
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        if "dp_shard" not in names:  # the strategy's own 1-D ("dp",) or hsdp's 2-D ("replicate", "shard")
            dp = mesh if mesh.ndim == 1 else mesh._flatten("dp")
            table = {"dp": dp, "fsdp": mesh, "hsdp": mesh}
        elif "cp" in names:  # FSDP shards over dp_shard x cp (torchtitan's "dp_shard_cp")
            shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            table = {"dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"), "fsdp": shard,
                     "hsdp": mesh["dp_replicate", "dp_shard_cp"]}
        else:
            table = {"dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"), "fsdp": mesh["dp_shard"],
                     "hsdp": mesh["dp_replicate", "dp_shard"]}
    table |= {n: mesh[n] if size(n) > 1 else None for n in ("tp", "cp", "pp")} | {"ep": None, "efsdp": None}
    setattr(mesh, _SUB, table)
    return table


def sub_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh | None:
    """The sub-mesh called `name` (SUB_MESHES); None for a tp or cp of degree 1."""
    return _sub_meshes(mesh)[name]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D tensor-parallel sub-mesh, or None without tp."""
    return sub_mesh(mesh, "tp")


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D context-parallel sub-mesh, or None without cp (> 1)."""
    return sub_mesh(mesh, "cp")


def fsdp_mesh(mesh: DeviceMesh, hybrid: bool) -> DeviceMesh:
    """The mesh FSDP2 shards over: hsdp's 2-D replicate x shard, or the 1-D shard group."""
    return sub_mesh(mesh, "hsdp" if hybrid else "fsdp")


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of the data-parallel ranks, 1-D."""
    return sub_mesh(mesh, "dp")


def dp_rank_size(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel degree): ranks of one TP (and CP) group share one."""
    dp = dp_mesh(mesh)
    return dp.get_local_rank(), dp.size()


def dp_group(mesh: DeviceMesh):
    """The group over all data-parallel ranks (zero1 shards its optimizer over it, the step sums its
    token counts over it)."""
    return dp_mesh(mesh).get_group()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, in order: the modules whose class HF lists in `_no_split_modules`
    (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(f"{type(model).__name__} declares no decoder layer class (_no_split_modules); "
                        "use a Llama, Mistral or Qwen2 style causal LM")
    return layers


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
    norm and head; the seed's transformer_auto_wrap_policy); split experts first (`_shard_experts`)."""
    s = STRATEGY[parallel_cfg.strategy]
    experts_mesh = sub_mesh(mesh, "efsdp")
    grad_divide = dp_mesh(mesh).size() * (cp_mesh(mesh).size() if cp_mesh(mesh) is not None else 1)
    mesh = fsdp_mesh(mesh, s.hybrid)
    if len(s.mesh_axes) != mesh.ndim:
        raise ValueError(f"strategy {s.name} needs a {len(s.mesh_axes)}-D mesh {s.mesh_axes}, got {mesh.ndim}-D")
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
    shard = experts_mesh.size(experts_mesh.ndim - 1)
    for experts in (m for m in layer.modules() if hasattr(m, "ep_group")):  # parallel/ep.py apply_ep
        fully_shard(experts, **(kwargs | {"mesh": experts_mesh}))
        experts.set_gradient_divide_factor(float(grad_divide))
        experts.set_force_sum_reduction_for_comms(shard > 1)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> DistributedDataParallel:
    """DDP around the whole model, which must be materialised: DDP broadcasts it when built."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("ddp/zero1: DDP needs materialised parameters (it broadcasts them when built); "
                         "wrap after the fill")
    first = next(model.parameters())
    device_ids = [first.device.index] if first.device.type == "cuda" else None
    # init_sync checks shapes and broadcasts rank 0's values: real data that fake tensors (the
    # simulator) lack; our init is identical on every rank anyway (train/core/model.py).
    return DistributedDataParallel(model, process_group=mesh.get_group(), device_ids=device_ids,
                                   gradient_as_bucket_view=True, init_sync=not isinstance(first, FakeTensor))
