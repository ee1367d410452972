"""The planner against the trainer's step traced on fake tensors (`simulate_strategy`): the tolerance
every model family is held to: states within 2 %, activations and the total
within 10 %."""
from __future__ import annotations

import pytest


def assert_plan_within_trace(mem, sim: dict) -> None:
    """`mem`: a plan's StrategyPlan.memory; `sim`: simulate_strategy's bytes by key."""
    for key in ("params", "grads", "optimizer"):
        assert getattr(mem, key) == pytest.approx(sim[key], rel=0.02), key
    for key in ("activations", "total"):
        assert getattr(mem, key) == pytest.approx(sim[key], rel=0.10), (key, getattr(mem, key), sim[key])
