"""The one table of recipe key ↔ planner input (plan.validate.PlanInputs field). Read by
`RunConfig.plan_inputs` (what `shardtune plan RECIPE` and a run's plan.json plan), by `plan --fit`'s
pasteable train line (plan/fit_commands.py) and by tests/unit/test_key_table.py, which checks that
every field and key named here exists, that every PlanInputs field is either here or planner-only,
and that `shardtune plan` has an option for each. The trainer's flags (config/flags.py) name their
recipe key, so a flag's planner input is found through this table."""
from __future__ import annotations

# PlanInputs field → the recipe key it is read from (model: `model.plan_name()`, the folder or its architecture)
PLAN_KEYS: dict[str, str] = {
    "model": "model.name",
    "gpu": "train.gpu",
    "seq_len": "train.seq_len",
    "micro_batch": "train.micro_batch",
    "grad_accum": "train.grad_accum",
    "precision": "parallel.precision",
    "optimizer": "optim.name",
    "optimizer_impl": "optim.implementation",
    "ac": "parallel.activation_checkpointing",
    "ac_every": "parallel.ac_every",
    "offload": "parallel.offload",
    "hsdp_shard_size": "parallel.hsdp_shard_size",
    "lora_rank": "lora.rank",
    "quantize_base": "lora.quantize_base",
    "loss_chunks": "train.loss_chunks",
    "objective": "train.objective",
    "reference": "train.reference",
    "tp": "parallel.tp",
    "sequence_parallel": "parallel.sequence_parallel",
    "tp_across_nodes": "parallel.tp_across_nodes",
    "cp": "parallel.cp",
    "activation_offload": "parallel.activation_offload",
}

# PlanInputs fields no recipe key holds: the cluster (a run takes it from torchrun), the planner's
# own options (links, MFU, accounting), and the strategies to compare (a recipe names one)
PLANNER_ONLY = frozenset({
    "gpus", "nodes", "gpus_per_node", "accounting", "params", "reserve_gib", "strategies", "interconnect",
    "intra_node", "nics_per_node", "network_profile", "mfu", "tokens", "host_ram_gib",
})


def read_key(cfg, key: str):
    """The value of dotted `key` in a RunConfig."""
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
