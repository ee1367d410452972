"""The training step under pipeline parallelism (parallel.pp > 1): the same loss normalisation,
clipping and optimizer step as step.py's `train_step`, with the forward and backward of the step's
micro-batches run by the stage's schedule (parallel/pp.py).

Normalisation: the last stage's forward returns a micro-batch's token-loss sum; the schedule's loss
function multiplies it by dp_size / N (N: the step's target tokens over all micro-batches and
data-parallel ranks, `step_tokens`: every stage reads the same rows, so each knows N), which is
exactly the factor the non-pp step's backward applies, so the summed gradient is the same. The
schedule does not rescale (scale_grads False). The gradient norm is summed over the stages.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardtune.parallel.mesh import sub_mesh
from shardtune.parallel.pp import build_pipeline, pipeline_of
from shardtune.parallel.tp import loss_context
from shardtune.train.core.chunked_loss import lm_token_loss_sum
from shardtune.train.core.step import StepOptions, StepResult, clip_and_step, step_tokens

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardtune.config import RunConfig


def attach_pipeline(model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device,
                    opts: StepOptions) -> None:
    """parallel.pp > 1: build the stage and its schedule on the sharded model (no-op otherwise)."""
    pp_mesh = sub_mesh(mesh, "pp")
    if pp_mesh is None:
        return

    def loss_sum(lm: nn.Module, batch: dict) -> torch.Tensor:
        return lm_token_loss_sum(lm, batch, opts.loss_chunks, opts.autocast_dtype)

    # what travels between stages: the compute dtype (FSDP2 casts to bf16 inside fully_shard)
    hidden_dtype = torch.float32 if cfg.parallel.precision == "fp32" else torch.bfloat16
    build_pipeline(model, pp_mesh, device, cfg.parallel.pp_schedule, cfg.train.grad_accum,
                   (cfg.train.micro_batch, cfg.train.seq_len), hidden_dtype, loss_sum)


def pp_train_step(model: nn.Module, optimizer, scheduler, micro_batches: list[dict], opts: StepOptions, *,
                  dp_group, dp_size: int, activations=None) -> StepResult:
    """`train_step`'s contract (step.py) through the pipeline schedule. `activations` counts every
    storage saved for backward during the step (all micro-batches in flight: GPipe's peak; an upper
    bound for 1F1B's)."""
    optimizer.zero_grad(set_to_none=True)
    num_tokens, denom = step_tokens(micro_batches, dp_group)
    with activations.micro_batch() if activations is not None else nullcontext(), loss_context(model):  # TP
        loss_sum = pipeline_of(model).run(micro_batches, scale=dp_size / denom)
    norm, lr, skipped = clip_and_step(model, optimizer, scheduler, loss_sum, opts)
    return StepResult(loss_part=loss_sum / denom, grad_norm=norm.detach(), lr=float(lr), num_tokens=num_tokens,
                      skipped=skipped)
