"""Every check that needs more than the config's own fields, before any process starts: the
layout on this world, the model, the data, the run folder, the checkpoint to resume. Imports no
torch (a bad input is one line and exit 2, not a rank's traceback)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.catalog.models import MODELS, resolve_model_config, safetensors_files
from shardtune.errors import UserError
from shardtune.strategies import Layout
from shardtune.train.data.dataset import check_dataset
from shardtune.train.durable.ckpt_files import resolve_resume

if TYPE_CHECKING:  # pydantic stays out of CLI start-up: train/commands.py imports this module
    from shardtune.config import ModelConfig, RunConfig

_DIR_HINT = "give another with --output-dir or output_dir=DIR"


def _check_writable(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output dir {str(run_dir)!r} is a file, not a folder; {_DIR_HINT}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise UserError(f"output dir {str(run_dir)!r} cannot be written ({e.strerror or e}); {_DIR_HINT}") from None


def _check_model(model: ModelConfig, seq_len: int) -> None:
    name = model.name
    looks_like_path = name not in MODELS and ("/" in name or name.startswith((".", "~")))
    if looks_like_path and not Path(name).expanduser().exists():
        raise UserError(f"model path {name!r} does not exist; give an HF model folder (config.json + "
                        "safetensors) or a catalogue name")
    hf = resolve_model_config(name)
    if model.init == "pretrained" and not safetensors_files(name):
        raise UserError(f"model.init is 'pretrained' but {name!r} has no *.safetensors; "
                        "give an HF model folder with weights or set model.init=random")
    max_pos = hf.get("max_position_embeddings")
    if max_pos and seq_len > max_pos:
        raise UserError(f"train.seq_len {seq_len} exceeds the model's max_position_embeddings {max_pos}; "
                        "lower train.seq_len")


def validate_for_launch(cfg: RunConfig, world_size: int, local_world_size: int) -> Layout:
    """The run's layout on `world_size` ranks (`local_world_size` per node), once every check has
    passed: hsdp shard size (strategies.Layout, the one check), model, data, run folder, resume."""
    layout = Layout.build(cfg.parallel.strategy, world_size, local_world_size, cfg.parallel.hsdp_shard_size)
    _check_model(cfg.model, cfg.train.seq_len)
    check_dataset(cfg.data)
    _check_writable(cfg.run_dir)
    resolve_resume(cfg.checkpoint, cfg.run_dir)  # a --resume PATH must be a complete checkpoint
    return layout
