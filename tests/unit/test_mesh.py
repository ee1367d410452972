"""parallel/mesh.py: one 5-D mesh for every strategy and degree, its sub-meshes by name.

Built on torch's fake process group (rank 0 of `world`, no communication): each sub-mesh's ranks
(rank 0's group) against rank lists worked out by hand from the numbering rule, ranks row-major
over (pp, dp_replicate, dp_shard, cp, tp), tp fastest; and the mesh FSDP2 gets is 1-D (zero2/zero3)
or 2-D (hsdp) as before the one mesh.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardtune.config import ParallelConfig
from shardtune.parallel.mesh import SUB_MESHES, build_mesh, fsdp_mesh, sub_mesh

D5 = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@pytest.mark.parametrize("world, per_node, par, want", [
    # ddp/zero1 replicate over dp_replicate: all 4 data ranks
    (4, 4, dict(strategy="ddp"), dict(dp=[0, 1, 2, 3])),
    (4, 4, dict(strategy="zero1"), dict(dp=[0, 1, 2, 3])),
    (4, 4, dict(strategy="zero3"), dict(dp=[0, 1, 2, 3], fsdp=[0, 1, 2, 3])),
    # hsdp: shard group of one node's 4 ranks, replicated over the 2 nodes
    (8, 4, dict(strategy="hsdp"), dict(dp=list(range(8)), fsdp=[0, 1, 2, 3], hsdp=[[0, 1, 2, 3], [4, 5, 6, 7]])),
    # tp 2 innermost: ranks 0,1 one tp group; data ranks every 2nd
    (8, 8, dict(strategy="zero3", tp=2), dict(tp=[0, 1], dp=[0, 2, 4, 6], fsdp=[0, 2, 4, 6])),
    # (dp 2, cp 2, tp 2): cp ranks tp apart, data ranks cp x tp apart, FSDP over dp x cp
    (8, 8, dict(strategy="zero2", tp=2, cp=2), dict(tp=[0, 1], cp=[0, 2], dp=[0, 4], fsdp=[0, 2, 4, 6])),
    # pp outermost: stage s is ranks [2s, 2s+2)
    (4, 4, dict(strategy="zero3", pp=2), dict(pp=[0, 2], dp=[0, 1], fsdp=[0, 1])),
    # ep borrows data ranks, innermost: ep group 0,1; experts' FSDP over 0,2
    (4, 4, dict(strategy="zero3", ep=2), dict(dp=[0, 1, 2, 3], ep=[0, 1], efsdp=[0, 2])),
])
def test_one_mesh_and_its_sub_meshes(world, per_node, par, want):
    pc = ParallelConfig(precision="fp32", **par)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = build_mesh(pc, world, per_node, "cpu")
        assert mesh.mesh_dim_names == D5
        got = {n: sub_mesh(mesh, n) for n in SUB_MESHES}
        for name in ("tp", "cp", "pp", "ep", "efsdp"):
            assert (got[name] is None) == (name not in want), name
        for name, ranks in want.items():
            assert got[name].mesh.tolist() == ranks, name
        hybrid = pc.strategy == "hsdp"
        assert fsdp_mesh(mesh, hybrid).ndim == (2 if hybrid else 1)
    finally:
        dist.destroy_process_group()


def test_a_mesh_not_built_here_has_no_table():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="build_mesh"):
            sub_mesh(init_device_mesh("cpu", (2,)), "dp")
    finally:
        dist.destroy_process_group()
