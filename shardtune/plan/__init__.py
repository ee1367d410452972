"""The planner: pure Python (imports no torch), so `shardtune plan` answers instantly.

`plan(PlanInputs(model=..., gpus=...))` returns a `PlanResult` (per-strategy memory, fit,
communication, step time); `PlanResult.to_dict()` is the `--json` output and the run folder's plan.json.
"""
from shardtune.plan.api import PlanResult, plan
from shardtune.plan.strategy_plan import Memory, StrategyPlan
from shardtune.plan.validate import PlanInputs

__all__ = ["plan", "PlanInputs", "PlanResult", "StrategyPlan", "Memory"]
