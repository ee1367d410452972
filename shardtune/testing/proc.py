"""The old import path of shardtune/processes.py (moved there: production uses it), kept for tests
written against it; new code imports `shardtune.processes`."""
from shardtune.processes import free_port, kill_groups, run_bounded

__all__ = ["free_port", "kill_groups", "run_bounded"]
