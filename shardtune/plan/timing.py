"""Step time from a plan: compute + exposed communication + optimizer, per strategy.

Collectives are priced by plan/ring.py (α-β ring model, nccl-tests sizes); here they overlap with
compute layer by layer (FSDP2 prefetch, DDP buckets: `exposed_time_s`), and `step_time` adds up a
step of `grad_accum` micro-batches. Pure Python, imports no torch. Derivations: docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.catalog.interconnects import default_intra_node, get_interconnect
from shardtune.errors import UserError
from shardtune.layout import Layout
from shardtune.plan import compute as C
from shardtune.plan.compute import achievable_mfu
from shardtune.plan.ep import effective_imbalance, routed_params_per_token
from shardtune.plan.memory import dtypes
from shardtune.plan.pipeline import matmul_params, time_pipeline
from shardtune.plan.preference import reference_forward as has_reference_forward
from shardtune.plan.ring import (
    Cluster,
    Group,
    Link,
    fsdp_copy_bytes,
    group_time_s,
    load_profile,
    mesh_groups,
    op_time_s,
    profile_link,
)
from shardtune.plan.rl import generation_time_s, training_rows
from shardtune.plan.validate import plan_layout
from shardtune.strategies import checkpointed_layers


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


def step_time(ops: list, cluster: Cluster, groups: dict[str, Group], forward_s: float,
              backward_s: float, num_layers: int, grad_accum: int = 1, optimizer_s: float = 0.0,
              overlap: bool = True, copy_bytes_per_s: float | None = None) -> StepTime:
    """Step time = micro-batches × (compute + exposed comm) + exposed per-step comm + optimizer.

    `forward_s` / `backward_s` are one micro-batch's compute (backward includes recomputation).
    Collectives of one phase on different links (HSDP: shard group on NVLink, replica group on
    the NICs) proceed in parallel, so a phase's comm is the slowest link's sum; collectives on
    the same link add up. `overlap=False` models a runtime that does not overlap at all.
    `copy_bytes_per_s` (memory bandwidth) prices FSDP2's copy-in/copy-out, which run on the
    collective's stream, so they count with its link (None: not counted). Tensor parallelism's
    collectives (group "tp") sit between a layer's matmuls, which wait for them: all exposed; so
    do context parallelism's all-to-alls (group "cp") around attention and expert parallelism's (group
    "ep") around the experts.
    """
    tp_ops = [op for op in ops if op.group in ("tp", "cp", "ep")]
    ops = [op for op in ops if op.group not in ("tp", "cp", "ep")]
    tp_fw, tp_bw = (sum(op_time_s(op, groups, cluster, num_layers) for op in tp_ops if op.phase == ph)
                    for ph in ("forward", "backward"))
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
    exposed_total = (k - 1) * exposed_mb + exposed_last + opt_comm + k * (tp_fw + tp_bw)
    compute = k * (forward_s + backward_s)
    comm_total = k * (fw_mb + bw_mb + tp_fw + tp_bw) + fw_st + bw_st + opt_comm
    return StepTime(
        step_time_s=compute + exposed_total + optimizer_s,
        compute_time_s=compute,
        comm_time_s=comm_total,
        exposed_comm_s=exposed_total,
        optimizer_time_s=optimizer_s,
        forward_comm_s=k * (fw_mb + tp_fw) + fw_st,
        backward_comm_s=k * (bw_mb + tp_bw) + bw_st,
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


def profile_mismatch(prof: dict, gpu_name: str) -> str | None:
    """Why a measured profile is not this plan's GPUs' network (another backend or device class),
    or None. A gloo profile on CPUs priced onto H100s once gave 0.1 % MFU without a word."""
    backend, device = str(prof.get("backend", "?")), str(prof.get("device", "?"))
    family = gpu_name.split("-")[0].lower()  # h100-80gb → h100
    if backend == "nccl" and family in device.lower():
        return None
    return (f"network profile {prof.get('_path', 'given')} was measured with {backend} on {device}, "
            f"not nccl on {gpu_name}: its bandwidths may not be this cluster's")


def build_cluster(nodes: int, gpus_per_node: int, gpu_name: str, interconnect: str | None = None,
                  intra_node: str | None = None, nics_per_node: int | None = None,
                  network_profile: str | None = None) -> tuple[Cluster, dict]:
    """The Cluster a plan prices collectives on, and a description for the report.

    Catalogue links (shardtune.catalog.interconnects) unless a measured profile is given: its
    per-collective busbw replaces the link of its scope (intra: inside a node; inter: between
    nodes — measured across nodes, a ring's busbw is already the node's NIC bandwidth).
    """
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
        prof = dict(load_profile(network_profile), _path=str(network_profile))
        link = profile_link(prof)
        if prof["scope"] == "inter":
            inter = link
        else:
            intra = link
        desc["network_profile"] = {"path": str(network_profile), "scope": prof["scope"],
                                   "busbw_gbps": {k: v["busbw_gbps"] for k, v in prof["links"].items()},
                                   "mismatch": profile_mismatch(prof, gpu_name)}
    return Cluster(nodes, gpus_per_node, intra, inter), desc


def predict_strategy(arch, collectives: list, *, layout: Layout, cluster: Cluster, micro_batch: int,
                     seq_len: int, grad_accum: int, ac: str, ac_every: int,
                     trainable_params: int, num_params: int, active_params: int, lora: bool,
                     offload: str, optimizer: str, peak_flops_per_s: float, mfu: float,
                     mem_bw_bytes_per_s: float, tokens: float | None = None, overlap: bool = True,
                     reference_forward: bool = False, offload_copy_s: float = 0.0, moe_imbalance: float = 1.0,
                     matmul: tuple[int, int] | None = None, generation_s: float | None = None) -> dict:
    """Step time, tokens/s per GPU, MFU, comm and compute time for one strategy (JSON fields).

    `mfu` is the achievable MFU of a compute-only step (compute.achievable_mfu, or --mfu): the
    compute kernels run at mfu × peak; recompute and exposed communication then lower the MFU
    reported here. `arch` None (a bare --params count): 6N FLOPs per token, no attention term.
    `layout` (layout.py; validate.plan_layout) holds the strategy and its degrees: each of the tp
    ranks of a tensor-parallel group computes 1/tp of the same tokens' FLOPs (heads and MLP width
    split) and updates 1/tp of the parameters; each of the cp ranks computes 1/cp of a row's tokens
    (attention: H/cp heads over the whole row, the same FLOPs); with ep and `moe_imbalance` the
    busiest expert-parallel rank computes f × its balanced routed-expert FLOPs (plan/ep.py), and
    the step waits for it. `offload_copy_s`: activation offload's host copies per step, exposed (plan/cp.py).
    `matmul`: (matmul parameters, those of the decoder layers) of a pipeline stage (plan/pipeline.py).
    `generation_s`: grpo's generation a step (plan/rl.py `generation_time_s`), before the training.
    """
    tp, cp, ep = layout.tp, layout.cp, layout.ep
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
    if matmul is not None:
        n_mm, layer_mm = matmul
    fwd_tok = C.forward_flops_per_token(n_mm, L, H, Q, seq_len)
    model_tok = C.model_flops_per_token(n_mm, L, H, Q, seq_len)
    if lora:  # frozen base weights: backward computes input grads (2N) but no weight grads (2N)
        model_tok -= 2.0 * n_mm
    if reference_forward:  # dpo's live reference: one more forward a micro-batch (plan/preference.py)
        fwd_tok, model_tok = 2 * fwd_tok, model_tok + fwd_tok
    recompute_tok = C.recompute_flops_per_token(ac, layer_mm, L, H, Q, seq_len, ac_every, down) if arch else (
        2.0 * num_params if ac == "full" else 0.0)
    tokens_mb = micro_batch * seq_len
    rate = peak_flops_per_s * mfu
    forward_s = tokens_mb * fwd_tok / rate / (tp * cp)
    backward_s = tokens_mb * (model_tok - fwd_tok + recompute_tok) / rate / (tp * cp)
    if arch is not None and (extra := effective_imbalance(moe_imbalance, ep) - 1.0) > 0:
        routed = 2.0 * routed_params_per_token(arch) * extra * tokens_mb / rate  # one forward's extra seconds
        recomputed = len(checkpointed_layers(L, ac, ac_every)) / L  # AC re-runs the experts' forward too
        forward_s, backward_s = forward_s + routed, backward_s + routed * (2 + recomputed)

    owners = layout.shard_degree * cp * tp  # ranks one optimizer state is split over (FSDP's: × cp), × TP
    params_per_rank = trainable_params / owners
    if offload in ("optimizer", "all"):
        optimizer_s = (C.optimizer_step_time_s(params_per_rank, HOST_OPTIMIZER_BYTES_PER_S, optimizer)
                       + C.offload_transfer_time_s(params_per_rank, PCIE_BYTES_PER_S))
    else:
        optimizer_s = C.optimizer_step_time_s(params_per_rank, mem_bw_bytes_per_s, optimizer)
    groups = mesh_groups(cluster, layout)
    st = step_time(collectives, cluster, groups, forward_s, backward_s, L, grad_accum, optimizer_s, overlap,
                   copy_bytes_per_s=mem_bw_bytes_per_s)
    if offload_copy_s:
        st.step_time_s += offload_copy_s
        st.exposed_comm_s += offload_copy_s
    st.step_time_s += generation_s or 0.0
    tokens_step = tokens_mb * grad_accum / (tp * cp)  # per GPU: a TP × CP group shares its tokens
    tps = throughput(st.step_time_s, tokens_step)
    out = {
        "step_time_s": st.step_time_s,
        "tokens_per_s": tps,
        "mfu": C.mfu(model_tok * tokens_step, st.step_time_s, peak_flops_per_s),
        "comm_time_s": st.comm_time_s,
        "exposed_comm_s": st.exposed_comm_s,
        "compute_time_s": st.compute_time_s,
        "optimizer_time_s": st.optimizer_time_s,
        **({"generation_time_s": generation_s} if generation_s is not None else {}),
    }
    if tokens:
        wall, gpu_h = time_for_tokens(tokens, tps, cluster.world_size)
        out.update(train_time_s=wall, gpu_hours=gpu_h)
    return {k: float(f"{v:.4g}") for k, v in out.items()}


def timing_context(inp, gpu, *, interconnect: str | None = None, intra_node: str | None = None,
                   nics_per_node: int | None = None, network_profile: str | None = None,
                   mfu: float | None = None, tokens: float | None = None) -> dict:
    """Checked timing options → {"cluster", "mfu", "tokens", "network" (a description)}."""
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
    """predict_strategy for one strategy_plan.StrategyPlan under `inp` (validate.PlanInputs); a
    pipeline plan stage by stage, with its bubble and P2P (plan/pipeline.py `time_pipeline`)."""
    if sp.stage_ctx is not None:
        def stage(sm, p, cluster):
            info = {"params": sm.num_params, "trainable_params": sm.trainable, "active_params": sm.active}
            return _predict(p, sm.arch, info, sp.stage_ctx.inputs, gpu, dict(ctx, cluster=cluster, tokens=None),
                            matmul_params(sm))
        return time_pipeline(sp, inp, stage, ctx["cluster"], ctx["tokens"])
    return _predict(sp, arch, model_info, inp, gpu, ctx)


def _generation_s(layout: Layout, arch, model_info: dict, inp, gpu, ctx: dict) -> float | None:
    """grpo: a step's generation on one rank (plan/rl.py), its weights gathered on the shard group's link."""
    if inp.objective != "grpo" or arch is None:
        return None
    cluster, tp, per = ctx["cluster"], layout.tp, dtypes(inp.precision).compute
    g = mesh_groups(cluster, layout)["shard"]
    gather_s = group_time_s("all_gather", -(-model_info["params"] // tp) * per, g.size, g.ranks_per_node,
                            g.groups_per_node, cluster, calls=arch.num_layers + 1)  # FSDP2: a unit a layer + root
    return generation_time_s(arch, model_info["params"], prompts=inp.micro_batch * inp.grad_accum,
                             num_generations=inp.num_generations, prompt_tokens=inp.seq_len,
                             max_new_tokens=inp.max_new_tokens, tp=tp, compute_bytes=per,
                             peak_flops_per_s=gpu.bf16_flops, mfu=ctx["mfu"], hbm_bytes_per_s=gpu.hbm_bytes_per_s,
                             gather_s=gather_s)


def _predict(sp, arch, model_info: dict, inp, gpu, ctx: dict, matmul: tuple[int, int] | None = None) -> dict:
    layout = plan_layout(inp, sp.name, ep=inp.ep)  # its strategy and degrees (a pipeline stage's: pp 1)
    generation_s = _generation_s(layout, arch, model_info, inp, gpu, ctx)
    inp = training_rows(inp)  # grpo: G completions a prompt, prompt + max_new_tokens long
    return predict_strategy(
        arch, sp.collectives, layout=layout, cluster=ctx["cluster"],
        micro_batch=inp.micro_batch, seq_len=inp.seq_len, grad_accum=inp.grad_accum, ac=inp.ac,
        ac_every=inp.ac_every, trainable_params=model_info["trainable_params"],
        num_params=model_info["params"], active_params=model_info.get("active_params") or model_info["params"],
        lora=bool(inp.lora_rank), offload=inp.offload, optimizer=inp.optimizer,
        peak_flops_per_s=gpu.bf16_flops, mfu=ctx["mfu"], mem_bw_bytes_per_s=gpu.hbm_bytes_per_s,
        tokens=ctx["tokens"], reference_forward=has_reference_forward(inp.objective, inp.reference, inp.rl_beta),
        offload_copy_s=(sp.host_ram or {}).get("offload_time_s", 0.0), moe_imbalance=inp.moe_imbalance,
        matmul=matmul, generation_s=generation_s)


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
    if (net.get("network_profile") or {}).get("mismatch"):
        result.notes.append("warning: " + net["network_profile"]["mismatch"])
    result.notes.append(f"step time assumes {ctx['mfu']:.0%} MFU for the compute ({net['mfu_source']}); "
                        "exposed comm = per layer max(0, comm − compute) (FSDP prefetch / DDP buckets)")
