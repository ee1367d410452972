"""The torchrun entry: setup → model, data, optimizer → loop → summary → teardown.

Every rank runs `run(cfg)`; rank 0 alone writes the run folder and draws the progress bar. The
same code serves `shardtune train` (one machine, torchrun started for you) and `torchrun ... -m
shardtune.train` by hand (any number of nodes).
"""
from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardtune.config import dump_config
from shardtune.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardtune.config import RunConfig


@dataclass
class DistContext:
    """Who this process is; passed down explicitly (no globals for rank or mesh state)."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def dp_group(self):
        """The group over all data-parallel ranks (every rank: there is no model parallelism)."""
        return self.mesh.get_group() if self.mesh.ndim == 1 else None


def setup_distributed(cfg: RunConfig) -> DistContext:
    """init_process_group (nccl on CUDA, gloo on CPU, timeout train.timeout_s) and the mesh."""
    from shardtune.parallel.apply import build_mesh

    env = os.environ
    if "RANK" not in env:  # plain `python -m shardtune.train`: a world of one
        from shardtune.testing.proc import free_port

        port = free_port()  # torchrun's --master_port 0 hangs
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=env.get("MASTER_PORT", str(port)))
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    backend = cfg.train.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise UserError("train.backend=nccl needs CUDA; use train.backend=auto or gloo")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    from shardtune.train.durable.resilience import restart_safe_store_kwargs

    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.train.timeout_s),
                            **restart_safe_store_kwargs(cfg.train.timeout_s))
    mesh = build_mesh(cfg.parallel, world, local_world, device.type)
    return DistContext(rank, world, local_rank, local_world, device, mesh)


def write_plan(cfg: RunConfig, world_size: int, run_dir: Path) -> dict | None:
    """The planner's prediction for this exact run → plan.json (None if it cannot plan it)."""
    try:
        from shardtune.plan import plan
        from shardtune.strategies import resolve_optimizer_impl

        inputs = cfg.plan_inputs()  # `auto`: the kernel torch picks on this run's device
        inputs["optimizer_impl"] = resolve_optimizer_impl(inputs["optimizer_impl"], inputs["offload"],
                                                          cuda=torch.cuda.is_available())
        p = plan(gpus=world_size, gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                 strategies=[cfg.parallel.strategy], **inputs)
        d = p.to_dict()
    except Exception as e:  # the run goes on without a prediction, and says why
        d = {"error": f"{type(e).__name__}: {e}"}
    (run_dir / "plan.json").write_text(json.dumps(d, indent=1))
    return d if "error" not in d else None


TEARDOWN_LIMIT_S = 30.0  # a healthy destroy_process_group takes well under a second


def run(cfg: RunConfig) -> dict:
    """Train with `cfg` on this process's rank; returns the final metrics record (rank 0)."""
    from shardtune.train.durable.resilience import exit_if_stuck

    ctx = setup_distributed(cfg)
    guard = None
    try:
        record = train(cfg, ctx)
        guard = exit_if_stuck(TEARDOWN_LIMIT_S, "the process-group teardown")
        return record
    finally:
        gc.collect()  # drop DDP's reducer before the group goes (gloo exit hang, PYTORCH-NOTES)
        if dist.is_initialized():
            dist.destroy_process_group()
        if guard is not None:
            guard.cancel()


def prepare_run_dir(cfg: RunConfig, ctx: DistContext) -> tuple[Path, dict | None]:
    """Rank 0 writes config.yaml and plan.json; every rank gets the planner's prediction."""
    run_dir = cfg.run_dir
    planned = None
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        # metrics.jsonl is truncated or removed by RunKeeper.resume (a resumed run continues it)
        planned = write_plan(cfg, ctx.world_size, run_dir)
    return run_dir, planned


def now_s(device: torch.device) -> float:
    """Wall time after the device finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _progress(enabled: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    disable=not enabled, refresh_per_second=2)  # its thread shares rank 0's core


def _peak_bytes(ctx: DistContext, model, optimizer, activations) -> tuple[int, dict]:
    """(peak bytes of this step on this rank, per-category bytes); see train/core/metrics.py."""
    from shardtune.train.core.metrics import model_state_bytes

    states = model_state_bytes(model, optimizer)
    states["activations_bytes"] = activations.peak_bytes if activations else 0
    if ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device)
        # what the caching allocator held: reserved - allocated is its fragmentation and cache
        states["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    else:
        peak = sum(states.values())
    states["peak_bytes"] = peak
    return peak, states


def train(cfg: RunConfig, ctx: DistContext) -> dict:
    """Build everything, run the loop, write metrics and the summary."""
    from shardtune.parallel.apply import autocast_dtype
    from shardtune.train.core.metrics import MetricsWriter, SavedActivations, flops_per_token, gpu_peak_flops
    from shardtune.train.core.model import build_model, unwrap
    from shardtune.train.core.optim import build_optimizer, build_scheduler
    from shardtune.train.core.step import TrainState, train_step
    from shardtune.train.data.dataset import build_dataloader, build_tokenizer, steps_for_epochs
    from shardtune.train.durable.keeper import RunKeeper

    torch.manual_seed(cfg.train.seed)
    run_dir, planned = prepare_run_dir(cfg, ctx)
    tokenizer = build_tokenizer(cfg.data, cfg.model.name, cfg.model.trust_remote_code)
    loader = build_dataloader(cfg.data, cfg.train, tokenizer, ctx.rank, ctx.world_size, cfg.train.seed)
    rows_per_step = cfg.train.micro_batch * cfg.train.grad_accum * ctx.world_size
    total_steps = cfg.train.max_steps or steps_for_epochs(loader.num_rows, cfg.train.epochs, rows_per_step)
    model = build_model(cfg.model, cfg.parallel, ctx.mesh, ctx.device, cfg.train.seed, cfg.lora)
    hf_config = unwrap(model).config
    if tokenizer.vocab_size > hf_config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                        f"{hf_config.vocab_size}; use the model's own tokenizer (data.tokenizer=auto)")
    optimizer = build_optimizer(model, cfg.optim, cfg.parallel, ctx.dp_group)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    state = TrainState(data=loader)
    keeper = RunKeeper(cfg, ctx, run_dir, model, optimizer, scheduler, state, tokenizer)
    keeper.resume()  # newest complete checkpoint (checkpoint.resume), resharded to this layout
    num_params = sum(p.numel() for p in unwrap(model).parameters())
    flops_tok = flops_per_token(hf_config, num_params, cfg.train.seq_len)
    peak_flops = gpu_peak_flops(cfg.train.gpu) if ctx.device.type == "cuda" else None
    activations = SavedActivations() if ctx.device.type == "cpu" else None
    amp = autocast_dtype(cfg.parallel)
    writer = MetricsWriter(run_dir / "metrics.jsonl") if ctx.rank == 0 else None
    if ctx.rank == 0:
        print(f"shardtune: {cfg.parallel.strategy} on {ctx.world_size} rank(s) ({ctx.device.type}), "
              f"{num_params:,} params, global batch {rows_per_step} x {cfg.train.seq_len} tokens "
              f"(micro {cfg.train.micro_batch} x accum {cfg.train.grad_accum} x ranks {ctx.world_size}), "
              f"{total_steps} steps -> {run_dir}", flush=True)
    record: dict = {}
    rank_bytes: dict = {}
    tracked: dict | None = None  # one CPU step's tracker bytes by category (train/core/memtrack.py)
    with _progress(ctx.rank == 0) as bar:
        task = bar.add_task("train", total=total_steps, completed=state.step, info="")
        while state.step < total_steps:
            keeper.before_step(state.step + 1)
            mbs = [{k: v.to(ctx.device) for k, v in next(loader).items()} for _ in range(cfg.train.grad_accum)]
            t0 = now_s(ctx.device)
            step_fn = lambda: train_step(model, optimizer, scheduler, mbs, dp_group=None, dp_size=ctx.world_size,  # noqa: E731
                                         grad_clip=cfg.optim.grad_clip, autocast_dtype=amp, activations=activations)
            # torch's MemTracker puts a grad hook on every parameter of a module and fails on
            # frozen ones (LoRA's base weights): LoRA runs are not tracked
            if ctx.device.type == "cpu" and state.step + 1 == min(3, total_steps) and not cfg.lora.rank:
                # CPU has no allocator statistics: track this step's tensors by category (the
                # third: optimizer states exist and DDP has rebuilt its buckets) for `report`
                from shardtune.strategies import FSDP_STRATEGIES
                from shardtune.train.core.memtrack import tracked_call

                r, tracked = tracked_call(unwrap(model), optimizer, step_fn, cfg.parallel.strategy in FSDP_STRATEGIES)
            else:
                r = step_fn()
            dt = now_s(ctx.device) - t0
            state.step += 1
            num_tokens, loss, grad_norm = int(r.num_tokens), float(r.loss), float(r.grad_norm)
            state.tokens_seen += num_tokens
            peak, rank_bytes = _peak_bytes(ctx, model, optimizer, activations)
            if tracked:
                rank_bytes["tracked"] = {k: v for k, v in tracked.items() if k != "breakdown_at_peak"}
            log = state.step % cfg.train.log_every == 0 or state.step == total_steps
            peak_t = torch.tensor([peak], dtype=torch.long, device=ctx.device)
            if log:  # the ranks' max, only for the lines written (a collective fewer per step)
                dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
            tokens_per_s = rows_per_step * cfg.train.seq_len / dt
            tflops = flops_tok * tokens_per_s / ctx.world_size / 1e12  # achieved, per rank
            record = {"step": state.step, "loss": loss, "lr": r.lr, "grad_norm": grad_norm,
                      "tokens_per_s": tokens_per_s, "tflops": tflops,
                      "mfu": tflops * 1e12 / peak_flops if peak_flops else None,
                      "peak_mem_bytes": int(peak_t.item()), "step_time_s": dt,
                      "target_tokens": num_tokens}
            record.update(keeper.record_extra(state.step, r))
            if writer and log:
                writer.write(record)
            bar.update(task, advance=1, info=f"loss {loss:.4f}  lr {r.lr:.2e}  {tokens_per_s:,.0f} tok/s")
            if keeper.after_step(state.step, r, total_steps):
                break  # preempted: checkpoint saved, stop cleanly
    keeper.finish(state.step)  # final checkpoint (checkpoint.save_final), collective
    all_bytes = [None] * ctx.world_size
    dist.all_gather_object(all_bytes, rank_bytes)
    if ctx.rank == 0:
        from shardtune.train.core.metrics import print_summary

        writer.close()
        (run_dir / "memory.json").write_text(json.dumps(
            {"method": "cuda max_memory_allocated" if ctx.device.type == "cuda" else
             "exact storage count (train/core/metrics.py)", "per_rank": all_bytes}, indent=1))
        print_summary(run_dir, all_bytes, planned, cfg.parallel.strategy)
    keeper.export_hf()  # rank 0 alone, after the last collective (checkpoint.export_hf)
    del model, optimizer, scheduler, keeper  # before destroy_process_group (gloo exit hang)
    return record
