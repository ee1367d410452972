"""Which setting changes a resume may carry, for the launcher (train/launcher/rerun.py) and the ranks
(keeper.resume: a by-hand or multi-node `torchrun -m shardtune.train` skips the launcher): the
changes are named against the checkpoint's saved config (the run folder's config.yaml, or an
earlier segment's, whose config_hash is the checkpoint's); BREAKING ones are refused."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import UserError
from shardtune.train.durable.ckpt_files import config_hash

if TYPE_CHECKING:
    from shardtune.config import RunConfig

# Settings whose change makes a checkpoint meaningless for the new run (weights, data position or
# optimizer state would belong to another run). Strategy and world size reshard (docs/checkpoints.md).
# The data ones change the token stream or its order, so the saved data position would point into
# another stream (a setting and every key below it: data.columns.prompt is data.columns).
BREAKING = ("model.name", "model.trust_remote_code", "data.path", "data.sources", "data.split", "data.format",
            "data.columns", "data.tokenizer", "data.template", "data.chat_template", "data.system_prompt",
            "data.packing", "data.shuffle", "data.generated_examples", "data.generated_seed", "train.seq_len",
            "optim.name", "lora.rank", "lora.alpha", "lora.target_modules", "lora.target_parameters")
IGNORED = ("name", "output_dir", "checkpoint.resume")
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
    from shardtune.config import load_recipe  # noqa: PLC0415 pydantic stays out of CLI start-up (rerun.py, on the launcher's path, imports this module)

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
    return [(k, a.get(k), b.get(k)) for k in dict.fromkeys([*b, *a]) if k not in IGNORED and a.get(k) != b.get(k)]


def breaking(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in BREAKING)


def fmt(change: tuple[str, object, object]) -> str:
    return f"{change[0]} {change[1]} → {change[2]}"


def resume_changes(ckpt: Path, ckpt_hash: str | None, cfg: RunConfig) -> list[tuple[str, object, object]] | None:
    """The settings changed since checkpoint `ckpt` was saved (None: no saved config to compare
    with); a BREAKING change is a UserError naming it."""
    old = saved_config(Path(ckpt).parents[1], ckpt_hash) if ckpt_hash else None
    if old is None:
        return None
    diff = changes(old, cfg)
    broken = [c for c in diff if breaking(c[0])]
    if broken:
        raise UserError(f"cannot resume {ckpt}: {', '.join(fmt(c) for c in broken)} would not continue that "
                        f"run; {WAY_OUT}")
    return diff
