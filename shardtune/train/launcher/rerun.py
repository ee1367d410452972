"""Re-runs and resumes, decided in the launcher before torchrun starts (issue 14 item 4): a fresh
start over old checkpoints is refused (or they are moved aside on request); a finished run re-run
is a no-op; a resume names exactly what changed against the checkpoint's saved config (the run
folder's config.yaml when its config_hash is the checkpoint's), and refuses changes that make the
checkpoint meaningless. Reads the run folder's files, never writes them (bar `move_aside`)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.catalog.models import resolve_model_config
from shardtune.errors import UserError
from shardtune.layout import Layout
from shardtune.train.durable import shards
from shardtune.train.durable.choice import choose_checkpoint, misnamed_checkpoints
from shardtune.train.durable.ckpt_files import (
    HF_DIR,
    CheckpointInfo,
    check_resume_files,
    complete_checkpoints,
    malformed_checkpoints,
)
from shardtune.train.durable.compat import WAY_OUT, fmt, resume_changes, saved_config

if TYPE_CHECKING:
    from shardtune.config import RunConfig

MOVED = ("checkpoints", "metrics.jsonl", "events.jsonl", "memory.json", "config.yaml", "plan.json", "hf_export",
         "stopped.json")
def move_aside(run_dir: Path) -> Path:
    """The old run's checkpoints, metrics and config into <run_dir>/previous-<time>/ (nothing deleted)."""
    dest = run_dir / time.strftime("previous-%Y%m%d-%H%M%S")
    dest.mkdir()
    for name in MOVED:
        if (run_dir / name).exists():
            (run_dir / name).rename(dest / name)
    return dest


ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "num_local_experts")


def check_same_model(ckpt: Path, cfg: RunConfig) -> None:
    """The checkpoint's model (its hf/config.json, read only) has the run's architecture."""
    saved_path = Path(ckpt) / HF_DIR / "config.json"
    if not saved_path.is_file():
        return
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, ValueError):
        raise UserError(f"checkpoint {str(ckpt)!r}: {saved_path.name} is not valid JSON; resume another "
                        f"checkpoint or {WAY_OUT}") from None
    now = resolve_model_config(cfg.model.name)
    diff = [f"{k} {saved.get(k)} → {now.get(k)}" for k in ARCH_KEYS
            if k in saved and k in now and saved.get(k) != now.get(k)]
    if diff:
        raise UserError(f"checkpoint {str(ckpt)!r} is of another model than {cfg.model.name!r} "
                        f"({', '.join(diff[:4])}); {WAY_OUT}")


def checkpoint_to_resume(cfg: RunConfig) -> CheckpointInfo | None:
    """Before launch, the checkpoint the ranks will load (choice.py: the one rule both use), its lines
    said. `--resume PATH`: it must have every file at its recorded size, a `.metadata` that names only
    allowed globals and shards that hold what it lists (shards.check_before_launch). `resume: auto`:
    the newest whose sizes and shards are right, each newer one named with why it is skipped."""
    picked = choose_checkpoint(cfg.run_dir, cfg.checkpoint)
    info = picked.chosen
    if info is None and picked.skipped:  # the ranks would skip each and stop: say so now, in one line
        why = "; ".join(f"{p.name}: {w}" for p, w in picked.skipped[:3])
        raise UserError(f"resume auto: no checkpoint of {cfg.run_dir} is intact ({why}); resume one by path "
                        f"after repairing it, or {WAY_OUT}")
    for line in picked.lines():
        print(line, file=sys.stderr, flush=True)
    if info is None:
        return None
    if cfg.checkpoint.resume != "auto":
        shards.check_before_launch(info)
    check_resume_files(info)
    return info


def keep_global_batch(info: CheckpointInfo, old: RunConfig | None, cfg: RunConfig, world_size: int,
                      diff: list) -> list[str]:
    """A resume on another number of data-parallel ranks (world / (tp x cp)) keeps the global batch
    (micro_batch × grad_accum × data-parallel ranks):
    the `train.grad_accum=K` override that does (said in one line), [] when nothing changes or the
    user set micro_batch or grad_accum themselves; a UserError naming the choices when none does."""
    if old is None:
        return []
    # data-parallel ranks (the trainer's Layout): the ranks of one tp and cp group read the same rows
    saved, now = Layout.of_config(old.parallel, info.world_size).dp, Layout.of_config(cfg.parallel, world_size).dp
    if saved == now or any(c[0] in ("train.micro_batch", "train.grad_accum") for c in diff):
        return []
    mb = cfg.train.micro_batch
    rows = old.train.micro_batch * old.train.grad_accum * saved
    accum, rest = divmod(rows, mb * now)
    if accum >= 1 and not rest:
        print(f"shardtune: resuming on {world_size} ranks (saved on {info.world_size}): train.grad_accum "
              f"{cfg.train.grad_accum} → {accum} keeps the global batch of {rows} rows")
        return [f"train.grad_accum={accum}"]
    tp = cfg.parallel.tp * cfg.parallel.cp  # --nproc = data-parallel ranks × tp × cp
    fits = [n * tp for n in range(1, 4 * max(now, saved) + 1) if rows % (mb * n) == 0][:6]
    raise UserError(f"resuming on {world_size} ranks cannot keep the global batch of {rows} rows (micro_batch "
                    f"{old.train.micro_batch} × grad_accum {old.train.grad_accum} × {saved} ranks): "
                    f"{rows} is not a multiple of micro_batch {mb} × {now}; use --nproc "
                    f"{' or '.join(map(str, fits)) or 'N'}, or set train.grad_accum (the global batch becomes "
                    f"micro_batch × grad_accum × {now}) or train.micro_batch yourself")


@dataclass
class Decision:
    done: str | None = None  # the run is already complete: print it, exit 0
    resume: CheckpointInfo | None = None  # the checkpoint the ranks load (None: a fresh start)
    overrides: list[str] = field(default_factory=list)  # key=value the ranks get on top of the user's


def decide(cfg: RunConfig, move_old: bool = False, world_size: int | None = None) -> Decision:
    """Launch (with the checkpoint to resume and any overrides), or the run is complete; a UserError:
    refused. `world_size`: the ranks to start (None: not known, the global batch is not checked)."""
    run_dir = cfg.run_dir
    malformed = malformed_checkpoints(run_dir)
    if cfg.checkpoint.resume == "never":
        found = complete_checkpoints(run_dir)
        misnamed = misnamed_checkpoints(run_dir)
        if (found or malformed or misnamed) and not move_old:
            newest = f"step_{found[-1].step}" if found else (malformed or misnamed)[-1][0].name
            raise UserError(f"--resume never, but {run_dir} holds checkpoints of an earlier run (newest "
                            f"{newest}) that this run would mix with; {WAY_OUT}")
        if found or malformed or misnamed or (move_old and (run_dir / "metrics.jsonl").exists()):
            print(f"shardtune: moved the earlier run's checkpoints and metrics to {move_aside(run_dir)}")
        return Decision()
    if move_old:
        raise UserError("--move-aside applies with --resume never only")
    # the one the ranks will load: with resume auto, a damaged newest one is passed over here as there
    # (so a finished run whose last checkpoint is damaged trains its last steps again)
    info = checkpoint_to_resume(cfg)
    if info is None and malformed and cfg.checkpoint.resume == "auto":
        # a fresh start would save over it: say what is wrong instead
        path, why = malformed[-1]
        raise UserError(f"resume auto: {path} is no usable checkpoint ({why}) and no other is; repair it, or "
                        f"{WAY_OUT}")
    if info is None:
        return Decision()
    check_same_model(info.path, cfg)
    diff = resume_changes(info.path, info.config_hash, cfg)
    if diff is None:  # no saved config to compare with: the ranks' own checks stand
        return Decision(resume=info)
    total = cfg.train.max_steps
    if total is not None and info.step >= total:
        ignored = f" ({', '.join(fmt(c) for c in diff)} ignored)" if diff else ""
        return Decision(done=f"shardtune: {run_dir} is already complete at step {info.step}{ignored}; nothing to do "
                             f"(raise train.max_steps to train on, or {WAY_OUT})", resume=info)
    if diff:
        print(f"shardtune: resuming {info.path} with changed settings: {', '.join(fmt(c) for c in diff)}")
    overrides = [] if world_size is None else keep_global_batch(
        info, saved_config(run_dir, info.config_hash), cfg, world_size, diff)
    return Decision(resume=info, overrides=overrides)


def check_rerun(cfg: RunConfig, move_old: bool = False) -> str | None:
    """None: launch. A string: the run is already complete (print it, exit 0). UserError: refused."""
    return decide(cfg, move_old).done
