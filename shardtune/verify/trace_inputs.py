"""Which planner inputs the fake-tensor trace (verify/simulate.py) runs, and what it refuses. Imports no torch.

The trace takes the planner's inputs (plan.validate.PlanInputs) and builds the trainer's RunConfig from
them through config/plan_keys.py `PLAN_KEYS` (`trace_recipe`): every field in `TRACED` sets its recipe
key, so a planner input with a recipe key reaches the traced trainer without a hand edit. The other
PLAN_KEYS fields are in `NOT_TRACED`, each with why; `untraceable_reason` refuses what the trace cannot
run (first match of `REFUSALS`), and fails closed: a NOT_TRACED field at a value other than its default,
that no refusal named, is refused too. tests/unit/test_key_table.py checks that every PLAN_KEYS field is
in exactly one of the two, that each traced one reaches the RunConfig and that each untraced one is
refused where it acts.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, fields

from shardtune.config.plan_keys import PLAN_KEYS
from shardtune.plan.validate import PlanInputs
from shardtune.rules.preference import holds_reference
from shardtune.strategies import STRATEGY

_DEFAULT = PlanInputs()


def _set(field: str) -> Callable[[PlanInputs, str], bool]:
    """Refuses when `field` is not its PlanInputs default."""
    return lambda inp, _strategy: getattr(inp, field) != getattr(_DEFAULT, field)


@dataclass(frozen=True)
class Refusal:
    refuses: Callable[[PlanInputs, str], bool]  # (resolved inputs, strategy) → the trace cannot run them
    reason: str  # one line; {field} is the input's value


# What the trace cannot run, in the order the reason is chosen (first match)
REFUSALS: tuple[Refusal, ...] = (
    Refusal(_set("pp"), "the fake-tensor trace runs one FSDP step of the whole model, not a pipeline stage's schedule "
            "(pp > 1: its micro-batches in flight and P2P are the planner's, plan/pipeline.py)"),
    Refusal(_set("cp"), "the fake-tensor trace does not run context parallelism (cp > 1)"),
    Refusal(_set("activation_offload"), "the fake-tensor trace does not run activation offload"),
    Refusal(_set("ep"), "the fake-tensor trace does not run expert parallelism (its all-to-all splits are the routed "
            "counts, values fake tensors do not hold: verify/moe_fake.py)"),
    Refusal(lambda inp, _s: inp.objective == "grpo", "the fake-tensor trace does not run grpo's generation and step"),
    Refusal(lambda inp, _s: inp.params is not None, "--params gives no architecture to build"),
    Refusal(lambda inp, s: holds_reference(inp.objective, inp.reference, inp.lora_rank) and not STRATEGY[s].fsdp,
            "dpo's frozen reference copy under ddp/zero1: torch's MemTracker hooks the gradient of every "
            "parameter a forward uses and fails on frozen ones"),
    Refusal(_set("offload"), "offload {offload} moves shards to host memory, which one fake CPU device cannot "
            "separate"),
    Refusal(_set("lora_rank"), "LoRA: torch's memory trackers hook every parameter's gradient and fail on frozen base "
            "weights"),
    Refusal(lambda inp, _s: inp.optimizer != "adamw", "optimizer {optimizer}: the trace builds torch's AdamW only "
            "(adamw-8bit's states are torchao's or bitsandbytes' kernels)"),
)

# PLAN_KEYS fields whose recipe key the trace sets from the inputs (`trace_recipe`); parallel.hsdp_shard_size
# under hsdp only, the key the other strategies refuse
TRACED = frozenset({
    "model", "gpu", "seq_len", "micro_batch", "grad_accum", "precision", "optimizer", "optimizer_impl", "ac",
    "ac_every", "hsdp_shard_size", "loss_chunks", "objective", "reference", "tp", "sequence_parallel",
    "tp_across_nodes",
})
# the other PLAN_KEYS fields: why the trace leaves each out (refused off its default, or it acts only
# where another input is refused)
NOT_TRACED: dict[str, str] = {
    "offload": "refused unless none: one fake CPU device holds GPU and host memory alike",
    "lora_rank": "refused unless 0: the memory trackers fail on frozen base weights",
    "quantize_base": "acts with lora_rank > 0 only (the planner refuses it without), which is refused",
    "lora_target_parameters": "acts with lora_rank > 0 only (the planner refuses it without), which is refused",
    "lora_target_modules": "acts with lora_rank > 0 only, which is refused",
    "num_generations": "acts under objective grpo only (the rl section), which is refused",
    "max_new_tokens": "acts under objective grpo only (the rl section), which is refused",
    "rl_beta": "acts under objective grpo only (the rl section), which is refused",
    "cp": "refused unless 1: the trace does not run context parallelism",
    "activation_offload": "refused unless false: the trace does not run activation offload",
    "ep": "refused unless 1: all-to-all splits are routed counts, values fake tensors do not hold",
    "pp": "refused unless 1: the trace runs one step of the whole model, not a stage's schedule",
    "pp_schedule": "acts with pp > 1 only, which is refused",
    "pp_virtual_stages": "acts with pp > 1 only, which is refused",
    "pp_layers": "acts with pp > 1 only (the planner refuses it without), which is refused",
}
# those whose why starts "acts" act only under another input's refused value; the rest are refused off default
_ACTS_UNDER = frozenset(field for field, why in NOT_TRACED.items() if why.startswith("acts "))


def untraceable_reason(inputs: PlanInputs, strategy: str) -> str | None:
    """Why the trace cannot run `strategy` with these (validated) planner inputs; None: it can."""
    values = {f.name: getattr(inputs, f.name) for f in fields(PlanInputs)}
    for refusal in REFUSALS:
        if refusal.refuses(inputs, strategy):
            return refusal.reason.format(**values)
    for field in NOT_TRACED:  # fail closed: an untraced input no refusal names
        if field not in _ACTS_UNDER and values[field] != getattr(_DEFAULT, field):
            return f"{field} {values[field]!r} is not traced ({NOT_TRACED[field]})"
    return None


def trace_recipe(inputs: PlanInputs, strategy: str, model_file: str) -> dict:
    """The recipe (nested dict, as a YAML recipe reads) of the run the trace builds: each TRACED input at
    its PLAN_KEYS key, `strategy`, and `model_file` (the model spec as a path ModelConfig takes)."""
    recipe: dict = {}
    for field in sorted(TRACED):
        value = model_file if field == "model" else getattr(inputs, field)
        if field == "hsdp_shard_size" and not STRATEGY[strategy].hybrid:
            value = None  # the planner's resolved shard group is hsdp's; other strategies take none
        *path, leaf = PLAN_KEYS[field].split(".")
        node = recipe
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    recipe["parallel"]["strategy"] = strategy
    return recipe


def mark_untraced(result) -> bool:
    """Mark each strategy of a `PlanResult` the trace cannot run ("analytic fallback" and the reason, one
    stderr line per reason); True when none is left to trace. Torch is imported only to trace the rest."""
    inputs = PlanInputs(**result.inputs)  # validated already: the plan's own
    reasons: dict[str, list[str]] = {}
    for sp in result.strategies:
        reason = None if sp.simulated is not None else untraceable_reason(inputs, sp.name)
        if reason:
            sp.simulated = {"status": "analytic fallback", "reason": reason}
            reasons.setdefault(reason, []).append(sp.name)
    for reason, names in reasons.items():  # one line each (print, not rich: no wrapping)
        print(f"shardtune: --simulate cannot trace {', '.join(names)}: {reason}; "
              "showing the analytic plan (marked 'analytic')", file=sys.stderr)
    return all(sp.simulated is not None for sp in result.strategies)
