"""Tensor (and sequence) parallelism on a Hugging Face Llama-style causal LM: a pure function of
(model, tp mesh, options), applied on the meta model before activation checkpointing and FSDP
(torchtitan's order: TP → AC → compile → FSDP). What each module becomes: docs/parallelism.md.

Per decoder layer: q/k/v and gate/up column-parallel (heads and the MLP's hidden split over tp),
o and down row-parallel; with sequence parallelism the norms run on sequence shards (Shard(1)),
attention and MLP all-gather their input and reduce-scatter their output. The embedding is
vocabulary-parallel with a replicated output: HF's model builds the attention mask and rotary
tables from it, at the full length (a sequence-sharded output gives them the local length, the
trap issue 29 records); the first layer takes its sequence shard locally. The head is column-
parallel with its logits left vocabulary-sharded for `loss_parallel`: the full [T, V] logits
never exist on one rank.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from shardtune.errors import UserError
from shardtune.parallel.layers import decoder_layers
from shardtune.parallel.record import applied, record
from shardtune.rules.tp import check_tp_model


class _QuietTwoStepNorm(logging.Filter):
    """The grad norm over a (dp_shard, tp) mesh all-reduces once per mesh dim (scalars): DTensor
    warns on every step that one flattened all-reduce would be faster; a run's log keeps it once."""
    seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "sequential all_reduce operations" not in record.getMessage():
            return True
        first, _QuietTwoStepNorm.seen = not _QuietTwoStepNorm.seen, True
        return first


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_QuietTwoStepNorm())


def _replicated(module: nn.Module, mesh: DeviceMesh, input_layout=None) -> None:
    """A module every tp rank holds whole (a norm without SP, a LoRA adapter): its params become
    Replicate DTensors on the tp mesh (so FSDP then shards every param on the same 2-D mesh and
    the grad norm sees one mesh); it takes and returns plain tensors, its input read as
    `input_layout` (Replicate; Shard(1): this rank's sequence rows, so the weight's gradient is a
    partial sum DTensor reduces over tp)."""
    layout = input_layout or Replicate()

    def to_dtensor(_mod, inputs, _mesh):
        return tuple(DTensor.from_local(x, _mesh, (layout,), run_check=False)
                     if hasattr(x, "dim") and not isinstance(x, DTensor) else x for x in inputs)

    def to_local(_mod, out, _mesh):
        return out.to_local() if hasattr(out, "to_local") else out

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


_PROJECTIONS = (("self_attn.q_proj", True), ("self_attn.k_proj", True), ("self_attn.v_proj", True),
                ("self_attn.o_proj", False), ("mlp.gate_proj", True), ("mlp.up_proj", True), ("mlp.down_proj", False))


def _projection(layer: nn.Module, path: str, colwise: bool, seq, mesh: DeviceMesh) -> dict:
    """Plan entries of one projection: the nn.Linear, or a PEFT LoRA `lora.Linear`'s base and
    adapters (docs/parallelism.md "LoRA"). Column-parallel: the base and B split by output rows, A
    whole on every rank (x A^T is then replicated, B's rows give this rank's output columns).
    Row-parallel: the base and A split by input columns; A's partial x A^T is reduce-scattered (SP)
    or all-reduced like the base's output, and B, whole, maps the rank's own rows."""
    style = (lambda: ColwiseParallel()) if colwise else (lambda: RowwiseParallel(output_layouts=seq))
    module = layer.get_submodule(path)
    if not hasattr(module, "base_layer"):
        return {path: style()}
    plan = {f"{path}.base_layer": style()}
    for name in module.lora_A:
        if colwise:
            _replicated(module.lora_A[name], mesh)
            plan[f"{path}.lora_B.{name}"] = ColwiseParallel()
        else:
            _replicated(module.lora_B[name], mesh, seq)
            plan[f"{path}.lora_A.{name}"] = RowwiseParallel(output_layouts=seq)
            drop = module.lora_dropout[name]
            if isinstance(drop, nn.Dropout) and drop.p > 0:
                module.lora_dropout[name] = SplitInputDropout(drop.p, mesh.get_local_rank(), mesh.size())
    return plan


class SplitInputDropout(nn.Module):
    """A row-parallel adapter's dropout (o, down: its input split by columns over tp): every tp rank
    draws the mask of the whole input, as one process would (the ranks of a tp group run the same
    ops, so their generators agree), and keeps its own columns, so the shards' masks do not repeat.
    CPU: the same draws and ops as `nn.Dropout` on the whole input (bernoulli_, div_, mul)."""

    def __init__(self, p: float, rank: int, size: int) -> None:
        super().__init__()
        self.p, self.rank, self.size = p, rank, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        w = x.shape[-1]
        full = torch.empty((*x.shape[:-1], w * self.size), dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)
        noise = full[..., self.rank * w:(self.rank + 1) * w].contiguous()  # the whole mask is not kept for backward
        return x * noise.div_(1 - self.p)


def _shard_rows_once(layer: nn.Module, mesh: DeviceMesh) -> None:
    """Layer 0's input: the replicated embedding output → this rank's rows (Shard(1); backward
    all-gathers the grad). Once only: AC's recompute calls the layer again with the args the first
    call's hooks made, already sliced (a PrepareModuleInput hook sliced them twice)."""
    def hook(_mod, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] != kwargs["position_embeddings"][0].shape[-2]:
            return None  # the rows of this rank already
        local = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False).redistribute(
            mesh, [Shard(1)]).to_local()
        if args:
            return (local, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": local}

    layer.register_forward_pre_hook(hook, with_kwargs=True)


def _gather_rows(layer: nn.Module, mesh: DeviceMesh) -> None:
    """A pipeline stage's last layer (not the model's): its sequence shard → the whole sequence, as
    the next stage's first layer takes it (`_shard_rows_once`; HF's mask and rotary tables need the
    full length). Backward keeps this rank's rows of the gradient, which every tp rank holds whole."""
    def hook(_mod, _args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        whole = DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False).redistribute(
            mesh, [Replicate()]).to_local()
        return (whole, *out[1:]) if isinstance(out, tuple) else whole

    layer.register_forward_hook(hook)


def _moe_block(layer: nn.Module, mesh: DeviceMesh) -> bool:
    """A mixture-of-experts MLP (docs/moe.md "ep with tp"): True, its router made a Replicate DTensor
    on the tp mesh (train/core/moe.py's router reads it local, its gradient a partial sum over tp:
    each tp rank routes its own tokens, Shard(1) of the sequence); the experts stay plain (parallel/ep.py
    splits them over the data ranks and the tp ranks hold copies). False for a dense MLP."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not isinstance(getattr(getattr(mlp, "experts", None), "gate_up_proj", None), torch.Tensor):
        return False
    for name, child in mlp.named_children():
        if name == "experts":
            continue
        if not type(child).__name__.lower().endswith("topkrouter"):
            raise UserError(f"tp over a mixture-of-experts block with a {type(child).__name__} ({name}) besides its "
                            "router and experts is not built: parallel.tp 1 / --tp 1")
        distribute_module(child, mesh)  # every parameter Replicate
    return True


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> None:
    """Tensor-parallel `model` in place over the 1-D `tp_mesh` (call on the meta model)."""
    check_tp_model(tp_mesh.size(), model.config.to_dict())  # a by-hand torchrun gets preflight's line
    # the styles make new nn.Parameters; SequenceParallel's are trainable whatever they were (LoRA's
    # frozen norms would train): each keeps the requires_grad it had
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    inner = model.get_decoder()
    if inner.embed_tokens is not None:  # a pipeline's later stage has none (parallel/pp.py)
        parallelize_module(inner.embed_tokens, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    head = model.get_output_embeddings()
    layers = decoder_layers(model)
    if isinstance(head, nn.Identity):  # a pipeline stage before the last: it sends whole hidden states
        if sp:
            _gather_rows(layers[-1], tp_mesh)
    else:
        parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                                          use_local_output=False))
        if model.config.tie_word_embeddings:  # both split the vocabulary rows (Shard(0)): one weight again
            head.weight = inner.embed_tokens.weight
        if sp:
            parallelize_module(inner.norm, tp_mesh, SequenceParallel())
        else:
            _replicated(inner.norm, tp_mesh)
    for i, layer in enumerate(layers):
        plan = {
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        }
        projections = _PROJECTIONS
        if _moe_block(layer, tp_mesh):  # experts not tp-split: the block runs on this rank's tokens
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(seq,), use_local_output=True)
            projections = _PROJECTIONS[:4]
        for path, colwise in projections:
            plan.update(_projection(layer, path, colwise, seq, tp_mesh))
        if sp:
            plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()})
            if i == 0:  # the replicated embedding output → this rank's sequence shard (a local slice)
                _shard_rows_once(layer, tp_mesh)
        else:
            _replicated(layer.input_layernorm, tp_mesh)
            _replicated(layer.post_attention_layernorm, tp_mesh)
        parallelize_module(layer, tp_mesh, plan)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable[name])
    rec = record(model)  # the step's loss and effective.py read it (parallel/record.py)
    rec.tp, rec.sequence_parallel = tp_mesh.size(), sp


def is_tp(model: nn.Module) -> bool:
    """Whether `apply_tp` made `model` (or the model a DDP wrapper holds) tensor-parallel."""
    return applied(model).tp > 1


def tp_degree(model: nn.Module) -> int:
    """The model's tensor-parallel degree (1 for a model `apply_tp` did not touch)."""
    return applied(model).tp


def loss_context(model: nn.Module):
    """`loss_parallel()` for a tensor-parallel model (its logits are vocabulary-sharded: the
    cross-entropy and its backward must both run inside), else a no-op context."""
    return loss_parallel() if is_tp(model) else nullcontext()
