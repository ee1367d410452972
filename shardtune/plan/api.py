"""`plan(...)`: per-strategy memory, fit and communication for a model on a GPU cluster.

The Python form of `shardtune plan`; `PlanResult.to_dict()` is its `--json` output and the run
folder's plan.json. Pure Python: imports no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shardtune.catalog.gpus import GPU, resolve_gpu
from shardtune.cp_rules import check_activation_offload, check_cp
from shardtune.errors import UserError
from shardtune.plan import comm, memory
from shardtune.plan import cp as cpp
from shardtune.plan.activations import activation_split
from shardtune.plan.loss import resolve_loss_chunks
from shardtune.plan.model import _load_model, _Model
from shardtune.plan.preference import reference_bytes, reference_disk
from shardtune.plan.timing import add_timing
from shardtune.plan.tp import (
    check_tp_arch,
    tp_collectives,
    tp_embedding_grad_bytes,
)
from shardtune.plan.validate import PlanInputs, resolve_inputs
from shardtune.plan.verdict import suggest, verdict
from shardtune.strategies import (
    STRATEGIES,
    STRATEGY,
    Layout,
    autocasts,
    check_combination,
    resolve_optimizer_impl,
)

GIB = 2**30


@dataclass
class Memory:
    """Per-GPU bytes. `total` is the peak: states + max(activations + buffers, optimizer temp)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    optimizer_step_temp: int
    total: int
    reference: int = 0  # dpo: the frozen reference copy (plan/preference.py), included in total


@dataclass
class StrategyPlan:
    """One strategy's per-GPU memory, fit and communication."""

    name: str
    shard_degree: int
    replicate_degree: int
    memory: Memory
    fits: bool
    headroom_bytes: int
    cpu_offload_bytes_per_node: int
    comm_bytes_per_step: int
    comm_ratio_to_ddp: float | None
    collectives: list[comm.Collective]
    suggestion: str = ""
    state_bytes_per_rank: dict | None = None  # local tensor bytes of each rank (worlds ≤ 16)
    timing: dict = field(default_factory=dict)  # plan.timing.add_timing: step_time_s, tokens_per_s, mfu, ...
    simulated: dict | None = None  # plan.simulate (--simulate): traced bytes with the `memory` keys, or a fallback note
    layout: dict = field(default_factory=dict)  # {"dp_replicate", "dp_shard", "cp", "tp", "sequence_parallel"}
    host_ram: dict = field(default_factory=dict)  # --activation-offload: host RAM per node, PCIe (plan/cp.py)

    @property
    def headroom_gib(self) -> float:
        return self.headroom_bytes / GIB

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headroom_gib"] = round(self.headroom_gib, 3)
        d["collectives"] = [c.to_dict() for c in self.collectives]
        d.update(d.pop("timing"))  # step_time_s, tokens_per_s, mfu, comm_time_s, compute_time_s, ...
        return d


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
        }


def _states(m: _Model, strategy: str, inp: PlanInputs, shard_degree: int) -> memory.States:
    if inp.accounting == "paper":  # model parallelism (the ZeRO paper's MP) splits all states by tp
        return memory.paper_states(-(-m.num_params // inp.tp), -(-m.trainable // inp.tp), strategy,
                                   shard_degree, inp.precision, inp.optimizer)
    if m.shapes is None:
        return memory.flat_states(m.num_params, m.trainable, strategy, shard_degree, inp.precision,
                                  inp.optimizer, _impl(inp))
    return memory.max_rank_states(m.local_shapes(inp.tp), strategy, inp.gpus // inp.tp, shard_degree,
                                  inp.precision, inp.optimizer, _impl(inp))


def _impl(inp: PlanInputs) -> str:
    """The AdamW kernel planned: for `auto`, the trainer's (strategies.resolve_optimizer_impl)."""
    return resolve_optimizer_impl(inp.optimizer_impl)


def _buffers(m: _Model, strategy: str, inp: PlanInputs) -> int:
    if inp.accounting == "paper" or m.shapes is None:
        return 0
    chunks = resolve_loss_chunks(inp.loss_chunks, m.arch.vocab_size) if m.arch else 1
    key = (strategy, inp.precision, chunks, inp.tp)  # independent of the world size: computed once per plan
    if key not in m.buffer_cache:
        shapes = m.local_shapes(inp.tp)  # TP: the gathered layers are this rank's TP shards
        if STRATEGY[strategy].fsdp:
            m.buffer_cache[key] = memory.fsdp_buffer_bytes(shapes, strategy, inp.precision)
        else:
            m.buffer_cache[key] = memory.ddp_buffer_bytes(shapes, inp.precision, chunks)
    return m.buffer_cache[key]


def _activations(m: _Model, inp: PlanInputs, strategy: str) -> tuple[int, int]:
    """(device, host) activation bytes of one rank (host: --activation-offload)."""
    if m.arch is None or inp.accounting == "paper":  # the paper's §5 figures are model states only
        return 0, 0
    # ddp/zero1 with bf16-mixed: an fp32 model under torch.autocast (strategies.autocasts, the
    # trainer's rule). Under LoRA the base (embedding and norms included) is stored in bf16, so
    # the residual stream is bf16 and only the adapters' weights are cast: bf16 activations.
    autocast = autocasts(strategy, inp.precision) and not inp.lora_rank
    return activation_split(m.arch, inp.micro_batch, inp.seq_len, memory.dtypes(inp.precision).compute,
                            inp.ac, inp.ac_every, calibrated=True, autocast=autocast,
                            loss_chunks=_loss_chunks(m, inp), tp=inp.tp, sp=inp.sequence_parallel,
                            cp=inp.cp, offload=inp.activation_offload)


def _loss_chunks(m: _Model, inp: PlanInputs) -> int:
    """The trainer's cross-entropy chunks: under TP none (vocabulary-parallel `loss_parallel`:
    V / tp logits a token already), else train.loss_chunks' default (plan/loss.py)."""
    return 1 if inp.tp > 1 else resolve_loss_chunks(inp.loss_chunks, m.arch.vocab_size)


def _plan_strategy(m: _Model, strategy: str, inp: PlanInputs, usable: int, per_rank: bool = True) -> StrategyPlan:
    # the FSDP part of the mesh: gpus / tp ranks, TP innermost (plan/tp.py); of them dp_replicate ×
    # dp_shard data-parallel and cp context-parallel ranks, FSDP sharding over dp_shard × cp
    dp, tp, cp = inp.gpus // inp.tp, inp.tp, inp.cp
    layout = Layout.build(strategy, dp // cp, max(1, inp.gpus_per_node // (tp * cp)), inp.hsdp_shard_size)
    shard, fsdp = layout.shard_degree * cp, layout.strategy.fsdp
    shapes = m.local_shapes(tp)
    st = _states(m, strategy, inp, shard)
    cpu_per_rank = 0
    if inp.offload == "optimizer":
        cpu_per_rank = st.optimizer + st.optimizer_step_temp
        st = memory.States(st.params, st.grads, 0, 0)
    elif inp.offload == "all":
        cpu_per_rank = st.params + st.grads + st.optimizer + st.optimizer_step_temp
        st = memory.States(0, 0, 0, 0)
    (act, host_act), buf = _activations(m, inp, strategy), _buffers(m, strategy, inp)
    grads_in_forward = not (fsdp and inp.grad_accum == 1
                            and inp.accounting == "shardtune")
    reduce = 0
    unsynced = 0  # DDP's fresh grads beside its buckets under accumulation (memory.peak_bytes)
    if not fsdp and inp.grad_accum > 1 and inp.accounting == "shardtune":
        unsynced = st.grads
    if m.shapes is not None and inp.accounting == "shardtune":
        # the root's sharded grads are not there yet, unless a previous micro-batch made them
        # or they live on the host (offload all)
        net_of = shard if fsdp and not grads_in_forward and inp.offload != "all" else 0
        if fsdp:
            reduce = memory.fsdp_root_reduce_bytes(shapes, inp.precision, net_of)
            if m.arch is not None:
                reduce += tp_embedding_grad_bytes(m.arch, tp, memory.dtypes(inp.precision).compute)
        chunks = _loss_chunks(m, inp) if m.arch else 1
        tied = memory.tied_backward_bytes(shapes, strategy, inp.precision, chunks, net_of)
        reduce = max(reduce, tied + unsynced if tied else 0)  # the embedding's backward
    ref = reference_bytes(shapes, -(-m.num_params // tp), strategy, dp, shard, inp.precision, inp.objective,
                          inp.reference, inp.lora_rank)
    if inp.offload == "all":  # the copy is sharded with the same CPUOffloadPolicy (train/core/dpo_ref.py)
        cpu_per_rank, ref = cpu_per_rank + ref, 0
    total = memory.peak_bytes(st, act, buf, grads_in_forward, reduce, unsynced) + ref
    colls = comm.collectives(strategy, num_params=-(-m.num_params // tp),
                             trainable_params=-(-m.trainable // tp), world_size=dp, shard_degree=shard,
                             precision=inp.precision, shapes=shapes, accounting=inp.accounting)
    if m.arch is not None and inp.accounting == "shardtune":
        colls += [comm.Collective(op, "tp", size, tp, "micro_batch", phase, what, calls)
                  for op, size, phase, calls, what in tp_collectives(
                      m.arch, inp.micro_batch * inp.seq_len // inp.cp, tp, inp.sequence_parallel,
                      memory.dtypes(inp.precision).compute, inp.ac, inp.ac_every)]
        colls += [comm.Collective(op, "cp", size, inp.cp, "micro_batch", phase, what, calls)
                  for op, size, phase, calls, what in cpp.ulysses_collectives(
                      m.arch, inp.micro_batch * inp.seq_len, inp.cp, tp, memory.dtypes(inp.precision).compute,
                      inp.ac, inp.ac_every)]
    host = cpp.host_ram(inp, host_act, cpu_per_rank) if inp.activation_offload else {}
    return StrategyPlan(
        layout={"dp_replicate": layout.replicate_degree if fsdp else dp, "dp_shard": layout.shard_degree,
                "cp": cp, "tp": tp, "sequence_parallel": inp.sequence_parallel},
        host_ram=host,
        state_bytes_per_rank=_per_rank(m, strategy, inp, shard) if per_rank and inp.offload == "none" else None,
        name=strategy, shard_degree=shard, replicate_degree=layout.replicate_degree,
        memory=Memory(st.params, st.grads, st.optimizer, act, buf, st.optimizer_step_temp, total, ref),
        fits=total <= usable and host.get("fits", True), headroom_bytes=usable - total,
        cpu_offload_bytes_per_node=cpu_per_rank * inp.gpus_per_node,
        comm_bytes_per_step=comm.bytes_per_step(colls, inp.grad_accum), comm_ratio_to_ddp=None,
        collectives=colls,
    )


def _per_rank(m: _Model, strategy: str, inp: PlanInputs, shard: int) -> dict | None:
    """params/grads/optimizer bytes of each rank's local tensors (FSDP2 `to_local()`, unpadded),
    for comparing a real run rank by rank; `memory` holds rank 0's, which equals the padded
    allocation every FSDP2 rank makes."""
    if m.shapes is None or inp.accounting != "shardtune" or inp.gpus > 16:
        return None
    dp = inp.gpus // inp.tp  # rank r: data-parallel rank r // tp (TP innermost); TP splits evenly
    by_dp = [memory.shardtune_states(m.local_shapes(inp.tp), strategy, dp, shard,
                                     inp.precision, inp.optimizer, r, padded=False, impl=_impl(inp))
             for r in range(dp)]
    ranks = [by_dp[r // inp.tp] for r in range(inp.gpus)]
    return {k: [getattr(s, k) for s in ranks] for k in ("params", "grads", "optimizer")}


def _combination_error(inp: PlanInputs, strategy: str) -> UserError | None:
    """strategies.check_combination's verdict on `strategy` with these inputs (planner modes on)."""
    try:
        check_combination(strategy, precision=inp.precision, offload=inp.offload, optimizer=inp.optimizer,
                          optimizer_impl=inp.optimizer_impl, lora_rank=inp.lora_rank,
                          activation_checkpointing=inp.ac, ac_every=inp.ac_every, planner_modes=True,
                          loss_chunks=inp.loss_chunks, quantize_base=inp.quantize_base,
                          # the ZeRO paper's accounting plans Megatron's model parallelism beside any
                          # ZeRO stage (its Table 2), not this trainer's TP
                          tp=1 if inp.accounting == "paper" else inp.tp, cp=inp.cp)
    except UserError as e:
        return e
    try:  # context parallelism's and activation offload's rules on the objective (cp_rules.py, the trainer's)
        check_cp(inp.cp, objective=inp.objective)
        check_activation_offload(inp.activation_offload, objective=inp.objective, offload=inp.offload)
    except UserError as e:
        return e
    return None


def _applicable(inp: PlanInputs) -> tuple[list[str], list[str]]:
    """The strategies to plan and a note on those omitted. A strategy the user named that cannot
    run with these options is a UserError, and so is every strategy failing: never an empty plan."""
    names = inp.strategies or list(STRATEGIES)
    errors = {s: _combination_error(inp, s) for s in names}
    bad = [s for s in names if errors[s]]
    if bad and (inp.strategies or len(bad) == len(names)):
        raise errors[bad[0]]
    omitted = []
    if bad and inp.offload == "all" and all("offload 'all'" in str(errors[s]) for s in bad):
        omitted.append("offload all applies to FSDP strategies only (FSDP2 CPUOffloadPolicy); ddp and zero1 omitted")
    elif bad:
        omitted.append(f"{', '.join(bad)} omitted: {errors[bad[0]]}")
    return [s for s in names if not errors[s]], omitted


def with_tp(inp: PlanInputs, tp: int, m: _Model) -> PlanInputs | None:
    """`inp` at tensor-parallel degree `tp` (the HSDP shard size re-derived), or None where that
    layout cannot run (validate's and check_tp_arch's rules)."""
    from dataclasses import fields, replace

    try:
        changed = replace(inp, tp=tp, sequence_parallel=None if tp > 1 else False,
                          hsdp_shard_size=None if inp.tp != tp else inp.hsdp_shard_size)
        changed = resolve_inputs(PlanInputs(**{f.name: getattr(changed, f.name) for f in fields(PlanInputs)}))
        check_tp_arch(m.arch, m.config, tp)
    except UserError:
        return None
    return changed


def with_cp(inp: PlanInputs, cp: int, m: _Model) -> PlanInputs | None:
    """`inp` at context-parallel degree `cp` (the HSDP shard size re-derived), or None where that
    layout cannot run (plan/cp.py's rules)."""
    from dataclasses import fields, replace

    try:
        changed = replace(inp, cp=cp, hsdp_shard_size=None if inp.cp != cp else inp.hsdp_shard_size)
        changed = resolve_inputs(PlanInputs(**{f.name: getattr(changed, f.name) for f in fields(PlanInputs)}))
        cpp.check_cp_arch(m.arch, m.config, cp, changed.tp)
    except UserError:
        return None
    return changed


def default_reserve_bytes(gpu: GPU) -> int:
    """What the planner keeps free: 1 GiB for the CUDA context, cuBLAS workspaces and NCCL
    buffers, plus 5 % of the GPU for the caching allocator's fragmentation (an estimate;
    override with `reserve_gib`)."""
    return GIB + gpu.memory_bytes // 20


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
    m = _load_model(inp.model, inp.params, inp.lora_rank, inp.quantize_base)
    if m.arch is not None:
        check_tp_arch(m.arch, m.config, inp.tp)
    if inp.accounting != "paper":
        cpp.check_cp_arch(m.arch, m.config, inp.cp, inp.tp)
    names, omitted = _applicable(inp)
    plans = [_plan_strategy(m, s, inp, usable) for s in names]
    ddp_bytes = comm.bytes_per_step(comm.collectives(
        "ddp", num_params=m.num_params, trainable_params=m.trainable, world_size=inp.gpus, shard_degree=1,
        precision=inp.precision, shapes=m.shapes, accounting=inp.accounting), inp.grad_accum)
    for p in plans:
        p.comm_ratio_to_ddp = round(p.comm_bytes_per_step / ddp_bytes, 4) if ddp_bytes else None
        if not p.fits:
            p.suggestion = suggest(m, p, inp, usable)
    notes = _notes(m, inp, omitted)
    result = PlanResult(
        model={"name": m.name, "source": m.source, "params": m.num_params,
               "trainable_params": m.trainable, "active_params": m.active,
               "architecture": asdict(m.arch) if m.arch else None},
        hardware={"gpu": gpu.name, "gpu_memory_bytes": gpu.memory_bytes, "reserve_bytes": reserve,
                  "usable_bytes": usable, "gpus": inp.gpus, "nodes": inp.nodes,
                  "gpus_per_node": inp.gpus_per_node, "bf16_flops": gpu.bf16_flops, "source": gpu.source},
        inputs=inp.to_dict(), accounting=inp.accounting, strategies=plans,
        verdict=verdict(plans, usable), notes=notes, disk=reference_disk(inp.objective, inp.reference),
    )
    add_timing(result, m.arch, inp, gpu, **inp.timing_options())  # step time, tokens/s, MFU (plan/timing.py)
    return result


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
    if inp.lora_rank:
        notes.append(f"LoRA rank {inp.lora_rank}: only the adapters carry grads and optimizer states")
    if inp.objective == "dpo":
        notes.append("dpo: memory.reference is the frozen reference copy (0: LoRA's base with adapters off, or "
                     "precomputed); a pair's chosen + rejected share one seq_len row (docs/dpo.md)")
        if disk := reference_disk(inp.objective, inp.reference):
            notes.append(f"dpo precompute: the reference log-prob cache takes {disk['reference_cache_bytes']} bytes "
                         f"on disk: {disk['reference_cache_bytes_per_1k_pairs'] / 1024:.1f} KiB per 1k pairs")
    return notes
