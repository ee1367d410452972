"""Supervised fine-tuning as an objective object (`train.objective: sft`), with DPO's and GRPO's
interface (train/core/dpo.py, grpo.py), so the loop (train/rank/loop.py) has one path: `step`,
`evaluate`, `blocks_memory_tracker`, `tracked_bytes`, and the two figures the loop reports from
(`flops_factor`, `step_tokens_fixed`). The step is step.py's `train_step`, or
pp_step.py's `pp_train_step` when the model carries a pipeline (parallel.pp > 1)."""
from __future__ import annotations

from shardtune.parallel.pp import pipeline_of
from shardtune.train.core.evaluate import evaluate
from shardtune.train.core.pp_step import pp_train_step
from shardtune.train.core.step import StepOptions, StepResult, train_step


class SFT:
    """The token-mean cross-entropy of the labels; no reference model."""
    reference = None
    flops_factor = 1  # model FLOPs a trained token costs, in units of the policy's (DPO: + its reference)
    step_tokens_fixed = True  # a step's throughput counts its rows × seq_len tokens (GRPO: its completions)

    def blocks_memory_tracker(self) -> bool:
        return False

    def tracked_bytes(self, tracked: dict) -> dict:
        """A tracked step's bytes as the trackers counted them (nothing held outside the model)."""
        return tracked

    def step(self, model, optimizer, scheduler, micro_batches: list[dict], opts: StepOptions, *, dp_group=None,
             dp_size: int, activations=None) -> StepResult:
        step = pp_train_step if pipeline_of(model) is not None else train_step
        return step(model, optimizer, scheduler, micro_batches, opts, dp_group=dp_group, dp_size=dp_size,
                    activations=activations)

    def evaluate(self, model, batches: list[dict], device, opts: StepOptions, group=None) -> dict:
        """{"val_loss": the global token mean over every rank's validation batches} (collective)."""
        return {"val_loss": evaluate(model, batches, device, opts, group)}
