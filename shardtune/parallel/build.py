"""The one build of a parallel model, for the trainer (train/core/model.py) and the simulator
(verify/simulate.py), and the optimizer as the strategy holds it.

The model comes in built on the meta device (LoRA adapters already injected, so each decoder
layer's adapters shard with it), and `fill` writes its values: parallel/ needs no transformers,
PEFT or checkpoint knowledge, and the simulator passes no fill (values do not change memory).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardtune.parallel.ac import apply_activation_checkpointing
from shardtune.parallel.cp import apply_cp
from shardtune.parallel.ep import apply_ep, expert_modules, mark_routing
from shardtune.parallel.fsdp import apply_ddp, apply_fsdp, apply_precision
from shardtune.parallel.layers import decoder_layers
from shardtune.parallel.mesh import cp_mesh, sub_mesh, tp_mesh
from shardtune.parallel.pp import apply_pp
from shardtune.parallel.record import record
from shardtune.parallel.tp import apply_tp
from shardtune.strategies import STRATEGY

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardtune.config import ParallelConfig


def build_parallel_model(meta_model: nn.Module, parallel_cfg: ParallelConfig, mesh: DeviceMesh,
                         device: torch.device | str, fill: Callable[[nn.Module], None] | None = None,
                         compile: bool = False, quantize: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """The model to train: `meta_model` itself for FSDP strategies (sharded in place), a DDP wrapper
    for ddp/zero1. `fill(model)` gets the materialised (sharded) model, before any DDP wrap.
    `compile` (train.compile): each decoder layer's training forward torch.compile'd (`apply_compile`)."""
    s = STRATEGY[parallel_cfg.strategy]
    # Order, and why. 1. Precision once, first: FSDP then shards the stored (bf16) storage and DDP
    # buckets bf16 grads. 2. Activation checkpointing before sharding: FSDP's pre/post-forward hooks
    # then wrap the checkpointed region, so the recompute in backward re-gathers the parameters
    # (torchtitan's order: TP → AC → compile → FSDP). 3. Compile inside the checkpointed region
    # (`apply_compile`: AC's and FSDP's hooks stay eager around the compiled forward). 4. FSDP
    # strategies shard on meta, then materialise (`to_empty`: each rank allocates its shard only;
    # on the CPU under offload all, where CPUOffloadPolicy keeps the shards, as torchtitan does)
    # and fill. ddp/zero1 (`materialise_before_wrap`): DDP broadcasts rank 0's parameters when
    # built, so materialise and fill first and wrap last.
    if sub_mesh(mesh, "pp") is not None:  # pipeline: this rank's stage only, before anything is applied
        apply_pp(meta_model, sub_mesh(mesh, "pp"), parallel_cfg.pp_layers)
    apply_precision(meta_model, parallel_cfg)
    if tp_mesh(mesh) is not None:  # TP first (torchtitan's order TP → AC → compile → FSDP): FSDP shards DTensors
        apply_tp(meta_model, tp_mesh(mesh), parallel_cfg.sequence_parallel)
    if cp_mesh(mesh) is not None:  # context parallelism: the all-to-all attention (parallel/cp.py)
        apply_cp(meta_model, cp_mesh(mesh), parallel_cfg.tp, parallel_cfg.sequence_parallel)
    if (ep := sub_mesh(mesh, "ep")) is not None:  # expert parallelism: E/ep experts a rank (parallel/ep.py)
        apply_ep(meta_model, ep.get_group())
    if (tp_mesh(mesh) is not None or cp_mesh(mesh) is not None) and expert_modules(meta_model):  # own tokens
        mark_routing(meta_model, tp_mesh(mesh).get_group() if tp_mesh(mesh) is not None else None)
    if quantize is not None:  # QLoRA (helper D, train/core/qlora.py): NF4 base after precision, before shard
        quantize(meta_model)
    apply_activation_checkpointing(meta_model, parallel_cfg.activation_checkpointing, parallel_cfg.ac_every)
    if compile:
        apply_compile(meta_model)
    if s.materialise_before_wrap:
        meta_model.to_empty(device=device)
        # to_empty gives lm_head and embed_tokens storages of their own; without re-tying, a tied
        # model (Llama-3.2-1B, Qwen2.5, SmolLM2) trains two copies under ddp/zero1
        meta_model.tie_weights()
        if fill is not None:
            fill(meta_model)
        return apply_ddp(meta_model, mesh)
    apply_fsdp(meta_model, parallel_cfg, mesh)
    meta_model.to_empty(device="cpu" if parallel_cfg.offload == "all" else device)
    if fill is not None:
        fill(meta_model)
    return meta_model


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder layer's forward (docs/compile.md), in place: parameter names and
    state-dict keys stay HF's (no `_orig_mod.` wrapper). Static shapes (`dynamic=False`: training
    batches are always (micro_batch, seq_len)), one graph per layer (`fullgraph=True`), shared by all
    layers. Only forwards that record autograd (training, and AC's recompute) run compiled;
    no-grad forwards (validation, its (1, 2) dummy batch, sample generation) run eager, so their
    shapes never trigger a recompile. The hooks stay outside the compiled code: FSDP2's all-gather
    and the activation-checkpoint context run eager around it."""
    # transformers >= 5.25 routes attention through the `kernels` package, whose forward wrapper
    # sets and resets a module-level variable: a side effect dynamo refuses inside op AC's
    # checkpoint region (fullgraph). It is undone within the same forward, so not replaying it in
    # the recompute changes nothing; torch names this switch in its own error message.
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in decoder_layers(model):
        eager = layer.forward  # bound before fully_shard, which swaps the class but keeps forward
        compiled = torch.compile(eager, dynamic=False, fullgraph=True)

        def forward(*args, _eager=eager, _compiled=compiled, **kwargs):
            return (_compiled if torch.is_grad_enabled() else _eager)(*args, **kwargs)

        layer.forward = forward
    record(model).compile = True


def build_strategy_optimizer(parallel_cfg: ParallelConfig, optimizer_class: type[torch.optim.Optimizer],
                             params: list[torch.Tensor], dp_group=None, **kwargs) -> torch.optim.Optimizer:
    """`optimizer_class(params, **kwargs)` as the strategy holds its states: zero1 (states sharded,
    params whole) wraps it in ZeroRedundancyOptimizer over `dp_group`; FSDP strategies' states
    follow their sharded DTensor params already; ddp keeps them whole."""
    if STRATEGY[parallel_cfg.strategy].partitions_optimizer:
        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=dp_group, **kwargs)
    return optimizer_class(params, **kwargs)
