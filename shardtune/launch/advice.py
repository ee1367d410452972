"""Is the recipe's strategy communication-bound on this interconnect? If so, say what is better.

Uses the planner's step-time model (`shardtune.plan.timing`: α-β ring costs on a hierarchical
cluster, FSDP overlap) with the catalogue's GPUs and links, and the exact parameter count
(`shardtune.plan.params`), and the planner's collectives per strategy (`shardtune.plan.comm`:
zero3 all-gathers the parameters in forward and again in backward and reduce-scatters the
gradients, hsdp does that inside a shard group plus an all-reduce of each gradient shard across
the replica groups; gathers in the compute dtype, reductions in the reduce dtype).

"Communication-bound" here means the collectives of a step take longer on the wire than the
step's compute, so no amount of overlap can hide them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from shardtune.catalog.gpus import resolve_gpu
from shardtune.catalog.interconnects import default_intra_node, get_interconnect
from shardtune.catalog.models import resolve_model_config
from shardtune.config import RunConfig
from shardtune.errors import UserError
from shardtune.plan import comm, compute, params, timing

# The catalogue link a network preset stands for, unless the user names one (--link).
DEFAULT_LINK = {"ib": "ib-ndr-400", "roce": "roce-400", "efa": "efa", "eth": "eth-10g"}


@dataclass(frozen=True)
class Estimate:
    strategy: str
    shard_size: Optional[int]
    step_s: float
    compute_s: float
    comm_s: float

    @property
    def comm_bound(self) -> bool:
        return self.comm_s > self.compute_s


def comm_ops(strategy: str, num_params: int, world_size: int, precision: str, shard_size: Optional[int],
             shapes=None) -> list[timing.CommOp]:
    """The planner's collectives for `strategy` (plan.comm.collectives) as timing ops."""
    colls = comm.collectives(strategy, num_params=num_params, trainable_params=num_params, world_size=world_size,
                             shard_degree=shard_size or world_size, precision=precision, shapes=shapes)
    return [timing.CommOp(c.op, c.payload_bytes, c.group, c.phase, c.count_per) for c in colls]


def estimate(cfg: RunConfig, nodes: int, gpus_per_node: int, interconnect: str, link: Optional[str] = None,
             strategy: Optional[str] = None, shard_size: Optional[int] = None) -> Estimate:
    """Predicted step of the recipe (or of `strategy`) on nodes × gpus_per_node GPUs."""
    arch = params.architecture_from_config(resolve_model_config(cfg.model.name))
    n = params.count_params(arch)
    gpu = resolve_gpu(cfg.train.gpu)
    mfu, _ = compute.achievable_mfu(gpu.name)
    seq, tokens = cfg.train.seq_len, cfg.train.micro_batch * cfg.train.seq_len
    mm = compute.matmul_params(n, arch.vocab_size, arch.hidden_size, arch.tie_embeddings)
    total = compute.model_flops_per_token(mm, arch.num_layers, arch.num_heads, arch.head_dim, seq) * tokens
    fwd = compute.forward_flops_per_token(mm, arch.num_layers, arch.num_heads, arch.head_dim, seq) * tokens
    inter = get_interconnect(link or DEFAULT_LINK[interconnect], scope="inter")
    intra = get_interconnect(default_intra_node(gpu.name), scope="intra")
    cluster = timing.Cluster(
        nodes, gpus_per_node,
        intra=timing.Link(intra.achieved_busbw_gbps * 1e9, intra.alpha_s, intra.name),
        inter=timing.Link(inter.achieved_busbw_gbps * inter.nics_per_node * 1e9, inter.alpha_s, inter.name))
    strategy = strategy or cfg.parallel.strategy
    if strategy == "hsdp":
        shard_size = shard_size or cfg.parallel.hsdp_shard_size or gpus_per_node
    groups = timing.mesh_groups(cluster, shard_size if strategy == "hsdp" else None)
    ops = comm_ops(strategy, n, cluster.world_size, cfg.parallel.precision, shard_size, params.param_shapes(arch))
    st = timing.step_time(ops, cluster, groups,
                          forward_s=compute.compute_time_s(fwd, gpu.bf16_flops, mfu),
                          backward_s=compute.compute_time_s(total - fwd, gpu.bf16_flops, mfu),
                          num_layers=arch.num_layers, grad_accum=cfg.train.grad_accum)
    return Estimate(strategy, shard_size if strategy == "hsdp" else None, st.step_time_s, st.compute_time_s, st.comm_time_s)


def comm_bound_warning(cfg: RunConfig, nodes: int, gpus_per_node: int, interconnect: str,
                       link: Optional[str] = None) -> Optional[str]:
    """A plain-words warning when the recipe is communication-bound across nodes, else None."""
    if nodes <= 1 or cfg.train.backend == "gloo":  # the model prices GPUs and their links, not CPU runs
        return None
    try:
        cur = estimate(cfg, nodes, gpus_per_node, interconnect, link)
    except (UserError, KeyError, ValueError) as e:  # model outside the planner's families, odd sizes
        return f"note: no communication estimate for this recipe ({e})"
    if not cur.comm_bound:
        return None
    name = link or DEFAULT_LINK[interconnect]
    where = f"{nodes} nodes x {gpus_per_node} GPUs on {name}"
    msg = (f"warning: {cur.strategy} across {where} is communication-bound: ~{cur.comm_s:.3g} s of collectives "
           f"per step vs ~{cur.compute_s:.3g} s of compute (predicted step {cur.step_s:.3g} s; shardtune.plan.timing).")
    if gpus_per_node > 1 and (cur.strategy, cur.shard_size) != ("hsdp", gpus_per_node):
        alt = estimate(cfg, nodes, gpus_per_node, interconnect, link, strategy="hsdp", shard_size=gpus_per_node)
        if alt.step_s < cur.step_s:
            msg += (f" Better: hsdp with the shard group inside a node, ~{alt.step_s:.3g} s per step "
                    f"({cur.step_s / alt.step_s:.1f}x faster): add parallel.strategy=hsdp "
                    f"parallel.hsdp_shard_size={gpus_per_node}.")
            if alt.comm_bound:
                msg += " Even that stays communication-bound: a faster interconnect or more tokens per micro-batch would help."
            return msg
    msg += " A faster interconnect (--link), fewer nodes, or more tokens per micro-batch would help."
    return msg
