"""The layout's one device mesh and its sub-meshes by name.

Every strategy and degree runs on the same 5-D mesh, `Layout.mesh_axes` = ("pp", "dp_replicate",
"dp_shard", "cp", "tp") with size-1 dimensions kept (torchtitan's parallel_dims order). What each
technique runs on is looked up by name in one table (`sub_mesh`), made once by `build_mesh` on
every rank alike (making a group is a collective); no caller reads a mesh's ndim or dimension names.
The experts' mesh is built beside it (`_expert_mesh`, as torchtitan builds its sparse mesh
separately) and looked up in the same table ("ep", "efsdp").
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtune.layout import Layout

if TYPE_CHECKING:
    from shardtune.config import ParallelConfig

_SUB = "_shardtune_sub_meshes"  # on a mesh: its sub-meshes by name, made once by `build_mesh`
# "dp": the data-parallel ranks, 1-D (ranks of one tp and cp group read the same rows); "fsdp": what
# zero2/zero3 shard over, 1-D (dp_shard, or dp_shard x cp flattened: torchtitan's "dp_shard_cp");
# "hsdp": FSDP2's 2-D (dp_replicate, fsdp) mesh; "tp", "cp", "pp": 1-D, None at degree 1; "ep" and
# "efsdp" (the experts' FSDP mesh, 2-D under hsdp or tp): None without expert parallelism.
SUB_MESHES = ("dp", "fsdp", "hsdp", "tp", "cp", "pp", "ep", "efsdp")


def build_layout(parallel_cfg: ParallelConfig, world_size: int, local_world_size: int) -> Layout:
    """The run's `Layout` (the one place degrees are derived and checked)."""
    return Layout.of_config(parallel_cfg, world_size, local_world_size)


def build_mesh(parallel_cfg: ParallelConfig, world_size: int, local_world_size: int,
               device_type: str) -> DeviceMesh:
    """The layout's mesh, shape `Layout.mesh_shape` on `Layout.mesh_axes` for every strategy (ddp and
    zero1 replicate over dp_replicate, zero2/zero3 shard over dp_shard, hsdp both), with its sub-mesh
    table (`sub_mesh`). Needs an initialised default process group."""
    layout = build_layout(parallel_cfg, world_size, local_world_size)
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=layout.mesh_axes)
    with warnings.catch_warnings():  # torch 2.13 asks to keep the flattened meshes rather than slice them by name
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        # FSDP shards over dp_shard x cp (torchtitan's "dp_shard_cp"): cp ranks hold different tokens
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if layout.cp > 1 else mesh["dp_shard"]
        table = {"dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"), "fsdp": shard,
                 "hsdp": mesh["dp_replicate", shard.mesh_dim_names[0]]}
    table |= {n: mesh[n] if layout.degree(n) > 1 else None for n in ("tp", "cp", "pp")}
    table |= {"ep": None, "efsdp": None}
    if layout.ep > 1:
        ep_mesh = _expert_mesh(layout, device_type)
        table |= {"ep": ep_mesh["ep"], "efsdp": ep_mesh["dp_replicate", "efsdp"]
                  if layout.strategy.hybrid or layout.tp > 1 else ep_mesh["efsdp"]}
    setattr(mesh, _SUB, table)
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


def sub_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh | None:
    """The sub-mesh called `name` (SUB_MESHES) of a `build_mesh` mesh; None for a degree of 1
    (tp, cp, pp) or without expert parallelism (ep, efsdp)."""
    table = getattr(mesh, _SUB, None)
    if table is None:
        raise ValueError(f"{mesh} was not made by parallel/mesh.py build_mesh: it has no sub-mesh table")
    return table[name]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D tensor-parallel sub-mesh, or None without tp."""
    return sub_mesh(mesh, "tp")


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D context-parallel sub-mesh, or None without cp (> 1)."""
    return sub_mesh(mesh, "cp")


def fsdp_mesh(mesh: DeviceMesh, hybrid: bool) -> DeviceMesh:
    """The mesh FSDP2 shards over: hsdp's 2-D (dp_replicate, shard), or the 1-D shard group."""
    return sub_mesh(mesh, "hsdp" if hybrid else "fsdp")


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of the data-parallel ranks, 1-D."""
    return sub_mesh(mesh, "dp")


def dp_rank_size(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel degree): ranks of one TP (and CP) group share one."""
    dp = dp_mesh(mesh)
    return dp.get_local_rank(), dp.size()


def dp_group(mesh: DeviceMesh):
    """The group over all data-parallel ranks (DDP and zero1's optimizer run over it, the step sums
    its token counts over it)."""
    return dp_mesh(mesh).get_group()
