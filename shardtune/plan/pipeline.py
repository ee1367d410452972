"""Pipeline parallelism in the planner: stages, their memory, the bubble and the P2P traffic.

The decoder layers split into pp·v stages (v virtual stages per rank with interleaved-1f1b), rank r
holding stages r, r + pp, ... (torchtitan's loop order); the first stage holds the embedding, the
last the final norm and the LM head (tied: its copy of the embedding). Each stage is planned as a
model of its own on its gpus / pp ranks (`plan_pipeline`: FSDP over the stage's data-parallel
ranks, TP inside it), with the activations of the micro-batches it keeps in flight:
  GPipe (Huang et al. 2019)          all m micro-batches on every stage;
  1F1B (PipeDream-Flush; Narayanan et al. 2021 §2.2.1, torch's Schedule1F1B warmup) min(m, pp − i) at rank i;
  interleaved 1F1B (same paper §2.2.2; torch's ScheduleInterleaved1F1B `_get_warmup_ops`)
                                     min(m·v, (v − 1)·r + 2(pp − 1 − i) + 1) chunks of 1/v of the rank's
                                     layers, r = micro-batches per round;
and the bubble (idle share of a step): (pp − 1)/(m + pp − 1), interleaved (pp − 1)/(v·m + pp − 1)
(Narayanan et al. 2021 eqs. (1), (2); GPipe §2.2). Each stage boundary sends the residual stream
of a micro-batch forward and its gradient backward: micro_batch × seq/cp × hidden × e bytes per rank
(/tp with sequence parallelism), priced on the link between the two stages. Derivations and the
step-time accounting: docs/parallelism.md "Pipeline parallelism". Imports no torch.
"""
from __future__ import annotations

from dataclasses import replace

from shardtune.errors import UserError
from shardtune.plan.model import _Model
from shardtune.plan.ring import Cluster
from shardtune.plan.validate import plan_layout, resolve_inputs

ROOT_FIRST = ("model.embed_tokens.weight",)
ROOT_LAST = ("model.norm.weight", "lm_head.weight")


def split_layers(num_layers: int, pp: int, virtual: int = 1, layers: list[int] | None = None) -> list[list[int]]:
    """The decoder layer indices of each pipeline rank: pp·virtual stages of `layers[s]` layers
    (default an even split), stage s on rank s % pp."""
    stages = pp * virtual
    if layers is not None:
        if len(layers) != stages or sum(layers) != num_layers:
            raise UserError(f"--pp-layers {layers}: give {stages} stage sizes (pp {pp} × virtual stages {virtual}) "
                            f"that sum to the model's {num_layers} decoder layers")
        sizes = list(layers)
    elif num_layers % stages:
        raise UserError(f"--pp {pp}{f' × --pp-virtual-stages {virtual}' if virtual > 1 else ''} = {stages} stages "
                        f"do not divide the model's {num_layers} decoder layers; give --pp-layers "
                        "(parallel.pp_layers) with each stage's layers")
    else:
        sizes = [num_layers // stages] * stages
    ranks: list[list[int]] = [[] for _ in range(pp)]
    start = 0
    for s, n in enumerate(sizes):
        ranks[s % pp] += range(start, start + n)
        start += n
    return ranks


def bubble_fraction(pp: int, microbatches: int, schedule: str, virtual: int = 1) -> float:
    """Idle share of a step on every rank: (pp − 1)/(v·m + pp − 1) (v = 1 for GPipe and 1F1B)."""
    v = virtual if schedule == "interleaved-1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def in_flight(rank: int, pp: int, microbatches: int, schedule: str, virtual: int = 1) -> float:
    """Micro-batches of rank `rank`'s layer activations alive at its peak (module doc)."""
    m = microbatches
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    per_round = m // max(1, m // pp)
    chunks = min(m * virtual, (virtual - 1) * per_round + 2 * (pp - 1 - rank) + 1)
    return chunks / virtual


def boundary_bytes(hidden: int, micro_batch: int, seq_len: int, elem_bytes: int, tp: int = 1, sp: bool = False,
                   cp: int = 1) -> int:
    """One rank's bytes across one stage boundary for one micro-batch, one direction: the
    residual stream (b, s/cp, h), sequence-sharded over tp with sequence parallelism."""
    return micro_batch * (seq_len // cp) // (tp if sp else 1) * hidden * elem_bytes


def sends_per_step(pp: int, microbatches: int, virtual: int = 1) -> int:
    """Sends of the busiest rank per step: each of its stages sends forward unless it is the last
    stage and backward unless it is the first (pp 2, v 1: m each; a middle rank 2·v·m)."""
    last = pp * virtual - 1
    return max(microbatches * sum((s != last) + (s != 0) for s in range(r, pp * virtual, pp)) for r in range(pp))


def p2p_time_s(nbytes: int, cluster: Cluster, pp: int) -> float:
    """One boundary transfer of `nbytes` per rank: stages of whole nodes (or several stages in
    a node) cross nodes whenever there is more than one node, and then every rank of a node at
    the boundary sends through the node's NICs at once; inside a node each GPU has its link."""
    stage_ranks = cluster.world_size // pp
    if cluster.num_nodes > 1:
        link, senders = cluster.inter, min(stage_ranks, cluster.gpus_per_node)
    else:
        link, senders = cluster.intra, 1
    return link.alpha_s + senders * nbytes / link.busbw_bytes_per_s


def stage_model(m: _Model, layers: list[int], first: bool, last: bool, stage: dict) -> _Model:
    """The part of `m` a pipeline rank holds, as a model of its own (layer groups, the first
    stage's embedding, the last one's norm and head; a tied head is a copy of the embedding)."""
    # a decoder layer's tensors do not depend on its index (dense models; MoE is refused), so stages of as
    # many layers share one model and its caches (shapes, TP shards, buffers, states), their groups renumbered
    key = ("stage", len(layers), first, last)
    if key in m.buffer_cache:
        return replace(m.buffer_cache[key], stage=dict(stage, first=first, last=last, layers=len(layers)))
    local = {g: i for i, g in enumerate(layers)}
    tied = not any(p.name == "lm_head.weight" for p in m.shapes)
    root = (ROOT_FIRST if first else ()) + (ROOT_LAST if last else ()) + (ROOT_FIRST if last and tied else ())
    shapes = [replace(p, group=local[p.group]) if p.group in local else p for p in m.shapes
              if p.group in local or (p.group == "root" and p.name in root)]
    total, trainable = sum(p.numel for p in shapes), sum(p.numel for p in shapes if p.trainable)
    arch = replace(m.arch, num_layers=len(layers))
    m.buffer_cache[key] = _Model(m.name, m.source, total, trainable, shapes, arch, total, config=m.config,
                                 stage=dict(stage, first=first, last=last, layers=len(layers)))
    return m.buffer_cache[key]


def matmul_params(stage: _Model) -> tuple[int, int]:
    """(matmul parameters a token passes through on this stage, those of its decoder layers):
    every tensor of 2 or more dims but the embedding's lookup; the head's (V, h) on the last."""
    if "matmul" not in stage.buffer_cache:
        stage.buffer_cache["matmul"] = _matmul_params(stage)
    return stage.buffer_cache["matmul"]


def _matmul_params(stage: _Model) -> tuple[int, int]:
    head = ("lm_head.weight", "model.embed_tokens.weight") if stage.stage["last"] else ("lm_head.weight",)
    layers = sum(p.numel for p in stage.shapes if p.group != "root" and len(p.shape) >= 2)
    heads = {p.name: p.numel for p in stage.shapes if p.group == "root" and p.name in head}
    return layers + (heads.get("lm_head.weight") or heads.get("model.embed_tokens.weight", 0)), layers


def check_pipeline(m: _Model, inp) -> list[list[int]]:
    """The layer split of `inp` (validate.PlanInputs) on model `m`, or a one-line UserError."""
    if m.arch is None:
        raise UserError("--pp needs a model architecture (the layers it splits); give a MODEL instead of --params")
    if m.arch.num_experts:
        raise UserError("--pp with a mixture of experts is not planned yet (its dense and sparse layers split "
                        "unevenly); plan it without --pp")
    if inp.accounting == "paper":
        raise UserError("--pp has no ZeRO-paper accounting; use --accounting shardtune")
    return split_layers(m.arch.num_layers, inp.pp, inp.pp_virtual_stages, inp.pp_layers)


def stage_inputs(inp, strategy: str):
    """The inputs of one stage: gpus / pp ranks (a node's share, or whole nodes), no pipeline."""
    ranks = inp.gpus // inp.pp
    per_node = min(inp.gpus_per_node, ranks)
    return resolve_inputs(replace(inp, gpus=ranks, nodes=ranks // per_node, gpus_per_node=per_node, pp=1,
                                  pp_schedule="1f1b", pp_virtual_stages=1, pp_layers=None, strategies=[strategy]))


def plan_pipeline(m: _Model, strategy: str, inp, usable: int, plan_one):
    """A StrategyPlan of `strategy` with pp stages: each rank's stage planned by `plan_one`
    (strategy_plan.plan_strategy) on its own ranks; the plan's memory is the worst stage's, and
    `stages` lists every rank's."""
    ranks = check_pipeline(m, inp)
    sub = stage_inputs(inp, strategy)
    mb = inp.grad_accum
    e = 4 if inp.precision == "fp32" else 2
    nbytes = boundary_bytes(m.arch.hidden_size, inp.micro_batch, inp.seq_len, e, inp.tp, inp.sequence_parallel,
                            inp.cp)
    last_rank = (inp.pp * inp.pp_virtual_stages - 1) % inp.pp
    plans, models = [], []
    for r, layers in enumerate(ranks):
        flight = in_flight(r, inp.pp, mb, inp.pp_schedule, inp.pp_virtual_stages)
        head_flight = mb if inp.pp_schedule == "gpipe" else 1
        sm = stage_model(m, layers, r == 0, r == last_rank, {"in_flight": flight, "head_in_flight": head_flight})
        models.append(sm)
        plans.append(plan_one(sm, strategy, sub, usable, per_rank=False))
    worst = max(range(inp.pp), key=lambda r: plans[r].memory.total)
    sends = sends_per_step(inp.pp, mb, inp.pp_virtual_stages)
    pipe = {"pp": inp.pp, "schedule": inp.pp_schedule, "virtual_stages": inp.pp_virtual_stages,
            "microbatches": mb, "bubble": bubble_fraction(inp.pp, mb, inp.pp_schedule, inp.pp_virtual_stages),
            "boundary_bytes": nbytes, "p2p_bytes_per_step": sends * nbytes, "worst_stage": worst}
    stages = [{"rank": r, "layers": len(ranks[r]), "first_layer": ranks[r][0] if ranks[r] else None,
               "embedding": r == 0, "head": r == last_rank, "in_flight_microbatches": models[r].stage["in_flight"],
               "memory": _bytes(plans[r].memory), "fits": plans[r].fits} for r in range(inp.pp)]
    w = plans[worst]
    return replace(w, fits=all(p.fits for p in plans), headroom_bytes=min(p.headroom_bytes for p in plans),
                   comm_bytes_per_step=w.comm_bytes_per_step + pipe["p2p_bytes_per_step"],
                   layout=dict(w.layout, pp=inp.pp), pipeline=pipe, stages=stages,
                   stage_ctx=_StageContext(models, sub, plans))


class _StageContext:
    """What timing needs of a pipeline plan's stages (kept out of plan.json)."""

    def __init__(self, models: list[_Model], inputs, plans: list):
        self.models, self.inputs, self.plans = models, inputs, plans


def time_pipeline(sp, inp, predict, cluster: Cluster, tokens: float | None) -> dict:
    """Step time of a pipeline plan: the slowest stage's own step (its m micro-batches with its
    FSDP/TP communication exposed as without pp, and its optimizer), plus every micro-batch's
    waits on the boundary's P2P (2·v·m transfers on the busiest rank, not overlapped: the
    schedules wait on each receive before computing), plus the bubble: pp − 1 slots of a
    micro-batch's (chunk's) forward, backward and two transfers. `predict(stage_model,
    stage_plan, stage_cluster)` is timing.predict_strategy for one stage."""
    pipe, ctx = sp.pipeline, sp.stage_ctx
    sub = ctx.inputs
    stage_cluster = Cluster(sub.nodes, sub.gpus_per_node, cluster.intra, cluster.inter)
    times = [predict(sm, p, stage_cluster) for sm, p in zip(ctx.models, ctx.plans, strict=True)]
    m, v, P = pipe["microbatches"], pipe["virtual_stages"], pipe["pp"]
    tau = p2p_time_s(pipe["boundary_bytes"], cluster, P)
    slot = max(t["compute_time_s"] for t in times) / m / v + 2 * tau
    p2p = sends_per_step(P, m, v) * tau
    bubble = (P - 1) * slot
    step = max(t["step_time_s"] for t in times) + p2p + bubble
    lay = plan_layout(inp, sp.name)  # a step's rows: micro_batch × m on each of its dp data ranks
    tokens_per_gpu = inp.micro_batch * inp.seq_len * m * lay.dp / lay.world_size
    out = {"step_time_s": step, "tokens_per_s": tokens_per_gpu / step,
           "mfu": sum(t["mfu"] * t["step_time_s"] for t in times) / (P * step),
           "comm_time_s": max(t["comm_time_s"] for t in times) + p2p,
           "exposed_comm_s": max(t["exposed_comm_s"] for t in times) + p2p,
           "compute_time_s": max(t["compute_time_s"] for t in times),
           "optimizer_time_s": max(t["optimizer_time_s"] for t in times),
           "bubble_time_s": bubble, "p2p_time_s": p2p}
    if tokens:
        wall = tokens / (out["tokens_per_s"] * cluster.world_size)
        out.update(train_time_s=wall, gpu_hours=wall * cluster.world_size / 3600.0)
    return {k: float(f"{val:.4g}") for k, val in out.items()}


def balanced_split(num_layers: int, stages: int) -> list[int] | None:
    """An uneven split for `plan --fit` when the stages do not divide the layers: the remainder
    goes to the middle stages, so the first (embedding) and last (head) stages hold fewer; None
    when they divide (the even split needs no --pp-layers)."""
    if num_layers % stages == 0 or num_layers < stages:
        return None
    base, extra = divmod(num_layers, stages)
    sizes = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for i in range(extra):
        sizes[middle[i % len(middle)]] += 1
    return sizes


def _bytes(mem) -> dict:
    """A stage's memory fields in bytes (the peak's moment and parts are the strategy's `peak`)."""
    return {k: v for k, v in vars(mem).items() if k not in ("peak_phase", "at_peak")}
