"""Communication per optimizer step: the collectives each strategy issues, and bytes per rank.

Each strategy is a list of `Collective`s (plan/timing.py prices them with plan/ring.py's α-β
model). `payload_bytes` follows nccl-tests' convention: the whole buffer (all-reduce buffer,
all-gather output, reduce-scatter input); a ring sends 2(n−1)/n · S per rank for all-reduce and
(n−1)/n · S for all-gather, reduce-scatter and zero1's partition broadcasts (nccl-tests
doc/PERFORMANCE.md; Patarasuk & Yuan 2009). Per step, Ψ = parameters, bf16-mixed: ddp 4Ψ bytes
(fp32 all-reduce); zero1 + 4Ψ broadcast; zero2 2Ψ gather + 4Ψ reduce-scatter per micro-batch;
zero3 gathers twice: (2 + 2 + 4)Ψ, DDP's bytes in 1.5× its elements (the "+50 %"); hsdp zero3
in a shard group + the grad shards all-reduced across replicas once per step. FSDP2 moves padded
shards (memory.fsdp2_shard_numel). Derivation: docs/planner.md "Communication: derivation".
Imports no torch.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from shardtune.plan.memory import dtypes, fsdp2_shard_numel
from shardtune.plan.params import ParamShape
from shardtune.plan.ring import ring_bytes_per_rank
from shardtune.strategies import STRATEGY


@dataclass(frozen=True)
class Collective:
    """One collective over the whole model (FSDP2 issues it layer by layer; sizes add up).

    `group`: "world", "shard" or "replica" (the data-parallel mesh dimensions, as in plan/timing.py),
    or "tp" (tensor parallelism's activation collectives: on the critical path, never overlapped).
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
    calls: int = 0  # collectives carrying the bytes; 0: ring.num_calls decides (FSDP2: one per module)

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
