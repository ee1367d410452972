"""Ring collective costs (α-β model) on a two-level cluster, and reading a measured network profile.

Pure Python, imports no torch. Sizes follow nccl-tests (doc/PERFORMANCE.md): `size_bytes` is the
whole buffer — the all-reduce buffer, the all-gather output, the reduce-scatter input. Per rank a
ring moves (NVIDIA nccl-tests PERFORMANCE.md; Patarasuk & Yuan 2009):
  all-reduce      2(n−1)/n · S in 2(n−1) steps
  all-gather      (n−1)/n · S  in n−1 steps
  reduce-scatter  (n−1)/n · S  in n−1 steps
  broadcast       S            in n−1 pipelined steps (nccl-tests: busbw = algbw)
  all-to-all      (n−1)/n · S  in n−1 steps (S: one rank's send buffer; nccl-tests alltoall)
and busbw = algbw × that factor, so time = steps·α + factor·S / busbw (the α-β model).

A broadcast sends (n−1)/n · S per rank on average but takes S / busbw; zero1's per-partition
broadcasts are priced as n calls (`num_calls`): docs/planner.md, "Ring costs".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.errors import UserError, read_json_object
from shardtune.layout import Layout

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for a collective over n ranks (PERFORMANCE.md)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
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
    rank). The latency per step is the slower link's. An all-to-all across nodes is no ring: the
    node's r members each send (n − r)/n of their S to other nodes at once, r·S·(n − r)/n through
    the node's NIC share. `calls`: the bytes go in that many equal collectives (FSDP2: one per
    wrapped module; DDP: one per bucket), each paying its own α.
    """
    if group_size <= 1:
        return 0.0
    if ranks_per_node >= group_size or cluster.num_nodes <= 1:
        bw, alpha = cluster.intra.for_kind(kind)
        return calls * collective_time_s(kind, size_bytes / calls, group_size, bw, alpha)
    inter_bw, inter_alpha = cluster.inter.for_kind(kind)
    bw = inter_bw / max(1, groups_per_node)
    if kind == "all_to_all":  # not a ring: each of a node's members sends its other-node share at once
        leaving = ranks_per_node * (size_bytes / calls) * (group_size - ranks_per_node) / group_size
        return calls * ((group_size - 1) * inter_alpha + leaving / bw)
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


def mesh_groups(cluster: Cluster, layout: Layout | None = None) -> dict[str, Group]:
    """The groups a strategy talks in: the data-parallel world, HSDP's shard and replica groups,
    and the tensor-, context- and expert-parallel groups, of `layout`'s degrees (layout.py; its
    hsdp shard group is FSDP's, dp_shard × cp). None: one data-parallel group over the cluster.

    Ranks are numbered node by node (torchrun's order) and the mesh is (replicate, shard, tp)
    with tp innermost, then the shard dimension (FSDP2's `init_device_mesh(..., (r, s))`), so a
    TP group is `tp` consecutive ranks of one node, and the data-parallel groups are those of a
    cluster of g/tp ranks per node, `tp` of them (one per TP position) sharing each node's NICs.
    """
    if layout is not None and layout.world_size != cluster.world_size:
        raise ValueError(f"a layout of {layout.world_size} ranks on a cluster of {cluster.world_size} GPUs")
    tp, cp, ep = (layout.tp, layout.cp, layout.ep) if layout is not None else (1, 1, 1)
    n, g = cluster.world_size // tp, max(1, cluster.gpus_per_node // tp)
    s = layout.fsdp_shard_degree if layout is not None and layout.strategy.hybrid else n
    r = n // s
    world = Group(n, min(n, g), 1)
    shard = Group(s, min(s, g), max(1, g // s))
    # A replica group: ranks {j, j+s, j+2s, ...}. On one node of g ranks it has max(1, g // s)
    # members when s < g (several shard groups per node) and 1 when s ≥ g; each of the s
    # (or g, if s ≥ g) local positions belongs to a different replica group.
    replica = Group(r, max(1, g // s) if s < g else 1, min(s, g))
    shared = min(tp, cluster.gpus_per_node)  # data-parallel groups (one per TP position) on a node
    dp = {k: Group(v.size, v.ranks_per_node, v.groups_per_node * shared) for k, v in
          (("world", world), ("shard", shard), ("replica", replica))}
    # a CP group: cp data-parallel-numbered ranks, tp apart (mesh (..., dp_shard, cp, tp)), inside a
    # node when cp·tp ≤ gpus per node; its all-to-alls share the NICs with the node's other CP groups
    in_node = min(cp, g)
    dp["cp"] = Group(cp, in_node, max(1, cluster.gpus_per_node // in_node))
    # ep (plan/ep.py): ep consecutive data ranks of a shard group, one node's while ep <= g; the experts'
    # FSDP group ("efsdp"): the shard group's ranks ep apart, shard / ep of them
    dp["ep"] = Group(ep, min(ep, g), max(1, g // min(ep, g)) * shared)
    e, in_shard = max(1, s // ep), min(s, g)
    dp["efsdp"] = Group(e, max(1, min(e, in_shard // ep)), max(1, g // max(1, in_shard // ep)) * shared)
    # a TP group larger than a node (--tp-across-nodes) spans tp / gpus_per_node whole nodes
    return dict(dp, tp=Group(tp, min(tp, cluster.gpus_per_node), max(1, cluster.gpus_per_node // tp)))


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



DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel(bucket_cap_mb=25), torch's default


def num_calls(op, num_layers: int, group_size: int) -> int:
    """How many collectives carry `op`'s bytes: FSDP2 issues one per wrapped module (each decoder
    layer and the root: L + 1), DDP one per 25 MiB gradient bucket, ZeroRedundancyOptimizer one
    broadcast per rank's partition; an op that says its own `calls` (TP's per-layer collectives)."""
    if getattr(op, "calls", 0):
        return op.calls
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


# ---- A measured network profile (`shardtune bench comm -o FILE`, netbench/profile.py writes it) --------

def load_profile(path: str | Path) -> dict:
    """Read and check a profile file; UserError with the fix when it is not one."""
    p = Path(path)
    prof = read_json_object(p, "network profile", f"write one with `shardtune bench comm -o {p}`")
    if not isinstance(prof.get("links"), dict) or not prof["links"]:
        raise UserError(f"{str(p)!r} is not a shardtune network profile (no 'links'); rerun `shardtune bench comm "
                        "-o FILE`")
    for kind, v in prof["links"].items():
        if kind not in KINDS or not isinstance(v, dict) or not float(v.get("busbw_gbps", 0)) > 0:
            raise UserError(f"network profile {str(p)!r}: bad entry for {kind!r}; rerun `shardtune bench comm -o FILE`")
    if prof.get("scope") not in ("intra", "inter"):
        raise UserError(f"network profile {str(p)!r}: 'scope' must be 'intra' or 'inter'")
    return prof


def profile_link(prof: dict) -> Link:
    """A timing.Link from a profile: per-collective busbw and α; the default is all-reduce's."""
    per_kind = {k: (float(v["busbw_gbps"]) * 1e9, float(v.get("alpha_s", 0.0))) for k, v in prof["links"].items()}
    if "broadcast" not in per_kind and "all_gather" in per_kind:
        per_kind["broadcast"] = per_kind["all_gather"]  # same ring pattern, bus factor 1 vs (n-1)/n
    base = per_kind.get("all_reduce") or next(iter(per_kind.values()))
    name = f"measured ({prof.get('backend', '?')}, {prof.get('world_size', '?')} ranks)"
    return Link(busbw_bytes_per_s=base[0], alpha_s=base[1], name=name, per_kind=per_kind)
