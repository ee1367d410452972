"""Communication per optimizer step: the collectives each strategy issues, and bytes per rank.

Each strategy is a list of `Collective`s (the α-β time model in plan/timing.py prices them).
`payload_bytes` follows nccl-tests' size convention: the whole buffer — the all-reduce buffer,
the all-gather output, the reduce-scatter input. A ring sends per rank (nccl-tests
doc/PERFORMANCE.md; Patarasuk & Yuan 2009):
  all-reduce      2(n−1)/n · S
  all-gather      (n−1)/n · S
  reduce-scatter  (n−1)/n · S
  broadcast       (n−1)/n · S  for ZeroRedundancyOptimizer's broadcasts of each rank's partition
                  from its owner (Σ = S; in a pipelined chain n−1 of the n ranks forward each
                  byte, so (n−1)·S sends in all, (n−1)/n·S per rank). Its time is S / busbw,
                  not (n−1)/n·S / busbw: one rank's link idles in each chain (plan/timing.py,
                  which owns both numbers: `ring_bytes_per_rank`, `bus_factor`).

What our trainer sends (docs/DESIGN.md; Ψ = parameters, bf16-mixed):
  ddp    all-reduce of the grads in the reduce dtype (fp32 → 4Ψ bytes), once per step (no_sync
         on the other micro-batches). The ZeRO paper counts 2Ψ elements in fp16.
  zero1  the same all-reduce, then ZeroRedundancyOptimizer broadcasts each rank's updated fp32
         partition (4Ψ bytes in all): 3Ψ elements, where the paper's ZeRO-1 moves 2Ψ.
  zero2  all-gather of the bf16 params (2Ψ bytes) per micro-batch + reduce-scatter of the fp32
         grads (4Ψ) per micro-batch (FSDP2 reduces in every backward by default).
  zero3  all-gather in forward and again in backward + reduce-scatter: 3Ψ elements, 1.5× DDP's
         2Ψ — the "+50 %" — counted in elements. In bytes with bf16 gathers and fp32 reductions
         it is (2 + 2 + 4)Ψ against DDP's 2·4Ψ: the same bytes as DDP.
  hsdp   zero3 inside a shard group of G ranks + all-reduce of the fp32 grad shards (4Ψ/G)
         across the N/G replicas, once per step: train/core/step.py sets FSDP2's
         set_requires_all_reduce(False) on all but the last micro-batch (FSDP2's default
         all-reduces every micro-batch); the reduce-scatter stays per micro-batch.
FSDP2 collectives move padded shards: S = n · Σ ceil(dim0/n)·rest (memory.fsdp2_shard_numel).
The root group is resharded after forward (the trainer passes reshard_after_forward explicitly)
and all-gathered again in backward. Imports no torch.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from shardtune.plan.memory import dtypes, fsdp2_shard_numel
from shardtune.plan.params import ParamShape
from shardtune.plan.ring import ring_bytes_per_rank
from shardtune.strategies import STRATEGY

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@dataclass(frozen=True)
class Collective:
    """One collective over the whole model (FSDP2 issues it layer by layer; sizes add up).

    `group`: "world", "shard" or "replica" (HSDP's mesh dimensions, as in plan/timing.py).
    `phase`: "forward" / "backward" (overlap with that phase's compute) or "optimizer".
    `count_per`: "micro_batch" (every forward/backward) or "step" (once per optimizer step).
    """

    op: str
    group: str
    payload_bytes: int
    group_size: int
    count_per: str
    phase: str
    what: str

    def bytes_per_rank(self) -> float:
        """Bytes each rank sends for one call, on average (ring; module doc)."""
        return ring_bytes_per_rank(self.op, self.payload_bytes, self.group_size)

    def to_dict(self) -> dict:
        return dict(asdict(self), bytes_per_rank=round(self.bytes_per_rank()))


def _padded_total(shapes: list[ParamShape] | None, num: int, n: int, trainable_only: bool) -> int:
    """Elements an FSDP2 collective over n ranks moves: n × the padded shard."""
    if shapes is None:
        return n * -(-num // n)
    kinds = Counter(p.shape for p in shapes if p.trainable or not trainable_only)
    return n * sum(c * fsdp2_shard_numel(shape, n) for shape, c in kinds.items())


def collectives(strategy: str, *, num_params: int, trainable_params: int, world_size: int,
                shard_degree: int, precision: str, shapes: list[ParamShape] | None = None,
                accounting: str = "shardtune") -> list[Collective]:
    """The collectives `strategy` issues per step (module doc). `shapes` None: a bare count."""
    N, G = world_size, shard_degree
    s = STRATEGY[strategy]
    if accounting == "paper":  # ZeRO §7: everything in fp16 (2 bytes), no padding
        P, T = 2 * num_params, 2 * trainable_params
        if s.zero_stage < 2:
            return [Collective("all_reduce", "world", T, N, "step", "backward", "grads")]
        if s.zero_stage == 2:
            return [Collective("reduce_scatter", "world", T, N, "step", "backward", "grads"),
                    Collective("all_gather", "world", P, N, "step", "optimizer", "updated params")]
        group, n = ("shard", G) if s.hybrid else ("world", N)
        out = [Collective("all_gather", group, P, n, "micro_batch", "forward", "params"),
               Collective("all_gather", group, P, n, "micro_batch", "backward", "params"),
               Collective("reduce_scatter", group, T, n, "micro_batch", "backward", "grads")]
        if s.hybrid and N > G:
            out.append(Collective("all_reduce", "replica", -(-T // G), N // G, "step", "backward", "grad shards"))
        return out

    dt = dtypes(precision)
    if not s.fsdp:
        out = [Collective("all_reduce", "world", dt.reduce * trainable_params, N, "step", "backward", "grads")]
        if s.shards_optimizer:
            out.append(Collective("broadcast", "world", dt.param * trainable_params, N, "step",
                                  "optimizer", "updated params (each rank its partition)"))
        return out
    group, n = ("shard", G) if s.hybrid else ("world", N)
    gathered = dt.compute * _padded_total(shapes, num_params, n, trainable_only=False)
    reduced = dt.reduce * _padded_total(shapes, trainable_params, n, trainable_only=True)
    out = [Collective("all_gather", group, gathered, n, "micro_batch", "forward", "params")]
    if s.reshard_after_forward:  # zero2 keeps the forward's unsharded params for backward
        out.append(Collective("all_gather", group, gathered, n, "micro_batch", "backward", "params"))
    out.append(Collective("reduce_scatter", group, reduced, n, "micro_batch", "backward", "grads"))
    if s.hybrid and N > G:
        out.append(Collective("all_reduce", "replica", reduced // n, N // G, "step", "backward", "grad shards"))
    return out


def bytes_per_step(colls: list[Collective], grad_accum: int = 1) -> int:
    """Bytes each rank sends per optimizer step (micro-batch collectives × grad_accum)."""
    return round(sum(c.bytes_per_rank() * (grad_accum if c.count_per == "micro_batch" else 1) for c in colls))
