"""The one table of recipe key ↔ planner input (plan.validate.PlanInputs field). Read by
`RunConfig.plan_inputs` (what `shardtune plan RECIPE` and a run's plan.json plan), by `plan --fit`'s
pasteable train line (plan/fit_line.py) and by tests/unit/test_key_table.py, which checks that
every field and key named here exists, that every PlanInputs field is either here or planner-only,
and that `shardtune plan` has an option for each. The trainer's flags (config/flags.py) name their
recipe key, so a flag's planner input is found through this table.

`PLAN_OPTIONS` is `shardtune plan`'s options, one row per planner input, in help order:
plan/commands.py builds the command from these rows, each option's type and default taken from its
PlanInputs field (torchtitan builds its CLI from its config dataclasses the same way). A new planner
input is a PlanInputs field, a row here and, where a recipe sets it, a PLAN_KEYS entry."""
from __future__ import annotations

from dataclasses import dataclass

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
    "lora_target_parameters": "lora.target_parameters",
    "lora_target_modules": "lora.target_modules",
    "loss_chunks": "train.loss_chunks",
    "objective": "train.objective",
    "reference": "train.reference",
    "num_generations": "rl.num_generations",
    "max_new_tokens": "rl.max_new_tokens",
    "rl_beta": "rl.beta",
    "tp": "parallel.tp",
    "sequence_parallel": "parallel.sequence_parallel",
    "tp_across_nodes": "parallel.tp_across_nodes",
    "cp": "parallel.cp",
    "activation_offload": "parallel.activation_offload",
    "ep": "parallel.ep",
    "pp": "parallel.pp",
    "pp_schedule": "parallel.pp_schedule",
    "pp_virtual_stages": "parallel.pp_virtual_stages",
    "pp_layers": "parallel.pp_layers",
}

# PlanInputs fields no recipe key holds: the cluster (a run takes it from torchrun), the planner's
# own options (links, MFU, accounting), and the strategies to compare (a recipe names one)
PLANNER_ONLY = frozenset({
    "gpus", "nodes", "gpus_per_node", "accounting", "params", "reserve_gib", "strategies", "interconnect",
    "intra_node", "nics_per_node", "network_profile", "mfu", "tokens", "host_ram_gib", "moe_imbalance",
})


def read_key(cfg, key: str):
    """The value of dotted `key` in a RunConfig."""
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class PlanOption:
    field: str  # the PlanInputs field it sets (type and default come from there)
    flag: str  # the option as typed; its parameter is the first name, dashes as underscores
    help: str
    metavar: str | None = None  # None for a flag

    @property
    def param(self) -> str:
        return self.flag.split("/")[0].removeprefix("--").replace("-", "_")


_O = PlanOption
# `shardtune plan`'s planner options in help order (the command's own, --list to --fit, are in plan/commands.py)
PLAN_OPTIONS: tuple[PlanOption, ...] = (
    _O("gpus", "--gpus", "Total GPUs (world size).", "N"),
    _O("nodes", "--nodes", "Nodes (default: gpus / gpus-per-node).", "N"),
    _O("gpus_per_node", "--gpus-per-node", "GPUs per node (default min(8, gpus)).", "N"),
    _O("gpu", "--gpu", "GPU catalogue name.", "NAME"),
    _O("seq_len", "--seq-len", "Tokens per sequence.", "TOKENS"),
    _O("micro_batch", "--micro-batch", "Sequences per GPU per forward/backward.", "N"),
    _O("grad_accum", "--grad-accum", "Micro-batches per optimizer step.", "N"),
    _O("precision", "--precision", "bf16-mixed | bf16 | fp32.", "[bf16-mixed|bf16|fp32]"),
    _O("optimizer", "--optimizer", "adamw | sgd | adamw-8bit.", "[adamw|sgd|adamw-8bit]"),
    _O("optimizer_impl", "--optimizer-impl",
       "AdamW kernel: auto (torch's fused AdamW, what the trainer builds; strategies.resolve_optimizer_impl) "
       "| foreach | fused | for-loop | bf16-stochastic; sets the step's temporaries.",
       "[auto|foreach|fused|for-loop|bf16-stochastic]"),
    _O("ac", "--ac", "Activation checkpointing: none | full | op (matmul outputs kept) | layer (every k-th; "
       "old name selective).", "[none|full|op|layer]"),
    _O("ac_every", "--ac-every", "layer AC: checkpoint every k-th layer.", "K"),
    _O("offload", "--offload", "none | optimizer | all (CPU RAM per node is reported).", "[none|optimizer|all]"),
    _O("lora_rank", "--lora-rank", "LoRA rank on the projections --lora-target-modules names (default all attention "
       "and MLP projections; 0: full fine-tune).", "R"),
    _O("lora_target_modules", "--lora-target-modules", "LoRA on these nn.Linear modules only, repeated once per name "
       "(lora.target_modules, e.g. q_proj; default q, k, v, o, gate, up and down projections).", "NAME"),
    _O("lora_target_parameters", "--lora-target-parameters", "LoRA also on these 3-D expert weights, repeated once "
       "per name (lora.target_parameters, e.g. experts.gate_up_proj): r x E x (in + out) each.", "NAME"),
    _O("quantize_base", "--quantize-base", "nf4: the LoRA base in 4-bit NF4 (QLoRA; needs --lora-rank).",
       "[none|nf4]"),
    _O("loss_chunks", "--loss-chunks",
       "Cross-entropy over K token chunks (train.loss_chunks; default 8 above a 32k vocabulary, else 1).", "K"),
    _O("objective", "--objective", "dpo: preference tuning; adds the reference model (memory.reference) and "
       "its forward; grpo: online RL, adds generation's KV cache and gathered weights (memory.kv_cache, "
       "memory.generation_weights) and, with --rl-beta > 0, the reference (train.objective).", "[sft|dpo|grpo]"),
    _O("reference", "--reference", "dpo's reference log-probs: live (a sharded frozen copy; LoRA: the base) or "
       "precompute (computed once, no copy held).", "[live|precompute]"),
    _O("num_generations", "--num-generations", "grpo: completions per prompt (rl.num_generations).", "G"),
    _O("max_new_tokens", "--max-new-tokens", "grpo: the longest completion (rl.max_new_tokens).", "TOKENS"),
    _O("rl_beta", "--rl-beta", "grpo: the KL weight (rl.beta); > 0 holds a frozen reference.", "BETA"),
    _O("accounting", "--accounting", "shardtune (what the trainer holds) | paper (ZeRO §5).", "[shardtune|paper]"),
    _O("hsdp_shard_size", "--hsdp-shard-size", "hsdp: ranks per shard group (default data-parallel ranks "
       "per node: gpus per node / tp).", "N"),
    _O("tp", "--tp", "Tensor-parallel degree inside a node (parallel.tp); FSDP shards over gpus / tp.", "N"),
    _O("sequence_parallel", "--sequence-parallel/--no-sequence-parallel",
       "Sequence parallelism with --tp (parallel.sequence_parallel; default on when tp > 1)."),
    _O("tp_across_nodes", "--tp-across-nodes",
       "Allow a --tp larger than a node (parallel.tp_across_nodes): TP priced on the inter-node link."),
    _O("cp", "--cp", "Context-parallel degree (parallel.cp): each row's sequence split over N ranks "
       "(all-to-all, DeepSpeed-Ulysses); FSDP shards over dp × cp.", "N"),
    _O("activation_offload", "--activation-offload",
       "Saved activations (with --ac full: the layer inputs) in pinned host RAM (parallel.activation_offload); "
       "host RAM per node and PCIe time are reported."),
    _O("ep", "--ep", "Expert-parallel degree (parallel.ep; MoE models): each layer's experts split over N "
       "data-parallel ranks (all-to-all dispatch); experts FSDP-sharded over the shard group / N.", "N"),
    _O("moe_imbalance", "--moe-imbalance", "With --ep: the busiest rank's expert tokens over the balanced count "
       "(1.0: balanced; scales its all-to-all and expert compute).", "FACTOR"),
    _O("pp", "--pp", "Pipeline-parallel degree (parallel.pp): the decoder layers split into N stages, outermost "
       "(across nodes); micro-batches = --grad-accum; the table shows the worst stage (docs/parallelism.md).", "N"),
    _O("pp_schedule", "--pp-schedule", "Pipeline schedule with --pp (parallel.pp_schedule).",
       "[1f1b|gpipe|interleaved-1f1b]"),
    _O("pp_virtual_stages", "--pp-virtual-stages",
       "interleaved-1f1b: stages per pipeline rank (parallel.pp_virtual_stages).", "V"),
    _O("pp_layers", "--pp-layers", "Decoder layers of each stage, repeated once per stage (parallel.pp_layers; "
       "default an even split).", "N"),
    _O("host_ram_gib", "--host-ram", "Host RAM per node for --activation-offload (default 256 GiB per GPU).",
       "GIB"),
    _O("params", "--params", "A bare parameter count (e.g. 7.5e9) instead of MODEL: model states only.", "COUNT"),
    _O("reserve_gib", "--reserve-gib", "GiB kept free per GPU (default 1 GiB + 5 % of the GPU).", "GIB"),
    _O("strategies", "--strategy", "Only these strategies (repeatable).", "[ddp|zero1|zero2|zero3|hsdp]"),
    _O("interconnect", "--interconnect", "Link between nodes: ib-ndr-400, ib-hdr-200, roce-400, efa, "
       "eth-100g, eth-25g, eth-10g (default ib-ndr-400).", "NAME"),
    _O("intra_node", "--intra-node",
       "Link inside a node: nvlink-h100, nvlink-a100, pcie-gen4, pcie-gen5 (default from --gpu).", "NAME"),
    _O("nics_per_node", "--nics-per-node",
       "NICs per node for --interconnect (default: the catalogue's, e.g. 8 for IB, 1 for Ethernet).", "N"),
    _O("network_profile", "--network-profile",
       "Measured profile from `shardtune bench comm -o FILE`, used instead of catalogue bandwidths.", "FILE"),
    _O("mfu", "--mfu", "Achievable MFU of the compute (default per GPU, e.g. 0.40 for H100).", "FRACTION"),
    _O("tokens", "--tokens", "Tokens to train on: report wall-clock days and GPU-hours.", "COUNT"),
)
