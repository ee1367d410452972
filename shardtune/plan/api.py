"""`plan(...)`: per-strategy memory, fit and communication for a model on a GPU cluster.

The Python form of `shardtune plan`; `PlanResult.to_dict()` is its `--json` output and the run
folder's plan.json. Each strategy is planned by strategy_plan.py (`plan_strategy`), which the
verdict's re-plans share. Pure Python: imports no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shardtune.catalog.gpus import resolve_gpu
from shardtune.errors import UserError
from shardtune.layout import Layout
from shardtune.plan import comm
from shardtune.plan import cp as cpp
from shardtune.plan.model import _load_model, _Model
from shardtune.plan.preference import reference_disk
from shardtune.plan.strategy_plan import (
    GIB,
    StrategyPlan,
    combination_error,
    default_reserve_bytes,
    plan_strategy,
)
from shardtune.plan.timing import add_timing
from shardtune.plan.tp import check_tp_arch
from shardtune.plan.validate import PlanInputs, plan_layout, resolve_inputs
from shardtune.plan.verdict import comm_bound, suggest, verdict
from shardtune.rules.ep import check_ep_model
from shardtune.rules.pipeline import settings_gap
from shardtune.strategies import STRATEGIES


@dataclass
class PlanResult:
    """The plan: model, hardware, inputs, one `StrategyPlan` per applicable strategy, a verdict."""

    model: dict
    hardware: dict
    inputs: dict
    accounting: str
    strategies: list[StrategyPlan]
    verdict: str
    notes: list[str] = field(default_factory=list)
    disk: dict = field(default_factory=dict)  # dpo precompute: the reference cache (plan/preference.py)
    layout: Layout | None = None  # the trainer's Layout of the inputs (validate.plan_layout): the degrees

    def strategy(self, name: str) -> StrategyPlan:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "planner": "shardtune.plan", "accounting": self.accounting, "model": self.model,
            "hardware": self.hardware, "inputs": self.inputs,
            "strategies": [s.to_dict() for s in self.strategies],
            "verdict": self.verdict, "notes": self.notes, **({"disk": self.disk} if self.disk else {}),
            **self._pipeline(),
        }

    def _pipeline(self) -> dict:
        """--pp: the degrees, the schedule and its bubble (every strategy's), and the stages of the first
        strategy that fits (else the first): each strategy's own are under strategies[i].stages."""
        piped = [s for s in self.strategies if s.pipeline]
        if not piped:
            return {}
        shown = next((s for s in piped if s.fits), piped[0])
        lay = self.layout
        return {"layout": {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp},
                "pipeline": {k: v for k, v in shown.pipeline.items() if k != "worst_stage"},
                "stages_of": shown.name, "stages": [dict(st) for st in shown.stages]}


def _applicable(inp: PlanInputs) -> tuple[list[str], list[str]]:
    """The strategies to plan and a note on those omitted. A strategy the user named that cannot
    run with these options is a UserError, and so is every strategy failing: never an empty plan."""
    names = inp.strategies or list(STRATEGIES)
    errors = {s: combination_error(inp, s) for s in names}
    bad = [s for s in names if errors[s]]
    if bad and (inp.strategies or len(bad) == len(names)):
        raise errors[bad[0]]
    omitted = []
    if bad and inp.offload == "all" and all("offload 'all'" in str(errors[s]) for s in bad):
        omitted.append("offload all applies to FSDP strategies only (FSDP2 CPUOffloadPolicy); ddp and zero1 omitted")
    elif bad:
        omitted.append(f"{', '.join(bad)} omitted: {errors[bad[0]]}")
    return [s for s in names if not errors[s]], omitted


def plan(inputs: PlanInputs | None = None, gpus: int | None = None, /, **fields) -> PlanResult:
    """Plan every applicable strategy: `plan(PlanInputs(model=..., gpus=...))`. The keyword form
    `plan(model, gpus, **fields)` (fields: PlanInputs names) builds the same PlanInputs. The model
    is a catalogue name, config.json, model folder or an HF config dict."""
    inp = resolve_inputs(inputs, gpus, fields)
    gpu = resolve_gpu(inp.gpu)
    reserve = default_reserve_bytes(gpu) if inp.reserve_gib is None else round(inp.reserve_gib * GIB)
    if reserve >= gpu.memory_bytes:
        raise UserError(f"--reserve-gib {inp.reserve_gib} leaves nothing of the {gpu.name}'s "
                        f"{gpu.memory_bytes / GIB:.1f} GiB; give a smaller reserve")
    usable = gpu.memory_bytes - reserve
    m = _load_model(inp.model, inp.params, inp.lora_rank, inp.quantize_base, inp.lora_target_parameters,
                    inp.lora_target_modules)
    if m.arch is not None:
        check_tp_arch(m.arch, m.config, inp.tp, inp.ep)
    if inp.accounting != "paper":
        cpp.check_cp_arch(m.arch, m.config, inp.cp, inp.tp)
    check_ep_model(inp.ep, m.config)  # a MoE model whose experts per layer ep divides (rules/ep.py)
    names, omitted = _applicable(inp)
    plans = [plan_strategy(m, s, inp, usable) for s in names]
    ddp_bytes = comm.bytes_per_step(comm.collectives(
        "ddp", num_params=m.num_params, trainable_params=m.trainable, world_size=inp.gpus, shard_degree=1,
        precision=inp.precision, shapes=m.shapes, accounting=inp.accounting), inp.grad_accum)
    for p in plans:
        p.comm_ratio_to_ddp = round(p.comm_bytes_per_step / ddp_bytes, 4) if ddp_bytes else None
        if not p.fits:
            p.suggestion = suggest(m, p, inp, usable)
    notes = _notes(m, inp, omitted) + _past_context(m, inp)
    result = PlanResult(
        model={"name": m.name, "source": m.source, "params": m.num_params,
               "trainable_params": m.trainable, "active_params": m.active,
               "architecture": asdict(m.arch) if m.arch else None,
               # MoE: total and active (per token) parameters under their issue-39 names; dense plans unchanged
               **({"params_total": m.num_params, "params_active": m.active}
                  if m.arch is not None and m.arch.num_experts else {})},
        hardware={"gpu": gpu.name, "gpu_memory_bytes": gpu.memory_bytes, "reserve_bytes": reserve,
                  "usable_bytes": usable, "gpus": inp.gpus, "nodes": inp.nodes,
                  "gpus_per_node": inp.gpus_per_node, "bf16_flops": gpu.bf16_flops, "source": gpu.source},
        inputs=inp.to_dict(), accounting=inp.accounting, strategies=plans,
        verdict=verdict(plans, usable), notes=notes, disk=reference_disk(inp.objective, inp.reference),
        layout=plan_layout(inp),
    )
    add_timing(result, m.arch, inp, gpu, **inp.timing_options())  # step time, tokens/s, MFU (plan/timing.py)
    for s in [s for s in plans if "generation_time_s" in s.timing][:1]:  # grpo: the same on every strategy
        result.notes.append(f"grpo: generation takes {s.timing['generation_time_s']:.3g} s of {s.name}'s "
                            f"{s.timing['step_time_s']:.3g} s step (generation_time_s, docs/rl.md)")
    result.verdict += comm_bound(m, plans, inp, usable, gpu)  # a fit that waits on the network, and its lever
    return result


def _past_context(m: _Model, inp: PlanInputs) -> list[str]:
    """One warning when seq_len exceeds the model's trained context (config.json
    max_position_embeddings): the plan holds, the model may not (RoPE positions it never saw)."""
    trained = (m.config or {}).get("max_position_embeddings")
    if not isinstance(trained, int) or inp.seq_len <= trained:
        return []
    return [f"warning: seq_len {inp.seq_len} is past {m.name}'s trained context (max_position_embeddings "
            f"{trained}); planned, but the model needs RoPE scaling"]


def _notes(m: _Model, inp: PlanInputs, omitted: list[str]) -> list[str]:
    notes = []
    if m.shapes is None:
        notes.append("model states only (--params): no activations, buffers or FSDP padding")
    if inp.accounting == "paper":
        notes.append("ZeRO paper accounting (Rajbhandari et al. 2020 §5): model states 2Ψ + 2Ψ + KΨ; "
                     "no buffers or temporaries")
    if inp.offload == "optimizer":
        notes.append("offload optimizer is a planner-only mode (DeepSpeed ZeRO-Offload); "
                     "the trainer offers offload all (FSDP2 CPUOffloadPolicy)")
    notes += omitted
    if inp.ep > 1:
        e = m.arch.num_experts
        notes.append(f"ep {inp.ep}: each rank keeps {e // inp.ep} of the {e} experts a layer, FSDP-sharded "
                     "over shard / ep ranks (layout.expert_fsdp); tokens reach them by all-to-all "
                     f"(comm.all_to_all), priced exposed; busiest rank at {inp.moe_imbalance:g}x its share "
                     "(--moe-imbalance)")
    if inp.pp > 1 and (gap := settings_gap(inp.pp, "zero3", inp)):
        notes.append(f"planned only: {gap}")
    if inp.lora_rank:
        notes.append(f"LoRA rank {inp.lora_rank}: only the adapters carry grads and optimizer states")
    if inp.objective == "dpo":
        notes.append("dpo: memory.reference is the frozen reference copy (0: LoRA's base with adapters off, or "
                     "precomputed); a pair's chosen + rejected share one seq_len row (docs/dpo.md)")
        if disk := reference_disk(inp.objective, inp.reference):
            notes.append(f"dpo precompute: the reference log-prob cache takes {disk['reference_cache_bytes']} bytes "
                         f"on disk: {disk['reference_cache_bytes_per_1k_pairs'] / 1024:.1f} KiB per 1k pairs")
    if inp.objective == "grpo":
        notes.append("grpo: generation holds the gathered model (memory.generation_weights) and one prompt's KV "
                     f"cache for {inp.num_generations} completions of up to seq_len + {inp.max_new_tokens} tokens "
                     "(memory.kv_cache); total is the larger of that peak and training's; the step time includes "
                     "generation's (generation_time_s: decode memory-bound at the GPU's HBM bandwidth, every "
                     "completion at its full length)"
                     + ("; memory.reference: the frozen reference (rl.beta > 0)" if inp.rl_beta and not inp.lora_rank
                        else "; the reference: the base with the LoRA adapters off" if inp.rl_beta else "")
                     + " (docs/rl.md)")
    return notes
