"""Re-runs and resumes, decided in the launcher before torchrun starts (issue 14 item 4): a fresh
start over old checkpoints is refused (or they are moved aside on request); a finished run re-run
is a no-op; a resume names exactly what changed against the checkpoint's saved config (the run
folder's config.yaml when its config_hash is the checkpoint's), and refuses changes that make the
checkpoint meaningless. Reads the run folder's files, never writes them (bar `move_aside`)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import UserError
from shardtune.train.durable import shards
from shardtune.train.durable.ckpt_files import (
    CheckpointInfo,
    check_resume_files,
    complete_checkpoints,
    malformed_checkpoints,
    resolve_resume,
)
from shardtune.train.durable.compat import WAY_OUT, fmt, resume_changes

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
    from shardtune.catalog.models import resolve_model_config
    from shardtune.train.durable.ckpt_files import HF_DIR

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


def checkpoint_to_resume(info: CheckpointInfo, auto: bool) -> CheckpointInfo:
    """Before launch, the checkpoint the ranks will load. `--resume PATH`: `info`, which must have
    every file at its recorded size, a `.metadata` that names only allowed globals and shards that
    hold what it lists (shards.check_before_launch). `resume: auto`: the newest checkpoint whose
    sizes and shards are right (a damaged one the ranks skip too, naming it), with such a `.metadata`."""
    if not auto:
        shards.check_before_launch(info)
        return info
    skipped = []
    for ckpt in reversed(complete_checkpoints(Path(info.path).parents[1])):
        bad = shards.damage(ckpt, sizes_only=True)  # a refused .metadata pickle is an error here, not a fallback
        if not bad:
            check_resume_files(ckpt)
            return ckpt
        skipped.append(f"{ckpt.path.name}: {bad[0]}")
    # the ranks would skip each and stop: say so now, before any process starts
    raise UserError(f"resume auto: no checkpoint of {Path(info.path).parents[1]} is intact ({'; '.join(skipped[:3])}); "
                    f"resume one by path after repairing it, or {WAY_OUT}")


def check_rerun(cfg: RunConfig, move_old: bool = False) -> str | None:
    """None: launch. A string: the run is already complete (print it, exit 0). UserError: refused."""
    run_dir = cfg.run_dir
    malformed = malformed_checkpoints(run_dir)
    if cfg.checkpoint.resume == "never":
        found = complete_checkpoints(run_dir)
        if (found or malformed) and not move_old:
            newest = f"step_{found[-1].step}" if found else malformed[-1][0].name
            raise UserError(f"--resume never, but {run_dir} holds checkpoints of an earlier run (newest "
                            f"{newest}) that this run would mix with; {WAY_OUT}")
        if found or malformed or (move_old and (run_dir / "metrics.jsonl").exists()):
            print(f"shardtune: moved the earlier run's checkpoints and metrics to {move_aside(run_dir)}")
        return None
    if move_old:
        raise UserError("--move-aside applies with --resume never only")
    info = resolve_resume(cfg.checkpoint, run_dir)
    if info is None and malformed and cfg.checkpoint.resume == "auto":
        # a fresh start would save over it: say what is wrong instead
        path, why = malformed[-1]
        raise UserError(f"resume auto: {path} is no usable checkpoint ({why}) and no other is; repair it, or "
                        f"{WAY_OUT}")
    if info is None:
        return None
    # the one the ranks will load: with resume auto, a damaged newest one is passed over here as there
    # (so a finished run whose last checkpoint is damaged trains its last steps again)
    info = checkpoint_to_resume(info, auto=cfg.checkpoint.resume == "auto")
    check_same_model(info.path, cfg)
    diff = resume_changes(info.path, info.config_hash, cfg)
    if diff is None:  # no saved config to compare with: the ranks' own checks stand
        return None
    total = cfg.train.max_steps
    if total is not None and info.step >= total:
        ignored = f" ({', '.join(fmt(c) for c in diff)} ignored)" if diff else ""
        return (f"shardtune: {run_dir} is already complete at step {info.step}{ignored}; nothing to do (raise "
                f"train.max_steps to train on, or {WAY_OUT})")
    if diff:
        print(f"shardtune: resuming {info.path} with changed settings: {', '.join(fmt(c) for c in diff)}")
    return None
