"""One strategy's plan (`plan_strategy`): its per-GPU memory, fit and communication for given
inputs, and the inputs re-derived at another tp or cp (`with_tp`, `with_cp`). `plan()` (api.py) runs
it for each strategy; the verdict (verdict.py) and `--fit` (fit.py) re-plan candidates with it, so
it sits below all three. Pure Python: imports no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from shardtune.catalog.gpus import GPU
from shardtune.errors import UserError
from shardtune.plan import comm, memory, moe
from shardtune.plan import cp as cpp
from shardtune.plan import ep as epp
from shardtune.plan.activations import activation_split
from shardtune.plan.model import _Model
from shardtune.plan.pipeline import plan_pipeline
from shardtune.plan.preference import reference_bytes
from shardtune.plan.rl import generation_weights_bytes, kv_cache_bytes, training_rows
from shardtune.plan.tp import check_tp_arch, tied_tp_embedding_grad_bytes, tp_collectives, tp_embedding_grad_bytes
from shardtune.plan.validate import PlanInputs, plan_layout, resolve_inputs
from shardtune.rules.combination import check_combination
from shardtune.rules.cp import check_activation_offload
from shardtune.rules.loss import resolve_loss_chunks
from shardtune.rules.rl import check_grpo
from shardtune.strategies import STRATEGY, autocasts, resolve_optimizer_impl

GIB = 2**30


@dataclass
class Memory:
    """Per-GPU bytes at rest; `total` is the peak, `at_peak` what is alive then (memory.peak_parts)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    optimizer_step_temp: int
    total: int
    reference: int = 0  # dpo: the frozen reference copy (plan/preference.py), included in total
    kv_cache: int = 0  # grpo: one generation batch's keys and values (plan/rl.py)
    generation_weights: int = 0  # grpo: the gathered model generation decodes with (plan/rl.py)
    experts: int | None = None  # MoE: the routed experts' share of params + grads + optimizer (plan/moe.py)
    peak_phase: str = ""  # when the peak happens: forward end, optimizer step, backward end, generation
    at_peak: dict = field(default_factory=dict)  # what is alive at that moment (these keys' bytes), summing to total


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
    comm: dict = field(default_factory=dict)  # MoE with --ep: the all-to-all per layer and step (plan/ep.py)
    pipeline: dict | None = None  # --pp: schedule, micro-batches, bubble, P2P bytes (plan/pipeline.py)
    stages: list | None = None  # --pp: each pipeline rank's layers and memory; `memory` is the worst's
    stage_ctx: object = None  # --pp: the stages' models, inputs and plans for timing (not in plan.json)

    @property
    def headroom_gib(self) -> float:
        return self.headroom_bytes / GIB

    def to_dict(self) -> dict:
        ctx, self.stage_ctx = self.stage_ctx, None
        try:
            d = asdict(self)
        finally:
            self.stage_ctx = ctx
        del d["stage_ctx"]
        for key in ("pipeline", "stages"):  # plans without pp: as before
            if d[key] is None:
                del d[key]
        d["headroom_gib"] = round(self.headroom_gib, 3)
        d["collectives"] = [c.to_dict() for c in self.collectives]
        d.update(d.pop("timing"))  # step_time_s, tokens_per_s, mfu, comm_time_s, compute_time_s, ...
        d["peak"] = {"phase": d["memory"].pop("peak_phase"), "alive": d["memory"].pop("at_peak")}
        for key in ("kv_cache", "generation_weights"):  # grpo's generation only
            if not d["memory"][key]:
                del d["memory"][key]
        if d["memory"]["experts"] is None:  # dense models: the plan as before
            del d["memory"]["experts"]
        if not d["comm"]:
            del d["comm"]
        return d


def _states(m: _Model, strategy: str, inp: PlanInputs, world: int, shard_degree: int) -> memory.States:
    key = ("states", strategy, inp.accounting, inp.tp, inp.gpus, shard_degree, inp.precision, inp.optimizer, _impl(inp))
    if key not in m.buffer_cache:  # the same for every micro-batch, AC mode and pipeline stage of as many layers
        m.buffer_cache[key] = _model_states(m, strategy, inp, world, shard_degree)
    return m.buffer_cache[key]


def _model_states(m: _Model, strategy: str, inp: PlanInputs, world: int, shard_degree: int) -> memory.States:
    """One rank's model states; `world`: FSDP's (the layout's dp × cp), `shard_degree` its shard group."""
    if inp.accounting == "paper":  # model parallelism (the ZeRO paper's MP) splits all states by tp
        return memory.paper_states(-(-m.num_params // inp.tp), -(-m.trainable // inp.tp), strategy,
                                   shard_degree, inp.precision, inp.optimizer)
    if m.shapes is None:
        return memory.flat_states(m.num_params, m.trainable, strategy, shard_degree, inp.precision,
                                  inp.optimizer, _impl(inp))
    if inp.ep > 1:  # experts (E/ep rows) over shard / ep ranks, the rest over all (plan/ep.py)
        return epp.ep_states(m.local_shapes(inp.tp), strategy, world, shard_degree, inp.ep,
                             inp.precision, inp.optimizer, _impl(inp))[0]
    return memory.max_rank_states(m.local_shapes(inp.tp), strategy, world, shard_degree,
                                  inp.precision, inp.optimizer, _impl(inp))


def _impl(inp: PlanInputs) -> str:
    """The AdamW kernel planned: for `auto`, the trainer's (strategies.resolve_optimizer_impl)."""
    return resolve_optimizer_impl(inp.optimizer_impl)


def _buffers(m: _Model, strategy: str, inp: PlanInputs) -> int:
    if inp.accounting == "paper" or m.shapes is None:
        return 0
    chunks = resolve_loss_chunks(inp.loss_chunks, m.arch.vocab_size) if m.arch else 1
    key = (strategy, inp.precision, chunks, inp.tp, inp.ep)  # independent of the world size: once per plan
    if key not in m.buffer_cache:  # TP: the gathered layers are this rank's TP shards; ep: its E/ep experts
        shapes = epp.ep_local_shapes(m.local_shapes(inp.tp), inp.ep)
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
    stage = m.stage or {}  # a pipeline stage: its micro-batches in flight (plan/pipeline.py)
    return activation_split(m.arch, inp.micro_batch, inp.seq_len, memory.dtypes(inp.precision).compute,
                            inp.ac, inp.ac_every, calibrated=True, autocast=autocast,
                            loss_chunks=_loss_chunks(m, inp), tp=inp.tp, sp=inp.sequence_parallel,
                            cp=inp.cp, offload=inp.activation_offload, in_flight=stage.get("in_flight", 1.0),
                            head_in_flight=stage.get("head_in_flight", 1) if stage.get("last", True) else 0)


def _loss_chunks(m: _Model, inp: PlanInputs) -> int:
    """The trainer's cross-entropy chunks (rules/loss.py: none under TP)."""
    return resolve_loss_chunks(inp.loss_chunks, m.arch.vocab_size, inp.tp)


def plan_strategy(m: _Model, strategy: str, inp: PlanInputs, usable: int, per_rank: bool = True) -> StrategyPlan:
    if inp.pp > 1:  # each pipeline rank's stage planned as a model of its own (plan/pipeline.py)
        return plan_pipeline(m, strategy, inp, usable, plan_strategy)
    # the trainer's Layout (TP innermost, plan/tp.py): FSDP's world is its dp_replicate × dp_shard
    # data-parallel and cp context-parallel ranks (gpus / tp), sharding over dp_shard × cp
    layout = plan_layout(inp, strategy)
    tp, cp, fsdp = layout.tp, layout.cp, layout.strategy.fsdp  # tp: also paper accounting's Megatron degree
    dp, shard = layout.grad_divide_factor, layout.shard_degree * cp  # FSDP's world and shard group: × cp
    shapes = m.local_shapes(tp)
    st = _states(m, strategy, inp, dp, shard)
    cpu_per_rank = 0
    if inp.offload == "optimizer":
        cpu_per_rank = st.optimizer + st.optimizer_step_temp
        st = memory.States(st.params, st.grads, 0, 0)
    elif inp.offload == "all":
        cpu_per_rank = st.params + st.grads + st.optimizer + st.optimizer_step_temp
        st = memory.States(0, 0, 0, 0)
    rows = training_rows(inp)  # grpo: G completions a prompt, prompt + max_new_tokens long (plan/rl.py)
    (act, host_act), buf = _activations(m, rows, strategy), _buffers(m, strategy, rows)
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
            if m.arch is not None and (m.stage or {}).get("first", True):
                reduce += tp_embedding_grad_bytes(m.arch, tp, memory.dtypes(inp.precision).compute)
        chunks = _loss_chunks(m, inp) if m.arch else 1
        key = ("tied", strategy, tp, inp.precision, chunks, net_of)
        if key not in m.buffer_cache:
            m.buffer_cache[key] = memory.tied_backward_bytes(shapes, strategy, inp.precision, chunks, net_of)
        tied = m.buffer_cache[key]
        if tied and tp > 1 and m.arch is not None:  # + the embedding's whole-vocabulary gradient (e·V·h)
            tied += tied_tp_embedding_grad_bytes(m.arch, memory.dtypes(inp.precision).compute)
        reduce = max(reduce, tied + unsynced if tied else 0)  # the embedding's backward
    ref = reference_bytes(shapes, -(-m.num_params // tp), strategy, dp, shard, inp.precision, inp.objective,
                          inp.reference, inp.lora_rank, inp.rl_beta)
    if inp.offload == "all":  # the copy is sharded with the same CPUOffloadPolicy (train/core/dpo_ref.py)
        cpu_per_rank, ref = cpu_per_rank + ref, 0
    total, phase, parts = memory.peak_parts(st, act, buf, grads_in_forward, reduce, unsynced)
    total, parts = total + ref, parts | {"reference": ref}
    kv = gen_w = 0
    if inp.objective == "grpo" and m.arch is not None:  # generation's peak: plan/rl.py
        per = memory.dtypes(inp.precision).compute
        kv = kv_cache_bytes(m.arch, inp.num_generations, inp.seq_len, inp.max_new_tokens, tp, per)
        gen_w = generation_weights_bytes(m.num_params, tp, per)
        gen = {"params": st.params, "optimizer": st.optimizer, "reference": ref, "generation_weights": gen_w,
               "kv_cache": kv}
        if sum(gen.values()) > total:
            total, phase, parts = sum(gen.values()), "generation", gen
    key = ("collectives", strategy, tp, dp, shard, inp.precision, inp.accounting, inp.ep)
    if key not in m.buffer_cache:  # the same for every micro-batch and AC mode
        m.buffer_cache[key] = comm.collectives(strategy, num_params=-(-m.num_params // tp),
                                               trainable_params=-(-m.trainable // tp), world_size=dp,
                                               shard_degree=shard, precision=inp.precision, shapes=shapes,
                                               accounting=inp.accounting) if inp.ep == 1 else \
            epp.ep_fsdp_collectives(strategy, shapes, dp, shard, inp.ep, inp.precision)
    colls = list(m.buffer_cache[key])
    if m.arch is not None and inp.accounting == "shardtune":
        colls += [comm.Collective(op, "tp", size, tp, "micro_batch", phase, what, calls)
                  for op, size, phase, calls, what in tp_collectives(
                      m.arch, inp.micro_batch * inp.seq_len // inp.cp, tp, inp.sequence_parallel,
                      memory.dtypes(inp.precision).compute, inp.ac, inp.ac_every)]
        colls += [comm.Collective(op, "cp", size, inp.cp, "micro_batch", phase, what, calls)
                  for op, size, phase, calls, what in cpp.ulysses_collectives(
                      m.arch, inp.micro_batch * inp.seq_len, inp.cp, tp, memory.dtypes(inp.precision).compute,
                      inp.ac, inp.ac_every)]
        colls += [comm.Collective(op, "ep", size, inp.ep, "micro_batch", phase, what, calls)
                  for op, size, phase, calls, what in epp.ep_collectives(
                      m.arch, _ep_tokens(inp), inp.ep, memory.dtypes(inp.precision).compute,
                      inp.ac, inp.ac_every, inp.moe_imbalance)]
    host = cpp.host_ram(inp, host_act, cpu_per_rank) if inp.activation_offload else {}
    return StrategyPlan(
        layout={"dp_replicate": layout.replicate_degree if fsdp else dp, "dp_shard": layout.shard_degree,
                "cp": cp, "tp": tp, "sequence_parallel": inp.sequence_parallel,
                **({"ep": inp.ep, "expert_fsdp": shard // inp.ep} if m.arch is not None and m.arch.num_experts
                   else {})},
        host_ram=host, comm=_ep_comm(m, inp),
        state_bytes_per_rank=(_per_rank(m, strategy, inp, dp, shard) if per_rank and inp.offload == "none"
                              and inp.ep == 1 else None),
        name=strategy, shard_degree=shard, replicate_degree=layout.replicate_degree,
        memory=Memory(st.params, st.grads, st.optimizer, act, buf, st.optimizer_step_temp, total, ref,
                      kv, gen_w, _expert_bytes(m, strategy, inp, dp, shard), phase,
                      {k: v for k, v in parts.items() if v}),
        fits=total <= usable and host.get("fits", True), headroom_bytes=usable - total,
        cpu_offload_bytes_per_node=cpu_per_rank * inp.gpus_per_node,
        comm_bytes_per_step=comm.bytes_per_step(colls, inp.grad_accum), comm_ratio_to_ddp=None,
        collectives=colls,
    )


def _expert_bytes(m: _Model, strategy: str, inp: PlanInputs, world: int, shard: int) -> int | None:
    """MoE: the routed experts' states on the largest rank, as `memory` accounts them (None: dense).
    Without expert parallelism the expert-FSDP degree is the strategy's shard degree (plan/moe.py)."""
    if m.arch is None or not m.arch.num_experts or m.shapes is None or inp.accounting != "shardtune":
        return None
    if inp.offload == "all":  # every state lives in host memory (CPUOffloadPolicy)
        return 0
    experts = [p for p in m.local_shapes(inp.tp) if moe.is_routed_expert(p.name)]
    st = (epp.ep_states(experts, strategy, world, shard, inp.ep, inp.precision, inp.optimizer, _impl(inp))[1]
          if inp.ep > 1 else
          memory.max_rank_states(experts, strategy, world, shard, inp.precision, inp.optimizer, _impl(inp)))
    if inp.offload == "optimizer":
        st = memory.States(st.params, st.grads, 0, 0)
    return moe.expert_state_bytes(st, ep_degree=1)


def _ep_tokens(inp: PlanInputs) -> int:
    """Tokens one rank routes per micro-batch: its cp slice of the sequence, and under tp its 1/tp of
    that (the experts are not tp-split: each tp rank dispatches its own rows, docs/moe.md)."""
    return inp.micro_batch * inp.seq_len // (inp.cp * inp.tp)


def _ep_comm(m: _Model, inp: PlanInputs) -> dict:
    """MoE with ep > 1: the all-to-all bytes one rank sends per MoE layer and per step (plan/ep.py)."""
    if m.arch is None or not m.arch.num_experts or inp.ep == 1 or inp.accounting != "shardtune":
        return {}
    layer = epp.all_to_all_bytes_per_layer(m.arch, _ep_tokens(inp), inp.ep,
                                           memory.dtypes(inp.precision).compute, inp.moe_imbalance)
    return {"all_to_all": {"group": "ep", "group_size": inp.ep, "moe_layers": len(epp.moe_layers(m.arch)),
                           "moe_imbalance": epp.effective_imbalance(inp.moe_imbalance, inp.ep),
                           "bytes_per_rank_per_layer": round(layer),
                           "bytes_per_rank_per_micro_batch": round(layer * len(epp.moe_layers(m.arch)))}}


def _per_rank(m: _Model, strategy: str, inp: PlanInputs, dp: int, shard: int) -> dict | None:
    """params/grads/optimizer bytes of each rank's local tensors (FSDP2 `to_local()`, unpadded),
    for comparing a real run rank by rank; `memory` holds rank 0's, which equals the padded
    allocation every FSDP2 rank makes."""
    if m.shapes is None or inp.accounting != "shardtune" or inp.gpus > 16:
        return None
    # rank r: rank r // tp of FSDP's dp (x cp) world (TP innermost); TP splits evenly
    by_dp = [memory.shardtune_states(m.local_shapes(inp.tp), strategy, dp, shard,
                                     inp.precision, inp.optimizer, r, padded=False, impl=_impl(inp))
             for r in range(dp)]
    ranks = [by_dp[r // inp.tp] for r in range(inp.gpus)]
    return {k: [getattr(s, k) for s in ranks] for k in ("params", "grads", "optimizer")}


def combination_error(inp: PlanInputs, strategy: str) -> UserError | None:
    """strategies.check_combination's verdict on `strategy` with these inputs (planner modes on)."""
    try:
        check_combination(strategy, precision=inp.precision, offload=inp.offload, optimizer=inp.optimizer,
                          optimizer_impl=inp.optimizer_impl, lora_rank=inp.lora_rank,
                          activation_checkpointing=inp.ac, ac_every=inp.ac_every, planner_modes=True,
                          loss_chunks=inp.loss_chunks, quantize_base=inp.quantize_base,
                          # the ZeRO paper's accounting plans Megatron's model parallelism beside any
                          # ZeRO stage (its Table 2), not this trainer's TP
                          tp=1 if inp.accounting == "paper" else inp.tp, cp=inp.cp, ep=inp.ep)
        if inp.ep > 1:  # ep divides this strategy's dp_shard x cp (the trainer's Layout rule), pp not counted
            plan_layout(inp, strategy, ep=inp.ep, pp=1)
    except UserError as e:
        return e
    try:  # activation offload's rule on the objective (rules/cp.py, the trainer's); grpo's (rules/rl.py)
        check_activation_offload(inp.activation_offload, objective=inp.objective, offload=inp.offload)
        if inp.objective == "grpo":
            check_grpo(strategy, tp=inp.tp, cp=inp.cp, quantize_base=inp.quantize_base, offload=inp.offload,
                       activation_offload=inp.activation_offload, activation_checkpointing=inp.ac)
    except UserError as e:
        return e
    return None


def with_tp(inp: PlanInputs, tp: int, m: _Model) -> PlanInputs | None:
    """`inp` at tensor-parallel degree `tp` (the HSDP shard size re-derived), or None where that
    layout cannot run (validate's and check_tp_arch's rules)."""
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
