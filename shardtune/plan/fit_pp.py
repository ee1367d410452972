"""`plan --fit`'s pipeline search (plan/pipeline.py): pp across nodes, each stage whole nodes with tp
inside; the global batch kept by more micro-batches per step (micro_batch × grad_accum × pp
constant at a tp), and the answer to "how much faster than FSDP across the nodes?". Imports no torch."""
from __future__ import annotations

from shardtune.rules.pipeline import settings_gap

GIB = 2**30


def pp_degrees(base, m, keep: frozenset[str]) -> list[int]:
    """1, one stage a node (pp = nodes) and two nodes a stage (nodes / 2), unless --pp was given
    (kept); a single node, a MoE model or a --params count: 1. Fewer, larger stages save nothing per
    GPU: the states are Ψ / world either way, and 1F1B's first stage keeps P micro-batches of L/P
    layers, one micro-batch of the whole model, whatever P."""
    if base.pp > 1 or "pp" in keep:
        return [base.pp]
    if m.arch is None or m.arch.num_experts or base.nodes < 2 or base.accounting != "shardtune":
        return [1]
    return [1, *sorted({p for p in (base.nodes // 2, base.nodes) if p >= 2 and base.nodes % p == 0})]


def pp_batches(mbs: tuple[int, ...], accum: int, pp: int, split: bool = True,
               keep_accum: bool = False) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) holding micro_batch × grad_accum × pp rows for each micro-batch
    of `mbs` (the global batch kept with pp times fewer data-parallel ranks), `split` into
    micro-batches of one row: the planner's compute runs at one MFU whatever the micro-batch, and
    the smallest has the smallest bubble and in-flight activations, so larger ones never win.
    Not `split` (--fit-batch, which searches the micro-batch): each micro-batch, pp × the micro-batches.
    `keep_accum` (--grad-accum given): pp × the micro-batch instead, where grad_accum ≥ pp."""
    if pp == 1:
        return [(mb, accum) for mb in mbs]
    if keep_accum:
        return [(mb * pp, accum) for mb in mbs] if accum >= pp else []
    return [(1, mb * accum * pp) for mb in mbs] if split else [(mb, accum * pp) for mb in mbs]


def pipeline_gain(fitting: list) -> dict | None:
    """The fastest pipeline candidate against the fastest without one (both fit)."""
    pipe = next((c for c in fitting if c.pp > 1), None)
    flat = next((c for c in fitting if c.pp == 1), None)
    if pipe is None:
        return None
    out = {"pipeline": pipe.label(), "pipeline_tokens_per_s": pipe.tokens_per_s, "without": None,
           "without_tokens_per_s": None, "speedup": None}
    if flat is not None:
        out.update(without=flat.label(), without_tokens_per_s=flat.tokens_per_s,
                   speedup=round(pipe.tokens_per_s / flat.tokens_per_s, 2))
    return out


def gain_line(gain: dict) -> str:
    if gain["without"] is None:
        return (f"pipeline across nodes: {gain['pipeline']} → {gain['pipeline_tokens_per_s']:,.0f} tokens/s per GPU; "
                "nothing without a pipeline fits")
    return (f"pipeline across nodes: {gain['pipeline']} → {gain['pipeline_tokens_per_s']:,.0f} tokens/s per GPU, "
            f"{gain['speedup']:,.2f}× the fastest without one ({gain['without']}: "
            f"{gain['without_tokens_per_s']:,.1f} tokens/s per GPU)")


def trainer_gap(best, base) -> str | None:
    """Why the trainer cannot run `best` yet (its pipeline's limits, rules/pipeline.py), else None."""
    return settings_gap(best.pp, best.strategy, best, base)
