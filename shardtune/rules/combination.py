"""Which option combinations run: `check_combination`, the one rule for `train` (RunConfig calls it
once), `plan` and `plan --fit`, and the strategy's part of tp and cp (FSDP2 only). Imports no torch.
"""
from __future__ import annotations

from shardtune.errors import UserError, positive_int, refuse_first
from shardtune.rules.cp import check_activation_offload, check_cp
from shardtune.rules.ep import check_ep
from shardtune.strategies import (
    FSDP_STRATEGIES,
    STRATEGY,
    Strategy,
    normalize_ac,
    normalize_offload,
    normalize_optimizer,
    normalize_optimizer_impl,
    normalize_precision,
    normalize_strategy,
)


def check_cp_strategy(s: Strategy, cp: int) -> None:
    """The strategy's part of the cp rule (rules.cp.check_cp holds the rest): FSDP shards over dp x cp."""
    if isinstance(cp, int) and cp > 1 and not s.fsdp:
        raise UserError(f"cp {cp} composes with FSDP2 strategies ({', '.join(FSDP_STRATEGIES)}), not {s.name!r} "
                        "(FSDP shards over dp x cp; DDP/ZeroRedundancyOptimizer have no such mesh): "
                        "parallel.strategy / --strategy")


# Modes the planner plans as what-ifs but the trainer does not offer (plan notes say so).
PLANNER_ONLY = {"offload": ("optimizer",), "optimizer": ("sgd",)}
DEVICES = ("cpu", "cuda")


def check_combination(strategy: str | Strategy, *, precision: str = "bf16-mixed", offload: str = "none",
                      optimizer: str = "adamw", optimizer_impl: str = "auto", lora_rank: int = 0,
                      hsdp_shard_size: int | None = None, activation_checkpointing: str = "none",
                      ac_every: int = 2, device: str | None = None, planner_modes: bool = False,
                      quantize_base: str = "none", compile: bool = False,
                      loss_chunks: int | None = None, tp: int = 1, cp: int = 1,
                      activation_offload: bool = False, seq_len: int | None = None,
                      sequence_parallel: bool = True, objective: str = "sft", ep: int = 1,
                      lora_experts: bool = False) -> None:
    """The one rule of which option combinations can run, for `train`, `plan` and `plan --fit`:
    a combination nothing runs is a one-line UserError naming the recipe key and the plan flag.
    `planner_modes`: also accept the planner's what-if modes (PLANNER_ONLY: DeepSpeed's optimizer
    offload, SGD), with the rules they would have. `device` None: any device. It probes nothing on
    this machine (a plan is for any machine): what the run needs installed (torchao, bitsandbytes,
    a C++ compiler) is train/launcher/preflight.py `check_environment`, the launcher's check."""
    s = strategy if isinstance(strategy, Strategy) else STRATEGY[normalize_strategy(strategy)]
    precision, offload = normalize_precision(precision), normalize_offload(offload)
    optimizer, impl = normalize_optimizer(optimizer), normalize_optimizer_impl(optimizer_impl)
    if device is not None and device not in DEVICES:
        raise UserError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if not planner_modes:
        if offload in PLANNER_ONLY["offload"]:
            raise UserError("offload 'optimizer' is a planner-only mode (DeepSpeed's); the trainer offers "
                            "offload 'all' (FSDP2 CPUOffloadPolicy): parallel.offload / --offload all")
        if optimizer in PLANNER_ONLY["optimizer"]:
            raise UserError(f"optimizer {optimizer!r} is a planner-only mode; the trainer runs adamw or "
                            "adamw-8bit (optim.name / --optimizer)")
    if loss_chunks is not None and (isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int)
                                    or loss_chunks < 1):
        raise UserError(f"loss chunks must be a positive integer (or unset: from the vocabulary), got "
                        f"{loss_chunks!r}: train.loss_chunks / --loss-chunks")
    fsdp = ", ".join(FSDP_STRATEGIES)
    if offload == "all" and not s.fsdp:
        raise UserError(f"offload 'all' needs an FSDP strategy ({fsdp}), not {s.name!r} "
                        "(FSDP2 CPUOffloadPolicy; DDP has no offload): parallel.offload / --offload")
    if offload == "optimizer" and not s.shards_optimizer:
        raise UserError(f"offload 'optimizer' (DeepSpeed ZeRO-Offload) needs a ZeRO stage of 1 or more, "
                        f"not {s.name!r}: --offload / --strategy")
    if optimizer == "adamw-8bit" and s.fsdp and precision == "bf16":
        # torchao 0.18's compiled step on bf16 DTensor shards: dynamo's fake copy of the 8-bit state
        # calls view(dtype), which OptimState8bit lacks (measured: shardtune train, step 1 fails)
        raise UserError(f"optimizer 'adamw-8bit' under {s.name} with pure bf16 weights fails in torchao's "
                        "compiled step; use parallel.precision bf16-mixed (--precision bf16-mixed), or "
                        "optim.implementation bf16-stochastic with optim.name adamw")
    if optimizer != "adamw" and impl != "auto":
        raise UserError(f"optimizer implementation {impl!r} applies to torch's AdamW; leave it 'auto' with "
                        f"{optimizer} (optim.implementation / --optimizer-impl)")
    if impl == "bf16-stochastic" and precision != "bf16":
        raise UserError("optimizer implementation 'bf16-stochastic' rounds bf16 weights: it needs "
                        f"parallel.precision bf16 (--precision bf16), not {precision!r}")
    if hsdp_shard_size is not None and not s.hybrid:
        raise UserError(f"hsdp shard size {hsdp_shard_size} applies to hsdp only, not {s.name!r}: "
                        "drop parallel.hsdp_shard_size / --hsdp-shard-size, or use strategy hsdp")
    if hsdp_shard_size is not None and (not isinstance(hsdp_shard_size, int) or hsdp_shard_size < 1):
        raise UserError(f"hsdp shard size {hsdp_shard_size!r} is not a positive integer")
    if not isinstance(ac_every, int) or ac_every < 1:
        raise UserError(f"ac_every {ac_every!r} is not a positive integer (parallel.ac_every / --ac-every)")
    ac = normalize_ac(activation_checkpointing)
    if ac_every != 2 and ac != "layer":
        raise UserError(f"parallel.ac_every {ac_every} applies to activation_checkpointing=layer only and would "
                        f"be ignored with {ac!r}; drop it or set parallel.activation_checkpointing=layer "
                        "(--ac-every / --ac layer)")
    if not isinstance(lora_rank, int) or lora_rank < 0:
        raise UserError(f"lora rank {lora_rank!r} is not a non-negative integer (lora.rank / --lora-rank)")
    if quantize_base not in ("none", "nf4"):
        raise UserError(f"unknown quantize_base {quantize_base!r}; choose none or nf4 "
                        "(lora.quantize_base / --quantize-base)")
    if quantize_base != "none" and lora_rank == 0:
        raise UserError(f"quantize_base {quantize_base!r} freezes the base in 4 bits: it needs LoRA adapters "
                        "(lora.rank / --lora-rank > 0)")
    _check_tp_combination(s, tp, quantize_base=quantize_base, loss_chunks=loss_chunks)
    check_cp_strategy(s, cp)
    check_cp(cp, tp=tp, seq_len=seq_len, sequence_parallel=sequence_parallel,
             quantize_base=quantize_base)  # rules/cp.py: heads and world are the layout's (preflight)
    check_activation_offload(activation_offload, compile=compile, objective=objective, offload=offload)
    check_ep(s, ep, tp=tp, cp=cp, lora_rank=lora_rank, lora_experts=lora_experts,  # rules/ep.py; the model's
             quantize_base=quantize_base)  # part: Layout.check_model


def _check_tp_combination(s: Strategy, tp: int, *, quantize_base: str, loss_chunks: int | None) -> None:
    """What tensor parallelism (parallel.tp > 1) does not compose with yet, one line each."""
    if positive_int(tp, "tensor-parallel degree", "parallel.tp / --tp") == 1:
        return
    refused = (
        (not s.fsdp, f"strategy {s.name!r} (DDP/ZeroRedundancyOptimizer take no DTensor params); use "
                     f"{', '.join(FSDP_STRATEGIES)}: parallel.strategy / --strategy"),
        (quantize_base != "none", f"QLoRA's NF4 base (lora.quantize_base {quantize_base}: NF4 tensors are not "
                                  "split by DTensor): lora.quantize_base none, or parallel.tp 1"),
        (loss_chunks is not None and loss_chunks > 1,
         f"train.loss_chunks {loss_chunks} (under tp the loss is vocabulary-parallel, loss_parallel: the full "
         "logits never exist on one rank): leave train.loss_chunks unset or 1"),
    )
    refuse_first(f"parallel.tp {tp} does not compose with", refused)
