"""Synthetic global batches that follow train/data/dataset.py's contract (labels already shifted, -100
where no loss, position ids restarting at each packed example). Learnable: each example is an
arithmetic progression of byte tokens."""
from __future__ import annotations

import torch


def global_batch(step: int, rows: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + step)
    start = torch.randint(0, 256, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    ids = (start + stride * torch.arange(seq_len)) % 256  # (rows, T)
    split = seq_len // 2  # two packed examples per row: positions restart at `split`
    pos = torch.cat([torch.arange(split), torch.arange(seq_len - split)]).expand(rows, -1).clone()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, split - 1] = -100  # never predict across the example boundary
    labels[:, -1] = -100
    prompt = torch.randint(0, split // 2, (rows,), generator=g)  # a prompt with no loss, varied length
    for r in range(rows):
        labels[r, : prompt[r]] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def rank_micro_batches(batch: dict, rank: int, world: int, grad_accum: int) -> list[dict]:
    """This rank's rows of a global batch, split into `grad_accum` micro-batches."""
    rows = batch["input_ids"].shape[0]
    per_rank = rows // world
    mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
    mb = per_rank // grad_accum
    return [{k: v[i * mb:(i + 1) * mb] for k, v in mine.items()} for i in range(grad_accum)]
