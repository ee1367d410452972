"""Recipe key names: every key of the schema, and the suggestion for an unknown one.

An unknown key is matched on its last segment, in this order: a name other tools use for the same
setting (HF TrainingArguments, torchtune: `learning_rate` → `lr`); the same name in another section
(`train.lr` → `optim.lr`); the initials of its words (`learning_rate` → `lr`); a longer name it begins
(`min_lr` → `min_lr_ratio`); then the smallest edit distance of the last segment, in the key's own
section first (`optim.lrr` → `optim.lr`)."""
from __future__ import annotations

from pydantic import BaseModel

# other tools' names for our keys (the last segment): HF TrainingArguments, torchtune, Axolotl
ALIASES = {
    "learning_rate": "lr", "max_lr": "lr", "gradient_accumulation_steps": "grad_accum",
    "per_device_train_batch_size": "micro_batch", "batch_size": "micro_batch", "micro_batch_size": "micro_batch",
    "max_seq_length": "seq_len", "max_length": "seq_len", "sequence_len": "seq_len", "seq_length": "seq_len",
    "num_train_epochs": "epochs", "num_epochs": "epochs", "warmup": "warmup_steps", "lr_scheduler": "schedule",
    "lr_scheduler_type": "schedule", "max_grad_norm": "grad_clip", "clip_grad_norm": "grad_clip",
    "save_steps": "every", "eval_steps": "eval_every", "logging_steps": "log_every", "lora_r": "rank", "r": "rank",
    "lora_alpha": "alpha", "lora_dropout": "dropout", "model_name_or_path": "name", "dataset": "path",
    "train_file": "path", "validation_file": "val_path", "eval_path": "val_path", "gradient_checkpointing":
    "activation_checkpointing", "optimizer": "name", "adam_epsilon": "eps", "sharding_strategy": "strategy",
}


def all_keys(model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of `model_cls`, sections included (so `modle:` suggests `model`)."""
    keys = []
    for name, field in model_cls.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += all_keys(ann, f"{prefix}{name}.")
    return keys


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute: 1 each)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def closest_key(key: str, keys: list[str]) -> str | None:
    """The key meant by the unknown `key`, or None when nothing is close."""
    section, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == section]
    wanted = [ALIASES.get(leaf.lower()), leaf]
    if "_" in leaf:
        wanted.append("".join(w[0] for w in leaf.split("_") if w))
    for name in filter(None, wanted):
        same = [k for k in siblings if _leaf(k) == name] or [k for k in keys if _leaf(k) == name]
        if same and same[0] != key:
            return same[0]
    longer = [k for k in siblings if _leaf(k).startswith(leaf) and len(leaf) >= 3]
    if longer:  # `optim.min_lr` → `optim.min_lr_ratio`
        return min(longer, key=len)
    for pool, most in ((siblings, max(2, len(leaf) // 3)), (keys, len(leaf) // 4)):
        scored = sorted((edit_distance(leaf, _leaf(k)), k) for k in pool if k != key)
        if scored and scored[0][0] <= most and scored[0][0] < len(leaf):
            return scored[0][1]
    return None
