"""Is the recipe's strategy communication-bound on this interconnect? If so, say what is better.

Asks the planner (`shardtune.plan.plan`: exact parameter counts, each strategy's collectives from
plan/comm.py, the α-β ring step-time model with FSDP overlap from plan/timing.py, catalogue GPUs
and links) for the recipe's step on the launch's nodes × GPUs, and for hsdp with the shard group
inside a node: zero3 all-gathers the parameters in forward and in backward and reduce-scatters the
gradients across every rank, so across nodes all of it crosses the NICs; hsdp keeps that inside a
node and sends only an all-reduce of each gradient shard between nodes.

"Communication-bound" here means the collectives of a step take longer on the wire than the
step's compute, so no amount of overlap can hide them.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.catalog.models import resolve_model_config
from shardtune.config import RunConfig
from shardtune.errors import UserError
from shardtune.layout import Layout
from shardtune.plan.api import plan
from shardtune.plan.pipeline import balanced_split
from shardtune.rules.pipeline import recipe_pipeline_gap

# The catalogue link a network preset stands for, unless the user names one (--link).
DEFAULT_LINK = {"ib": "ib-ndr-400", "roce": "roce-400", "efa": "efa", "eth": "eth-10g"}


@dataclass(frozen=True)
class Estimate:
    strategy: str
    shard_size: int | None
    step_s: float
    compute_s: float
    comm_s: float

    @property
    def comm_bound(self) -> bool:
        return self.comm_s > self.compute_s


def estimate(cfg: RunConfig, nodes: int, gpus_per_node: int, interconnect: str, link: str | None = None,
             strategy: str | None = None, shard_size: int | None = None, **inputs) -> Estimate:
    """The planner's predicted step (`shardtune.plan.plan`) for the recipe, or for `strategy`,
    on nodes × gpus_per_node GPUs joined by `link` (default: the preset's catalogue link);
    `inputs`: planner inputs that replace the recipe's (a pipeline's pp, grad_accum, pp_layers)."""
    strategy, par = strategy or cfg.parallel.strategy, cfg.parallel
    # hsdp's shard group: the one rule (layout.Layout), one node's data-parallel ranks unless the recipe says
    layout = Layout.of_config(par, nodes * gpus_per_node, gpus_per_node, strategy, shard_size)
    shard_size = layout.shard_degree if layout.strategy.hybrid else None
    # the recipe's own planner inputs (RunConfig.plan_inputs: cp, LoRA, optimizer, objective … included)
    p = plan(**{**cfg.plan_inputs(), "gpus": nodes * gpus_per_node, "nodes": nodes, "gpus_per_node": gpus_per_node,
                "hsdp_shard_size": shard_size, "strategies": [strategy],
                "interconnect": link or DEFAULT_LINK[interconnect], **inputs})
    t = p.strategy(strategy).timing
    return Estimate(strategy, shard_size, t["step_time_s"], t["compute_time_s"],
                    t["comm_time_s"])


def comm_bound_warning(cfg: RunConfig, nodes: int, gpus_per_node: int, interconnect: str,
                       link: str | None = None) -> str | None:
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
           f"per step vs ~{cur.compute_s:.3g} s of compute (predicted step {cur.step_s:.3g} s; `shardtune plan` "
           "gives the details).")
    msg += _pipeline_advice(cfg, nodes, gpus_per_node, interconnect, link, cur)
    in_node = gpus_per_node // cfg.parallel.tp  # a node's data-parallel ranks (TP takes the rest)
    if in_node > 1 and cur.shard_size != in_node:  # shard_size: None unless hybrid
        alt = estimate(cfg, nodes, gpus_per_node, interconnect, link, strategy="hsdp", shard_size=in_node)
        if alt.step_s < cur.step_s:
            msg += (f" Better: hsdp with the shard group inside a node, ~{alt.step_s:.3g} s per step "
                    f"({cur.step_s / alt.step_s:.1f}x faster): add parallel.strategy=hsdp "
                    f"parallel.hsdp_shard_size={in_node}.")
            if alt.comm_bound:
                msg += (" Even that stays communication-bound: a faster interconnect or more tokens per "
                        "micro-batch would help.")
            return msg
    msg += " A faster interconnect (--link), fewer nodes, or more tokens per micro-batch would help."
    return msg


def _pipeline_advice(cfg: RunConfig, nodes: int, gpus_per_node: int, interconnect: str, link: str | None,
                     cur: Estimate) -> str:
    """" Better: a pipeline across the nodes …" when one stage a node (pp = nodes, the global batch
    kept by nodes × the micro-batches, plan/pipeline.py) is faster than the recipe's step; else ""."""
    if cfg.parallel.pp > 1:
        return ""
    ga = cfg.train.grad_accum * nodes
    try:
        split = balanced_split(_num_layers(cfg), nodes)
        alt = estimate(cfg, nodes, gpus_per_node, interconnect, link, pp=nodes, grad_accum=ga, pp_layers=split)
    except (UserError, KeyError, ValueError):  # a model outside the planner's families, a split it refuses
        return ""
    if alt.step_s >= cur.step_s:
        return ""
    given = f" 'parallel.pp_layers=[{','.join(map(str, split))}]'" if split else ""
    gap = recipe_pipeline_gap(cfg, nodes)  # the trainer's pipeline may not run this recipe's settings yet
    return (f" Better: a pipeline across the nodes (one stage a node, only activations on the link), ~{alt.step_s:.3g} "
            f"s per step ({cur.step_s / alt.step_s:.1f}x faster, the global batch kept): add --pp {nodes} "
            f"train.grad_accum={ga}{given}" + (f"; planned only: {gap}." if gap else "."))


def _num_layers(cfg: RunConfig) -> int:
    return int(resolve_model_config(cfg.model.plan_name())["num_hidden_layers"])
