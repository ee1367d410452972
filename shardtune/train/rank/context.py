"""Who this rank is (`DistContext`), built by train/rank/main.py's `setup_distributed` and passed down
to the loop and the parts it builds; its own module so that main.py → loop.py has no way back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardtune.parallel.mesh import cp_mesh, dp_group, dp_rank_size, sub_mesh, tp_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class DistContext:
    """Who this process is; passed down explicitly (no globals for rank or mesh state)."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def dp_group(self):
        """The group over all data-parallel ranks (with tp: the ranks holding this rank's TP shard)."""
        return dp_group(self.mesh)

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1 without tp)."""
        return tp_mesh(self.mesh).size() if tp_mesh(self.mesh) is not None else 1

    @property
    def cp(self) -> int:
        """The context-parallel degree (1 without cp)."""
        return cp_mesh(self.mesh).size() if cp_mesh(self.mesh) is not None else 1

    @property
    def pp(self) -> int:
        """The pipeline-parallel degree (1 without pp)."""
        return sub_mesh(self.mesh, "pp").size() if sub_mesh(self.mesh, "pp") is not None else 1

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of each global batch it reads."""
        return dp_rank_size(self.mesh)[0]

    @property
    def dp_size(self) -> int:
        """The data-parallel degree world / (tp x cp) (ranks of one TP and CP group read the same rows)."""
        return dp_rank_size(self.mesh)[1]

    @property
    def grad_divide_factor(self) -> int:
        """Ranks a gradient is averaged over: dp x cp (FSDP reduces over the cp ranks too;
        layout.Layout.grad_divide_factor)."""
        return self.dp_size * self.cp
