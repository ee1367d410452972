"""Communication and step time: ring costs, α-β model, hierarchical clusters, FSDP overlap.

Pure Python, imports no torch. Sizes follow nccl-tests (doc/PERFORMANCE.md): `size_bytes` is the
whole buffer — the all-reduce buffer, the all-gather output, the reduce-scatter input. Per rank a
ring moves (NVIDIA nccl-tests PERFORMANCE.md; Patarasuk & Yuan 2009):
  all-reduce      2(n−1)/n · S in 2(n−1) steps
  all-gather      (n−1)/n · S  in n−1 steps
  reduce-scatter  (n−1)/n · S  in n−1 steps
  broadcast       S            in n−1 pipelined steps (nccl-tests: busbw = algbw)
and busbw = algbw × that factor, so time = steps·α + factor·S / busbw (the α-β model).

The factor is the bytes of the busiest rank. For all-reduce, all-gather and reduce-scatter every
rank sends that much; a broadcast is a pipelined chain root → … → last, in which n−1 ranks
forward all S bytes and the last sends none: time S / busbw, but (n−1)/n · S sent per rank on
average (`ring_bytes_per_rank`, what plan/comm.py counts). ZeroRedundancyOptimizer (zero1)
broadcasts each rank's partition from its owner (torch: parameter by parameter), one after another
on the communicator: Σ B_i = S in all, so S / busbw plus (n−1)α per call, and (n−1)/n · S sent per
rank. We price n calls (one per partition, `num_calls`); torch's per-tensor calls add more α.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for a collective over n ranks (PERFORMANCE.md)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if kind == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {kind!r}; one of {', '.join(KINDS)}")


def ring_steps(kind: str, n: int) -> int:
    """Latency-bound steps of the ring algorithm (each costs α)."""
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def ring_bytes_per_rank(kind: str, size_bytes: float, n: int) -> float:
    """Bytes each rank sends on average: bus_factor × S (e.g. 2(n−1)/n·S for all-reduce), except a
    broadcast: (n−1)/n · S, as n−1 of the chain's n ranks forward S (module doc)."""
    if kind == "broadcast":
        return (n - 1) / n * size_bytes if n > 1 else 0.0
    return bus_factor(kind, n) * size_bytes


def collective_time_s(kind: str, size_bytes: float, n: int, busbw_bytes_per_s: float, alpha_s: float) -> float:
    """α-β ring time: steps·α + factor·S / busbw; 0 for a group of one."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return ring_steps(kind, n) * alpha_s + bus_factor(kind, n) * size_bytes / busbw_bytes_per_s


@dataclass(frozen=True)
class Link:
    """Achieved bus bandwidth and per-step latency of one path, per collective kind if measured."""

    busbw_bytes_per_s: float
    alpha_s: float
    name: str = ""
    per_kind: dict = field(default_factory=dict)  # kind → (busbw_bytes_per_s, alpha_s) from a profile

    def for_kind(self, kind: str) -> tuple[float, float]:
        return self.per_kind.get(kind, (self.busbw_bytes_per_s, self.alpha_s))


@dataclass(frozen=True)
class Cluster:
    """num_nodes × gpus_per_node GPUs; `intra` per GPU inside a node, `inter` the node's NICs together."""

    num_nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node


def group_time_s(kind: str, size_bytes: float, group_size: int, ranks_per_node: int,
                 groups_per_node: int, cluster: Cluster, calls: int = 1) -> float:
    """Time of one collective over a group laid out on a hierarchical cluster.

    A group inside one node (`ranks_per_node == group_size`) uses the intra-node link. A group
    spanning nodes runs one ring through all its ranks; each node's outbound inter-node traffic
    per ring is the same factor·S as one rank's (NCCL spreads its rings over the NICs), so the
    ring's busbw is min(intra busbw, the node's NIC bandwidth ÷ `groups_per_node`, the number of
    such groups using those NICs at the same time — e.g. HSDP's replica groups, one per local
    rank). The latency per step is the slower link's. `calls`: the bytes go in that many equal
    collectives (FSDP2: one per wrapped module; DDP: one per bucket), each paying its own α.
    """
    if group_size <= 1:
        return 0.0
    if ranks_per_node >= group_size or cluster.num_nodes <= 1:
        bw, alpha = cluster.intra.for_kind(kind)
        return calls * collective_time_s(kind, size_bytes / calls, group_size, bw, alpha)
    inter_bw, inter_alpha = cluster.inter.for_kind(kind)
    bw = inter_bw / max(1, groups_per_node)
    if ranks_per_node > 1:
        intra_bw, intra_alpha = cluster.intra.for_kind(kind)
        bw, inter_alpha = min(bw, intra_bw), max(inter_alpha, intra_alpha)
    return calls * collective_time_s(kind, size_bytes / calls, group_size, bw, inter_alpha)


@dataclass(frozen=True)
class Group:
    """A process group's shape on the cluster: size, its ranks per node, groups sharing a node."""

    size: int
    ranks_per_node: int
    groups_per_node: int


def mesh_groups(cluster: Cluster, shard_size: int | None = None) -> dict[str, Group]:
    """The groups a strategy talks in: the whole world, and HSDP's shard and replica groups.

    Ranks are numbered node by node (torchrun's order) and the HSDP mesh is (replicate, shard)
    with the shard dimension innermost (FSDP2's `init_device_mesh(..., (r, s))`), so a shard
    group holds consecutive ranks and a replica group takes one rank from each shard group.
    """
    n, g = cluster.world_size, cluster.gpus_per_node
    s = shard_size or n
    if n % s:
        raise ValueError(f"shard size {s} does not divide world size {n}")
    r = n // s
    world = Group(n, min(n, g), 1)
    shard = Group(s, min(s, g), max(1, g // s))
    # A replica group: ranks {j, j+s, j+2s, ...}. On one node of g ranks it has max(1, g // s)
    # members when s < g (several shard groups per node) and 1 when s ≥ g; each of the s
    # (or g, if s ≥ g) local positions belongs to a different replica group.
    replica = Group(r, max(1, g // s) if s < g else 1, min(s, g))
    return {"world": world, "shard": shard, "replica": replica}


@dataclass(frozen=True)
class CommOp:
    """One collective a strategy issues, for the whole model (spread evenly over its layers).

    The fields are those of `shardtune.plan.comm.Collective`, which `step_time` also accepts.
    `phase`: "forward" / "backward" collectives overlap with that phase's compute layer by layer
    (FSDP2 prefetch, DDP's bucketed all-reduce); "optimizer" ones run exposed after backward.
    `count_per`: "micro_batch" or "step" (DDP and HSDP's replica all-reduce sync grads only on
    the last micro-batch).
    """

    op: str
    payload_bytes: float
    group: str  # "world" | "shard" | "replica"
    phase: str  # "forward" | "backward" | "optimizer"
    count_per: str = "micro_batch"


def exposed_time_s(comm_s: float, compute_s: float, num_layers: int) -> float:
    """Communication not hidden behind compute when each of L layers prefetches the next one's.

    Per layer c = comm/L and f = compute/L. The first layer's collective cannot overlap (nothing
    runs before it); after that a layer's collective hides behind the previous layer's compute,
    and only max(0, c − f) shows. Exposed = L·max(0, c − f) + min(c, f). Check: c ≫ f gives
    L·c − (L−1)·f (the link is the critical path, plus the last layer's compute); c ≪ f gives c.
    """
    if comm_s <= 0:
        return 0.0
    L = max(1, num_layers)
    c, f = comm_s / L, compute_s / L
    return L * max(0.0, c - f) + min(c, f)


@dataclass
class StepTime:
    """One optimizer step on one rank, in seconds; `comm_time_s` is the total on the wire."""

    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    exposed_comm_s: float
    optimizer_time_s: float
    forward_comm_s: float
    backward_comm_s: float
    optimizer_comm_s: float


DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel(bucket_cap_mb=25), torch's default


def num_calls(op, num_layers: int, group_size: int) -> int:
    """How many collectives carry `op`'s bytes: FSDP2 issues one per wrapped module (each decoder
    layer and the root: L + 1), DDP one per 25 MiB gradient bucket, ZeroRedundancyOptimizer one
    broadcast per rank's partition."""
    if op.op in ("all_gather", "reduce_scatter") or op.group == "replica":
        return num_layers + 1
    if op.op == "broadcast":
        return max(1, group_size)
    return max(1, math.ceil(op.payload_bytes / DDP_BUCKET_BYTES))


def op_time_s(op, groups: dict[str, Group], cluster: Cluster, num_layers: int = 0) -> float:
    """Time of a CommOp / plan.comm.Collective on its group, split into `num_calls` collectives."""
    g = groups[op.group]
    return group_time_s(op.op, op.payload_bytes, g.size, g.ranks_per_node, g.groups_per_node, cluster,
                        num_calls(op, num_layers, g.size))


def fsdp_copy_bytes(op, n: int) -> float:
    """Bytes FSDP2 copies in memory around one of its collectives (S = the whole buffer).

    all-gather: copy-in of the local shard into the send buffer (read + write S/n) and copy-out of
    the gathered buffer into the unsharded parameters (read + write S); reduce-scatter: copy-in of
    the unsharded grads (read + write S) and accumulation of the S/n output into the sharded grad
    (read 2·S/n, write S/n) — torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py. DDP
    (gradient_as_bucket_view) and HSDP's in-place replica all-reduce copy nothing extra.
    """
    if op.op == "all_gather":
        return 2.0 * op.payload_bytes + 2.0 * op.payload_bytes / n
    if op.op == "reduce_scatter":
        return 2.0 * op.payload_bytes + 3.0 * op.payload_bytes / n
    return 0.0


def step_time(ops: list, cluster: Cluster, groups: dict[str, Group], forward_s: float,
              backward_s: float, num_layers: int, grad_accum: int = 1, optimizer_s: float = 0.0,
              overlap: bool = True, copy_bytes_per_s: float | None = None) -> StepTime:
    """Step time = micro-batches × (compute + exposed comm) + exposed per-step comm + optimizer.

    `forward_s` / `backward_s` are one micro-batch's compute (backward includes recomputation).
    Collectives of one phase on different links (HSDP: shard group on NVLink, replica group on
    the NICs) proceed in parallel, so a phase's comm is the slowest link's sum; collectives on
    the same link add up. `overlap=False` models a runtime that does not overlap at all.
    `copy_bytes_per_s` (memory bandwidth) prices FSDP2's copy-in/copy-out, which run on the
    collective's stream, so they count with its link (None: not counted).
    """
    def phase_comm(phase: str, every: str) -> dict[bool, float]:
        by_link: dict[bool, float] = {}  # crosses nodes? → seconds
        for op in ops:
            if op.phase == phase and op.count_per == every:
                g = groups[op.group]
                crosses = g.ranks_per_node < g.size and cluster.num_nodes > 1
                t = op_time_s(op, groups, cluster, num_layers)
                if copy_bytes_per_s:
                    t += fsdp_copy_bytes(op, g.size) / copy_bytes_per_s
                by_link[crosses] = by_link.get(crosses, 0.0) + t
        return by_link

    def slowest(*parts: dict[bool, float]) -> float:
        """Collectives on one link add up; different links run in parallel."""
        return max((sum(p.get(k, 0.0) for p in parts) for k in set().union(*parts)), default=0.0)

    def exposed(comm: float, compute: float) -> float:
        return exposed_time_s(comm, compute, num_layers) if overlap else comm

    links = {(ph, ev): phase_comm(ph, ev) for ph in ("forward", "backward", "optimizer")
             for ev in ("micro_batch", "step")}
    (fw_mb, bw_mb), (fw_st, bw_st) = ([slowest(links[ph, ev]) for ph in ("forward", "backward")]
                                      for ev in ("micro_batch", "step"))
    opt_comm = slowest(links["optimizer", "micro_batch"]) * grad_accum + slowest(links["optimizer", "step"])
    k = max(1, grad_accum)
    # Micro-batches without per-step traffic, then the last one carrying both kinds (HSDP: the
    # replica all-reduce on the NICs beside the shard group's collectives on NVLink).
    exposed_mb = exposed(fw_mb, forward_s) + exposed(bw_mb, backward_s)
    exposed_last = (exposed(slowest(links["forward", "micro_batch"], links["forward", "step"]), forward_s)
                    + exposed(slowest(links["backward", "micro_batch"], links["backward", "step"]), backward_s))
    exposed_total = (k - 1) * exposed_mb + exposed_last + opt_comm
    compute = k * (forward_s + backward_s)
    comm_total = k * (fw_mb + bw_mb) + fw_st + bw_st + opt_comm
    return StepTime(
        step_time_s=compute + exposed_total + optimizer_s,
        compute_time_s=compute,
        comm_time_s=comm_total,
        exposed_comm_s=exposed_total,
        optimizer_time_s=optimizer_s,
        forward_comm_s=k * fw_mb + fw_st,
        backward_comm_s=k * bw_mb + bw_st,
        optimizer_comm_s=opt_comm,
    )


def throughput(step_time_s: float, tokens_per_step_per_gpu: float) -> float:
    """Tokens per second per GPU."""
    return tokens_per_step_per_gpu / step_time_s


def time_for_tokens(total_tokens: float, tokens_per_s_per_gpu: float, num_gpus: int) -> tuple[float, float]:
    """(wall-clock seconds, GPU-hours) to train on `total_tokens`."""
    wall_s = total_tokens / (tokens_per_s_per_gpu * num_gpus)
    return wall_s, wall_s * num_gpus / 3600.0


# ---- From a plan's pieces to per-strategy times -------------------------------------------

# What an optimizer update streams when it runs on the host (offload): a 2-socket server's
# ~300 GB/s of DRAM bandwidth shared by 8 GPUs' optimizer threads, and CPU Adam is partly
# compute-bound, so we take 20 GB/s per GPU (an assumption; the step is small next to comm).
HOST_OPTIMIZER_BYTES_PER_S = 20e9
# Host↔GPU copies under offload: PCIe 4.0 x16, ~25 GB/s achieved (31.5 GB/s line rate).
PCIE_BYTES_PER_S = 25e9
TIMING_OPTIONS = ("interconnect", "intra_node", "network_profile", "mfu", "tokens", "nics_per_node")


def build_cluster(nodes: int, gpus_per_node: int, gpu_name: str, interconnect: str | None = None,
                  intra_node: str | None = None, nics_per_node: int | None = None,
                  network_profile: str | None = None) -> tuple[Cluster, dict]:
    """The Cluster a plan prices collectives on, and a description for the report.

    Catalogue links (shardtune.catalog.interconnects) unless a measured profile is given: its
    per-collective busbw replaces the link of its scope (intra: inside a node; inter: between
    nodes — measured across nodes, a ring's busbw is already the node's NIC bandwidth).
    """
    from shardtune.catalog.interconnects import default_intra_node, get_interconnect

    intra_c = get_interconnect(intra_node or default_intra_node(gpu_name), "intra")
    inter_c = get_interconnect(interconnect or "ib-ndr-400", "inter")
    nics = nics_per_node or inter_c.nics_per_node
    intra = Link(intra_c.achieved_busbw_gbps * 1e9, intra_c.alpha_s, intra_c.name)
    inter = Link(inter_c.achieved_busbw_gbps * 1e9 * nics, inter_c.alpha_s, f"{inter_c.name} × {nics}")
    desc = {"intra_node": intra_c.name, "intra_busbw_gbps": intra_c.achieved_busbw_gbps,
            "interconnect": inter_c.name if nodes > 1 else None, "nics_per_node": nics if nodes > 1 else None,
            "inter_busbw_gbps_per_node": inter_c.achieved_busbw_gbps * nics if nodes > 1 else None,
            "interconnect_defaulted": nodes > 1 and interconnect is None, "network_profile": None}
    if network_profile:
        from shardtune.netbench.profile import load_profile, profile_link

        prof = load_profile(network_profile)
        link = profile_link(prof)
        if prof["scope"] == "inter":
            inter = link
        else:
            intra = link
        desc["network_profile"] = {"path": str(network_profile), "scope": prof["scope"],
                                   "busbw_gbps": {k: v["busbw_gbps"] for k, v in prof["links"].items()}}
    return Cluster(nodes, gpus_per_node, intra, inter), desc


def predict_strategy(arch, collectives: list, *, strategy: str, shard_degree: int, cluster: Cluster,
                     micro_batch: int, seq_len: int, grad_accum: int, ac: str, ac_every: int,
                     trainable_params: int, num_params: int, active_params: int, lora: bool,
                     offload: str, optimizer: str, peak_flops_per_s: float, mfu: float,
                     mem_bw_bytes_per_s: float, tokens: float | None = None, overlap: bool = True) -> dict:
    """Step time, tokens/s per GPU, MFU, comm and compute time for one strategy (JSON fields).

    `mfu` is the achievable MFU of a compute-only step (compute.achievable_mfu, or --mfu): the
    compute kernels run at mfu × peak; recompute and exposed communication then lower the MFU
    reported here. `arch` None (a bare --params count): 6N FLOPs per token, no attention term.
    """
    from shardtune.plan import compute as C

    if arch is not None:
        L, H, Q = arch.num_layers, arch.num_heads, arch.head_dim
        embed = arch.vocab_size * arch.hidden_size
        norms = (2 * L + 1) * arch.hidden_size
        n_mm = active_params - norms - (0 if arch.tie_embeddings else embed)
        layer_mm = n_mm - embed  # minus the LM head
        k = arch.experts_per_token if arch.num_experts else 1
        down = k * arch.intermediate_size * arch.hidden_size
    else:
        L, H, Q, n_mm, layer_mm, down = 1, 0, 0, num_params, num_params, 0
    fwd_tok = C.forward_flops_per_token(n_mm, L, H, Q, seq_len)
    model_tok = C.model_flops_per_token(n_mm, L, H, Q, seq_len)
    if lora:  # frozen base weights: backward computes input grads (2N) but no weight grads (2N)
        model_tok -= 2.0 * n_mm
    recompute_tok = C.recompute_flops_per_token(ac, layer_mm, L, H, Q, seq_len, ac_every, down) if arch else (
        2.0 * num_params if ac == "full" else 0.0)
    tokens_mb = micro_batch * seq_len
    rate = peak_flops_per_s * mfu
    forward_s = tokens_mb * fwd_tok / rate
    backward_s = tokens_mb * (model_tok - fwd_tok + recompute_tok) / rate

    owners = {"ddp": 1, "hsdp": shard_degree}.get(strategy, cluster.world_size)
    params_per_rank = trainable_params / owners
    if offload in ("optimizer", "all"):
        optimizer_s = (C.optimizer_step_time_s(params_per_rank, HOST_OPTIMIZER_BYTES_PER_S, optimizer)
                       + C.offload_transfer_time_s(params_per_rank, PCIE_BYTES_PER_S))
    else:
        optimizer_s = C.optimizer_step_time_s(params_per_rank, mem_bw_bytes_per_s, optimizer)
    groups = mesh_groups(cluster, shard_degree if strategy == "hsdp" else None)
    st = step_time(collectives, cluster, groups, forward_s, backward_s, L, grad_accum, optimizer_s, overlap,
                   copy_bytes_per_s=mem_bw_bytes_per_s)
    tokens_step = tokens_mb * grad_accum
    tps = throughput(st.step_time_s, tokens_step)
    out = {
        "step_time_s": st.step_time_s,
        "tokens_per_s": tps,
        "mfu": C.mfu(model_tok * tokens_step, st.step_time_s, peak_flops_per_s),
        "comm_time_s": st.comm_time_s,
        "exposed_comm_s": st.exposed_comm_s,
        "compute_time_s": st.compute_time_s,
        "optimizer_time_s": st.optimizer_time_s,
    }
    if tokens:
        wall, gpu_h = time_for_tokens(tokens, tps, cluster.world_size)
        out.update(train_time_s=wall, gpu_hours=gpu_h)
    return {k: float(f"{v:.4g}") for k, v in out.items()}


def timing_context(inp, gpu, *, interconnect: str | None = None, intra_node: str | None = None,
                   nics_per_node: int | None = None, network_profile: str | None = None,
                   mfu: float | None = None, tokens: float | None = None) -> dict:
    """Checked timing options → {"cluster", "mfu", "tokens", "network" (a description)}."""
    from shardtune.errors import UserError
    from shardtune.plan.compute import achievable_mfu

    if mfu is not None and not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise UserError(f"--mfu {mfu!r} must be a fraction in (0, 1], e.g. 0.4")
    if tokens is not None and not (isinstance(tokens, (int, float)) and tokens > 0):
        raise UserError(f"--tokens {tokens!r} must be a positive number of tokens, e.g. 1e9")
    if nics_per_node is not None and not (isinstance(nics_per_node, int) and 1 <= nics_per_node <= 64):
        raise UserError(f"--nics-per-node {nics_per_node!r} must be an integer from 1 to 64")
    cluster, net = build_cluster(inp.nodes, inp.gpus_per_node, gpu.name, interconnect, intra_node,
                                 nics_per_node, network_profile)
    mfu_used, mfu_source = (mfu, "--mfu") if mfu is not None else achievable_mfu(gpu.name)
    net["mfu_assumed"], net["mfu_source"] = mfu_used, mfu_source
    return {"cluster": cluster, "mfu": mfu_used, "tokens": tokens, "network": net}


def time_strategy(sp, arch, model_info: dict, inp, gpu, ctx: dict) -> dict:
    """predict_strategy for one api.StrategyPlan under `inp` (validate.Inputs)."""
    return predict_strategy(
        arch, sp.collectives, strategy=sp.name, shard_degree=sp.shard_degree, cluster=ctx["cluster"],
        micro_batch=inp.micro_batch, seq_len=inp.seq_len, grad_accum=inp.grad_accum, ac=inp.ac,
        ac_every=inp.ac_every, trainable_params=model_info["trainable_params"],
        num_params=model_info["params"], active_params=model_info.get("active_params") or model_info["params"],
        lora=bool(inp.lora_rank), offload=inp.offload, optimizer=inp.optimizer,
        peak_flops_per_s=gpu.bf16_flops, mfu=ctx["mfu"], mem_bw_bytes_per_s=gpu.hbm_bytes_per_s,
        tokens=ctx["tokens"])


def add_timing(result, arch, inp, gpu, **options) -> None:
    """Fill each StrategyPlan's `timing` (the JSON fields step_time_s, tokens_per_s, mfu,
    comm_time_s, compute_time_s, ...) and describe the network and MFU assumption in the result.
    `options`: those of `timing_context` (TIMING_OPTIONS)."""
    ctx = timing_context(inp, gpu, **options)
    net = ctx["network"]
    result.hardware["network"] = net
    for sp in result.strategies:
        sp.timing = time_strategy(sp, arch, result.model, inp, gpu, ctx)
    if net["interconnect_defaulted"]:
        result.notes.append(f"no --interconnect given: timed with {net['interconnect']} × {net['nics_per_node']} "
                            "per node; give --interconnect (e.g. eth-10g) or --network-profile FILE")
    result.notes.append(f"step time assumes {ctx['mfu']:.0%} MFU for the compute ({net['mfu_source']}); "
                        "exposed comm = per layer max(0, comm − compute) (FSDP prefetch / DDP buckets)")
