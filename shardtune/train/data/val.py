"""Validation micro-batches: this rank's share of `data.val_path` (or of the examples `data.val_split`
holds out of `data.path`, sources.py `hold_out`), packed like training data.

Every val example lands in exactly one row of exactly one rank (rows dealt round-robin:
row i → rank i mod world_size, in a fixed unshuffled order); every rank gets the same number
of micro-batches, the short ones padded with rows whose labels are all -100 (no loss), so the
global token-mean loss is the sum over ranks of each rank's label sums (train/core/evaluate.py).
Labels are shifted exactly as the training batches' (packing.build_row).
"""
from __future__ import annotations

import torch

from shardtune.errors import UserError
from shardtune.strategies import IGNORE_INDEX
from shardtune.train.data.dataset import encode_records
from shardtune.train.data.packing import build_row, pack_examples
from shardtune.train.data.sources import read_records


def val_config(data_cfg):
    """`data_cfg` with `path` = its `val_path` (same format, template and packing options)."""
    return data_cfg.model_copy(update={"path": data_cfg.val_path})


def val_records(data_cfg) -> list[dict]:
    """The val examples: data.val_split's held-out share of data.path, else data.val_path's."""
    if data_cfg.val_split:
        return read_records(data_cfg, part="val")
    return read_records(val_config(data_cfg))


def pack_val(data_cfg, seq_len: int, tokenizer):
    """The val set read, tokenized and packed in file order (no shuffle)."""
    encoded = encode_records(val_records(data_cfg), tokenizer, data_cfg, "val example")
    try:
        return pack_examples(encoded, seq_len, data_cfg.packing, seed=0, shuffle=False)
    except UserError:
        what = (f"held out by data.val_split {data_cfg.val_split}" if data_cfg.val_split
                else repr(data_cfg.val_path))
        raise UserError(f"the val set {what} has no target token within seq_len={seq_len} (nothing "
                        "to measure a loss on); give examples with a response, or raise train.seq_len") from None


def build_val_batches(data_cfg, train_cfg, tokenizer, rank: int, world_size: int, pack=pack_val) -> list[dict] | None:
    """None without a val set (data.val_path / data.val_split); else this rank's val micro-batches
    ((micro_batch, seq_len) long); `pack(data_cfg, seq_len, tokenizer)` (dpo: preference.pack_val_pairs)."""
    if not data_cfg.has_val:
        return None
    data = pack(data_cfg, train_cfg.seq_len, tokenizer)
    seq_len, mb = train_cfg.seq_len, train_cfg.micro_batch
    mine = [build_row(data, data.rows[i], tokenizer.pad_id) for i in range(rank, data.num_rows, world_size)]
    per_rank = -(-data.num_rows // world_size)
    n_batches = -(-per_rank // mb)
    blank = ([tokenizer.pad_id] * seq_len, [IGNORE_INDEX] * seq_len, list(range(seq_len)))
    mine += [blank] * (n_batches * mb - len(mine))
    batches = []
    for b in range(n_batches):
        rows = mine[b * mb:(b + 1) * mb]
        batches.append({key: torch.tensor([r[i] for r in rows], dtype=torch.long)
                        for i, key in enumerate(("input_ids", "labels", "position_ids"))})
    return batches
