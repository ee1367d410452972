"""`train.loggers`: each metrics.jsonl record also to TensorBoard and/or Weights & Biases (rank 0).

tensorboard  torch.utils.tensorboard's SummaryWriter, event files in <run_dir>/tensorboard/; one
             scalar per numeric field of the record (loss, val_loss, lr, grad_norm, tokens_per_s,
             tflops, mfu, peak_mem_bytes, ...), tagged by the field's name, at the record's step
wandb        wandb.init(dir=<run_dir>, name=the run's name), offline when WANDB_API_KEY is unset
             (`wandb sync <run_dir>/wandb/offline-run-*` uploads it later); wandb.log(record, step)
Both are optional extras (`pip install 'shardtune[tensorboard]'`, `[wandb]`). This module imports
neither at the top: `check_loop_options` runs in the torch-free launcher (train/commands.py).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from shardtune.errors import UserError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # logger → the package it needs


def check_loop_options(cfg) -> None:
    """The loop's options that cannot run, as one UserError before any process starts: a logger
    whose package is missing, validation asked for without validation data."""
    for name in cfg.train.loggers:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(f"train.loggers: {name} needs the {PACKAGES[name]} package; "
                            f"pip install 'shardtune[{name}]' (or drop it from train.loggers)")
    tb = Path(cfg.run_dir) / "tensorboard"
    if "tensorboard" in cfg.train.loggers and (tb.exists() or tb.is_symlink()) and not tb.is_dir():
        raise UserError(f"train.loggers: tensorboard writes into {str(tb)!r}, which is a file, not a folder; move it "
                        "away (or drop tensorboard from train.loggers)")
    if cfg.train.eval_every and not cfg.data.has_val and not cfg.train.sample_prompts:
        raise UserError(f"train.eval_every={cfg.train.eval_every} needs validation data or sample prompts: set "
                        "data.val_path, data.val_split or train.sample_prompts (or train.eval_every=0)")


def _numbers(record: dict) -> dict[str, float]:
    """The record's numeric fields (step aside; None, strings and booleans left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Loggers:
    """The loggers `names` names; `log(record)` sends one metrics.jsonl record to each."""

    def __init__(self, names: list[str], run_dir: Path, run_name: str, config: dict | None = None) -> None:
        self._tb = self._wandb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 optional extra

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if "wandb" in names:
            import wandb  # noqa: PLC0415 optional extra

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardtune"), name=run_name,
                                     dir=str(run_dir), mode=mode, config=config or {})

    def log(self, record: dict) -> None:
        step, values = int(record["step"]), _numbers(record)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
