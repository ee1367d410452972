"""The lr schedule of train/core/step.py against values worked out by hand (linear warmup, then
cosine (Loshchilov & Hutter 2017, no restarts) or linear decay to min_lr_ratio)."""
import math

import pytest

from shardtune.train.core.optim import lr_factor


@pytest.mark.parametrize("step, schedule, want", [
    (0, "cosine", 0.5),  # warmup 2: (0 + 1) / 2
    (1, "cosine", 1.0),
    (2, "cosine", 1.0),  # decay starts: progress 0
    (4, "cosine", 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # progress 2/8 → 0.868198
    (6, "cosine", 0.55),  # progress 1/2: half way between 1 and 0.1
    (10, "cosine", 0.1),
    (50, "cosine", 0.1),  # past the end: stays at the floor
    (4, "linear", 0.775),  # 1 - 0.9 · 2/8
    (6, "constant", 1.0),
])
def test_lr_factor_by_hand(step, schedule, want):
    assert lr_factor(step, warmup_steps=2, total_steps=10, schedule=schedule, min_lr_ratio=0.1) == pytest.approx(want)


def test_lr_factor_matches_torch_lambdalr():
    """build_scheduler hands the same numbers to torch's LambdaLR."""
    import torch

    from shardtune.config import OptimConfig
    from shardtune.train.core.optim import build_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_scheduler(opt, OptimConfig(lr=2.0, warmup_steps=2, schedule="linear", min_lr_ratio=0.1), 10)
    lrs = []
    for _ in range(5):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 2.0, 2.0, 2.0 * 0.8875, 2.0 * 0.775])
