"""Pipeline parallelism (parallel.pp): a Hugging Face causal LM cut into stages along its decoder
layers, one stage per rank of the "pp" mesh dimension, run by torch.distributed.pipelining's
schedules (docs/parallelism.md, "Pipeline parallelism in the trainer").

`apply_pp` prunes the meta model to this rank's stage before anything else is applied (torchtitan
splits the same way: a copy of the whole model with the other stages' modules removed): its decoder
layers keep their global indices, so parameter names, the seeded init and checkpoints' keys are
the whole model's; the embedding stays on the first stage, the final norm and LM head on the last
(elsewhere identities). `build_pipeline` wraps the sharded stage for the schedule: every stage gets
the micro-batch's position ids (rotary embeddings, packed rows' masks) and labels as keyword
inputs; the last computes the micro-batch's token-loss sum in its forward (the caller's
`loss_sum`, the non-pp step's own loss), which the schedule's loss function scales.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from shardtune.rules.pipeline import stage_layer_counts

PP_ATTR = "_shardtune_pipeline"  # on the HF model: its `Pipeline` once built, its `StageSpan` after apply_pp
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}  # rules/pipeline.py says which the trainer runs


class _StageLayers(nn.ModuleList):
    """A stage's decoder layers named by their global index (state-dict keys stay the whole model's);
    HF's forward iterates a slice of it, which numbers from 0 and is only iterated."""

    def __init__(self, modules=(), first_index: int = 0):
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(first_index + i), m)


@dataclass(frozen=True)
class StageSpan:
    stage: int  # this rank's stage index
    num_stages: int
    layers: tuple[int, ...]  # decoder layers per stage, all stages

    @property
    def first_layer(self) -> int:
        """The model's index of this stage's first decoder layer."""
        return sum(self.layers[:self.stage])

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def apply_pp(model: nn.Module, pp_mesh, pp_layers: list[int] | None) -> StageSpan:
    """Prune `model` (on meta) to this rank's stage: its share of the decoder layers (an even split
    or `pp_layers`, rules/pipeline.py), the embedding on the first stage only, the final norm and
    LM head on the last only."""
    decoder = model.get_decoder()
    counts = stage_layer_counts(len(decoder.layers), pp_mesh.size(), pp_layers)
    span = StageSpan(pp_mesh.get_local_rank(), pp_mesh.size(), tuple(counts))
    start = span.first_layer
    decoder.layers = _StageLayers(list(decoder.layers)[start:start + counts[span.stage]], start)
    if not span.first:
        decoder.embed_tokens = None  # the inputs are the previous stage's hidden states (inputs_embeds)
    if not span.last:
        decoder.norm = nn.Identity()
        model.lm_head = nn.Identity()  # the CausalLM's "logits" are then the hidden states to send on
    setattr(model, PP_ATTR, span)
    return span


class _StageModule(nn.Module):
    """One stage as the schedule calls it: (x, position_ids=, labels=) → the hidden states for the
    next stage (B, S, h), or on the last stage the micro-batch's token-loss sum (0-dim fp32)."""

    def __init__(self, lm: nn.Module, span: StageSpan, loss_sum: Callable[[nn.Module, dict], torch.Tensor]):
        super().__init__()
        self.lm, self.span, self.loss_sum = lm, span, loss_sum
        self.token_loss_sums: list[torch.Tensor] = []  # the last stage's, this step's micro-batches

    def forward(self, x, position_ids, labels):
        inputs = {"input_ids" if self.span.first else "inputs_embeds": x, "position_ids": position_ids}
        if not self.span.last:
            with warnings.catch_warnings():  # HF slices the hidden states (a view) for its LM head; nothing
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")  # edits them
                return self.lm(**inputs).logits  # the LM head is an identity here: hidden states (B, S, h)
        total = self.loss_sum(self.lm, {**inputs, "labels": labels})
        self.token_loss_sums.append(total.detach())
        return total


@dataclass(eq=False)
class Pipeline:
    """A stage, its schedule, and the factor the loss function scales each micro-batch's loss by."""
    span: StageSpan
    module: _StageModule
    stage: PipelineStage
    schedule: object
    group: object  # the pp process group
    hidden: torch.Tensor  # meta: what travels between stages, its dtype and hidden size
    scale: float = 1.0

    def loss_fn(self, output: torch.Tensor, _target) -> torch.Tensor:
        return output * self.scale

    @torch.no_grad()
    def forward_only(self, batch: dict) -> torch.Tensor:
        """One batch's token-loss sum through every stage, forward only, by blocking point-to-point
        sends (validation: any batch shape; every stage holds the same batch); 0 off the last stage."""
        ranks, span = dist.get_process_group_ranks(self.group), self.span
        x = batch["input_ids"]
        if not span.first:
            x = torch.empty(*x.shape, self.hidden.shape[-1], dtype=self.hidden.dtype, device=x.device)
            dist.recv(x, src=ranks[span.stage - 1], group=self.group)
        out = self.module(x, position_ids=batch["position_ids"], labels=batch["labels"])
        if span.last:
            return out
        dist.send(out.contiguous(), dst=ranks[span.stage + 1], group=self.group)
        return torch.zeros((), device=x.device)

    def run(self, micro_batches: list[dict], scale: float) -> torch.Tensor:
        """Forward and backward of the step's micro-batches through the pipeline, every micro-batch's
        loss multiplied by `scale` before its backward; the summed token losses (0 off the last stage)."""
        self.scale = scale
        self.module.token_loss_sums.clear()
        cat = lambda k: torch.cat([mb[k] for mb in micro_batches])  # noqa: E731 (the schedule splits it again)
        labels = cat("labels")
        args = (cat("input_ids"),) if self.span.first else ()
        self.schedule.step(*args, target=labels, position_ids=cat("position_ids"), labels=labels,
                           return_outputs=False)
        sums = self.module.token_loss_sums
        return torch.stack(sums).sum() if sums else torch.zeros((), device=labels.device)


def build_pipeline(model: nn.Module, pp_mesh, device: torch.device, schedule_name: str, num_microbatches: int,
                   micro_shape: tuple[int, int], hidden_dtype: torch.dtype,
                   loss_sum: Callable[[nn.Module, dict], torch.Tensor]) -> Pipeline:
    """The stage and schedule of a model `apply_pp` pruned (and since sharded and filled), kept on it
    (`pipeline_of`). Static shapes (`micro_shape` = (rows, seq_len) per micro-batch): the stage
    exchanges no metadata and runs no inference forward."""
    span = getattr(model, PP_ATTR)
    module = _StageModule(model, span, loss_sum)
    # the hidden states a stage receives need their gradient sent back: requires_grad in the metadata
    hidden = torch.empty(*micro_shape, model.config.hidden_size, dtype=hidden_dtype, device="meta",
                         requires_grad=True)
    ids = torch.empty(*micro_shape, dtype=torch.long, device="meta")
    loss = torch.empty((), dtype=torch.float32, device="meta")
    stage = PipelineStage(module, span.stage, span.num_stages, device, input_args=ids if span.first else hidden,
                          output_args=loss if span.last else hidden, group=pp_mesh.get_group())
    pipe = Pipeline(span, module, stage, None, pp_mesh.get_group(), hidden)
    # scale_grads False: the loss function scales (by the step's target tokens), as the non-pp step does
    pipe.schedule = SCHEDULES[schedule_name](stage, num_microbatches, loss_fn=pipe.loss_fn, scale_grads=False)
    setattr(model, PP_ATTR, pipe)
    return pipe


def stage_span(model: nn.Module) -> StageSpan | None:
    """This rank's stage of a model `apply_pp` pruned (before or after `build_pipeline`), or None."""
    found = getattr(model, PP_ATTR, None)
    return found.span if isinstance(found, Pipeline) else found


def pipeline_params(model: nn.Module, stage_params: int) -> int:
    """The whole model's parameter count from this stage's (`stage_params`: summed over the pp group)."""
    pipe = pipeline_of(model)
    if pipe is None:
        return stage_params
    total = torch.tensor([stage_params], dtype=torch.float64, device=pipe.stage.device)
    dist.all_reduce(total, group=pipe.group)
    return int(total[0])


def whole_model_layers(model: nn.Module, stage_indices: list[int]) -> list[int]:
    """Stage-local decoder-layer indices as the whole model's, gathered from every stage (the
    checkpointed layers memory.json reports); unchanged without a pipeline. Collective over pp."""
    pipe = pipeline_of(model)
    if pipe is None:
        return stage_indices
    parts: list = [None] * pipe.span.num_stages
    dist.all_gather_object(parts, [pipe.span.first_layer + i for i in stage_indices], group=pipe.group)
    return sorted(i for part in parts for i in part)


def schedule_name(pipe: Pipeline) -> str:
    """The recipe's name of the schedule class the pipeline runs (memory.json's effective.pp_schedule)."""
    return next(name for name, cls in SCHEDULES.items() if type(pipe.schedule) is cls)


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The model's built `Pipeline`, or None (no pipeline parallelism)."""
    pipe = getattr(getattr(model, "module", model), PP_ATTR, None)
    return pipe if isinstance(pipe, Pipeline) else None


def pp_clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor | None:
    """clip_grad_norm_ over every stage's gradients (None without a pipeline), rounded as torch's
    one-process call rounds: each gradient's norm in its dtype (FSDP's DTensor norm, over its
    data-parallel ranks), their squares summed in fp32 over the stage and the pp group, the root
    rounded to the gradients' dtype (pure bf16: bf16), and torch's clip rule
    (max_norm / (norm + 1e-6), at most 1) computed in that dtype on this stage's gradients."""
    pipe = pipeline_of(model)
    if pipe is None:
        return None
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dtype = next(model.parameters()).dtype
    norms = [torch.linalg.vector_norm(g) for g in grads]
    mine = (torch.linalg.vector_norm(torch.stack(norms), dtype=torch.float32) if norms
            else torch.zeros((), device=pipe.stage.device))
    mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
    squared = (mine.float() ** 2).reshape(1)
    dist.all_reduce(squared, group=pipe.group)
    total = squared[0].sqrt().to(dtype)
    # a host scalar (foreach mul refuses a plain tensor on DTensors), exactly the dtype's coefficient
    coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return total
