"""The one training step every path uses (torchtune #2307: copied loops drift apart), and the
loop state that a checkpoint saves. It returns device tensors: the loop converts them to Python
numbers on logging steps only (torchtitan does the same), so a step adds no host sync of its own
beyond the non-finite skip decision.

Loss normalisation: each micro-batch contributes (sum of its token losses) / N, N = number of
target tokens over ALL micro-batches of the step and ALL data-parallel ranks (the step's one
scalar all-reduce: the loss needs it), so the step's gradient is that of the global token mean,
not a mean of means. DDP and FSDP
average gradients over the ranks they reduce across (divide by `dp_size`: the data-parallel ranks,
× cp with context parallelism, whose ranks share one batch and hold parts of each row), so the
backward loss is scaled by `dp_size` to undo that average.

Gradient accumulation syncs across data-parallel replicas once per step: DDP through `no_sync`,
HSDP through FSDP2's `set_requires_all_reduce(False)` on all but the last micro-batch (the shard
group still reduce-scatters every micro-batch, so the grads stay sharded: ZeRO-2/3 memory).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardtune.parallel.ep import ep_clip_grad_norm_
from shardtune.parallel.fsdp import autocast_dtype
from shardtune.parallel.pp import pp_clip_grad_norm_
from shardtune.parallel.tp import loss_context
from shardtune.rules.loss import resolve_loss_chunks
from shardtune.train.core.chunked_loss import IGNORE_INDEX, lm_token_loss_sum
from shardtune.train.core.moe import MoeTerms
from shardtune.train.core.offload import HostOffload

if TYPE_CHECKING:
    from shardtune.config import RunConfig


@dataclass(frozen=True)
class StepOptions:
    """Every setting the training step and evaluation use, built ONCE from the config
    (`from_config`) and passed whole: the loop, evaluation, the simulator and bench/ all take it,
    so no call site re-derives a setting (issue 26). A new setting is one field here and one line
    in `from_config`."""
    loss_chunks: int | None = None  # train.loss_chunks; from_config resolves it (None: the vocabulary's
    # default, rules/loss.py, resolved at the loss)
    autocast_dtype: torch.dtype | None = None  # parallel.precision under ddp/zero1 (parallel/fsdp.py)
    grad_clip: float = 1.0  # optim.grad_clip (0: no clipping)
    skip_non_finite: bool = True  # a non-finite loss or grad norm skips the update (the simulator: off)
    objective: str = "sft"  # train.objective; dpo, simpo: train/core/dpo.py's step and evaluation
    dpo_beta: float = 0.1  # train.dpo_beta
    dpo_label_smoothing: float = 0.0  # train.dpo_label_smoothing
    simpo_gamma: float = 0.5  # train.simpo_gamma
    activation_offload: bool = False  # parallel.activation_offload: saved tensors in host memory (offload.py)

    @classmethod
    def from_config(cls, cfg: RunConfig, vocab_size: int, **overrides) -> StepOptions:
        """The options of a run of `cfg` on a model of `vocab_size` ids; `overrides` replace fields."""
        opts = cls(loss_chunks=resolve_loss_chunks(cfg.train.loss_chunks, vocab_size, cfg.parallel.tp),
                   autocast_dtype=autocast_dtype(cfg.parallel), grad_clip=cfg.optim.grad_clip,
                   objective=cfg.train.objective, dpo_beta=cfg.train.dpo_beta,
                   dpo_label_smoothing=cfg.train.dpo_label_smoothing, simpo_gamma=cfg.train.simpo_gamma,
                   activation_offload=cfg.parallel.activation_offload)
        return replace(opts, **overrides)


@dataclass
class StepResult:
    loss_part: torch.Tensor  # 0-dim: this rank's token-loss sum / the step's global target tokens
    # (summed over the ranks: the step's global token-mean loss; `global_loss`, or the loop's one
    # gather on logged steps)
    grad_norm: torch.Tensor  # 0-dim: global L2 norm before clipping
    lr: float  # learning rate used by this step (the scheduler's, already on the host)
    num_tokens: torch.Tensor  # 0-dim int: target tokens over all micro-batches and ranks
    skipped: bool = False  # non-finite loss or grad norm on some rank: no update (train/durable/resilience.py)
    # more of the step's global means, each as loss_part is: this rank's part (dpo: reward_acc, ...)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TrainState:
    """Everything the loop advances; train/durable/checkpoint.py saves step, tokens_seen and the
    data position (with the scheduler and each rank's RNG) and restores them on resume."""
    step: int = 0  # optimizer steps done
    tokens_seen: int | torch.Tensor = 0  # target tokens over all ranks (a device tensor between logs)
    data: Any = None  # the dataloader: state_dict()/load_state_dict() give the data position


def train_step(model: nn.Module, optimizer, scheduler, micro_batches: list[dict], opts: StepOptions, *,
               dp_group, dp_size: int, activations=None) -> StepResult:
    """Forward/backward over the micro-batches (gradient accumulation), clip, optimizer step, as
    `opts` says. `activations` (metrics.SavedActivations) counts the bytes saved for backward, if given."""
    optimizer.zero_grad(set_to_none=True)  # here, not after the step: grads stay measurable at rest
    device = micro_batches[0]["input_ids"].device
    num_tokens, denom = step_tokens(micro_batches, dp_group)
    loss_sum = torch.zeros((), device=device)
    offload = HostOffload() if opts.activation_offload else None
    moe = MoeTerms(model, len(micro_batches), dp_group)  # MoE: the load-balancing loss (moe.py)
    for i, mb in enumerate(micro_batches):
        with accumulation(model, last=i == len(micro_batches) - 1), loss_context(model):  # TP: loss_parallel
            with _saved_tensors(activations, offload), moe.routing() as seen:
                # full logits (1 chunk) or chunked cross-entropy (train.loss_chunks, docs/loss.md)
                token_loss_sum = lm_token_loss_sum(model, mb, opts.loss_chunks, opts.autocast_dtype)
            (moe.add_objective(token_loss_sum * dp_size / denom, seen, dp_size)).backward()
        loss_sum += token_loss_sum.detach()
    norm, lr, skipped = clip_and_step(model, optimizer, scheduler, loss_sum, opts)
    return StepResult(loss_part=loss_sum / denom, grad_norm=norm.detach(), lr=float(lr),
                      num_tokens=num_tokens, skipped=skipped, parts=moe.parts(dp_size))


def step_tokens(micro_batches: list[dict], dp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(target tokens of the step over all micro-batches and data-parallel ranks, that count as the
    fp32 divisor, at least 1): the step's ONE all-reduce."""
    # already shifted: labels[t] follows input[t] (train/data/dataset.py)
    num_tokens = torch.stack([(mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches]).sum()
    dist.all_reduce(num_tokens, group=dp_group)
    return num_tokens, num_tokens.clamp(min=1).to(torch.float32)


def _saved_tensors(activations, offload):
    """The hooks on what one micro-batch's forward saves: counted (`activations`), moved to host
    memory (`offload`, parallel.activation_offload), both, or neither."""
    if activations is not None:
        return activations.micro_batch(offload)
    return offload.hooks() if offload is not None else nullcontext()


def accumulation(model: nn.Module, last: bool):
    """The context of one micro-batch's backward: gradients synced across replicas on the last only."""
    if isinstance(model, FSDPModule):
        # HSDP: reduce-scatter inside the shard group every micro-batch (FSDP2 accumulates the
        # shards), all-reduce across replicas on the last only. Set on every micro-batch so an
        # interrupted step leaves nothing behind; no-op without a replicate dimension.
        model.set_requires_all_reduce(last)
    is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    return model.no_sync() if is_ddp and not last else nullcontext()  # DDP: all-reduce on the last only


def clip_and_step(model: nn.Module, optimizer, scheduler, loss_sum: torch.Tensor, opts: StepOptions
                  ) -> tuple[torch.Tensor, float, bool]:
    """Clip, then step (or skip a non-finite step); (global grad norm, lr used, skipped)."""
    max_norm = opts.grad_clip if opts.grad_clip > 0 else math.inf
    norm = ep_clip_grad_norm_(model, max_norm)  # expert parallelism: one norm per mesh (parallel/ep.py)
    if norm is None:  # pipeline parallelism: the stages' norms summed over the pp group (parallel/pp.py)
        norm = pp_clip_grad_norm_(model, max_norm)
    if norm is None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor on FSDP
    lr = scheduler.get_last_lr()[0]
    # a non-finite loss or grad norm on ANY rank skips the update on every rank, with no collective
    # of its own: the norm is global (of all-reduced DDP grads, or FSDP's all-reduced DTensor norm),
    # and a rank whose loss is non-finite has non-finite gradients, which reach every rank's norm.
    # The local loss is checked too, so the rank that saw it needs no help from the norm.
    skipped = opts.skip_non_finite and not bool(torch.isfinite(torch.stack([loss_sum, norm.float()])).all())
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        scheduler.step()
    return norm, float(lr), skipped


def global_loss(r: StepResult, group=None) -> float:
    """The step's global token-mean loss (one scalar all-reduce; for callers outside the loop)."""
    total = r.loss_part.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total)
