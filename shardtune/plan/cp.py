"""Context (sequence) parallelism and activation offload in the planner (issue 30). Imports no torch.

The trainer's CP is all-to-all sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023,
arXiv 2309.14509): each of the cp ranks of a group holds s/cp tokens of every row; inside
attention an all-to-all turns the sequence-sharded q, k, v into head shards (H/cp heads over
the whole sequence) and another one turns the output back. Mesh (dp_replicate, dp_shard, cp,
tp), tp innermost; FSDP shards over dp_shard × cp (torchtitan). Per layer and micro-batch, with
t = b·s/cp local tokens and widths per TP rank, forward: 4 all-to-alls (q: e·t·h_q, k and v:
e·t·h_kv' each with h_kv' the KV heads repeated until cp divides them (rules.cp.kv_repeat), out: e·t·h_q); backward
the same 4 for the gradients; AC re-runs the forward's 4 of each recomputed layer. Activation
offload (torch's save_on_cpu) moves what the decoder layers save to pinned host RAM and back:
2× those bytes over the GPU's host link per micro-batch. Derivations: docs/long-context.md.
"""
from __future__ import annotations

from math import ceil

from shardtune.catalog.interconnects import get_interconnect
from shardtune.errors import UserError
from shardtune.plan.params import Architecture
from shardtune.rules.cp import check_cp, kv_repeat
from shardtune.rules.ep import check_ep_model

# the host link (PCIe x16) of each catalogue GPU; SXM H100 / H200 and MI300X: Gen5, the others Gen4
HOST_LINKS = {"h100-80gb": "pcie-gen5", "h200-141gb": "pcie-gen5", "mi300x-192gb": "pcie-gen5"}
HOST_LINK_EFFICIENCY = 0.8  # pinned copies reach ~80 % of PCIe line rate (TLP headers; an estimate)
HOST_RAM_PER_GPU_GIB = 256  # default node RAM: a DGX H100's 2 TiB over its 8 GPUs


def cp_degrees(gpus: int, tp: int) -> list[int]:
    """`plan --fit`'s search: powers of two that divide gpus / tp."""
    dp, out, c = gpus // tp, [], 1
    while c <= dp:
        if dp % c == 0:
            out.append(c)
        c *= 2
    return out


def check_cp_arch(arch: Architecture | None, config: dict | None, cp: int, tp: int) -> None:
    """The trainer's rule on the model (rules.cp.check_cp: cp divides the query heads of a TP
    rank); a bare --params count has no heads to split. One-line UserError."""
    if cp > 1 and arch is None:
        raise UserError(f"--cp {cp} needs a model architecture (the heads it splits); give a MODEL, not --params")
    if cp > 1:
        check_cp(cp, tp=tp, hf=config)
        check_ep_model(1, config or {}, cp=cp)  # GPT-OSS: no cp path for its sinks (the trainer's rule)


def kv_width(arch: Architecture, cp: int, tp: int) -> int:
    """K (or V) width a TP rank sends into the all-to-all: its KV heads, repeated until cp divides
    them (rules.cp.kv_repeat, the trainer's)."""
    kv = max(1, arch.num_kv_heads // tp)
    return kv * kv_repeat(kv, arch.num_heads // tp, cp) * arch.head_dim


def ulysses_collectives(arch: Architecture, tokens: int, cp: int, tp: int, elem_bytes: int, ac: str,
                        ac_every: int = 2) -> list[tuple[str, int, str, int, str]]:
    """(op, payload bytes, phase, calls, what) of one micro-batch's Ulysses all-to-alls (module
    doc). `tokens` = b·s, the whole rows; payload: `calls` × one rank's send buffer (nccl-tests'
    all-to-all size), each rank sending (cp−1)/cp of it."""
    if cp == 1:
        return []
    L, t = arch.num_layers, tokens // cp
    h_q = arch.num_heads * arch.head_dim // tp
    qkvo = elem_bytes * t * (2 * h_q + 2 * kv_width(arch, cp, tp))  # one layer's four buffers
    recomputed = {"none": 0, "full": L, "op": L}.get(ac, -(-L // max(1, ac_every)))
    out = [("all_to_all", L * qkvo, "forward", 4 * L, "CP all-to-all (q, k, v in; out back)"),
           ("all_to_all", L * qkvo, "backward", 4 * L, "CP all-to-all grads")]
    if recomputed:
        out.append(("all_to_all", recomputed * qkvo, "backward", 4 * recomputed, "CP recompute (AC)"))
    return out


def host_link_bytes_per_s(gpu_name: str) -> tuple[float, str]:
    """(achieved bytes/s one direction, link name) between a GPU and its host's pinned memory."""
    link = get_interconnect(HOST_LINKS.get(gpu_name, "pcie-gen4"))
    return link.line_rate_gbps * 1e9 * HOST_LINK_EFFICIENCY, link.name


def default_host_ram_bytes(gpus_per_node: int) -> int:
    return HOST_RAM_PER_GPU_GIB * 2**30 * gpus_per_node


def offload_time_s(host_bytes_per_rank: int, gpu_name: str, micro_batches: int) -> float:
    """Seconds a step spends copying offloaded activations: out in forward, back in backward
    (2× the bytes per micro-batch), on the host link, not overlapped (save_on_cpu copies on the
    compute stream)."""
    bw, _ = host_link_bytes_per_s(gpu_name)
    return 2 * host_bytes_per_rank * micro_batches / bw if host_bytes_per_rank else 0.0


def local_tokens(micro_batch: int, seq_len: int, cp: int) -> int:
    return ceil(micro_batch * seq_len / cp)


def host_ram(inp, act_per_rank: int, states_per_rank: int) -> dict:
    """Host RAM per node under --activation-offload (offloaded activations + offloaded states of
    the node's ranks) against the node's RAM (--host-ram, default 256 GiB a GPU), and the PCIe
    traffic and time per step (module doc). `inp`: validate.PlanInputs."""
    from shardtune.catalog.gpus import resolve_gpu

    node = default_host_ram_bytes(inp.gpus_per_node) if inp.host_ram_gib is None else round(inp.host_ram_gib * 2**30)
    need = (act_per_rank + states_per_rank) * inp.gpus_per_node
    gpu = resolve_gpu(inp.gpu).name
    bw, link = host_link_bytes_per_s(gpu)
    return {"activation_bytes_per_rank": act_per_rank, "bytes_per_node": need, "node_ram_bytes": node,
            "fits": need <= node, "pcie_bytes_per_step": 2 * act_per_rank * inp.grad_accum,
            "offload_time_s": offload_time_s(act_per_rank, gpu, inp.grad_accum), "link": link,
            "link_bytes_per_s": bw}
