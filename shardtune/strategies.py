"""The shared vocabulary of planner and trainer: what each strategy is, and which options combine.

One name, one meaning (docs/DESIGN.md, "Strategies"): `STRATEGY[name]` says what a strategy shards,
how torch applies it and on which mesh; a strategy on a world of ranks is layout.py's `Layout`.
Planner, config, launch checks, parallel/ and the trainer all read these. Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.cp_rules import check_activation_offload, check_cp
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
    mesh_axes: tuple[str, ...]  # ("dp",) or HSDP's ("replicate", "shard")

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
    2k-1, ... instead); none → []. The trainer wraps these (parallel/apply.py), the planner counts them."""
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


def check_cp_strategy(s: Strategy, cp: int) -> None:
    """The strategy's part of the cp rule (cp_rules.check_cp holds the rest): FSDP shards over dp x cp."""
    if isinstance(cp, int) and cp > 1 and not s.fsdp:
        raise UserError(f"cp {cp} composes with FSDP2 strategies ({', '.join(FSDP_STRATEGIES)}), not {s.name!r} "
                        "(FSDP shards over dp x cp; DDP/ZeroRedundancyOptimizer have no such mesh): "
                        "parallel.strategy / --strategy")


def check_tp_model(tp: int, hf: dict, seq_len: int | None = None, sequence_parallel: bool = True) -> None:
    """tp divides what it splits (attention and KV heads, the MLP's intermediate size, the
    vocabulary: no padding is done) and, with sequence parallelism, the sequence length; a
    model with tied embeddings is refused (the embedding and the head would each shard their
    own copy of the one weight). `hf`: the model's config.json values;
    `seq_len` None: not checked."""
    if tp == 1:
        return
    for key, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
                      ("intermediate_size", "the MLP's intermediate size"), ("vocab_size", "the vocabulary")):
        n = hf.get(key, hf.get("num_attention_heads") if key == "num_key_value_heads" else None)
        if n is not None and n % tp:
            raise UserError(f"tp {tp} does not divide {what} ({key} {n}; no padding is done): choose a tp "
                            f"that divides {n} (parallel.tp / --tp)")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise UserError(f"sequence parallelism splits train.seq_len {seq_len} over tp {tp}: make it a multiple "
                        f"of {tp}, or parallel.sequence_parallel=false")


# Modes the planner plans as what-ifs but the trainer does not offer (plan notes say so).
PLANNER_ONLY = {"offload": ("optimizer",), "optimizer": ("sgd",)}
DEVICES = ("cpu", "cuda")


def check_combination(strategy: str | Strategy, *, precision: str = "bf16-mixed", offload: str = "none",
                      optimizer: str = "adamw", optimizer_impl: str = "auto", lora_rank: int = 0,
                      hsdp_shard_size: int | None = None, activation_checkpointing: str = "none",
                      ac_every: int = 2, device: str | None = None, planner_modes: bool = False,
                      quantize_base: str = "none", compile: bool = False,
                      loss_chunks: int | None = None, tp: int = 1, cp: int = 1,
                      activation_offload: bool = False) -> None:
    """The one rule of which option combinations can run, for `train`, `plan` and `plan --fit`:
    a combination nothing runs is a one-line UserError naming the recipe key and the plan flag.
    `planner_modes`: also accept the planner's what-if modes (PLANNER_ONLY: DeepSpeed's optimizer
    offload, SGD), with the rules they would have. `device` None: any device. It probes nothing on
    this machine (a plan is for any machine): what the run needs installed (torchao, bitsandbytes,
    a C++ compiler) is train/launcher/preflight.py `check_environment`, the launcher's check."""
    s = strategy if isinstance(strategy, Strategy) else STRATEGY[normalize_strategy(strategy)]
    precision, offload = normalize_precision(precision), normalize_offload(offload)
    optimizer, impl = normalize_optimizer(optimizer), normalize_optimizer_impl(optimizer_impl)
    normalize_ac(activation_checkpointing)
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
    check_cp(cp, tp=tp, quantize_base=quantize_base)  # cp_rules.py: the heads, world and seq_len parts where known
    check_activation_offload(activation_offload, compile=compile, offload=offload)


def _check_tp_combination(s: Strategy, tp: int, *, quantize_base: str, loss_chunks: int | None) -> None:
    """What tensor parallelism (parallel.tp > 1) does not compose with yet, one line each."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UserError(f"tensor-parallel degree {tp!r} is not a positive integer (parallel.tp / --tp)")
    if tp == 1:
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
    for bad, what in refused:
        if bad:
            raise UserError(f"parallel.tp {tp} does not compose with {what}")
