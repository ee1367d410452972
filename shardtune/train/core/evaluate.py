"""Validation loss: the global token mean over every rank's validation batches (docs/loop.md).

Each rank sums the token losses and counts the target tokens of its own batches (model in eval
mode, no grad, the step's loss and autocast: `StepOptions`); one all-reduce of [loss sum, tokens]
gives the mean over all ranks' tokens, the same number one process would get from all the examples at once. Under FSDP
every rank must take part in every forward: a rank with fewer batches runs extra forwards on one
of its batches (or a 2-token dummy) that count nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardtune.parallel.cp import cp_degree
from shardtune.parallel.pp import pipeline_of
from shardtune.parallel.tp import loss_context, tp_degree
from shardtune.train.core.chunked_loss import IGNORE_INDEX, lm_token_loss_sum
from shardtune.train.core.step import StepOptions


def _forward_loss(model: nn.Module, batch: dict, opts: StepOptions):
    """(sum of token losses, target tokens) of one batch; labels are already shifted. The loss is
    the step's (`lm_token_loss_sum`: full logits, or chunked per train.loss_chunks)."""
    tokens = (batch["labels"] != IGNORE_INDEX).sum().double()
    if (pipe := pipeline_of(model)) is not None:  # pp: through every stage, counted on the last only
        return pipe.forward_only(batch).double(), tokens if pipe.span.last else tokens * 0
    loss = lm_token_loss_sum(model, batch, opts.loss_chunks, opts.autocast_dtype)  # cp: this rank's rows
    # every rank of a cp group sees the whole batch: its tokens / cp, summed over the group, count once
    return loss.double(), tokens / cp_degree(model)


def evaluate(model: nn.Module, batches: list[dict], device: torch.device, opts: StepOptions,
             group=None) -> float:
    """The validation loss over every rank's `batches` (collective: every rank calls it), with the
    training step's loss and autocast (`opts`). Returns nan when no rank has a target token."""
    n_mine = torch.tensor([len(batches)], dtype=torch.int64, device=device)
    dist.all_reduce(n_mine, op=dist.ReduceOp.MAX, group=group)  # forwards every rank runs
    n_all = int(n_mine)
    n = max(2, tp_degree(model))  # sequence parallelism splits the dummy's length over tp
    dummy = {"input_ids": torch.zeros((1, n), dtype=torch.long, device=device),
             "position_ids": torch.arange(n, device=device).unsqueeze(0),
             "labels": torch.full((1, n), IGNORE_INDEX, dtype=torch.long, device=device)}
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), loss_context(model):  # TP: vocabulary-parallel cross-entropy
            for i in range(n_all):
                mine = i < len(batches)
                batch = batches[i] if mine else (batches[0] if batches else dummy)
                batch = {k: v.to(device) for k, v in batch.items()}
                loss, tokens = _forward_loss(model, batch, opts)
                if mine:
                    totals += torch.stack([loss, tokens])
    finally:
        model.train(was_training)
    dist.all_reduce(totals, group=group)
    return float(totals[0] / totals[1]) if float(totals[1]) > 0 else float("nan")
