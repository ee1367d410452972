"""The torchrun entry: setup → model, data, optimizer → loop → summary → teardown.

Every rank runs `run(cfg)`; rank 0 alone writes the run folder and draws the progress bar. The
same code serves `shardtune train` (one machine, torchrun started for you) and `torchrun ... -m
shardtune.train` by hand (any number of nodes).
"""
from __future__ import annotations

import gc
import json
import os
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.config import RunConfig, dump_config
from shardtune.devices import resolve_backend
from shardtune.errors import UserError
from shardtune.parallel.mesh import build_mesh
from shardtune.processes import free_port
from shardtune.strategies import resolve_optimizer_impl
from shardtune.train.durable.diskfull import check_room, on_full_disk, write_atomic
from shardtune.train.durable.resilience import exit_if_stuck, restart_safe_store_kwargs
from shardtune.train.durable.watchdog import prefork as prefork_watcher
from shardtune.train.launcher.runlock import RUN_LOCK_ENV, RunLock
from shardtune.train.rank.context import DistContext
from shardtune.train.rank.loop import finish, loop, set_up

Planner = Callable[..., object]  # shardtune.plan.plan: keyword PlanInputs fields -> PlanResult (.to_dict())


def setup_distributed(cfg: RunConfig) -> DistContext:
    """init_process_group (nccl on CUDA, gloo on CPU, timeout train.timeout_s) and the mesh."""
    env = os.environ
    if "RANK" not in env:  # plain `python -m shardtune.train`: a world of one

        port = free_port()  # torchrun's --master_port 0 hangs
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=env.get("MASTER_PORT", str(port)))
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    backend = resolve_backend(cfg.train.backend)  # as the launcher decided it (devices.py)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.train.timeout_s),
                            **restart_safe_store_kwargs(cfg.train.timeout_s))
    mesh = build_mesh(cfg.parallel, world, local_world, device.type)
    return DistContext(rank, world, local_rank, local_world, device, mesh)


def plan_dict(cfg: RunConfig, world_size: int, local_world_size: int, planner: Planner | None) -> dict:
    """The planner's prediction for this exact run (plan.json); {"error": ...} if it cannot plan it.
    `planner`: `shardtune.plan.plan`, handed down by the entry (train/__main__.py), so the trainer
    imports no planner (docs/DESIGN.md, Layers); None (a rank started from a test): no prediction."""
    if planner is None:
        return {"error": "no planner given: the entry (python -m shardtune.train) passes shardtune.plan.plan"}
    try:
        inputs = cfg.plan_inputs()  # `auto`: the kernel the trainer builds (torch's AdamW only)
        if inputs["optimizer"] == "adamw":
            inputs["optimizer_impl"] = resolve_optimizer_impl(inputs["optimizer_impl"])
        p = planner(gpus=world_size, gpus_per_node=local_world_size,
                 strategies=[cfg.parallel.strategy], **inputs)
        return p.to_dict()
    except Exception as e:  # the run goes on without a prediction, and says why
        return {"error": f"{type(e).__name__}: {e}"}


TEARDOWN_LIMIT_S = 30.0  # a healthy destroy_process_group takes well under a second


def run(cfg: RunConfig, planner: Planner | None = None) -> dict:
    """Train with `cfg` on this process's rank; returns the final metrics record (rank 0). `planner`:
    `shardtune.plan.plan` for plan.json (`plan_dict`)."""

    prefork_watcher()  # before the process group's threads (train/durable/watchdog.py)
    ctx = setup_distributed(cfg)
    guard = None
    try:
        record = train(cfg, ctx, planner)
        guard = exit_if_stuck(TEARDOWN_LIMIT_S, "the process-group teardown")
        return record
    finally:
        gc.collect()  # drop DDP's reducer before the group goes (gloo exit hang, PYTORCH-NOTES)
        if dist.is_initialized():
            dist.destroy_process_group()
        if guard is not None:
            guard.cancel()


def write_run_files(run_dir: Path, config_text: str, plan_text: str) -> None:
    """An earlier segment's config.yaml and plan.json → segments/<n>/ (so `report` sees the whole run),
    then this segment's, each swapped in whole. A full disk: one line with the bytes needed and
    free, the new segment folder removed, config.yaml and plan.json as they were."""

    earlier = [run_dir / n for n in ("config.yaml", "plan.json") if (run_dir / n).is_file()]
    earlier = earlier if (run_dir / "config.yaml").is_file() else []
    needed = len(config_text.encode()) + len(plan_text.encode()) + sum(p.stat().st_size for p in earlier)
    seg = run_dir / "segments" / f"{len(list((run_dir / 'segments').glob('*'))) + 1:03d}"
    what = "writing the run's config.yaml, plan.json and segments/"
    check_room(what, run_dir, needed)
    with on_full_disk(what, run_dir, needed, cleanup=lambda: shutil.rmtree(seg, ignore_errors=True)):
        run_dir.mkdir(parents=True, exist_ok=True)
        if earlier:
            seg.mkdir(parents=True, exist_ok=True)
            for path in earlier:
                shutil.copy2(path, seg / path.name)
        # metrics.jsonl is truncated or removed by RunKeeper.resume (a resumed run continues it)
        write_atomic({run_dir / "config.yaml": config_text, run_dir / "plan.json": plan_text})


def prepare_run_dir(cfg: RunConfig, ctx: DistContext, planner: Planner | None = None) -> tuple[Path, dict | None]:
    """Rank 0 writes config.yaml and plan.json (its UserError, e.g. a full disk, is every rank's:
    they stop together); rank 0 gets the planner's prediction."""
    run_dir = cfg.run_dir
    planned, error = None, None
    if ctx.rank == 0:
        d = plan_dict(cfg, ctx.world_size, ctx.local_world_size, planner)
        planned = d if "error" not in d else None
        try:
            write_run_files(run_dir, dump_config(cfg), json.dumps(d, indent=1))
        except UserError as e:
            error = str(e)
    if ctx.world_size > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise UserError(error)
    return run_dir, planned


def train(cfg: RunConfig, ctx: DistContext, planner: Planner | None = None) -> dict:
    """set-up → loop → finish (train/rank/loop.py); returns the last logged metrics record."""

    lock = None
    if ctx.rank == 0 and not os.environ.get(RUN_LOCK_ENV):  # started by hand: rank 0 owns the folder
        lock = RunLock(cfg.run_dir).acquire()
    try:
        run_dir, planned = prepare_run_dir(cfg, ctx, planner)
        built = set_up(cfg, ctx, run_dir, planned)
        record, rank_bytes = loop(built)
        finish(built, rank_bytes)
        del built  # model, optimizer, keeper go before destroy_process_group (gloo exit hang)
    finally:
        if lock is not None:
            lock.release()
    return record
