"""One rank of the checkpoint tests: runs the real trainer (`shardtune.train.rank.main.train`) once per
case in the same processes (imports cost ~7 s per process) and writes rank<r>.json with each
case's outcome ("ok" or the error message).

argv: cases.json out_dir (`_rank.serve`). A case: {name, overrides: [key=value, ...], env: {VAR: value}}; every
case gets its own run folder <out_dir>/<name>.
"""
from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
from _rank import serve

from shardtune.config import load_recipe
from shardtune.errors import UserError
from shardtune.parallel.mesh import build_mesh
from shardtune.plan import plan
from shardtune.train.rank.context import DistContext
from shardtune.train.rank.main import train


def run_case(case: dict, rank: int, world: int) -> dict:
    cfg = load_recipe(None, [*case["overrides"], f"output_dir={Path(case['out_dir']) / case['name']}"])
    mesh = build_mesh(cfg.parallel, world, world, "cpu")
    ctx = DistContext(rank, world, rank, world, torch.device("cpu"), mesh)
    saved_env = dict(os.environ)
    # the hung-rank watchdog off: these processes have threads, so each case's watcher would be a fresh
    # interpreter importing torch (1.1 CPU-s a rank a case); it is tested through the CLI, with saves,
    # in tests/e2e/test_watchdog.py and test_elastic.py
    os.environ.update({"SHARDTUNE_WATCHDOG_S": "0", **case.get("env", {})})
    try:
        train(cfg, ctx, planner=plan)  # plan.json, as python -m shardtune.train writes it
        return {"outcome": "ok"}
    except UserError as e:
        return {"outcome": "error", "message": str(e)}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        gc.collect()


if __name__ == "__main__":
    serve(run_case)
