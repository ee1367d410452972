"""The planner's inputs with their defaults, and the checks that turn bad ones into UserErrors.

Defaults live here, in one place; `shardtune plan` and `shardtune.plan.plan()` share them.
Imports no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dc_fields

from shardtune.errors import UserError
from shardtune.layout import Layout, check_placement
from shardtune.plan.preference import check_objective
from shardtune.rules.cp import check_cp
from shardtune.rules.lora import check_lora_targets
from shardtune.rules.pipeline import check_pp_schedule
from shardtune.strategies import (
    LORA_TARGETS,
    STRATEGY,
    normalize_ac,
    normalize_offload,
    normalize_optimizer,
    normalize_optimizer_impl,
    normalize_precision,
    normalize_strategy,
)

ACCOUNTINGS = ("shardtune", "paper")
MAX_GPUS = 1_000_000
MAX_PARAMS = 1e14  # 100 T parameters
MAX_SEQ_LEN = 10_000_000
MAX_MICRO_BATCH = 100_000


# step-time options (plan/timing.py `timing_context` checks them); not part of plan.json's "inputs"
TIMING_OPTIONS = ("interconnect", "intra_node", "network_profile", "mfu", "tokens", "nics_per_node")


@dataclass
class PlanInputs:
    """Everything a plan depends on (names as in the CLI flags); `plan(PlanInputs(...))`."""

    model: object = None  # catalogue name, config.json, model folder or HF config dict
    gpus: int = 8  # total GPUs (world size)
    gpu: str = "h100-80gb"
    nodes: int | None = None  # default: gpus / gpus_per_node
    gpus_per_node: int | None = None  # default: gpus / nodes, or min(8, gpus)
    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    optimizer_impl: str = "auto"  # torch AdamW's kernel; auto: fused (strategies.resolve_optimizer_impl)
    ac: str = "none"
    ac_every: int = 2  # selective AC: every k-th decoder layer
    offload: str = "none"
    lora_rank: int = 0
    quantize_base: str = "none"  # lora.quantize_base: nf4 stores the LoRA base in 4 bits (QLoRA)
    lora_target_parameters: list[str] | None = None  # lora.target_parameters: LoRA on 3-D expert weights
    lora_target_modules: list[str] | None = None  # lora.target_modules; None: strategies.LORA_TARGETS
    loss_chunks: int | None = None  # train.loss_chunks; default: rules/loss.py (8 above a 32k vocabulary)
    objective: str = "sft"  # train.objective: dpo holds a reference model (plan/preference.py)
    reference: str = "live"  # train.reference: live | precompute
    num_generations: int = 8  # rl.num_generations: grpo's completions per prompt (plan/rl.py: memory.kv_cache)
    max_new_tokens: int = 64  # rl.max_new_tokens: grpo's longest completion
    rl_beta: float = 0.0  # rl.beta: grpo holds a reference when > 0
    accounting: str = "shardtune"
    hsdp_shard_size: int | None = None  # default: data-parallel ranks per node (gpus_per_node / tp)
    tp: int = 1  # parallel.tp: tensor-parallel degree, inside a node (plan/tp.py)
    sequence_parallel: bool | None = None  # parallel.sequence_parallel; default: on when tp > 1
    tp_across_nodes: bool = False  # parallel.tp_across_nodes: a TP group over several nodes' links
    cp: int = 1  # parallel.cp: context-parallel degree (the sequence split over cp ranks)
    activation_offload: bool = False  # parallel.activation_offload: saved activations in pinned host RAM
    ep: int = 1  # parallel.ep: expert-parallel degree (MoE; plan/ep.py), borrows data-parallel ranks
    moe_imbalance: float = 1.0  # the busiest ep rank's expert tokens / the balanced count (plan/ep.py)
    pp: int = 1  # parallel.pp: pipeline stages, outermost (plan/pipeline.py)
    pp_schedule: str = "1f1b"  # parallel.pp_schedule: 1f1b | gpipe | interleaved-1f1b
    pp_virtual_stages: int = 1  # parallel.pp_virtual_stages: stages per pipeline rank (interleaved-1f1b)
    pp_layers: list[int] | None = None  # parallel.pp_layers: decoder layers per stage (None: even)
    host_ram_gib: float | None = None  # host RAM per node for offload (default plan/cp.py: 256 GiB a GPU)
    params: float | None = None  # a bare parameter count instead of a model
    reserve_gib: float | None = None  # default: planner.api.default_reserve_bytes
    strategies: list[str] | None = None  # default: all that apply
    interconnect: str | None = None  # link between nodes (default ib-ndr-400)
    intra_node: str | None = None  # link inside a node (default from the GPU)
    nics_per_node: int | None = None  # default: the interconnect's
    network_profile: str | None = None  # `shardtune bench comm -o FILE`, instead of catalogue links
    mfu: float | None = None  # achievable MFU of the compute (default per GPU)
    tokens: float | None = None  # tokens to train on: wall-clock days and GPU-hours

    def to_dict(self) -> dict:
        """The plan.json "inputs": every field but the model and the timing options."""
        d = asdict(self)
        for k in ("model", *TIMING_OPTIONS):
            d.pop(k)
        return d

    def timing_options(self) -> dict:
        return {k: getattr(self, k) for k in TIMING_OPTIONS}


def resolve_inputs(inputs=None, gpus: int | None = None, fields: dict | None = None) -> PlanInputs:
    """Validated PlanInputs from `plan(PlanInputs(...))` or from the keyword form
    `plan(model, gpus, **fields)` (fields: PlanInputs names; an unknown one is a UserError)."""
    fields = dict(fields or {})
    if isinstance(inputs, PlanInputs):
        if gpus is not None or fields:
            raise TypeError("give a PlanInputs or keyword fields, not both")
        fields = {f.name: getattr(inputs, f.name) for f in dc_fields(PlanInputs)}
    else:
        if inputs is not None:
            fields["model"] = inputs
        if gpus is not None:
            fields["gpus"] = gpus
    return validate_inputs(**fields)


def _int_in(name: str, value, lo: int, hi: int) -> int:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise UserError(f"{flag} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise UserError(f"{flag} {value} is out of range; give {lo} to {hi:,}")
    return int(value)


def validate_inputs(**kw) -> PlanInputs:
    """Checked, normalised `Inputs`; a bad value is a one-line UserError naming the flag."""
    known = {f.name for f in dc_fields(PlanInputs)}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise UserError(f"unknown plan option {unknown[0]!r}; known: {', '.join(sorted(known))}")
    inp = PlanInputs(**{k: v for k, v in kw.items() if v is not None or k in ("model",)})
    if inp.model is None and inp.params is None:
        raise UserError("give a MODEL (catalogue name, config.json or model folder) or --params N")
    if inp.model is not None and inp.params is not None:
        raise UserError("give either a MODEL or --params, not both")
    if inp.params is not None:
        if not isinstance(inp.params, (int, float)) or not 1 <= inp.params <= MAX_PARAMS:
            raise UserError(f"--params {inp.params!r} is out of range; give a count such as 7.5e9 (at most 1e14)")
        if inp.lora_rank:
            raise UserError("--lora-rank needs a model architecture; give a MODEL instead of --params")
    inp.gpus = _int_in("gpus", inp.gpus, 1, MAX_GPUS)
    inp.seq_len = _int_in("seq_len", inp.seq_len, 1, MAX_SEQ_LEN)
    inp.micro_batch = _int_in("micro_batch", inp.micro_batch, 1, MAX_MICRO_BATCH)
    inp.grad_accum = _int_in("grad_accum", inp.grad_accum, 1, 1_000_000)
    inp.ac_every = _int_in("ac_every", inp.ac_every, 1, 100_000)
    inp.lora_rank = _int_in("lora_rank", inp.lora_rank, 0, 65_536)
    inp.lora_target_parameters = [str(t) for t in inp.lora_target_parameters or []] or None  # unrepeated: []
    inp.lora_target_modules = [str(t) for t in inp.lora_target_modules or []] or None  # unrepeated: the default
    check_lora_targets(inp.lora_rank, inp.lora_target_modules or LORA_TARGETS, inp.lora_target_parameters or ())
    if not inp.lora_rank:  # what a full fine-tune adapts: nothing (plan.json as the rank's effective line says)
        inp.lora_target_modules = None
    if inp.loss_chunks is not None:
        inp.loss_chunks = _int_in("loss_chunks", inp.loss_chunks, 1, 1_000_000)
    inp.tp = _int_in("tp", inp.tp, 1, MAX_GPUS)
    inp.num_generations = _int_in("num-generations", inp.num_generations, 2, 4096)
    inp.max_new_tokens = _int_in("max-new-tokens", inp.max_new_tokens, 1, 1_000_000)
    if isinstance(inp.rl_beta, bool) or not isinstance(inp.rl_beta, (int, float)) or not 0 <= inp.rl_beta < 1e6:
        raise UserError(f"--rl-beta {inp.rl_beta!r} must be a number >= 0")
    inp.cp = _int_in("cp", inp.cp, 1, MAX_GPUS)
    inp.ep = _int_in("ep", inp.ep, 1, MAX_GPUS)
    if isinstance(inp.moe_imbalance, bool) or not isinstance(inp.moe_imbalance, (int, float)) or not (
            1.0 <= inp.moe_imbalance <= 1000.0):
        raise UserError(f"--moe-imbalance {inp.moe_imbalance!r} must be a number from 1.0 (balanced routing) up; "
                        "the busiest expert-parallel rank's tokens over the balanced count")
    inp.moe_imbalance = float(inp.moe_imbalance)
    if inp.ep > 1 and inp.params is not None:
        raise UserError("--ep needs a mixture-of-experts architecture; give a MODEL instead of --params")
    if (inp.gpus // inp.tp) % inp.ep:  # per strategy: ep divides its dp_shard x cp (strategy_plan, layout.py)
        raise UserError(f"--ep {inp.ep} does not divide the {inp.gpus // inp.tp} data-parallel ranks (gpus / tp): "
                        "expert parallelism borrows them; give an ep that divides them")
    if not isinstance(inp.activation_offload, bool):
        raise UserError(f"--activation-offload must be true or false, got {inp.activation_offload!r}")
    if inp.host_ram_gib is not None and not (isinstance(inp.host_ram_gib, (int, float)) and 0 < inp.host_ram_gib < 1e9):
        raise UserError(f"--host-ram {inp.host_ram_gib!r} must be a positive number of GiB per node")
    _layout(inp)
    _pipeline(inp)
    inp.precision = normalize_precision(inp.precision)
    inp.optimizer = normalize_optimizer(inp.optimizer)
    inp.optimizer_impl = normalize_optimizer_impl(inp.optimizer_impl)
    inp.ac = normalize_ac(inp.ac)
    inp.offload = normalize_offload(inp.offload)
    check_objective(inp.objective, inp.reference)
    if inp.accounting not in ACCOUNTINGS:
        raise UserError(f"unknown accounting {inp.accounting!r}; choose one of {', '.join(ACCOUNTINGS)}")
    if inp.strategies is not None:
        inp.strategies = list(dict.fromkeys(normalize_strategy(s) for s in inp.strategies))
    if inp.reserve_gib is not None and not (isinstance(inp.reserve_gib, (int, float)) and 0 <= inp.reserve_gib < 1e6):
        raise UserError(f"--reserve-gib {inp.reserve_gib!r} must be a non-negative number of GiB")
    return inp


def _layout(inp: PlanInputs) -> None:
    """nodes × gpus_per_node = gpus, a TP degree inside a node, and an HSDP shard size that
    divides the data-parallel world (gpus / tp)."""
    n = inp.gpus
    if inp.nodes is not None:
        inp.nodes = _int_in("nodes", inp.nodes, 1, MAX_GPUS)
    if inp.gpus_per_node is not None:
        inp.gpus_per_node = _int_in("gpus_per_node", inp.gpus_per_node, 1, MAX_GPUS)
    if inp.nodes is not None and inp.gpus_per_node is not None:
        if inp.nodes * inp.gpus_per_node != n:
            raise UserError(f"--nodes {inp.nodes} × --gpus-per-node {inp.gpus_per_node} ≠ --gpus {n}; "
                            "give two of the three that agree")
    elif inp.nodes is not None:
        if n % inp.nodes:
            raise UserError(f"--gpus {n} is not divisible by --nodes {inp.nodes}; give a multiple")
        inp.gpus_per_node = n // inp.nodes
    else:
        if inp.gpus_per_node is None:
            inp.gpus_per_node = min(8, n)
        if n % inp.gpus_per_node:
            raise UserError(f"--gpus {n} is not a multiple of {inp.gpus_per_node} GPUs per node; "
                            "give --gpus-per-node or --nodes")
        inp.nodes = n // inp.gpus_per_node
    _tp_layout(inp)
    check_cp(inp.cp, world_size=n, tp=inp.tp, seq_len=inp.seq_len, sequence_parallel=inp.sequence_parallel)
    # hsdp's shard group: the trainer's rule and default (layout.Layout: a divisor of the
    # gpus / (tp × cp) data-parallel ranks, one node's by default), planned for every strategy
    if inp.hsdp_shard_size is not None:
        inp.hsdp_shard_size = _int_in("hsdp_shard_size", inp.hsdp_shard_size, 1, MAX_GPUS)
    inp.pp = _int_in("pp", inp.pp, 1, MAX_GPUS)
    inp.hsdp_shard_size = Layout.build("hsdp", n, inp.gpus_per_node, inp.hsdp_shard_size, tp=inp.tp, cp=inp.cp,
                                       tp_across_nodes=inp.tp_across_nodes, pp=inp.pp).shard_degree


def plan_layout(inp: PlanInputs, strategy: str = "zero3", **degrees) -> Layout:
    """The trainer's `Layout` of these inputs for `strategy` (its data-parallel degree, shard group and
    divisors), `degrees` (tp, cp, pp, ep, hsdp_shard_size) replacing the inputs' own; ep 1 unless given.
    --accounting paper plans a tp beside ddp/zero1 as Megatron's model parallelism (ZeRO's Table 2),
    outside the trainer's mesh: the Layout of the gpus / tp data-parallel ranks, with that tp
    innermost over the whole world (a layout the trainer refuses: tp composes with FSDP2 only)."""
    d = {"tp": inp.tp, "cp": inp.cp, "pp": inp.pp, "ep": 1, "hsdp_shard_size": inp.hsdp_shard_size, **degrees}
    tp, shard = d.pop("tp"), d.pop("hsdp_shard_size")
    if tp > 1 and not STRATEGY[strategy].fsdp:
        data = Layout.build(strategy, inp.gpus // tp, max(1, inp.gpus_per_node // tp), shard, **d)
        return replace(data, world_size=inp.gpus, gpus_per_node=inp.gpus_per_node, tp=tp)
    return Layout.build(strategy, inp.gpus, inp.gpus_per_node, shard, tp=tp, tp_across_nodes=inp.tp_across_nodes,
                        sequence_parallel=bool(inp.sequence_parallel), **d)


def _pipeline(inp: PlanInputs) -> None:
    """The pipeline's schedule rules (rules/pipeline.py, the launcher's too) and a model
    architecture to split; the layer split is checked against the model (plan/pipeline.py), the
    stages' placement by layout.check_pp_placement (via Layout.build)."""
    inp.pp_virtual_stages = _int_in("pp_virtual_stages", inp.pp_virtual_stages, 1, 1024)
    inp.pp_schedule = str(inp.pp_schedule).lower()
    inp.pp_layers = list(inp.pp_layers) if inp.pp_layers else None  # the CLI's unrepeated option: []
    if inp.pp_layers is not None:
        inp.pp_layers = [_int_in("pp_layers", v, 1, 1_000_000) for v in inp.pp_layers]
    check_pp_schedule(inp.pp, inp.pp_schedule, inp.pp_virtual_stages, inp.grad_accum)
    if inp.pp > 1 and inp.params is not None:
        raise UserError("--pp needs a model architecture (the layers it splits); give a MODEL instead of --params")


def _tp_layout(inp: PlanInputs) -> None:
    """TP innermost, inside one node (its collectives need NVLink; layout.check_placement), dividing the world and, with
    sequence parallelism (default on with tp > 1), the sequence."""
    t = inp.tp
    if inp.sequence_parallel is None:
        inp.sequence_parallel = t > 1
    if not isinstance(inp.sequence_parallel, bool):
        raise UserError(f"--sequence-parallel must be true or false, got {inp.sequence_parallel!r}")
    if t == 1:
        inp.sequence_parallel = False
        return
    if inp.gpus % t:
        raise UserError(f"--tp {t} does not divide --gpus {inp.gpus}; give a world of dp × tp GPUs")
    check_placement(t, inp.gpus_per_node, inp.tp_across_nodes)  # the trainer's and launch's rule (layout.py)
    if inp.sequence_parallel and inp.seq_len % t:
        raise UserError(f"--seq-len {inp.seq_len} is not divisible by --tp {t}: sequence parallelism splits "
                        "the sequence; give a multiple of tp (or --no-sequence-parallel)")
    if inp.params is not None and inp.accounting != "paper":
        raise UserError("--tp needs a model architecture (what TP splits); give a MODEL instead of --params, "
                        "or --accounting paper (model states / tp)")
