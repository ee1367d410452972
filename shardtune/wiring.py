"""What the top of the package hands the layers below it (docs/DESIGN.md, Layers): the trainer's
two entries, `shardtune train` (train/commands.py) and a rank's `python -m shardtune.train`
(train/__main__.py), ask here for the planner they pass down (the model-states check before any
process starts, the run folder's plan.json), so nothing under train/ imports plan/ and nothing
under plan/ imports train/. Imports nothing at module level: the planner loads when asked."""
from __future__ import annotations


def planner():
    """`shardtune.plan.plan`, the function the trainer is handed as `planner=`."""
    from shardtune.plan import plan  # noqa: PLC0415 the planner loads when asked, not with every entry

    return plan
