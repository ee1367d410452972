"""Expert parallelism in the plan (parallel.ep / --ep; docs/moe.md "Planner: expert parallelism").
Pure Python, imports no torch.

Layout (the trainer's dp2ep, parallel/mesh.py): the FSDP shard group of G = dp_shard × cp ranks
splits as (efsdp = G / ep, ep), ep innermost (consecutive ranks, one node's while ep ≤ the node).
Each rank keeps E/ep of every MoE layer's routed experts, FSDP-sharded over efsdp; every other
tensor is sharded over all G, as without ep. So per rank:
  expert states = states of the (E/ep)-row expert tensors sharded over efsdp = G / ep
  dense states  = states of the other tensors sharded over G            (as today)
With ep = 1 both are the strategy's own plan.

All-to-all (parallel/ep.py): per MoE layer and micro-batch, each rank sends its t = b·s tokens'
t·k rows of h values to the ranks holding their experts (dispatch) and receives them back
(combine), and backward sends the gradients both ways again: 4 all-to-alls of a t·k·h·bytes
buffer, of which (ep − 1)/ep leaves the rank (the rows for its own experts stay), i.e.
  2 × 2 × t × k × h × bytes × (ep − 1)/ep  bytes sent per rank per MoE layer,
plus the forward's two again in backward for each layer activation checkpointing recomputes. The
count exchange (E integers a layer) is left out. They sit between the router and the experts, so
they are not overlapped (plan/timing.py prices group "ep" exposed, on the link the ep group spans).

Imbalance (`--moe-imbalance f`, default 1.0): the busiest rank receives f × the balanced t·k rows
(at most all ep ranks' rows: f is capped at ep). Its all-to-all buffers and its experts' FLOPs
scale by f, and the step waits for it.
"""
from __future__ import annotations

from dataclasses import replace

from shardtune.plan import memory, moe
from shardtune.plan.comm import collectives
from shardtune.plan.params import ParamShape
from shardtune.strategies import STRATEGY, checkpointed_layers


def moe_layers(arch) -> list[int]:
    """The decoder layers that route (plan/moe.py is_moe_layer; Mixtral: all)."""
    dense, step = getattr(arch, "dense_layers", ()), getattr(arch, "sparse_step", 1)
    return [i for i in range(arch.num_layers) if i not in dense and (i + 1) % step == 0]


def effective_imbalance(imbalance: float, ep: int) -> float:
    """The busiest rank's expert tokens over the balanced count: 1 without ep, at most ep."""
    return 1.0 if ep <= 1 else min(float(imbalance), float(ep))


def ep_local_shapes(shapes: list[ParamShape], ep: int) -> list[ParamShape]:
    """Each tensor as one ep rank holds it before FSDP: routed experts E/ep rows, the rest whole."""
    if ep <= 1:
        return shapes
    return [replace(p, shape=(p.shape[0] // ep, *p.shape[1:])) if moe.is_routed_expert(p.name) else p
            for p in shapes]


def _add(a: memory.States, b: memory.States, impl: str) -> memory.States:
    """Two groups of tensors under one optimizer: bytes add; the step's temporary adds for foreach
    (a copy of every state) and is the larger one's for the per-tensor kernels."""
    temp = a.optimizer_step_temp + b.optimizer_step_temp if impl == "foreach" else max(
        a.optimizer_step_temp, b.optimizer_step_temp)
    return memory.States(a.params + b.params, a.grads + b.grads, a.optimizer + b.optimizer, temp,
                         a.optimizer_host + b.optimizer_host)


def ep_states(shapes: list[ParamShape], strategy: str, world: int, shard: int, ep: int, precision: str,
              optimizer: str, impl: str) -> tuple[memory.States, memory.States]:
    """(all states, the expert states) of the largest rank (module doc): expert tensors of E/ep rows
    sharded over shard / ep ranks, the others over `shard`."""
    local = ep_local_shapes(shapes, ep)
    experts = [p for p in local if moe.is_routed_expert(p.name)]
    dense = [p for p in local if not moe.is_routed_expert(p.name)]
    ex = memory.max_rank_states(experts, strategy, world, max(1, shard // ep), precision, optimizer, impl)
    de = memory.max_rank_states(dense, strategy, world, shard, precision, optimizer, impl)
    return _add(de, ex, impl), ex


def all_to_all_bytes_per_layer(arch, tokens: int, ep: int, elem_bytes: int, imbalance: float = 1.0) -> float:
    """Bytes one rank sends per MoE layer and micro-batch, forward and backward (module doc)."""
    if ep <= 1 or not arch.num_experts:
        return 0.0
    return 2 * 2 * tokens * arch.experts_per_token * arch.hidden_size * elem_bytes * (ep - 1) / ep * \
        effective_imbalance(imbalance, ep)


def ep_collectives(arch, tokens: int, ep: int, elem_bytes: int, ac: str, ac_every: int = 2,
                   imbalance: float = 1.0) -> list[tuple[str, int, str, int, str]]:
    """(op, payload bytes, phase, calls, what) of one micro-batch's all-to-alls on the ep group:
    payload = calls × one rank's t·k·h buffer (nccl-tests' all-to-all size, scaled by the imbalance)."""
    if ep <= 1 or not arch.num_experts:
        return []
    layers = moe_layers(arch)
    buf = round(tokens * arch.experts_per_token * arch.hidden_size * elem_bytes * effective_imbalance(imbalance, ep))
    n, again = len(layers), len(set(layers) & set(checkpointed_layers(arch.num_layers, ac, ac_every)))
    out = [("all_to_all", 2 * n * buf, "forward", 2 * n, "EP all-to-all (dispatch + combine)"),
           ("all_to_all", 2 * n * buf, "backward", 2 * n, "EP all-to-all grads (combine + dispatch)")]
    if again:
        out.append(("all_to_all", 2 * again * buf, "backward", 2 * again, "EP all-to-all recompute (AC)"))
    return out


def routed_params_per_token(arch) -> int:
    """Routed-expert weights one token multiplies by, over all layers: k experts of each MoE layer
    (gate, up, down: 3·I·h, plus GPT-OSS's biases 2I + h)."""
    if not arch.num_experts:
        return 0
    h, inner = arch.hidden_size, arch.intermediate_size
    per_expert = 3 * inner * h + ((2 * inner + h) if getattr(arch, "expert_bias", False) else 0)
    return len(moe_layers(arch)) * arch.experts_per_token * per_expert


def ep_degrees(arch, shard_degrees: list[int]) -> list[int]:
    """The ep degrees `plan --fit` searches: powers of two dividing the experts per layer and some
    shard degree (1 for a dense model)."""
    if arch is None or not arch.num_experts:
        return [1]
    out, e = [], 1
    while e <= arch.num_experts:
        if arch.num_experts % e == 0 and any(g % e == 0 for g in shard_degrees):
            out.append(e)
        e *= 2
    return out


def ep_fsdp_collectives(strategy: str, shapes: list[ParamShape], dp: int, shard: int, ep: int,
                        precision: str) -> list:
    """FSDP's collectives under ep: the dense tensors over the shard group as today, the experts'
    E/ep rows over their expert-FSDP group ("efsdp", shard / ep ranks; hsdp: + the replica all-reduce)."""
    local = ep_local_shapes(shapes, ep)
    dense = [p for p in local if not moe.is_routed_expert(p.name)]
    experts = [p for p in local if moe.is_routed_expert(p.name)]

    def numels(ps):
        return sum(p.numel for p in ps), sum(p.numel for p in ps if p.trainable)

    out = collectives(strategy, num_params=numels(dense)[0], trainable_params=numels(dense)[1], world_size=dp,
                      shard_degree=shard, precision=precision, shapes=dense)
    e = max(1, shard // ep)
    ex = collectives(strategy, num_params=numels(experts)[0], trainable_params=numels(experts)[1],
                     world_size=dp // shard * e if STRATEGY[strategy].hybrid else e, shard_degree=e,
                     precision=precision, shapes=experts)
    return out + [replace(c, group="efsdp" if c.group in ("world", "shard") else c.group, what=f"experts' {c.what}")
                  for c in ex if c.group_size > 1]
