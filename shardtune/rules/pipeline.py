"""Pipeline parallelism's rules (parallel.pp, pp_schedule, pp_virtual_stages, pp_layers), torch-free:
`check_pp_schedule` what any pipeline needs (plan/validate.py, launch/checks.py and the trainer's
`check_pipeline` call it, so they refuse alike); `check_pipeline` what the trainer's pipeline runs
with, one line for everything else (only combinations measured against a one-process run:
docs/parallelism.md, "Pipeline parallelism in the trainer"); `stage_layer_counts` the one split of
the decoder layers over stages (parallel/pp.py builds it, the preflight checks it). Where the stages
sit is layout.check_pp_placement's."""
from __future__ import annotations

from types import SimpleNamespace

from shardtune.errors import UserError

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


def check_pp_schedule(pp: int, schedule: str, virtual_stages: int, microbatches: int) -> None:
    """A known schedule; virtual stages with interleaved-1f1b only (2 or more); at least pp
    micro-batches (train.grad_accum) for the 1F1B schedules (torch's Schedule1F1B refuses fewer)."""
    if schedule not in SCHEDULES:
        raise UserError(f"parallel.pp_schedule {schedule!r} (--pp-schedule) is not one of {', '.join(SCHEDULES)}")
    if pp == 1:
        return
    if (schedule == "interleaved-1f1b") != (virtual_stages > 1):
        raise UserError(f"parallel.pp_schedule {schedule} with pp_virtual_stages {virtual_stages} "
                        "(--pp-virtual-stages): interleaved-1f1b takes 2 or more virtual stages per rank, the "
                        "others exactly 1")
    if schedule != "gpipe" and microbatches < pp:
        raise UserError(f"train.grad_accum {microbatches} micro-batches (--grad-accum) < pp {pp}: {schedule} needs "
                        f"at least one micro-batch per stage (torch's Schedule1F1B refuses fewer); give a grad_accum "
                        f">= {pp}")


# the schedules the trainer runs on gloo (tests/e2e/test_pp.py: loss parity with one process)
PP_SCHEDULES = ("1f1b", "gpipe")
PP_STRATEGIES = ("zero3", "zero2")  # FSDP2 per stage; ddp/zero1/hsdp are not verified with a pipeline


def pipeline_gap(pp: int, *, strategy: str, schedule: str = "1f1b", cp: int = 1,
                 precision: str = "fp32", offload: str = "none", activation_offload: bool = False,
                 lora_rank: int = 0, objective: str = "sft", compile: bool = False, optimizer: str = "adamw",
                 sample_prompts: bool = False) -> str | None:
    """The first setting the trainer's pipeline does not run yet, as one line naming the key (None:
    it runs, or pp 1). The planner plans such layouts and says this line beside them."""
    if pp == 1:
        return None
    refused = (
        (schedule not in PP_SCHEDULES, "parallel.pp_schedule",
         f"{schedule!r} (its multi-stage-per-rank runtime is untested on gloo: use {' or '.join(PP_SCHEDULES)})"),
        (strategy not in PP_STRATEGIES, "parallel.strategy",
         f"{strategy!r} (each stage is FSDP2-sharded: use {' or '.join(PP_STRATEGIES)})"),
        (cp > 1, "parallel.cp", f"{cp} (set 1)"),
        (precision not in ("fp32", "bf16-mixed", "bf16"), "parallel.precision", f"{precision!r} (set fp32 or bf16)"),
        (offload != "none", "parallel.offload", f"{offload!r} (set none)"),
        (activation_offload, "parallel.activation_offload", "true (set false)"),
        (lora_rank > 0, "lora.rank", f"{lora_rank} (set 0)"),
        (objective != "sft", "train.objective", f"{objective!r} (set sft)"),
        (compile, "train.compile", "true (set false)"),
        (optimizer != "adamw", "optim.name", f"{optimizer!r} (set adamw)"),
        (sample_prompts, "train.sample_prompts", "(drop them)"),
    )
    for bad, key, value in refused:
        if bad:
            return (f"parallel.pp {pp} does not run with {key} {value} in the trainer yet: its pipeline is verified "
                    "for full fine-tuning in fp32, bf16-mixed and bf16, with tp, AC, validation and checkpoints "
                    "(docs/parallelism.md)")
    return None


# pipeline_gap's settings by the planner's names (plan/validate.py PlanInputs) → its keyword arguments
GAP_SETTINGS = {"pp_schedule": "schedule", "cp": "cp", "precision": "precision", "offload": "offload",
                "activation_offload": "activation_offload", "lora_rank": "lora_rank", "objective": "objective",
                "optimizer": "optimizer"}


def settings_gap(pp: int, strategy: str, *sources, **more) -> str | None:
    """`pipeline_gap` of the settings (GAP_SETTINGS) read by name from the first of `sources` holding
    each: a plan's inputs; a --fit candidate, then the inputs; a recipe's sections (`recipe_pipeline_gap`)."""
    return pipeline_gap(pp, strategy=strategy, **more, **{
        arg: getattr(next(s for s in sources if hasattr(s, name)), name) for name, arg in GAP_SETTINGS.items()})


def check_pipeline(cfg) -> None:
    """What the trainer's pipeline runs with (`cfg`: a RunConfig, read by name), one line naming the
    key: the trainer's preflight (every rank's too) and `shardtune launch` call it; `RunConfig` checks
    only the schedule (`check_pp_schedule`), so `shardtune plan` plans what the trainer cannot run yet
    and says so (`pipeline_gap`)."""
    if gap := recipe_pipeline_gap(cfg):
        raise UserError(gap)


def recipe_pipeline_gap(cfg, pp: int | None = None) -> str | None:
    """`pipeline_gap` of a RunConfig's settings at `pp` (None: the recipe's)."""
    par, train = cfg.parallel, cfg.train
    rest = SimpleNamespace(lora_rank=cfg.lora.rank, objective=train.objective, optimizer=cfg.optim.name)
    return settings_gap(par.pp if pp is None else pp, par.strategy, rest, par, compile=train.compile,
                        sample_prompts=bool(train.sample_prompts))


def stage_layer_counts(num_layers: int, pp: int, pp_layers: list[int] | None) -> list[int]:
    """Decoder layers per stage: `pp_layers` as given (checked), or an even split."""
    if pp_layers is not None:
        if len(pp_layers) != pp or any(not isinstance(n, int) or n < 1 for n in pp_layers):
            raise UserError(f"parallel.pp_layers {pp_layers} must give {pp} positive layer counts (one per stage)")
        if sum(pp_layers) != num_layers:
            raise UserError(f"parallel.pp_layers {pp_layers} sums to {sum(pp_layers)}, not the model's "
                            f"{num_layers} decoder layers")
        return list(pp_layers)
    if num_layers % pp:
        raise UserError(f"parallel.pp {pp} does not divide the model's {num_layers} decoder layers; choose a "
                        "divisor or give parallel.pp_layers (layers per stage, summing to "
                        f"{num_layers})")
    return [num_layers // pp] * pp


def check_pipeline_model(pp: int, pp_layers: list[int] | None, hf: dict) -> None:
    """What the model must be for its layers to split over `pp` stages (`hf`: config.json values)."""
    if pp == 1:
        return
    stage_layer_counts(int(hf.get("num_hidden_layers") or 0), pp, pp_layers)
    if hf.get("tie_word_embeddings"):
        raise UserError(f"parallel.pp {pp}: the model ties its embedding and LM head, which would live on the "
                        "first and the last stage; the pipeline runs untied models only")
    if any(k in hf for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise UserError(f"parallel.pp {pp} does not run mixture-of-experts models yet")
