"""Every check that needs more than the config's own fields, before any process starts: the
model, the data, the layout on this world, the run folder, the checkpoint to resume. Imports no
torch (a bad input is one line and exit 2, not a rank's traceback)."""
from __future__ import annotations

import tempfile
from pathlib import Path

from shardtune.errors import UserError


def _check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise UserError(f"output dir {str(run_dir)!r} cannot be written ({e.strerror}); "
                        "give a writable --output-dir") from None


def validate_for_launch(cfg, world_size: int, local_world_size: int) -> None:
    """Checks that need more than the config's own fields: model, data, hsdp size, output dir."""
    from shardtune.catalog.models import resolve_model_config
    from shardtune.train.data.dataset import check_dataset

    resolve_model_config(cfg.model.name)
    folder = Path(cfg.model.name).expanduser()
    if cfg.model.init == "pretrained" and not (folder.is_dir() and any(folder.glob("*.safetensors"))):
        raise UserError(f"model.init is 'pretrained' but {cfg.model.name!r} has no *.safetensors; "
                        "give an HF model folder with weights or set model.init=random")
    if cfg.parallel.strategy == "hsdp":
        shard = cfg.parallel.hsdp_shard_size or local_world_size
        if world_size % shard:
            raise UserError(f"parallel.hsdp_shard_size {shard} does not divide the world size "
                            f"{world_size}; choose a divisor of {world_size}")
    check_dataset(cfg.data)
    _check_writable(cfg.run_dir)
    from shardtune.train.durable.ckpt_files import resolve_resume

    resolve_resume(cfg.checkpoint, cfg.run_dir)  # a --resume PATH must be a complete checkpoint
