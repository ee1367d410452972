"""What the trainer's pipeline parallelism (parallel.pp > 1) runs with, one line for everything else,
and the one split of the decoder layers over stages (parallel/pp.py builds it, the preflight checks
it). Only combinations measured against a one-process run are allowed (docs/parallelism.md,
"Pipeline parallelism in the trainer"). Imports no torch.
"""
from __future__ import annotations

from shardtune.errors import UserError

# the schedules the trainer runs on gloo (tests/e2e/test_pp.py: loss parity with one process)
PP_SCHEDULES = ("1f1b", "gpipe")
PP_KNOWN_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
PP_STRATEGIES = ("zero3", "zero2")  # FSDP2 per stage; ddp/zero1/hsdp are not verified with a pipeline


def check_pipeline(cfg) -> None:
    """The recipe's pipeline settings (`cfg`: a RunConfig, read by name): the schedule, its
    micro-batches, and every setting not verified with pp > 1, one line naming the key."""
    par, train = cfg.parallel, cfg.train
    if par.pp_schedule not in PP_KNOWN_SCHEDULES:
        raise UserError(f"unknown parallel.pp_schedule {par.pp_schedule!r}; choose one of "
                        f"{', '.join(PP_KNOWN_SCHEDULES)}")
    if par.pp_layers is not None and par.pp == 1:
        raise UserError("parallel.pp_layers splits the layers over pipeline stages: it needs parallel.pp > 1")
    if par.pp == 1:
        return
    if par.pp_schedule not in PP_SCHEDULES:
        raise UserError(f"parallel.pp_schedule {par.pp_schedule!r} does not run in the trainer yet (its "
                        f"multi-stage-per-rank runtime is untested on gloo); use {' or '.join(PP_SCHEDULES)}")
    if par.pp_virtual_stages != 1:
        raise UserError(f"parallel.pp_virtual_stages {par.pp_virtual_stages} needs interleaved-1f1b, which the "
                        "trainer does not run yet; set it to 1")
    if par.pp_schedule == "1f1b" and train.grad_accum < par.pp:
        raise UserError(f"parallel.pp_schedule 1f1b needs at least pp = {par.pp} micro-batches a step, got "
                        f"train.grad_accum {train.grad_accum}: raise train.grad_accum (the micro-batches)")
    lora = cfg.lora
    refused = (
        (par.strategy not in PP_STRATEGIES, "parallel.strategy",
         f"{par.strategy!r} (each stage is FSDP2-sharded: use {' or '.join(PP_STRATEGIES)})"),
        (par.tp > 1, "parallel.tp", f"{par.tp} (set 1)"),
        (par.cp > 1, "parallel.cp", f"{par.cp} (set 1)"),
        (par.precision not in ("fp32", "bf16-mixed"), "parallel.precision",
         f"{par.precision!r} (set fp32 or bf16-mixed)"),
        (par.offload != "none", "parallel.offload", f"{par.offload!r} (set none)"),
        (par.activation_offload, "parallel.activation_offload", "true (set false)"),
        (lora.rank > 0, "lora.rank", f"{lora.rank} (set 0)"),
        (train.objective != "sft", "train.objective", f"{train.objective!r} (set sft)"),
        (train.compile, "train.compile", "true (set false)"),
        (cfg.optim.name != "adamw", "optim.name", f"{cfg.optim.name!r} (set adamw)"),
        (bool(train.sample_prompts), "train.sample_prompts", "(drop them)"),
    )
    for bad, key, value in refused:
        if bad:
            raise UserError(f"parallel.pp {par.pp} does not run with {key} {value} yet: the pipeline is verified "
                            "for full fine-tuning in fp32 (docs/parallelism.md)")


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
