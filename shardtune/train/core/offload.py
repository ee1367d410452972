"""Activation offload (parallel.activation_offload): what the forward saves for backward kept in host
memory (pinned, on CUDA) until the backward brings it back, as torch's `save_on_cpu` does, but
parameters (and views of them: F.linear saves weight.t()) stay where they are: FSDP re-gathers them
for the backward anyway. With AC full the saved tensors are the checkpointed layers' inputs
(non-reentrant checkpoint saves them through these hooks; inside a layer its own hooks apply), so
the device holds no (b, s, h) block input between forward and backward (docs/long-context.md).

On a CPU run the device is the host: nothing moves, and memory.json says so (0 bytes offloaded).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _stays(t: torch.Tensor) -> bool:
    """A tensor the offload leaves alone: a parameter or a view of one, a DTensor (its local pieces
    are what ops save), anything already in host memory, and meta tensors (the simulator)."""
    return (isinstance(t, (nn.Parameter, DTensor)) or isinstance(t._base, nn.Parameter)
            or t.device.type in ("cpu", "meta"))


class HostOffload:
    """The pack / unpack pair of `torch.autograd.graph.saved_tensors_hooks` (train/core/step.py)."""

    def pack(self, t: torch.Tensor):
        if _stays(t):
            return t
        # pinned needs an accelerator (PYTORCH-NOTES); tests/unit/test_activation_offload.py runs it on CPU
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=torch.cuda.is_available())
        host.copy_(t, non_blocking=True)  # same stream as the kernels that reuse t's memory: ordered
        return t.device, host

    @staticmethod
    def unpack(packed):
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=True)
        return packed

    @staticmethod
    def moved(packed) -> bool:
        return isinstance(packed, tuple)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
