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
from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import (
    CheckpointInfo,
    check_before_launch,
    check_metadata_pickle,
    complete_checkpoints,
    config_hash,
    resolve_resume,
)

if TYPE_CHECKING:
    from shardtune.config import RunConfig

# Settings whose change makes a checkpoint meaningless for the new run (weights, data position or
# optimizer state would belong to another run). Strategy and world size reshard (docs/checkpoints.md).
BREAKING = ("model.name", "model.trust_remote_code", "data.path", "data.format", "data.tokenizer", "data.template",
            "data.packing", "data.generated_examples", "data.generated_seed", "train.seq_len", "optim.name",
            "lora.rank", "lora.alpha", "lora.target_modules")
IGNORED = ("name", "output_dir", "checkpoint.resume")
MOVED = ("checkpoints", "metrics.jsonl", "events.jsonl", "memory.json", "config.yaml", "plan.json", "hf_export",
         "stopped.json")
WAY_OUT = "give a new --output-dir, or --resume never --move-aside to start afresh here"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def saved_config(run_dir: Path, cfg_hash: str) -> RunConfig | None:
    """The config the checkpoint was trained with: config.yaml (or an earlier segment's) whose hash matches."""
    from shardtune.config import load_recipe

    for path in [run_dir / "config.yaml", *sorted((run_dir / "segments").glob("*/config.yaml"), reverse=True)]:
        try:
            old = load_recipe(path)
        except UserError:
            continue
        if config_hash(old) == cfg_hash:
            return old
    return None


def changes(old: RunConfig, new: RunConfig) -> list[tuple[str, object, object]]:
    a, b = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return [(k, a.get(k), b.get(k)) for k in b if k not in IGNORED and a.get(k) != b.get(k)]


def _fmt(change: tuple[str, object, object]) -> str:
    return f"{change[0]} {change[1]} → {change[2]}"


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


def check_checkpoint_files(info: CheckpointInfo, auto: bool) -> None:
    """Before launch: `--resume PATH` must have every file at its recorded size and a `.metadata`
    that names only allowed globals (ckpt_files.check_before_launch). `resume: auto`: the newest
    checkpoint whose sizes are right (the one the ranks will verify and load; a damaged one they
    skip, naming it) must have such a `.metadata`."""
    if not auto:
        check_before_launch(info)
        return
    for ckpt in reversed(complete_checkpoints(Path(info.path).parents[1])):
        if ckpt.files is None or not integrity.problems(ckpt.path, ckpt.files, sizes_only=True):
            check_metadata_pickle(ckpt.path / ".metadata")
            return


def check_rerun(cfg: RunConfig, move_old: bool = False) -> str | None:
    """None: launch. A string: the run is already complete (print it, exit 0). UserError: refused."""
    run_dir = cfg.run_dir
    if cfg.checkpoint.resume == "never":
        found = complete_checkpoints(run_dir)
        if found and not move_old:
            raise UserError(f"--resume never, but {run_dir} holds checkpoints of an earlier run (newest "
                            f"step_{found[-1].step}) that this run would mix with; {WAY_OUT}")
        if found or (move_old and (run_dir / "metrics.jsonl").exists()):
            print(f"shardtune: moved the earlier run's checkpoints and metrics to {move_aside(run_dir)}")
        return None
    if move_old:
        raise UserError("--move-aside applies with --resume never only")
    info = resolve_resume(cfg.checkpoint, run_dir)
    if info is None:
        return None
    check_same_model(info.path, cfg)
    old = saved_config(Path(info.path).parents[1], info.config_hash) if info.config_hash else None
    if old is None:  # no saved config to compare with: the ranks' own checks stand
        check_checkpoint_files(info, auto=cfg.checkpoint.resume == "auto")
        return None
    diff = changes(old, cfg)
    broken = [c for c in diff if c[0] in BREAKING]
    if broken:
        raise UserError(f"cannot resume {info.path}: {', '.join(_fmt(c) for c in broken)} would not continue that "
                        f"run; {WAY_OUT}")
    total = cfg.train.max_steps
    if total is not None and info.step >= total:
        ignored = f" ({', '.join(_fmt(c) for c in diff)} ignored)" if diff else ""
        return (f"shardtune: {run_dir} is already complete at step {info.step}{ignored}; nothing to do (raise "
                f"train.max_steps to train on, or {WAY_OUT})")
    check_checkpoint_files(info, auto=cfg.checkpoint.resume == "auto")
    if diff:
        print(f"shardtune: resuming {info.path} with changed settings: {', '.join(_fmt(c) for c in diff)}")
    return None
