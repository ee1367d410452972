"""What a rank actually runs, not what the recipe asked: memory.json's `"effective"` and the
start-up line. The techniques parallel/ applied come from its record (parallel/record.py, written as
each is applied); the rest is read back from the built objects (the parameters' meshes and dtypes,
the optimizer, StepOptions, torch's thread count): docs/DESIGN.md "What ran" lists which is which.
Keys are the recipe's names where one exists (docs/loop.md "What ran"). tests/e2e/test_effective.py
compares them with the recipe and with plan.json's inputs, so a setting the trainer drops shows.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardtune.parallel.pp import pipeline_of, schedule_name, whole_model_layers
from shardtune.parallel.record import applied
from shardtune.train.core.moe import num_experts
from shardtune.train.core.qlora import is_nf4
from shardtune.train.core.step import StepOptions

_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers in order, also once sharded (fully_shard renames the class
    FSDP<name>: match the class HF's `_no_split_modules` names anywhere in the MRO)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def activation_checkpointing(model: nn.Module) -> tuple[str, list[int]]:
    """(AC mode as the recipe names it, the checkpointed decoder layers' indices), from parallel/'s
    record: "full" when every layer is checkpointed, "layer" when some are (parallel/ac.py)."""
    rec = applied(model)
    # a pipeline stage's (parallel/pp.py): the model's indices, every stage's (collective over pp)
    ckpt, every = (whole_model_layers(model, x) for x in (rec.ac_layers, list(range(len(decoder_layers(model))))))
    if not ckpt:
        return "none", []
    if rec.ac == "op":
        return "op", ckpt
    return ("full" if len(ckpt) == len(every) else "layer"), ckpt


def _mesh_dim(model: nn.Module, names: tuple[str, ...]) -> int | None:
    """The size of the parameters' mesh dimension named one of `names` (None: no such dimension)."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    for i, name in enumerate(getattr(mesh, "mesh_dim_names", None) or ()):
        if name in names:
            return mesh.size(i)
    return None


def _strategy(model: nn.Module, optimizer) -> str:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "zero1" if hasattr(optimizer, "optim") else "ddp"  # ZeroRedundancyOptimizer
    if not isinstance(model, FSDPModule):
        return "none"
    if _mesh_dim(model, ("dp_replicate",)) is not None:  # read back: the parameters' mesh
        return "hsdp"
    return "zero3" if applied(model).reshard_after_forward else "zero2"


def optimizer_name(optimizer) -> str:
    """"adamw (torch, fused)", "adamw-8bit (torchao)", "adamw-8bit (bitsandbytes)",
    "adamw (shardtune, bf16-stochastic)": the class that steps, and its kernel."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    cls = type(inner)
    if cls.__module__.startswith("torchao"):
        return "adamw-8bit (torchao)"
    if cls.__module__.startswith("bitsandbytes"):
        return "adamw-8bit (bitsandbytes)"
    if cls.__name__ == "AdamWStochasticBF16":
        return "adamw (shardtune, bf16-stochastic)"
    group = inner.param_groups[0]
    kernel = "fused" if group.get("fused") else "foreach" if group.get("foreach") else (
        "for-loop" if group.get("foreach") is False else "torch default")
    return f"adamw (torch, {kernel})"


def _lora(hf: nn.Module) -> dict:
    """LoRA as PEFT's layers hold it: rank, alpha (scaling × rank), dropout, the adapted modules and
    the adapted 3-D parameters (PEFT's ParamWrapper: `<module>.<parameter_name>`, wrappers of one
    module nest as `base_layer`)."""
    layers = {name: m for name, m in hf.named_modules() if hasattr(m, "lora_A") and hasattr(m, "scaling")}
    if not layers:
        return {"lora_rank": 0, "lora_alpha": None, "lora_dropout": None, "lora_target_modules": [],
                "lora_target_parameters": []}
    m = next(iter(layers.values()))
    rank = int(m.r["default"])
    owner = lambda name: [p for p in name.split(".") if p != "base_layer"][-1]  # noqa: E731
    return {"lora_rank": rank, "lora_alpha": float(m.scaling["default"]) * rank,
            "lora_dropout": float(getattr(m.lora_dropout["default"], "p", 0.0)),
            "lora_target_modules": sorted({owner(n) for n, m in layers.items() if not hasattr(m, "parameter_name")}),
            "lora_target_parameters": sorted({f"{owner(n)}.{m.parameter_name}" for n, m in layers.items()
                                              if hasattr(m, "parameter_name")})}


def _hyper(optimizer) -> dict:
    """The optimizer's own hyperparameters (peak lr: the scheduler's `initial_lr`)."""
    group = getattr(optimizer, "optim", optimizer).param_groups[0]
    lr = group.get("initial_lr", group["lr"])
    return {"lr": float(lr), "betas": [float(b) for b in group["betas"]], "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"])}


def _dtypes(model: nn.Module, opts: StepOptions) -> tuple[str, str, str]:
    """(precision as the recipe names it, master dtype of the trained params, compute dtype)."""
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    master = "/".join(sorted(_DTYPE.get(d, str(d)) for d in trained)) or "none"
    rec = applied(model)
    if rec.fsdp:  # FSDP casts inside fully_shard, as its MixedPrecisionPolicy says
        compute = rec.param_dtype or next(iter(trained), torch.float32)
    else:
        compute = opts.autocast_dtype or next(iter(trained), torch.float32)
    compute_name = _DTYPE.get(compute, str(compute))
    if master == "float32":
        precision = "fp32" if compute == torch.float32 else "bf16-mixed"
    else:
        precision = "bf16" if master == "bfloat16" else master
    return precision, master, compute_name


def effective_settings(model: nn.Module, optimizer, opts: StepOptions, world_size: int, objective=None) -> dict:
    """What this rank runs (memory.json "effective"); `model` as the loop holds it (DDP-wrapped or not),
    `objective` the loop's objective object (grpo's: its settings, `_rl`)."""
    hf = getattr(model, "module", model)
    ac, ac_layers = activation_checkpointing(hf)
    precision, master, compute = _dtypes(hf, opts)
    rec = applied(hf)  # what parallel/ applied (parallel/record.py)
    strategy = _strategy(model, optimizer)
    tp, sequence_parallel = rec.tp, rec.sequence_parallel
    return {
        "strategy": strategy, "world_size": world_size,
        "hsdp_shard_size": (_mesh_dim(model, ("dp_shard",)) or _mesh_dim(model, ("dp_shard_cp",))
                            // rec.cp) if strategy == "hsdp" else None,  # cp: FSDP's dim is dp_shard x cp
        "tp": int(tp), "sequence_parallel": bool(sequence_parallel) if tp > 1 else None,
        "cp": rec.cp, "activation_offload": opts.activation_offload,
        "precision": precision, "master_dtype": master, "compute_dtype": compute,
        "autocast_dtype": _DTYPE.get(opts.autocast_dtype) if opts.autocast_dtype else None,
        "activation_checkpointing": ac, "ac_layers": ac_layers,
        "offload": rec.offload, "compile": rec.compile,
        "loss_chunks": opts.loss_chunks, "grad_clip": opts.grad_clip, "skip_non_finite": opts.skip_non_finite,
        "objective": opts.objective, "dpo_beta": opts.dpo_beta, "dpo_label_smoothing": opts.dpo_label_smoothing,
        "simpo_gamma": opts.simpo_gamma,
        "optimizer": optimizer_name(optimizer), **_hyper(optimizer), **_lora(hf),
        "quantize_base": "nf4" if any(is_nf4(p) for p in hf.parameters()) else "none",
        "threads": torch.get_num_threads(), **_experts(hf), **_pipeline(hf), **_rl(objective),
    }


RL_KEYS = ("rl_loss", "num_generations", "max_new_tokens", "temperature", "top_p", "rl_beta", "epsilon",
           "epsilon_high", "scale_rewards", "iterations", "rewards")


def _rl(objective) -> dict:
    """grpo's settings as its objective (train/core/grpo.py GRPO) runs them: the clip's upper bound and
    the reward scaling resolved, each built reward function's label and weight; None for the others."""
    rl = getattr(objective, "rl", None)
    if rl is None:
        return dict.fromkeys(RL_KEYS)
    rewards = objective.rewards
    return {"rl_loss": rl.loss, "num_generations": rl.num_generations, "max_new_tokens": rl.max_new_tokens,
            "temperature": rl.temperature, "top_p": rl.top_p, "rl_beta": rl.beta, "epsilon": rl.epsilon,
            "epsilon_high": rl.clip_high, "scale_rewards": rl.scales_rewards, "iterations": rl.iterations,
            "rewards": [[label, w] for label, w in zip(rewards.labels, rewards.weights, strict=True)]}


def _pipeline(hf: nn.Module) -> dict:
    """Pipeline parallelism as built (parallel/pp.py): stages, the schedule's class, layers per stage."""
    pipe = pipeline_of(hf)
    if pipe is None:
        return {"pp": 1, "pp_schedule": None, "pp_layers": None}
    return {"pp": pipe.span.num_stages, "pp_schedule": schedule_name(pipe), "pp_layers": list(pipe.span.layers)}


def _experts(hf: nn.Module) -> dict:
    """The expert-parallel degree (1 without it; parallel/ep.py marks the split experts); MoE only: the
    experts' implementation as transformers runs them, experts per layer, top-k, and the ranks one
    expert's states are sharded over (expert_fsdp: the experts' own FSDP mesh, else the layer's)."""
    split = next((m for m in hf.modules() if hasattr(m, "ep_degree")), None)
    ep = applied(hf).ep  # parallel/ep.py apply_ep's record
    if not num_experts(hf.config):
        return {"ep": ep}
    weight = split.gate_up_proj if split is not None else next(
        (p for n, p in hf.named_parameters() if n.endswith("experts.gate_up_proj")), None)
    mesh = getattr(weight, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    shard = [mesh.size(i) for i, n in enumerate(names) if n not in ("dp_replicate", "tp")]
    return {"ep": ep, "expert_fsdp": shard[0] if shard else 1,
            "experts_implementation": hf.config._experts_implementation, "num_experts": num_experts(hf.config),
            "experts_per_token": int(hf.config.num_experts_per_tok)}


def describe(eff: dict) -> str:
    """The start-up line's form of `effective_settings`."""
    ac = eff["activation_checkpointing"] + (f" (layers {eff['ac_layers']})" if eff["ac_layers"] else "")
    lora = f"LoRA rank {eff['lora_rank']}" + (" on an nf4 base" if eff["quantize_base"] == "nf4" else "") \
        if eff["lora_rank"] else "LoRA off"
    extra = (f"pp {eff['pp']} ({eff['pp_schedule']}, layers {eff['pp_layers']}), " if eff.get("pp", 1) > 1 else "") + (
        f"tp {eff['tp']}{' + SP' if eff.get('sequence_parallel') else ''}, " if eff.get("tp", 1) > 1 else "") + (
        f"cp {eff['cp']}, " if eff.get("cp", 1) > 1 else "") + (
        "activation offload on, " if eff.get("activation_offload") else "") + (
        f"experts {eff['experts_implementation']} ({eff['num_experts']} per layer, top-{eff['experts_per_token']}"
        f"{', ep ' + str(eff['ep']) if eff.get('ep', 1) > 1 else ''}, expert_fsdp {eff.get('expert_fsdp', 1)}), "
        if eff.get("num_experts") else "")
    return (f"{eff['strategy']}, {eff['precision']} (master {eff['master_dtype']}, compute {eff['compute_dtype']}, "
            f"autocast {eff['autocast_dtype'] or 'off'}), AC {ac}, offload {eff['offload']}, {extra}"
            f"compile {'on' if eff['compile'] else 'off'}, loss_chunks {eff['loss_chunks']}, "
            f"objective {eff['objective']}, "
            f"optimizer {eff['optimizer']}, grad_clip {eff['grad_clip']}, {lora}, threads {eff['threads']}")
