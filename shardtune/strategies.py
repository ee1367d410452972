"""The shared vocabulary of planner and trainer: what each strategy is, and the names of every option.

One name, one meaning (docs/DESIGN.md, "Strategies"): `STRATEGY[name]` says what a strategy shards,
how torch applies it and on which mesh; a strategy on a world of ranks is layout.py's `Layout`; which
options run together is rules/combination.py's. Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.errors import UserError, suggest


@dataclass(frozen=True)
class Strategy:
    """What one strategy holds sharded at rest and how the trainer applies it."""

    name: str
    zero_stage: int  # the ZeRO paper's stage (1: optimizer, 2: + grads, 3: + params; hsdp: 3)
    shards_optimizer: bool  # optimizer states split over the shard group
    shards_grads: bool  # grads at rest split over the shard group
    shards_params: bool  # params at rest split (FSDP2 zero2 too: gathered only forward → backward)
    fsdp: bool  # FSDP2 `fully_shard` per decoder layer and root (else DDP around the model)
    reshard_after_forward: bool  # FSDP2: free the gathered params after forward (zero3, hsdp)
    materialise_before_wrap: bool  # DDP broadcasts rank 0's params when built: fill them first
    mesh_axes: tuple[str, ...]  # FSDP's mesh: 1-D ("dp",) or HSDP's 2-D (replicate, shard) (parallel/mesh.py)

    @property
    def partitions_optimizer(self) -> bool:
        """Optimizer states split, params and grads whole (zero1: ZeroRedundancyOptimizer)."""
        return self.shards_optimizer and not self.shards_grads

    @property
    def hybrid(self) -> bool:
        """Sharded inside a group, replicated across groups (a 2-D mesh)."""
        return len(self.mesh_axes) == 2


_DDP_LIKE = dict(fsdp=False, reshard_after_forward=False, materialise_before_wrap=True, mesh_axes=("dp",))
_FSDP = dict(shards_optimizer=True, shards_grads=True, shards_params=True, fsdp=True,
             materialise_before_wrap=False)
STRATEGY: dict[str, Strategy] = {s.name: s for s in (
    Strategy("ddp", 0, shards_optimizer=False, shards_grads=False, shards_params=False, **_DDP_LIKE),
    # torch.distributed.optim.ZeroRedundancyOptimizer around the optimizer, DDP around the model
    Strategy("zero1", 1, shards_optimizer=True, shards_grads=False, shards_params=False, **_DDP_LIKE),
    Strategy("zero2", 2, reshard_after_forward=False, mesh_axes=("dp",), **_FSDP),
    Strategy("zero3", 3, reshard_after_forward=True, mesh_axes=("dp",), **_FSDP),
    Strategy("hsdp", 3, reshard_after_forward=True, mesh_axes=("replicate", "shard"), **_FSDP),
)}
STRATEGIES = tuple(STRATEGY)
FSDP_STRATEGIES = tuple(s.name for s in STRATEGY.values() if s.fsdp)  # applied with FSDP2 fully_shard
# The seed's FSDP1 spellings (torch.distributed.fsdp.ShardingStrategy) and common ZeRO spellings.
STRATEGY_ALIASES = {
    "FULL_SHARD": "zero3",
    "SHARD_GRAD_OP": "zero2",
    "NO_SHARD": "ddp",
    "HYBRID_SHARD": "hsdp",
    "fsdp": "zero3",
}

PRECISIONS = ("bf16-mixed", "bf16", "fp32")
# none | full (every decoder layer recomputed) | op (every layer, matmul outputs kept: torch's
# selective checkpoint, docs/ac.md) | layer (every `ac_every`-th layer, full recompute)
AC_MODES = ("none", "full", "op", "layer")
AC_ALIASES = {"selective": "layer"}  # the old name of `layer` (before op AC), still accepted
OFFLOAD_MODES = ("none", "optimizer", "all")
OPTIMIZERS = ("adamw", "sgd", "adamw-8bit")
IGNORE_INDEX = -100  # a label no loss counts (HF's and torch cross_entropy's convention): data, loss and cp pad
# torch AdamW's kernels; "auto" is the fused kernel (resolve_optimizer_impl)
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "for-loop", "bf16-stochastic")
# The nn.Linear modules of a Llama-style layer that get LoRA adapters by default (PEFT names):
# the planner's model_shapes and the trainer's lora.target_modules share this list.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pick(kind: str, value: str, choices, aliases: dict | None = None) -> str:
    v = str(value).strip()
    if aliases:
        for k, target in aliases.items():
            if v == k or v.upper() == k.upper() or v.endswith("." + k):  # ShardingStrategy.FULL_SHARD
                return target
    if v.lower() in choices:
        return v.lower()
    names = list(choices) + list(aliases or {})
    raise UserError(f"unknown {kind} {value!r}{suggest(v, names)}; choose one of {', '.join(choices)}")


def normalize_strategy(name: str) -> str:
    """Canonical strategy name; accepts the FSDP1 aliases (FULL_SHARD → zero3, ...)."""
    return _pick("strategy", name, STRATEGIES, STRATEGY_ALIASES)


def strategy(name: str) -> Strategy:
    """The record of a strategy name (aliases accepted)."""
    return STRATEGY[normalize_strategy(name)]


def normalize_precision(name: str) -> str:
    return _pick("precision", name, PRECISIONS, {"bf16_mixed": "bf16-mixed", "mixed": "bf16-mixed",
                                                  "float32": "fp32", "bfloat16": "bf16"})


def autocasts(strategy_name: str, precision: str) -> bool:
    """The one autocast rule: bf16-mixed under ddp/zero1 runs an fp32 model under torch.autocast
    (bf16); FSDP strategies cast inside fully_shard (MixedPrecisionPolicy) instead."""
    return precision == "bf16-mixed" and not STRATEGY[normalize_strategy(strategy_name)].fsdp


def checkpointed_layers(num_layers: int, mode: str, every: int = 2) -> list[int]:
    """The one AC layer rule: which decoder layers recompute (part of) their activations. full and
    op → all; layer → every k-th, layers 0, k, 2k, ... (⌈L/k⌉; torchtitan's `ac_freq` picks k-1,
    2k-1, ... instead); none → []. The trainer wraps these (parallel/ac.py), the planner counts them."""
    mode = AC_ALIASES.get(mode, mode)
    if mode in ("full", "op"):
        return list(range(num_layers))
    if mode == "layer":
        return list(range(0, num_layers, max(1, every)))
    return []


def normalize_ac(name: str) -> str:
    """Canonical AC mode; `selective` (this project's old name of every-k-th-layer AC) → layer."""
    return _pick("activation checkpointing mode", name, AC_MODES, AC_ALIASES)


def normalize_offload(name: str) -> str:
    return _pick("offload mode", name, OFFLOAD_MODES)


def normalize_optimizer(name: str) -> str:
    return _pick("optimizer", name, OPTIMIZERS)


def normalize_optimizer_impl(name: str) -> str:
    return _pick("optimizer implementation", name, OPTIMIZER_IMPLS)


def resolve_optimizer_impl(impl: str) -> str:
    """The one meaning of `optim.implementation: auto`: torch's fused AdamW, which torch 2.13 has
    for CUDA and CPU tensors (so also for the params `offload all` keeps on the CPU), plain and
    DTensor; torch's own default would be foreach on CUDA, for-loop on CPU
    (`_default_to_fused_or_foreach`), slower and with temporaries (docs/qlora.md "Fused AdamW by
    default"). The trainer builds it, the planner and plan.json plan it. Other names stand."""
    if impl != "auto":
        return impl
    return "fused"
