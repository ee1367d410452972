"""What the training loop calls to make a run durable: resume at start, checkpoint every N steps,
agree on preemption, count skipped steps, save and export at the end.

`RunKeeper` holds references to the objects the loop already owns (model, optimizer, scheduler,
TrainState); it adds no state of its own beyond counters. Every method that saves is collective:
all ranks call it at the same step, which the all-reduced flags guarantee.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from shardtune.train.durable import ckpt_files
from shardtune.train.durable.resilience import BadStepCounter, DebugHooks, PreemptionSignal, agree_any

if TYPE_CHECKING:
    from shardtune.config import RunConfig


class RunKeeper:
    def __init__(self, cfg: RunConfig, ctx, run_dir: Path, model, optimizer, scheduler, state,
                 tokenizer=None) -> None:
        self.cfg, self.ctx, self.run_dir = cfg, ctx, Path(run_dir)
        self.model, self.optimizer, self.scheduler, self.state = model, optimizer, scheduler, state
        self.tokenizer = tokenizer
        self.hooks = DebugHooks.from_env()
        self.hooks.install_nan(model, ctx.rank)
        self.bad = BadStepCounter(cfg.train.max_bad_steps)
        self.signal = PreemptionSignal().install()
        self.cfg_hash = ckpt_files.config_hash(cfg)
        self.resumed_from: int | None = None
        self.last_saved: Path | None = None
        self.last_saved_step = -1
        self.preempted = False

    # ------------------------------------------------------------ start
    def resume(self) -> int | None:
        """Load the checkpoint `checkpoint.resume` names (rank 0 decides, all load); truncate
        metrics.jsonl after its step (or start it afresh). Returns the step resumed from."""
        from shardtune.train.durable.checkpoint import load_checkpoint

        choice: list = [None]
        if self.ctx.rank == 0:
            ckpt_files.remove_stale_temporaries(self.run_dir)
            try:
                info = ckpt_files.resolve_resume(self.cfg.checkpoint, self.run_dir)
                choice[0] = ("ok", str(info.path) if info else None)
            except Exception as e:  # every rank raises the same error, nobody waits
                choice[0] = ("error", str(e))
        dist.broadcast_object_list(choice, src=0)
        kind, value = choice[0]
        if kind == "error":
            from shardtune.errors import UserError

            raise UserError(value)
        info = ckpt_files.read_info(Path(value)) if value else None
        if self.ctx.rank == 0:
            ckpt_files.truncate_metrics(self.run_dir / "metrics.jsonl", info.step if info else 0)
        if info is None:
            return None
        load_checkpoint(info, self.model, self.optimizer, self.scheduler, self.state, rank=self.ctx.rank)
        self.resumed_from, self.last_saved, self.last_saved_step = info.step, info.path, info.step
        if self.ctx.rank == 0:
            changed = [] if info.config_hash == self.cfg_hash else ["model/data/optim settings differ"]
            note = f" ({'; '.join(changed)})" if changed else ""
            print(f"shardtune: resuming from {info.path} (step {info.step}, saved by {info.world_size} "
                  f"rank(s) with {info.strategy}; now {self.ctx.world_size} with "
                  f"{self.cfg.parallel.strategy}){note}", flush=True)
            ckpt_files.append_event(self.run_dir, {"event": "resume", "step": info.step, "path": str(info.path),
                                                   "saved_world_size": info.world_size,
                                                   "saved_strategy": info.strategy,
                                                   "world_size": self.ctx.world_size,
                                                   "strategy": self.cfg.parallel.strategy})
        return info.step

    # ------------------------------------------------------------ each step
    def before_step(self, step: int) -> None:
        if self.hooks.active:
            self.hooks.before_step(step, self.ctx.rank)

    def record_extra(self, step: int, result) -> dict:
        """Fields for this step's metrics line: skipped steps carry no loss; the first step after a
        resume says where it came from."""
        extra: dict = {}
        if getattr(result, "skipped", False):
            extra.update(skipped=True, loss=None, grad_norm=None)
        if self.resumed_from is not None and step == self.resumed_from + 1:
            extra["resumed_from"] = self.resumed_from
        return extra

    def after_step(self, step: int, result, total_steps: int) -> bool:
        """Count a skipped step (raises after too many), agree on preemption, save when due.
        True: stop now (preempted, checkpoint saved)."""
        skipped = bool(getattr(result, "skipped", False))
        if skipped and self.ctx.rank == 0:
            ckpt_files.append_event(self.run_dir, {"event": "skipped_step", "step": step})
        self.bad.update(step, skipped, str(self.last_saved) if self.last_saved else None, self.ctx.rank)
        preempt = agree_any([self.signal.requested], self.ctx.device)[0]
        every = self.cfg.checkpoint.every
        if preempt or (every and step % every == 0 and step < total_steps):
            self.save(step)
        if preempt:
            self.preempted = True
            if self.ctx.rank == 0:
                print(f"shardtune: preempted (SIGTERM): saved {self.last_saved}; exiting; the next "
                      "start resumes from it", file=sys.stderr, flush=True)
                ckpt_files.append_event(self.run_dir, {"event": "preempted", "step": step})
        return preempt

    def save(self, step: int) -> Path:
        from shardtune.train.durable.checkpoint import save_checkpoint

        hf_files = self._write_hf_files if self.ctx.rank == 0 else None
        path = save_checkpoint(self.run_dir, step, self.model, self.optimizer, self.scheduler, self.state,
                               rank=self.ctx.rank, world_size=self.ctx.world_size,
                               strategy=self.cfg.parallel.strategy, cfg_hash=self.cfg_hash,
                               keep=self.cfg.checkpoint.keep, hf_files=hf_files,
                               in_save_hook=lambda: self.hooks.in_save(step, self.ctx.rank))
        self.last_saved, self.last_saved_step = path, step
        if self.ctx.rank == 0:
            ckpt_files.append_event(self.run_dir, {"event": "checkpoint", "step": step, "path": str(path)})
        return path

    def _write_hf_files(self, folder: Path) -> None:
        from shardtune.train.core.model import unwrap

        unwrap(self.model).config.save_pretrained(folder)
        if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(folder)

    # ------------------------------------------------------------ end
    def finish(self, step: int) -> None:
        """Final checkpoint (`checkpoint.save_final`, or when `export_hf` needs one). Collective."""
        self.signal.uninstall()
        ck = self.cfg.checkpoint
        if not self.preempted and (ck.save_final or ck.export_hf) and self.last_saved_step != step:
            self.save(step)

    def export_hf(self) -> Path | None:
        """`checkpoint.export_hf`: rank 0 alone streams the last checkpoint to an HF folder (no
        collective, so a long export cannot trip the process-group timeout)."""
        if not self.cfg.checkpoint.export_hf or self.preempted or self.last_saved is None:
            return None
        out = self.run_dir / "hf_export"
        if self.ctx.rank == 0:
            from shardtune.train.durable.export import export_checkpoint

            export_checkpoint(self.last_saved, out, overwrite=True)
            print(f"shardtune: exported a Hugging Face model to {out}", flush=True)
        return out
