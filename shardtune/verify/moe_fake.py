"""What an MoE step needs to run on fake tensors (`plan --simulate`), patched for the trace only.

Two ops of the trainer's MoE step cannot run under FakeTensorMode as they do on real tensors:
- torch's grouped_mm has no fake kernel for fp32 (its meta function asks for bf16), so the experts'
  grouped GEMMs go through transformers' own `transformers::grouped_mm_fallback` custom op, which
  registers a fake kernel and saves the same tensors for backward (input and weight);
- `torch.bincount` (the aux loss's assignment counts) has an output size that depends on the
  values; on a fake tensor with `minlength` = E it returns the counts of balanced routing
  (every expert receives N·k / E rows), the routing the trace assumes: the counts' values change
  no byte, their (E,) size is what the trainer's bincount gives.
Expert parallelism is not traced: its all-to-all splits are the routed counts read as Python
integers (parallel/ep.py), which fake tensors do not hold.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor


@contextmanager
def moe_on_fake_tensors():
    """Within the block: grouped GEMMs through transformers' fallback op, bincount balanced on fake
    tensors (module doc). Real tensors keep torch's own bincount."""
    from transformers.integrations import moe as hf_moe  # noqa: PLC0415 transformers only here

    can_use, bincount = hf_moe._can_use_grouped_mm, torch.bincount

    def balanced_bincount(input, weights=None, minlength=0):
        if not isinstance(input, FakeTensor) or weights is not None or not minlength:
            return bincount(input, weights, minlength)
        return torch.full((minlength,), input.numel() // minlength, dtype=torch.int64, device=input.device)

    hf_moe._can_use_grouped_mm = lambda *a, **k: False
    torch.bincount = balanced_bincount
    try:
        yield
    finally:
        hf_moe._can_use_grouped_mm, torch.bincount = can_use, bincount
