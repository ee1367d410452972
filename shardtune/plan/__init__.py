"""The planner: pure Python (imports no torch), so `shardtune plan` answers instantly.

`plan(model, gpus, ...)` returns a `PlanResult` (per-strategy memory, fit, communication);
`PlanResult.to_dict()` is the `--json` output and the run folder's plan.json.
"""
from shardtune.plan.api import Memory, PlanResult, StrategyPlan, plan

__all__ = ["plan", "PlanResult", "StrategyPlan", "Memory"]
