"""The shared vocabulary of planner and trainer: strategy, precision, AC and offload names.

One name, one meaning (docs/DESIGN.md, "Strategies"). Imports no torch.
"""
from __future__ import annotations

from shardtune.errors import UserError, suggest

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
# The seed's FSDP1 spellings (torch.distributed.fsdp.ShardingStrategy) and common ZeRO spellings.
STRATEGY_ALIASES = {
    "FULL_SHARD": "zero3",
    "SHARD_GRAD_OP": "zero2",
    "NO_SHARD": "ddp",
    "HYBRID_SHARD": "hsdp",
    "fsdp": "zero3",
}
FSDP_STRATEGIES = ("zero2", "zero3", "hsdp")  # applied with FSDP2 fully_shard

PRECISIONS = ("bf16-mixed", "bf16", "fp32")
AC_MODES = ("none", "full", "selective")
OFFLOAD_MODES = ("none", "optimizer", "all")
OPTIMIZERS = ("adamw", "sgd", "adamw-8bit")
# torch AdamW's kernels; "auto" is torch's own choice (foreach on CUDA, for-loop on CPU)
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "for-loop", "bf16-stochastic")


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


def normalize_precision(name: str) -> str:
    return _pick("precision", name, PRECISIONS, {"bf16_mixed": "bf16-mixed", "mixed": "bf16-mixed",
                                                  "float32": "fp32", "bfloat16": "bf16"})


def normalize_ac(name: str) -> str:
    return _pick("activation checkpointing mode", name, AC_MODES)


def normalize_offload(name: str) -> str:
    return _pick("offload mode", name, OFFLOAD_MODES)


def normalize_optimizer(name: str) -> str:
    return _pick("optimizer", name, OPTIMIZERS)


def normalize_optimizer_impl(name: str) -> str:
    return _pick("optimizer implementation", name, OPTIMIZER_IMPLS)


def resolve_optimizer_impl(impl: str, offload: str, cuda: bool = True) -> str:
    """The kernel `auto` gets: torch's own choice (torch/optim/optimizer.py
    `_default_to_fused_or_foreach`), foreach for CUDA tensors, for-loop for CPU ones (a CPU run,
    or the params that `offload all` keeps on the CPU). Other names stand as given."""
    if impl != "auto":
        return impl
    return "foreach" if cuda and offload != "all" else "for-loop"
