"""The one place that picks the objective (`train.objective`): its data, its object (SFT, DPO /
SimPO, GRPO: train/core/sft.py, dpo.py, grpo.py), whose attributes hold the two figures the loop
reports from it (`flops_factor`, `step_tokens_fixed`). The loop (train/rank/loop.py) then has one
path: `objective.step`, `objective.evaluate`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtune.train.core.dpo_ref import set_up_dpo
from shardtune.train.core.grpo import set_up_grpo
from shardtune.train.core.sft import SFT
from shardtune.train.data.dataset import build_dataloader
from shardtune.train.data.preference import build_pair_loader, pack_val_pairs
from shardtune.train.data.val import build_val_batches

if TYPE_CHECKING:
    from shardtune.config import RunConfig


def _preference(cfg: RunConfig) -> bool:
    return cfg.train.objective in ("dpo", "simpo")


def objective_data(cfg: RunConfig, ctx, tokenizer, run_dir: Path) -> tuple[Any, Any, Any]:
    """(the training loader, this rank's validation data or None, the GRPO objective or None): grpo
    reads prompts and builds its object with them; sft and dpo build theirs on the model."""
    if cfg.train.objective == "grpo":  # online RL: prompts, generation, rewards (train/core/grpo.py)
        return set_up_grpo(cfg, ctx, tokenizer, run_dir)
    pairs = _preference(cfg)
    loader = (build_pair_loader if pairs else build_dataloader)(cfg.data, cfg.train, tokenizer, ctx.dp_rank,
                                                                ctx.dp_size, cfg.train.seed)
    pack = {"pack": pack_val_pairs} if pairs else {}
    val = build_val_batches(cfg.data, cfg.train, tokenizer, ctx.dp_rank, ctx.dp_size, **pack)
    return loader, val, None


def build_objective(cfg: RunConfig, ctx, model, loader, val, tokenizer, run_dir: Path, opts,
                    early, marks: list):
    """The objective object on the built model: grpo's (`early`, from objective_data) started, dpo's
    with its reference (its time a start-up mark), or SFT."""
    if early is not None:
        early.start(model, ctx, marks)  # the held-out reward before training; the reference was built
        return early
    if _preference(cfg):
        objective = set_up_dpo(cfg, ctx, model, loader, val, tokenizer, run_dir, opts)
        marks.append(("dpo reference", time.perf_counter()))
        return objective
    return SFT()
