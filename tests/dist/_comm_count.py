"""torch's CommDebugMode, counting bytes and process groups too: every collective a step issues
(DTensor's functional collectives, FSDP2's and the step's c10d calls), as
{group label: {op: [count, bytes]}}. Bytes of one call: the largest tensor argument or result (the
full buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's tensor), what the
planner's comm model calls the collective's size.

Its module tracker is switched off: its forward hook pops a parent it never pushed when modules run
under FSDP2's and the TP plan's hooks (IndexError in `_fw_set_module_hook`, torch 2.13); module-
level attribution is not needed here.

Groups are told apart by their ranks, not their names: in a process that built meshes before (the
dist tier's shared launch), DTensor's collectives may run on an earlier mesh's group over the same
ranks, under another name.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_leaves


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _group_ranks(name: str) -> tuple[int, ...] | None:
    """The ranks of the process group registered as `name`; None if no group has that name."""
    try:
        return tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
    except (RuntimeError, ValueError, KeyError):
        return None


def _call_group_ranks(args, kwargs) -> tuple[int, ...] | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, ProcessGroup) or hasattr(a, "group_name"):  # c10d ops: a ScriptObject
            return _group_ranks(a.group_name)
        if isinstance(a, str) and (ranks := _group_ranks(a)) is not None:  # functional collectives: the name
            return ranks
    return None


class _NoTracker:
    """Stands in for CommDebugMode's module tracker (see the module docstring)."""
    name, is_bw, activation_checkpointing = "", False, False
    module_helper_dict: dict = {}
    module_parents_dict: dict = {"": set()}
    parent_dict: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return None


class CommCounter(CommDebugMode):
    def __init__(self, labels: dict[str, str]) -> None:
        """`labels`: process-group name → label ("tp", "dp", ...); groups over other ranks count as "other"."""
        super().__init__()
        self.advanced_module_tracker = _NoTracker()
        self.labels = {_group_ranks(name): label for name, label in labels.items()}
        self.by_group: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and sum(self.comm_counts.values()) > before:
            kwargs = kwargs or {}
            label = self.labels.get(_call_group_ranks(args, kwargs), "other")
            op = str(func._overloadpacket).split(".")[-1].rstrip("_")
            entry = self.by_group[label][op]
            entry[0] += 1
            entry[1] += max([_nbytes(a) for a in args] + [_nbytes(v) for v in kwargs.values()] + [_nbytes(out)])
        return out

    def result(self) -> dict:
        return {g: {op: list(v) for op, v in ops.items()} for g, ops in self.by_group.items()}
