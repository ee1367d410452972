"""The files of a run's checkpoints, without torch (the CLI checks `--resume` before any process
starts): discovery of complete checkpoints, resume resolution, pruning, metrics truncation.
Layout and atomicity rules: train/durable/checkpoint.py; checksums: integrity.py.

"Newest" is the checkpoint saved last (`saved_at` in its metadata), not the highest step: a run
resumed from an older step, or a fresh run in a folder with old higher steps, continues from what
it wrote itself. Pruning removes only checkpoints of the same run (`run_id`, kept across resumes).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import UserError

if TYPE_CHECKING:
    from shardtune.config import CheckpointConfig, RunConfig

META_FILE = "shardtune_checkpoint.json"
TRAINER_FILE = "trainer.json"
HF_DIR = "hf"
FORMAT_VERSION = 1
OLD_PREFIX = ".old-"  # a re-saved step's previous copy, until the new one is in place


# ---------------------------------------------------------------- discovery
@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    world_size: int
    strategy: str
    config_hash: str
    run_id: str = ""  # "" : written before run ids (never pruned by another run)
    saved_at: float = 0.0
    files: dict | None = field(default=None, compare=False)  # {name: [bytes, crc32]}; None: unverifiable


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def read_info(path: Path) -> CheckpointInfo | None:
    """The checkpoint's metadata, or None if the folder is not a complete checkpoint."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not meta.get("complete") or not (Path(path) / ".metadata").is_file():
        return None
    try:
        saved_at = float(meta.get("saved_at") or (Path(path) / META_FILE).stat().st_mtime)
        files = meta.get("files")
        return CheckpointInfo(Path(path), int(meta["step"]), int(meta["world_size"]), str(meta["strategy"]),
                              str(meta.get("config_hash", "")), str(meta.get("run_id", "")), saved_at,
                              files if isinstance(files, dict) else None)
    except (KeyError, TypeError, ValueError, OSError):
        return None


def complete_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints of a run, oldest saved first: `step_<N>` folders, and the previous copy
    `.old-step_<N>` of a step whose re-save was cut between its two renames (so no instant exists
    where a step's only copy is invisible)."""
    found: dict[int, CheckpointInfo] = {}
    d = checkpoints_dir(run_dir)
    for p in sorted(d.glob(f"{OLD_PREFIX}step_*")) + sorted(d.glob("step_*")) if d.is_dir() else []:
        info = read_info(p)
        if info is not None and p.name in (f"step_{info.step}", f"{OLD_PREFIX}step_{info.step}"):
            found[info.step] = info  # step_<N> is listed last: it wins over its .old- copy
    return sorted(found.values(), key=lambda i: (i.saved_at, i.step))


def resolve_resume(ckpt_cfg: CheckpointConfig, run_dir: Path) -> CheckpointInfo | None:
    """`checkpoint.resume`: never → None; auto → the newest (last saved) complete checkpoint (or
    None); a path → that checkpoint, which must be complete. Checksums are the ranks' to verify."""
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

def prune(run_dir: Path, keep: int, run_id: str) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints of run `run_id` (a checkpoint of another
    run, or one without a run id, is never touched); each loses its metadata file first (so a
    half-deleted folder never looks complete), then the rest. Returns the steps deleted."""
    own = [i for i in complete_checkpoints(run_dir) if run_id and i.run_id == run_id]
    gone = own[:-keep] if keep > 0 else []
    for info in gone:
        (info.path / META_FILE).unlink(missing_ok=True)
        shutil.rmtree(info.path, ignore_errors=True)
    return [i.step for i in gone]


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
    """Tidy what killed saves left (rank 0, at start): `.tmp-*` folders are never read and go; an
    `.old-step_<N>` whose `step_<N>` is complete goes; one without (a re-save killed between its two
    renames) is the step's only copy and is renamed back to `step_<N>`, with a line."""
    d = checkpoints_dir(run_dir)
    for p in d.glob(".tmp-step_*") if d.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in d.glob(f"{OLD_PREFIX}step_*") if d.is_dir() else []:
        final = d / p.name.removeprefix(OLD_PREFIX)
        if read_info(final) is not None or read_info(p) is None:
            shutil.rmtree(p, ignore_errors=True)
        elif not final.exists():
            p.rename(final)
            print(f"shardtune: restored {final} from {p.name} (its re-save was cut between two renames)",
                  file=sys.stderr, flush=True)


def append_event(run_dir: Path, event: dict) -> None:
    """One line in <run_dir>/events.jsonl (resume, save, skipped step, preemption, stop)."""
    with open(Path(run_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")
