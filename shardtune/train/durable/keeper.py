"""What the training loop calls to make a run durable: resume at start, checkpoint every N steps,
agree on preemption, count skipped steps, save and export at the end.

`RunKeeper` holds references to the objects the loop already owns (model, optimizer, scheduler,
TrainState); it adds no state of its own beyond counters. Every method that saves is collective:
all ranks call it at the same step, which the all-reduced flags guarantee.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from shardtune.errors import UserError
from shardtune.train.core.model import build_hf_config, unwrap
from shardtune.train.durable import ckpt_files, compat
from shardtune.train.durable.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from shardtune.train.durable.choice import CHOICE_ENV, choose_checkpoint
from shardtune.train.durable.export import copy_source_files, export_checkpoint
from shardtune.train.durable.resilience import BadStepCounter, DebugHooks, PreemptionSignal, agree_max
from shardtune.train.durable.watchdog import Watchdog

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
        self.resume_diff: list[str] = []  # rank 0: the settings changed since the resumed checkpoint
        self.resumed_from: int | None = None
        self.last_saved: Path | None = None
        self.last_saved_step = -1
        self.preempted = False
        self.run_id = ""  # this run's id (kept across resumes): prune touches its checkpoints only
        self.watchdog = Watchdog(ctx.rank, ctx.world_size, cfg.train.timeout_s, cfg.train.watchdog_s,
                                 cfg.train.watchdog_first_step_s)

    # ------------------------------------------------------------ start
    def resume(self) -> int | None:
        """Load the checkpoint `checkpoint.resume` names, once its checksums verify (rank 0 lists
        the candidates, every rank checks its share); `auto` falls back to the newest one that
        verifies, naming each skipped and why. Truncates metrics.jsonl after its step (or starts it
        afresh). Returns the step resumed from."""
        choice: list = [None]
        bug: Exception | None = None
        if self.ctx.rank == 0:
            ckpt_files.remove_stale_temporaries(self.run_dir)
            try:
                picked = choose_checkpoint(self.run_dir, self.cfg.checkpoint)  # the launcher's rule (choice.py)
                handed = os.environ.get(CHOICE_ENV)
                if handed is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                    picked = picked.handed_on(handed)  # its lines were said by the launcher
                else:
                    for line in picked.lines():
                        print(line, file=sys.stderr, flush=True)
                info = picked.chosen
                # the launcher's rule (compat.py), here too: a by-hand or multi-node torchrun skips it
                diff = compat.resume_changes(info.path, info.config_hash, self.cfg) if info else None
                self.resume_diff = [compat.fmt(c) for c in diff or []]
                choice[0] = ("ok", [str(i.path) for i in picked.candidates], uuid.uuid4().hex[:12])
            except (UserError, OSError) as e:  # what the user can fix (a damaged or unreadable folder): one line
                choice[0] = ("error", str(e), "")
            except Exception as e:  # a bug: every rank stops too (nobody waits), rank 0 with its traceback
                choice[0], bug = ("bug", f"{type(e).__name__}: {e}", ""), e
        dist.broadcast_object_list(choice, src=0)
        kind, value, new_id = choice[0]
        if kind == "error":
            raise UserError(value)
        if kind == "bug":
            raise bug if bug is not None else RuntimeError(f"rank 0 failed while choosing the checkpoint: {value}")
        info = self._first_verified([Path(v) for v in value], strict=self.cfg.checkpoint.resume != "auto")
        self.run_id = (info.run_id if info is not None and info.run_id else new_id)
        if self.ctx.rank == 0:
            ckpt_files.truncate_metrics(self.run_dir / "metrics.jsonl", info.step if info else 0)
        if info is None:
            return None
        load_checkpoint(info, self.model, self.optimizer, self.scheduler, self.state, rank=self.ctx.rank)
        self.resumed_from, self.last_saved, self.last_saved_step = info.step, info.path, info.step
        if self.ctx.rank == 0:
            changed = self.resume_diff if info.config_hash != self.cfg_hash else []
            if info.config_hash != self.cfg_hash and not changed:
                changed = ["settings differ from the checkpoint's; its config.yaml is not in the run folder"]
            note = f" (changed: {', '.join(changed)})" if changed else ""
            print(f"shardtune: resuming from {info.path} (step {info.step}, saved by {info.world_size} "
                  f"rank(s) with {info.strategy}; now {self.ctx.world_size} with "
                  f"{self.cfg.parallel.strategy}){note}", flush=True)
            ckpt_files.append_event(self.run_dir, {"event": "resume", "step": info.step, "path": str(info.path),
                                                   "saved_world_size": info.world_size,
                                                   "saved_strategy": info.strategy,
                                                   "world_size": self.ctx.world_size,
                                                   "strategy": self.cfg.parallel.strategy})
        return info.step

    def _first_verified(self, paths: list[Path], strict: bool):
        """The first of `paths` whose files verify (collective); `strict` (a path was given): one
        that does not is an error, not a fallback."""
        skipped = []
        for path in paths:
            info = ckpt_files.read_info(path)
            bad = verify_checkpoint(info, self.ctx.rank, self.ctx.world_size) if info else ["it is incomplete"]
            if not bad:
                if self.ctx.rank == 0 and info.files is None:
                    print(f"shardtune: warning: {path} was saved without checksums; loading it unverified",
                          file=sys.stderr, flush=True)
                return info
            why = bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            if strict:
                raise UserError(f"checkpoint {path} is damaged: {why}; give another checkpoint or 'auto'")
            skipped.append(f"{path.name}: {why}")
            if self.ctx.rank == 0:
                print(f"shardtune: skipping {path}: {why}; trying the previous checkpoint", file=sys.stderr,
                      flush=True)
                ckpt_files.append_event(self.run_dir, {"event": "skipped_checkpoint", "path": str(path), "why": why})
        if skipped:
            raise UserError(f"no checkpoint in {ckpt_files.checkpoints_dir(self.run_dir)} verifies ("
                            f"{'; '.join(skipped)}); start afresh with --resume never --move-aside, or give "
                            "another --output-dir")
        return None

    # ------------------------------------------------------------ each step
    def before_step(self, step: int) -> None:
        if self.watchdog.enabled and self.watchdog._thread is None:
            self.watchdog.start()  # after set-up and resume: only steps are watched
        self.watchdog.beat(step)
        if self.hooks.active:
            with self._stopping_watchdog_on_error():
                self.hooks.before_step(step, self.ctx.rank)

    @contextlib.contextmanager
    def _stopping_watchdog_on_error(self):
        """A run that ends in an error takes its watchdog with it (no thread outlives the run)."""
        try:
            yield
        except BaseException:
            self.watchdog.stop()
            raise

    def record_extra(self, step: int, result) -> dict:
        """Fields for this step's metrics line: skipped steps carry no loss; the first step after a
        resume says where it came from."""
        extra: dict = {}
        if getattr(result, "skipped", False):
            extra.update(skipped=True, loss=None, grad_norm=None)
        if self.resumed_from is not None and step == self.resumed_from + 1:
            extra["resumed_from"] = self.resumed_from
        return extra

    def checkpoint_due(self, step: int, total_steps: int) -> bool:
        """A periodic save (`checkpoint.every`) falls on this step (the final one is `finish`'s)."""
        every = self.cfg.checkpoint.every
        return bool(every and step % every == 0 and step < total_steps)

    def after_step(self, step: int, result, total_steps: int, signum: int | None = None) -> bool:
        """Count a skipped step (raises after too many), save when due or preempted. `signum`: the
        signal the ranks agreed on in the loop's gather of a logged step (None: not a logged step;
        then only a checkpoint step agrees, by one all-reduce of its own, so a signal is acted on
        within `train.log_every` steps). True: stop now (preempted, checkpoint saved)."""
        with self._stopping_watchdog_on_error():
            return self._after_step(step, result, total_steps, signum)

    def _after_step(self, step: int, result, total_steps: int, signum: int | None) -> bool:
        skipped = bool(getattr(result, "skipped", False))
        if skipped and self.ctx.rank == 0:
            ckpt_files.append_event(self.run_dir, {"event": "skipped_step", "step": step})
        self.bad.update(step, skipped, str(self.last_saved) if self.last_saved else None, self.ctx.rank)
        due = self.checkpoint_due(step, total_steps)
        if signum is None:
            signum = agree_max(self.signal.signum, self.ctx.device) if due else 0
        if signum or due:
            self.save(step)
        if signum:
            self.preempted = True
            if self.ctx.rank == 0:
                self._say_stopped(step, signal.Signals(signum).name)
        return bool(signum)

    def _say_stopped(self, step: int, name: str) -> None:
        """Rank 0, after the save a signal asked for: one line, an event and <run_dir>/stopped.json
        (the launcher reads it to exit 0: train/commands.py `stopped_by_signal`)."""
        print(f"shardtune: saved step_{step}, stopped on {name}; the same command resumes from it",
              file=sys.stderr, flush=True)
        ckpt_files.append_event(self.run_dir, {"event": "preempted", "step": step, "signal": name})
        tmp = self.run_dir / "stopped.json.tmp"
        tmp.write_text(json.dumps({"step": step, "signal": name, "checkpoint": str(self.last_saved)}))
        tmp.replace(self.run_dir / "stopped.json")

    def save(self, step: int) -> Path:
        hf_files = self._write_hf_files if self.ctx.rank == 0 else None
        self.watchdog.beat(step, "save")
        path = save_checkpoint(self.run_dir, step, self.model, self.optimizer, self.scheduler, self.state,
                               rank=self.ctx.rank, world_size=self.ctx.world_size,
                               strategy=self.cfg.parallel.strategy, cfg_hash=self.cfg_hash,
                               keep=self.cfg.checkpoint.keep, run_id=self.run_id, hf_files=hf_files,
                               in_save_hook=lambda: self.hooks.in_save(step, self.ctx.rank),
                               previous=self.last_saved)
        self.watchdog.beat(step + 1, "step")
        self.last_saved, self.last_saved_step = path, step
        if self.ctx.rank == 0:
            ckpt_files.append_event(self.run_dir, {"event": "checkpoint", "step": step, "path": str(path)})
        return path

    def _write_hf_files(self, folder: Path) -> None:
        """The checkpoint's hf/: the run's config.json; the model folder's tokenizer and generation
        files copied as files when the run uses the folder's tokenizer (export.SOURCE_FILES), else
        the run's tokenizer as it saves itself."""
        # training turns the KV cache off (core/model.py); the saved config keeps the source's
        # setting, so an export generates with its cache as the source folder does
        config = copy.deepcopy(unwrap(self.model).config)
        config.use_cache = getattr(build_hf_config(self.cfg.model), "use_cache", True)
        config.save_pretrained(folder)
        folders_own = getattr(self.tokenizer, "name", None) == "hf"  # HFTokenizer: the model folder's
        copied = copy_source_files(self.cfg.model.name, folder, tokenizer=folders_own)
        if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained") and not (
                folders_own and any(n.startswith("tokenizer") for n in copied)):
            self.tokenizer.save_pretrained(folder)

    # ------------------------------------------------------------ end
    def finish(self, step: int) -> None:
        """Final checkpoint (`checkpoint.save_final`, or when `export_hf` needs one). Collective."""
        self.signal.uninstall()
        self.watchdog.stop()  # the final save and the export are no steps
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
            export_checkpoint(self.last_saved, out, overwrite=True)
            print(f"shardtune: exported a Hugging Face model to {out}", flush=True)
        return out
