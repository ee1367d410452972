"""The files of a run's checkpoints, without torch (the CLI checks `--resume` before any process
starts): discovery of complete checkpoints, resume resolution, pruning, metrics truncation.
Layout and atomicity rules: train/durable/checkpoint.py.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import UserError

if TYPE_CHECKING:
    from shardtune.config import CheckpointConfig, RunConfig

META_FILE = "shardtune_checkpoint.json"
TRAINER_FILE = "trainer.json"
HF_DIR = "hf"
FORMAT_VERSION = 1


# ---------------------------------------------------------------- discovery
@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    world_size: int
    strategy: str
    config_hash: str


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def read_info(path: Path) -> CheckpointInfo | None:
    """The checkpoint's metadata, or None if the folder is not a complete checkpoint."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not meta.get("complete") or not (Path(path) / ".metadata").is_file():
        return None
    return CheckpointInfo(Path(path), int(meta["step"]), int(meta["world_size"]), meta["strategy"],
                          meta.get("config_hash", ""))


def complete_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Complete `step_<N>` checkpoints of a run, oldest first."""
    found = []
    d = checkpoints_dir(run_dir)
    for p in d.glob("step_*") if d.is_dir() else []:
        info = read_info(p)
        if info is not None and p.name == f"step_{info.step}":
            found.append(info)
    return sorted(found, key=lambda i: i.step)


def resolve_resume(ckpt_cfg: CheckpointConfig, run_dir: Path) -> CheckpointInfo | None:
    """`checkpoint.resume`: never → None; auto → the newest complete checkpoint (or None);
    a path → that checkpoint, which must be complete."""
    how = ckpt_cfg.resume
    if how == "never":
        return None
    if how == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    info = read_info(Path(how).expanduser())
    if info is None:
        raise UserError(f"checkpoint.resume {how!r} is not a complete checkpoint (no {META_FILE} with "
                        "complete: true); give a checkpoints/step_<N> folder, 'auto' or 'never'")
    return info


def config_hash(cfg: RunConfig) -> str:
    """Hash of what defines the training trajectory (model, data, optim, train): a resume under a
    different value is allowed (e.g. another strategy) but reported."""
    keys = ("model", "data", "optim")
    d = {k: cfg.model_dump(mode="json")[k] for k in keys}
    d["train"] = {k: v for k, v in cfg.train.model_dump(mode="json").items()
                  if k in ("seq_len", "seed", "max_steps", "epochs")}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]



def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints; each loses its metadata file first
    (so a half-deleted folder never looks complete), then the rest."""
    for info in complete_checkpoints(run_dir)[:-keep]:
        (info.path / META_FILE).unlink(missing_ok=True)
        shutil.rmtree(info.path, ignore_errors=True)


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the metrics lines of steps ≤ `last_step` (0: none), so a resumed run never logs a step
    twice; returns the number of lines kept."""
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return len(kept)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Leftovers of killed saves (`.tmp-*`, `.old-*`): never read, safe to delete (rank 0, at start)."""
    d = checkpoints_dir(run_dir)
    for p in (list(d.glob(".tmp-step_*")) + list(d.glob(".old-step_*"))) if d.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)


def append_event(run_dir: Path, event: dict) -> None:
    """One line in <run_dir>/events.jsonl (resume, save, skipped step, preemption, stop)."""
    import time

    with open(Path(run_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")
