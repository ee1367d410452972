"""Per-GPU model states (params, grads, optimizer) and temporary buffers for each strategy.

Two accountings, named in every result. `paper`: ZeRO (Rajbhandari et al. 2020, §5, Figure 1),
2Ψ + 2Ψ + KΨ with K = 12, sharded by stage: DDP (4 + K)Ψ, ZeRO-1 4Ψ + KΨ/N, ZeRO-2
2Ψ + (2 + K)Ψ/N, ZeRO-3 (4 + K)Ψ/N (Ψ = 7.5e9, N = 64 → 120 / 31.4 / 16.6 / 1.9 GB).
`shardtune` (default): what the trainer holds — FSDP2 shards of fp32 params and grads and AdamW
m, v (4 + 4 + 8 B/param ÷ shard degree, dim 0 padded: `fsdp2_shard_numel`); ddp whole; zero1
whole params/grads and torch's greedy optimizer partition (`zero1_partition`); pure bf16
2 + 2 + 4; frozen (LoRA base) in the compute dtype; AdamW's step counters apart
(`States.optimizer_host`). Buffers in flight: unsharded bf16 params of the root and two layers,
grads in flight, zero2's whole gathered copy, autocast's weight cache. The optimizer step's
temporaries per kernel (foreach 1.00 × states, fused 0, for-loop 2 × the largest tensor,
bf16-stochastic 8 B × it; measured). Rank 0 is the largest rank.
Derivation and measurements: docs/planner.md "Memory: derivation". Imports no torch.
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from math import ceil, prod

from shardtune.plan.params import ParamShape
from shardtune.strategies import STRATEGY


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each role under a precision setting."""

    param: int  # the sharded / stored master params
    grad: int  # the stored grads
    compute: int  # unsharded params and activations in forward/backward
    reduce: int  # gradient collectives
    state: int  # optimizer states (per state)
    frozen: int  # params that do not train (LoRA's base): stored in the compute dtype


def dtypes(precision: str) -> Dtypes:
    """bf16-mixed: fp32 master, bf16 compute, fp32 reduce, frozen params bf16 (no update, so no
    master copy: parallel/fsdp.py `apply_precision`); bf16: all bf16; fp32: all fp32."""
    return {
        "bf16-mixed": Dtypes(param=4, grad=4, compute=2, reduce=4, state=4, frozen=2),
        "bf16": Dtypes(param=2, grad=2, compute=2, reduce=2, state=2, frozen=2),
        "fp32": Dtypes(param=4, grad=4, compute=4, reduce=4, state=4, frozen=4),
    }[precision]


def fsdp2_shard_numel(shape: tuple[int, ...], shard_degree: int, rank: int = 0, padded: bool = True) -> int:
    """Elements of one tensor's FSDP2 shard on `rank` (torch.chunk on dim 0).

    FSDP2 pads dim 0 to a multiple of the shard degree, so every rank allocates ceil(dim0/N) rows
    (`padded=True`); the unpadded local tensor (`DTensor.to_local()`, the optimizer states made
    with zeros_like) has min(c, max(0, dim0 − rank·c)) rows. Rank 0 always has the full c rows.
    """
    if not shape:
        return 1
    dim0, rest = shape[0], prod(shape[1:])
    rows = ceil(dim0 / shard_degree)
    if not padded:
        rows = min(rows, max(0, dim0 - rank * rows))
    return rows * rest


def zero1_partition(numels: list[int], world_size: int) -> list[list[int]]:
    """Tensor sizes each rank owns under ZeroRedundancyOptimizer (one param group).

    torch/distributed/optim/zero_redundancy_optimizer.py `_partition_parameters`: sort by numel,
    largest first (a stable sort), give each tensor to the rank with the fewest elements so far
    (the lowest rank on ties) — a heap of (elements, rank) picks the same rank.
    """
    owned: list[list[int]] = [[] for _ in range(world_size)]
    heap = [(0, r) for r in range(world_size)]
    for n in sorted(numels, reverse=True):
        size, r = heapq.heappop(heap)
        owned[r].append(n)
        heapq.heappush(heap, (size + n, r))
    return owned


def optimizer_state_bytes(numel: int, optimizer: str, state_bytes: int) -> int:
    """Optimizer state bytes for one tensor of `numel` elements.

    adamw: m and v (2 states); sgd: the momentum buffer (1 state); adamw-8bit (bitsandbytes
    AdamW8bit, blockwise): two 1-byte states and one fp32 absmax per 256-element block each, and
    32-bit states for tensors under 4,096 elements (bitsandbytes' `min_8bit_size`); bitsandbytes
    0.50 `Optimizer2State.init_state`. Its two 256-entry fp32 quantisation maps are one pair per
    optimizer, shared by every tensor (`QMAP_BYTES`, added once by `shardtune_states`).
    """
    if optimizer == "adamw":
        return 2 * state_bytes * numel
    if optimizer == "sgd":
        return state_bytes * numel
    if numel < 4096:
        return 8 * numel
    return 2 * numel + 2 * 4 * ceil(numel / 256)


QMAP_BYTES = 2 * 256 * 4  # adamw-8bit: the signed and unsigned dynamic maps, fp32, per optimizer


def torchao_8bit_state_bytes(numel: int, state_bytes: int) -> int:
    """torchao 0.18 AdamW8bit's m and v for one local tensor (FSDP strategies): `_new_buffer`
    quantises a local shard of ≥ 4,096 elements divisible by the 256-element block into an
    OptimState8bit each (uint8 codes, one fp32 scale per block, its own 256-entry fp32 qmap);
    any other shard gets zeros_like (the param's dtype)."""
    if numel >= 4096 and numel % 256 == 0:
        return 2 * (numel + 4 * (numel // 256) + 4 * 256)
    return 2 * state_bytes * numel


def step_counter_bytes(num_tensors: int, optimizer: str) -> int:
    """AdamW's per-tensor `step` counters: 4 bytes (fp32, torch.optim.optimizer `_get_scalar_dtype`)
    per tensor with optimizer state; none for sgd and bitsandbytes' adamw-8bit (a Python int);
    torchao's (FSDP strategies) is added by `shardtune_states`."""
    return 4 * num_tensors if optimizer == "adamw" else 0


def optimizer_temp_bytes(state_numel: int, largest_numel: int, optimizer: str, state_bytes: int,
                         impl: str = "foreach") -> int:
    """The AdamW step's temporaries for the rank's `state_numel` state elements, the largest
    tensor `largest_numel` of them, under kernel `impl` (module doc; callers resolve `auto` first:
    strategies.resolve_optimizer_impl, fused)."""
    if optimizer != "adamw" or impl == "fused":
        return 0
    if impl == "bf16-stochastic":
        return 8 * largest_numel
    if impl == "for-loop":
        return 2 * state_bytes * largest_numel
    return state_bytes * state_numel


@dataclass(frozen=True)
class States:
    """Per-rank bytes at rest, and the optimizer step's temporaries."""

    params: int
    grads: int
    optimizer: int
    optimizer_step_temp: int
    optimizer_host: int = 0  # host-resident optimizer bytes: AdamW's `step` counters, unless fused (module doc)


def local_numels(shapes: list[ParamShape], strategy: str, world_size: int, shard_degree: int,
                 rank: int = 0, padded: bool = True) -> tuple[int, int, Counter]:
    """(param elements, grad elements, optimizer-owned tensor sizes → count) held by `rank`.

    FSDP strategies hold padded shards of everything; ddp/zero1 hold whole params and grads;
    grads and optimizer states exist for trainable tensors only. Tensors of the same shape are
    counted together (80 identical layers cost one computation). `padded=False`: the FSDP2
    params and grads as `to_local()` sizes them instead of the padded allocation.
    """
    kinds = Counter((p.shape, p.trainable) for p in shapes)
    if STRATEGY[strategy].fsdp:
        r = rank % shard_degree  # mesh (replicate, shard): the shard index is innermost
        params = grads = 0
        opt: Counter = Counter()
        for (shape, trainable), count in kinds.items():
            local = count * fsdp2_shard_numel(shape, shard_degree, r, padded)
            params += local
            if trainable:
                grads += local
                opt[fsdp2_shard_numel(shape, shard_degree, r, padded=False)] += count
        return params, grads, opt
    params = sum(prod(shape) * c for (shape, _), c in kinds.items())
    trainable = Counter()
    for (shape, t), c in kinds.items():
        if t:
            trainable[prod(shape)] += c
    grads = sum(n * c for n, c in trainable.items())
    if STRATEGY[strategy].partitions_optimizer:
        return params, grads, Counter(zero1_partition(list(trainable.elements()), world_size)[rank])
    return params, grads, trainable


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # torchao to_nf4's defaults (train/core/qlora.py)


def nf4_stored(shape: tuple[int, ...], shard: int) -> bool:
    """QLoRA's rule (train/core/qlora.py `quantizable`): whole blocks and scaler blocks per shard."""
    return len(shape) == 2 and shape[0] % shard == 0 and prod(shape) % (NF4_BLOCK * NF4_SCALER_BLOCK * shard) == 0


def nf4_bytes(numel: int, dtype_bytes: int) -> int:
    """Bytes of a (local) torchao NF4Tensor of `numel` weights: 4-bit codes (2 a byte), one int8
    scale per 64-weight block, one factor per 256 scales, the scalers' mean and the 16-entry
    code table, the last three in the weight's dtype (`__tensor_flatten__`'s five tensors)."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + (blocks // NF4_SCALER_BLOCK + 1 + 16) * dtype_bytes


def _nf4_local(shapes: list[ParamShape], strategy: str, shard_degree: int, frozen_bytes: int) -> tuple[int, int]:
    """(local elements stored as NF4, their bytes) on any rank: the rule's shards are even."""
    shard = shard_degree if STRATEGY[strategy].fsdp else 1
    numels = [p.numel // shard for p in shapes if p.nf4 and nf4_stored(p.shape, shard)]
    return sum(numels), sum(nf4_bytes(n, frozen_bytes) for n in numels)


def shardtune_states(shapes: list[ParamShape], strategy: str, world_size: int, shard_degree: int,
                     precision: str, optimizer: str, rank: int = 0, padded: bool = True,
                     impl: str = "foreach") -> States:
    """What our trainer holds on `rank` (module doc, `shardtune` accounting).

    `padded=True`: FSDP2's allocation (ceil(dim0/N) rows on every rank); `padded=False`: the bytes
    of the local tensors (`DTensor.to_local()`), which differ on the last ranks. Optimizer states
    are made with zeros_like of the local tensor, so they are never padded. Rank 0: both agree.
    """
    dt = dtypes(precision)
    p, g, opt = local_numels(shapes, strategy, world_size, shard_degree, rank, padded)
    counters = step_counter_bytes(sum(opt.values()), optimizer)
    qmaps = QMAP_BYTES if optimizer == "adamw-8bit" and any(n >= 4096 for n in opt) else 0
    on_device = impl == "fused"  # torch puts fused AdamW's counters beside the params
    if optimizer == "adamw-8bit" and STRATEGY[strategy].fsdp:  # torchao's, a CPU fp32 `step` per tensor
        opt_bytes, counters, qmaps, on_device = (sum(c * torchao_8bit_state_bytes(n, dt.state) for n, c in opt.items()),
                                                 4 * sum(opt.values()), 0, False)
    else:
        opt_bytes = sum(c * optimizer_state_bytes(n, optimizer, dt.state) for n, c in opt.items())
    q_numel, q_bytes = _nf4_local(shapes, strategy, shard_degree, dt.frozen)  # QLoRA's NF4 base
    return States(
        params=g * dt.param + (p - g - q_numel) * dt.frozen + q_bytes,  # trainable local elements = grads'
        grads=g * dt.grad,
        optimizer=opt_bytes + (counters if on_device else 0) + qmaps,
        optimizer_step_temp=optimizer_temp_bytes(sum(n * c for n, c in opt.items()), max(opt, default=0),
                                                 optimizer, dt.state, impl),
        optimizer_host=0 if on_device else counters,
    )


def max_rank_states(shapes: list[ParamShape], strategy: str, world_size: int, shard_degree: int,
                    precision: str, optimizer: str, impl: str = "foreach") -> States:
    """The largest rank's states: rank 0 for FSDP2 and DDP; the fullest zero1 partition."""
    if not STRATEGY[strategy].partitions_optimizer:
        return shardtune_states(shapes, strategy, world_size, shard_degree, precision, optimizer, 0, impl=impl)
    trainable = [p.numel for p in shapes if p.trainable]
    owned = zero1_partition(trainable, world_size)
    fullest = max(range(world_size), key=lambda r: sum(owned[r]))
    return shardtune_states(shapes, strategy, world_size, shard_degree, precision, optimizer, fullest, impl=impl)


def flat_states(num_params: int, trainable: int, strategy: str, shard_degree: int,
                precision: str, optimizer: str, impl: str = "foreach") -> States:
    """`shardtune` states for a bare parameter count (--params): an even split, no padding, and
    no tensor count for AdamW's step counters (0). With no tensor sizes, for-loop's temporary is
    planned as foreach's (one copy of the states: an upper bound)."""
    dt = dtypes(precision)
    shard = ceil(trainable / shard_degree)
    sharded = STRATEGY[strategy].fsdp
    opt_numel = shard if STRATEGY[strategy].shards_optimizer else trainable
    frozen = num_params - trainable
    return States(
        params=(ceil(trainable / shard_degree) * dt.param + ceil(frozen / shard_degree) * dt.frozen
                if sharded else trainable * dt.param + frozen * dt.frozen),
        grads=(shard if sharded else trainable) * dt.grad,
        optimizer=optimizer_state_bytes(opt_numel, optimizer, dt.state),
        optimizer_step_temp=optimizer_temp_bytes(opt_numel, opt_numel, optimizer, dt.state,
                                                 "foreach" if impl == "for-loop" else impl),
    )


def paper_bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, float]:
    """(param, grad, K) bytes per parameter in ZeRO's accounting (§5: 2, 2, 12 for mixed Adam)."""
    if precision == "bf16-mixed":
        return 2, 2, {"adamw": 12, "sgd": 8, "adamw-8bit": 6}[optimizer]  # fp32 master + states
    if precision == "bf16":
        return 2, 2, {"adamw": 4, "sgd": 2, "adamw-8bit": 2}[optimizer]
    return 4, 4, {"adamw": 8, "sgd": 4, "adamw-8bit": 2}[optimizer]


def paper_states(num_params: int, trainable: int, strategy: str, shard_degree: int,
                 precision: str, optimizer: str) -> States:
    """ZeRO §5 model states per rank: stage 1 shards K, stage 2 also grads, stage 3 also params."""
    pb, gb, k = paper_bytes_per_param(precision, optimizer)
    n = shard_degree
    stage = STRATEGY[strategy].zero_stage
    return States(
        params=ceil(pb * num_params / (n if stage >= 3 else 1)),
        grads=ceil(gb * trainable / (n if stage >= 2 else 1)),
        optimizer=ceil(k * trainable / (n if stage >= 1 else 1)),
        optimizer_step_temp=0,
    )


def fsdp_buffer_bytes(shapes: list[ParamShape], strategy: str, precision: str) -> int:
    """Unsharded params and grads in flight at the start of backward (module doc)."""
    dt = dtypes(precision)
    layers: dict[int, list[ParamShape]] = {}
    for p in shapes:
        if p.group != "root":
            layers.setdefault(p.group, []).append(p)
    root = [p for p in shapes if p.group == "root"]
    # QLoRA: a gathered NF4 weight is its codes and scales (nf4_bytes, rule taken at shard 1: the
    # caller's shard degree is not known here), plus one weight dequantised at a time by the matmul
    gathered = lambda ps: sum(nf4_bytes(p.numel, dt.frozen) if p.nf4 and nf4_stored(p.shape, 1)  # noqa: E731
                              else dt.compute * p.numel for p in ps)
    dequant = max((p.numel for p in shapes if p.nf4 and nf4_stored(p.shape, 1)), default=0)
    layer_bytes = max((gathered(ps) for ps in layers.values()), default=0)
    layer_trainable = max((sum(p.numel for p in ps if p.trainable) for ps in layers.values()), default=0)
    if not STRATEGY[strategy].reshard_after_forward:  # zero2: gathered from forward to backward
        unsharded = gathered(shapes)
    else:
        unsharded = gathered(root) + 2 * layer_bytes
    # The root's grads wait for the end of backward; the embedding's arrives last (unless tied).
    root_grads = sum(p.numel for p in root if p.trainable and p.name != "model.embed_tokens.weight")
    if any(p.name == "model.embed_tokens.weight" and p.trainable for p in root) and not any(
            p.name == "lm_head.weight" for p in root):
        root_grads += next(p.numel for p in root if p.name == "model.embed_tokens.weight")
    return unsharded + dt.compute * (root_grads + dequant) + (dt.compute + dt.reduce) * layer_trainable


def ddp_buffer_bytes(shapes: list[ParamShape], precision: str, loss_chunks: int = 1) -> int:
    """ddp/zero1: torch.autocast's cache of bf16 weight copies (bf16-mixed), the chunked loss's dW.

    Autocast caches the bf16 cast of leaf weights that require grad and feed a matmul: every 2-D
    trainable weight except the input embedding (an embedding lookup is not cast) unless it is
    tied to the LM head. Mixtral's 3-D expert tensors are indexed per expert (a non-leaf view),
    so their casts are not cached. With `loss_chunks` > 1 the head's weight goes to the chunked
    loss, which casts it itself (not cached), and its backward holds dW in the compute dtype with
    its cast to the weight's dtype (train/core/chunked_loss.py) beside the layers' cached casts.
    """
    dt = dtypes(precision)
    tied = not any(p.name == "lm_head.weight" for p in shapes)
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    head = next((p for p in shapes if p.name == head_name and p.trainable), None)
    chunked = loss_chunks > 1 and head is not None
    cached = sum(p.numel for p in shapes if p.trainable and len(p.shape) == 2
                 and (tied or p.name != "model.embed_tokens.weight") and not (chunked and p is head))
    cache = dt.compute * cached if precision == "bf16-mixed" else 0
    return cache + (head.numel * (dt.compute + (dt.param if dt.param != dt.compute else 0)) if chunked else 0)


def tied_backward_bytes(shapes: list[ParamShape], strategy: str, precision: str, loss_chunks: int,
                        shard_degree: int = 0) -> int:
    """Bytes above the states at the embedding's backward, for a tied, trained embedding
    (Llama-3.2-1B, Qwen2.5-0.5B; untied: 0). The head's gradient of the shared weight waits in
    autograd's input buffer while the embedding's is made: two (V, h) grads (FSDP2: compute dtype;
    ddp/zero1: the grads'), summed in place, or into a third when the head's is a view (one loss
    chunk, no autocast cast: input_buffer.cpp `can_accumulate_inplace`). FSDP2 also holds the
    unsharded root and the last layer's reduce-scatter input, and (`shard_degree` > 0, as
    `fsdp_root_reduce_bytes`) not yet the root's grad shard. Calibrated against `plan --simulate`
    (docs/calibration.md, tied embeddings)."""
    embed = next((p for p in shapes if p.name == "model.embed_tokens.weight" and p.trainable), None)
    if embed is None or any(p.name == "lm_head.weight" for p in shapes):
        return 0
    dt, fsdp = dtypes(precision), STRATEGY[strategy].fsdp
    view = loss_chunks == 1 and (fsdp or precision != "bf16-mixed")
    grads = (3 if view else 2) * (dt.compute if fsdp else dt.grad) * embed.numel
    if not fsdp:
        return grads
    layer_trainable = Counter()
    for p in shapes:
        if p.group != "root" and p.trainable:
            layer_trainable[p.group] += p.numel
    root = [p for p in shapes if p.group == "root"]
    own_shard = dt.grad * sum(fsdp2_shard_numel(p.shape, shard_degree) for p in root if p.trainable and shard_degree)
    return (grads + dt.compute * sum(p.numel for p in root) + dt.reduce * max(layer_trainable.values(), default=0)
            - own_shard)


def fsdp_root_reduce_bytes(shapes: list[ParamShape], precision: str, shard_degree: int = 0) -> int:
    """The end of backward under FSDP2: the root group's (embedding, final norm, LM head)
    unsharded grads in the compute dtype and the reduce-scatter input in the reduce dtype, alive
    together (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce` copies
    the grads in before freeing them), while every other group's sharded grads already exist.
    `shard_degree` > 0 (no gradient accumulation): net of the root's own sharded grads, which the
    grads at rest count but which do not exist yet (zero_grad(set_to_none=True) freed them; the
    reduce-scatter makes them). Calibrated against `plan --simulate` (docs/calibration.md): the
    peak with full AC (Llama-3-8B, N = 8: the trace is 51 kB above, Adam's `step` scalars)."""
    dt = dtypes(precision)
    root = [p for p in shapes if p.group == "root" and p.trainable]
    own_shard = dt.grad * sum(fsdp2_shard_numel(p.shape, shard_degree) for p in root) if shard_degree else 0
    return (dt.compute + dt.reduce) * sum(p.numel for p in root) - own_shard


def peak_bytes(states: States, activations: int, buffers: int, grads_in_forward: bool = True,
               reduce_in_flight: int = 0, unsynced_grads: int = 0) -> int:
    """The step's peak bytes (`peak_parts`)."""
    return peak_parts(states, activations, buffers, grads_in_forward, reduce_in_flight, unsynced_grads)[0]


def peak_parts(states: States, activations: int, buffers: int, grads_in_forward: bool = True,
               reduce_in_flight: int = 0, unsynced_grads: int = 0) -> tuple[int, str, dict]:
    """The peak, its moment and what is alive then (summing to it): the end of forward (the grads only
    with `grads_in_forward`, plus ddp's `unsynced_grads`), the optimizer step, or the end of backward
    with `reduce_in_flight` (`fsdp_root_reduce_bytes`). Why each: docs/planner.md, "The peak and its
    columns"; calibrated against `plan --simulate` (docs/calibration.md)."""
    p, g, o = states.params, states.grads, states.optimizer
    moments = [("optimizer step", {"params": p, "grads": g, "optimizer": o,
                                   "optimizer_step_temp": states.optimizer_step_temp})]
    fwd = {"params": p, "optimizer": o, "activations": activations, "buffers": buffers}
    if grads_in_forward:
        fwd |= {"grads": g, "other": unsynced_grads}
    moments.insert(0, ("forward end", fwd))
    if reduce_in_flight:
        moments.append(("backward end", {"params": p, "grads": g, "optimizer": o, "other": reduce_in_flight}))
    phase, parts = max(moments, key=lambda m: sum(m[1].values()))  # the first of equals, as max() was
    return sum(parts.values()), phase, parts
