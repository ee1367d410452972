"""`train()` as set-up → loop → finish: `set_up` builds a `Run`, `loop` advances it, `finish` saves
the final checkpoint, memory.json and the summary.

The step returns device tensors; the loop turns them into Python numbers on logged steps only
(every `train.log_every` steps, every `train.eval_every` steps and the last) and adds no
collective of its own to the other steps: a logged step gathers [loss part, peak bytes, signal]
from every rank in ONE small all-gather (the loss, the ranks' max peak, and the preemption flag),
so a SIGTERM is acted on (saved, stopped) within `log_every` steps; a `checkpoint.every` step
agrees on it too. tokens_seen stays a device tensor between logs (a checkpoint converts it to an
exact int). `iterate(run)` is the loop as a generator (one `next()` per step: bench/ drives it).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from shardtune.errors import UserError
from shardtune.parallel.ep import whole_model_params
from shardtune.parallel.pp import pipeline_of, pipeline_params
from shardtune.train.core.dpo import DPO
from shardtune.train.core.effective import describe, effective_settings
from shardtune.train.core.grpo import GRPO
from shardtune.train.core.loggers import Loggers, check_loop_options
from shardtune.train.core.metrics import (
    MetricsWriter,
    SavedActivations,
    flops_per_token,
    gpu_peak_flops,
    print_summary,
    step_peak_bytes,
    track_this_step,
    tracked_step,
    write_memory_json,
)
from shardtune.train.core.model import build_model, describe_weights, unwrap
from shardtune.train.core.objective import build_objective, objective_data
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.pp_step import attach_pipeline
from shardtune.train.core.samples import Sampler
from shardtune.train.core.sft import SFT
from shardtune.train.core.step import StepOptions, StepResult, TrainState
from shardtune.train.data.dataset import build_tokenizer, steps_for_epochs
from shardtune.train.durable.keeper import RunKeeper

if TYPE_CHECKING:
    from shardtune.config import RunConfig
    from shardtune.train.rank.context import DistContext


@dataclass(kw_only=True)  # built by keyword from its parts
class Run:
    """What set-up built, for the loop and the finish."""
    cfg: RunConfig
    ctx: DistContext
    run_dir: Path
    planned: dict | None
    loader: Any
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    state: TrainState
    keeper: RunKeeper
    total_steps: int
    rows_per_step: int
    num_params: int
    flops_per_token: float
    peak_flops: float | None
    activations: SavedActivations | None
    opts: StepOptions  # the step's and evaluation's settings, built once from the config
    writer: MetricsWriter | None
    val_batches: list[dict] | None = None  # this rank's validation batches (data.val_path)
    loggers: Loggers | None = None  # train.loggers, rank 0
    threads: int = 1  # intra-op threads of this rank
    sampler: Sampler | None = None  # train.sample_prompts
    last_record: dict | None = None  # iterate(): the last logged record
    rank_bytes: dict | None = None  # iterate(): this rank's bytes of its last logged (or stopping) step
    objective: SFT | DPO | GRPO  # train.objective (core/objective.py picks it)
    effective: dict | None = None  # what this rank runs, read from the built objects (core/effective.py)


def now_s(device: torch.device) -> float:
    """Wall time after the device finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _progress(enabled: bool):

    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    disable=not enabled, refresh_per_second=2)  # its thread shares rank 0's core


def set_up(cfg: RunConfig, ctx: DistContext, run_dir: Path, planned: dict | None) -> Run:
    """Tokenizer, data, model, optimizer, scheduler, resume; prints the start-up line (rank 0)."""
    check_loop_options(cfg)  # the launcher checked it too; a by-hand torchrun gets the same line
    marks = [("imports and process group", time.perf_counter())]
    threads = cfg.train.threads_per_rank(ctx.local_world_size)
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    tokenizer = build_tokenizer(cfg.data, cfg.model.name, cfg.model.trust_remote_code)
    loader, val_batches, early = objective_data(cfg, ctx, tokenizer, run_dir)  # train.objective's data
    marks.append(("tokenizer and data", time.perf_counter()))
    rows_per_step = cfg.train.micro_batch * cfg.train.grad_accum * ctx.dp_size  # a TP group reads one share
    total_steps = cfg.train.max_steps or steps_for_epochs(loader.num_rows, cfg.train.epochs, rows_per_step)
    model = build_model(cfg.model, cfg.parallel, ctx.mesh, ctx.device, cfg.train.seed, cfg.lora,
                        compile=cfg.train.compile)
    marks.append(("model", time.perf_counter()))
    hf_config = unwrap(model).config
    if tokenizer.vocab_size > hf_config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                        f"{hf_config.vocab_size}; use the model's own tokenizer (data.tokenizer=auto)")
    opts = StepOptions.from_config(cfg, hf_config.vocab_size)
    attach_pipeline(model, cfg, ctx.mesh, ctx.device, opts)  # parallel.pp > 1: its schedule (core/pp_step.py)
    objective = build_objective(cfg, ctx, model, loader, val_batches, tokenizer, run_dir, opts, early, marks)
    optimizer = build_optimizer(model, cfg.optim, cfg.parallel, ctx.dp_group)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    state = TrainState(data=loader)
    keeper = RunKeeper(cfg, ctx, run_dir, model, optimizer, scheduler, state, tokenizer)
    keeper.resume()  # newest complete checkpoint (checkpoint.resume), resharded to this layout
    marks.append(("optimizer and resume", time.perf_counter()))
    num_params = pipeline_params(model, whole_model_params(unwrap(model)))  # pp: every stage's; ep: every expert
    on_cpu = ctx.device.type == "cpu"
    run = Run(cfg=cfg, ctx=ctx, run_dir=run_dir, planned=planned, loader=loader, model=model, optimizer=optimizer,
              scheduler=scheduler, state=state, keeper=keeper, total_steps=total_steps, rows_per_step=rows_per_step,
              num_params=num_params, flops_per_token=flops_per_token(hf_config, num_params, cfg.train.seq_len)
              * objective.flops_factor,  # dpo: + the live reference's forward
              peak_flops=None if on_cpu else gpu_peak_flops(cfg.train.gpu),
              activations=SavedActivations() if on_cpu else None, opts=opts,
              writer=MetricsWriter(run_dir / "metrics.jsonl") if ctx.rank == 0 else None, val_batches=val_batches,
              threads=threads, objective=objective)
    run.effective = effective_settings(model, optimizer, run.opts, ctx.world_size, objective)
    if cfg.train.sample_prompts:
        run.sampler = Sampler(cfg.train.sample_prompts, tokenizer, cfg.data, cfg.train.sample_max_new_tokens,
                              run_dir / "samples.jsonl" if ctx.rank == 0 else None)
    if ctx.rank == 0:
        if cfg.train.loggers:
            run.loggers = Loggers(cfg.train.loggers, run_dir, cfg.name, cfg.model_dump(mode="json"))
        tp = "" if ctx.tp * ctx.cp * ctx.pp == 1 else (
            f" as {f'pp {ctx.pp} ({cfg.parallel.pp_schedule}) x ' if ctx.pp > 1 else ''}dp {ctx.dp_size}"
            f"{f' x cp {ctx.cp}' if ctx.cp > 1 else ''}{f' x tp {ctx.tp}' if ctx.tp > 1 else ''}"
            f"{' (sequence parallel)' if ctx.tp > 1 and cfg.parallel.sequence_parallel else ''}")
        ranks = f"ranks {ctx.world_size}" if ctx.tp * ctx.cp * ctx.pp == 1 else f"dp ranks {ctx.dp_size}"
        print(f"shardtune: {cfg.parallel.strategy} on {ctx.world_size} rank(s){tp} ({ctx.device.type}, "
              f"{threads} thread{'s' if threads > 1 else ''} per rank), "
              f"{num_params:,} params, global batch {rows_per_step} x {cfg.train.seq_len} tokens "
              f"(micro {cfg.train.micro_batch} x accum {cfg.train.grad_accum} x {ranks}), "
              f"{total_steps} steps -> {run_dir}", flush=True)
        print(f"shardtune: weights: {describe_weights(cfg.model)} | tokenizer: "
              f"{describe_tokenizer(tokenizer, cfg.model.name)} | trained: {_trained_dtypes(run)}", flush=True)
        print(f"shardtune: effective: {describe(run.effective)}", flush=True)
        print(f"shardtune: start-up {_startup(marks)}", flush=True)
    return run


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), None elsewhere."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _startup(marks: list[tuple[str, float]]) -> str:
    """'4.1 s since the process started: imports and process group 2.3 s, data 0.1 s, ...'."""
    age = _process_age_s()
    first = age - (time.perf_counter() - marks[0][1]) if age is not None else None
    parts = ([f"{marks[0][0]} {first:.2f} s"] if first is not None else []) + [
        f"{name} {t - marks[i][1]:.2f} s" for i, (name, t) in enumerate(marks[1:])]
    total = f"{age:.2f} s since the process started: " if age is not None else ""
    return total + ", ".join(parts)


def describe_tokenizer(tok, model_name: str) -> str:
    """"PreTrainedTokenizerFast from the model folder, 49,152 ids, chat template yes" or the byte one's
    (saying so when the model folder has a tokenizer of its own that data.tokenizer=byte set aside)."""
    if getattr(tok, "tok", None) is None:
        own = any((Path(model_name).expanduser() / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        return (f"built-in byte tokenizer, {tok.vocab_size} ids, chat template no (plain turns)"
                + ("; data.tokenizer=byte: the model folder's own tokenizer is NOT used" if own else ""))
    return (f"{type(tok.tok).__name__} from the model folder, {tok.vocab_size:,} ids, "
            f"chat template {'yes' if tok.chat_template else 'no'}")


def _trained_dtypes(run: Run) -> str:
    """The dtypes of the trainable parameters (the optimizer's masters) and the compute dtype."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in unwrap(run.model).parameters() if p.requires_grad})
    compute = "float32" if run.cfg.parallel.precision == "fp32" else "bfloat16"  # FSDP casts inside fully_shard
    return f"{run.cfg.parallel.precision} (params {'/'.join(dtypes)}, compute {compute})"


def _step(run: Run, micro_batches: list[dict]) -> tuple[StepResult, dict | None]:
    """One train_step; the tracked CPU step also returns the tracker's bytes."""
    cfg, ctx = run.cfg, run.ctx
    pipelined = pipeline_of(run.model) is not None  # parallel.pp > 1: the schedule's step, untracked

    def step_fn() -> StepResult:
        # the ranks of a cp group share the batch, so its (full) target tokens are counted over dp;
        # FSDP averages the grads over dp x cp ranks (dp_shard x cp, and replicate): undone in full
        return run.objective.step(run.model, run.optimizer, run.scheduler, micro_batches, run.opts,
                                  dp_group=ctx.dp_group, dp_size=ctx.grad_divide_factor, activations=run.activations)

    # torch's MemTracker refuses a second forward of the root module in one tracked call (grad_accum > 1)
    if len(micro_batches) == 1 and not pipelined and track_this_step(
            ctx.device, run.state.step + 1, run.total_steps, cfg.lora.rank, cfg.train.compile) and not (
            run.objective.blocks_memory_tracker()):
        result, tracked = tracked_step(unwrap(run.model), run.optimizer, step_fn, cfg.parallel.strategy)
        # dpo: + the frozen reference copy, as plan's memory.reference and total (the trackers never see it)
        return result, run.objective.tracked_bytes(tracked)
    return step_fn(), None


def _rank_bytes(run: Run, tracked: dict | None) -> tuple[int, dict]:
    """(this rank's peak since the last logged step, its bytes by category for memory.json)."""
    peak, rank_bytes = step_peak_bytes(run.ctx.device, run.model, run.optimizer, run.activations)
    if tracked:
        rank_bytes["tracked"] = tracked
    return peak, rank_bytes


def _record(run: Run, r: StepResult, peak: int, dt: float) -> tuple[dict, int]:
    """(the metrics line of a logged step, the signal the ranks agreed on): the only place the
    step's tensors reach the host."""
    # logged steps only: ONE small gather of [this rank's loss part, its peak bytes, its signal]
    # → the loss (sum over ranks), the ranks' max peak and max signal (float64: exact below 2**53)
    # (dpo: and its metrics' parts, r.parts, summed like the loss)
    width = 3 + len(r.parts)
    mine = torch.cat([r.loss_part.detach().double().reshape(1),
                      torch.tensor([float(peak), float(run.keeper.signal.signum)], dtype=torch.float64,
                                   device=run.ctx.device), *(v.detach().double().reshape(1) for v in r.parts.values())])
    gathered = torch.empty(run.ctx.world_size * width, dtype=torch.float64, device=run.ctx.device)
    # torch 2.13 renames all_gather_into_tensor (deprecated, a FutureWarning a run) all_gather_single
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, mine)
    per_rank = gathered.view(run.ctx.world_size, width)
    # the ranks of one TP group (consecutive: TP is innermost) hold the same loss part: count it once
    loss = float(per_rank[::run.ctx.tp, 0].sum())
    peak_all, signum = int(per_rank[:, 1].max()), int(per_rank[:, 2].max())
    # grpo: the completion tokens trained on (its rows are prompts; generation's time is in dt)
    fixed = run.objective.step_tokens_fixed
    tokens_per_s = (run.rows_per_step * run.cfg.train.seq_len if fixed else float(r.num_tokens)) / dt
    tflops = run.flops_per_token * tokens_per_s / run.ctx.world_size / 1e12  # achieved, per rank
    record = {"step": run.state.step, "loss": loss, "lr": r.lr, "grad_norm": float(r.grad_norm),
              "tokens_per_s": tokens_per_s, "tflops": tflops,
              "mfu": tflops * 1e12 / run.peak_flops if run.peak_flops else None,
              "peak_mem_bytes": peak_all, "step_time_s": dt, "target_tokens": int(r.num_tokens)}
    record.update({k: float(per_rank[::run.ctx.tp, 3 + i].sum()) for i, k in enumerate(r.parts)})
    record.update(run.keeper.record_extra(run.state.step, r))
    return record, signum


def _eval_step(run: Run, step: int) -> bool:
    """Every `train.eval_every` steps and the last step: validation and sample prompts."""
    every = run.cfg.train.eval_every
    return step == run.total_steps or bool(every and step % every == 0)


def _eval_due(run: Run, step: int) -> bool:
    """Validation at evaluation steps (with data.val_path)."""
    return run.val_batches is not None and _eval_step(run, step)


def iterate(run: Run) -> Iterator[dict | None]:
    """The loop as a generator: one step per `next()`, yielding that step's metrics record (None
    on a step that is not logged). Ends at total_steps or after a preemption save; then
    `run.last_record` and `run.rank_bytes` hold the last logged record and this rank's bytes."""
    cfg, ctx, state = run.cfg, run.ctx, run.state
    run.last_record, run.rank_bytes = {}, {}
    tracked: dict | None = None  # the tracked CPU step's bytes, kept in every later step's rank_bytes
    with _progress(ctx.rank == 0) as bar:
        task = bar.add_task("train", total=run.total_steps, completed=state.step, info="")
        while state.step < run.total_steps:
            run.keeper.before_step(state.step + 1)
            mbs = [{k: v.to(ctx.device) for k, v in next(run.loader).items()} for _ in range(cfg.train.grad_accum)]
            t0 = now_s(ctx.device)
            r, tracked_now = _step(run, mbs)
            tracked = tracked_now or tracked
            dt = now_s(ctx.device) - t0
            state.step += 1
            state.tokens_seen = state.tokens_seen + r.num_tokens  # a device tensor until a checkpoint
            evaluating = _eval_due(run, state.step)
            logged = state.step % cfg.train.log_every == 0 or state.step == run.total_steps or evaluating
            record, signum = None, None
            if logged:  # the state bytes are read where they are written: logged steps (the last too)
                peak, run.rank_bytes = _rank_bytes(run, tracked)
                record, signum = _record(run, r, peak, dt)
                if evaluating:  # validation and samples are no step: the watchdog's deadlock check waits
                    run.keeper.watchdog.beat(state.step, "eval")
                if evaluating:
                    record.update(run.objective.evaluate(run.model, run.val_batches, ctx.device, run.opts))
                if run.writer:
                    run.writer.write(record)
                if run.loggers:
                    run.loggers.log(record)
                run.last_record = record
                # the step's own loss (a skipped step's record carries None, the bar shows nan)
                shown = float("nan") if record["loss"] is None else record["loss"]
                info = f"loss {shown:.4f}  lr {r.lr:.2e}  {record['tokens_per_s']:,.0f} tok/s"
                bar.update(task, info=info)
            if run.sampler is not None and _eval_step(run, state.step):
                run.sampler.write(unwrap(run.model), state.step)  # DDP: its module, on every rank
            bar.update(task, advance=1)
            stop = run.keeper.after_step(state.step, r, run.total_steps, signum)
            if stop and not logged:  # memory.json describes the step the run stopped at
                _, run.rank_bytes = _rank_bytes(run, tracked)
            yield record
            if stop:
                return  # preempted: checkpoint saved, stop cleanly


def loop(run: Run) -> tuple[dict, dict]:
    """Steps until total_steps or preemption; (the last logged record, this rank's last-step bytes)."""
    for _ in iterate(run):
        pass
    return run.last_record, run.rank_bytes


def finish(run: Run, rank_bytes: dict) -> None:
    """Final checkpoint, memory.json and the summary (rank 0), then the HF export."""
    ctx = run.ctx
    run.keeper.finish(run.state.step)  # final checkpoint (checkpoint.save_final), collective
    all_bytes = [None] * ctx.world_size
    dist.all_gather_object(all_bytes, dict(rank_bytes, effective=run.effective))
    if ctx.rank == 0:
        run.writer.close()
        if run.loggers:
            run.loggers.close()
        write_memory_json(run.run_dir, ctx.device, all_bytes, run.effective)
        print_summary(run.run_dir, all_bytes, run.planned, run.cfg.parallel.strategy)
    run.keeper.export_hf()  # rank 0 alone, after the last collective (checkpoint.export_hf)
