"""What autograd saves during one module's forward: the independent measurement the planner's
activation terms are held to (tests/unit/test_memory.py dense, tests/unit/test_moe_plan.py MoE)."""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def saved_in(model, layer):
    """Yield {storage pointer: bytes} of every tensor autograd saves while `layer` runs forward
    (saved_tensors_hooks), the model's parameters excluded, each storage once, storages made before
    the layer (RoPE cos/sin, computed once per model) excluded."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, saved, before = [False], {}, set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params and ptr not in before:
            saved[ptr] = t.untyped_storage().nbytes()
        elif not inside[0] and not saved:
            before.add(ptr)
        return t

    hooks = (layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True)),
             layer.register_forward_hook(lambda *a: inside.__setitem__(0, False)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved
    finally:
        for h in hooks:
            h.remove()
