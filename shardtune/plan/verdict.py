"""What the verdict suggests when no single change of a strategy's own settings fits: each
alternative is re-planned and named only when it fits (issue 27: "try zero3" was printed where
zero3 did not fit). The families are tried in the order the peak's largest part suggests:
activations first → context parallelism (with activation offload), then a shorter sequence; else
another strategy that shards the parameters, LoRA / QLoRA, a larger GPU of the catalogue, context
parallelism, a shorter sequence. `suggest` tries single changes first. Each re-plan is
strategy_plan.py's `plan_strategy` (below api.py, which calls `suggest`). Imports no torch."""
from __future__ import annotations

from dataclasses import replace

from shardtune.catalog.gpus import GPUS, resolve_gpu
from shardtune.errors import UserError
from shardtune.plan.cp import cp_degrees
from shardtune.plan.model import _load_model
from shardtune.plan.pipeline import balanced_split
from shardtune.plan.strategy_plan import GIB, combination_error, default_reserve_bytes, plan_strategy, with_cp, with_tp
from shardtune.plan.tp import TP_DEGREES
from shardtune.plan.validate import plan_layout, resolve_inputs
from shardtune.strategies import STRATEGY

LORA_RANK = 16
MIN_SEQ = 128


def _ram(p) -> str:
    return f" ({p.cpu_offload_bytes_per_node / GIB:,.0f} GiB CPU RAM per node)" if p.cpu_offload_bytes_per_node else ""


def _variants(m, inp):
    """(label, inputs): as given, --ac full, --offload all, both (what the trainer can run)."""
    full = replace(inp, ac="full") if m.arch is not None and inp.ac != "full" else None
    yield "", inp
    if full:
        yield " --ac full", full
    if inp.offload != "all" and inp.accounting == "shardtune":
        yield " --offload all", replace(inp, offload="all")
        if full:
            yield " --ac full --offload all", replace(full, offload="all")


def _zero3(m, sp, inp, usable):
    if STRATEGY[sp.name].reshard_after_forward or combination_error(inp, "zero3"):
        return None
    for label, changed in [*_variants(m, inp), *((" " + lab, ch) for lab, ch in _cp_labels(m, "zero3", inp))]:
        if not combination_error(changed, "zero3"):
            p = plan_strategy(m, "zero3", changed, usable, per_rank=False)
            if p.fits:
                return f"zero3{label}{_ram(p)}"
    return None


def _cp_labels(m, strategy: str, inp):
    """(label, inputs) at each larger context-parallel degree (plan/cp.py), as given and with --ac full."""
    if m.arch is None or not STRATEGY[strategy].fsdp or inp.accounting != "shardtune":
        return
    for c in (c for c in cp_degrees(inp.gpus, inp.tp) if c > inp.cp):
        full = [("--ac full", replace(inp, ac="full"))] if inp.ac != "full" else []
        for label, base in [("", inp), *full]:
            changed = with_cp(base, c, m)
            if changed:
                yield f"{label.strip()} --cp {c}".strip(), changed


def _cp(m, sp, inp, usable):
    """Context parallelism, then with activation offload (the layers' saved tensors in host RAM)."""
    for offload in (False, True):
        for label, changed in _cp_labels(m, sp.name, inp):
            if offload:
                label, changed = f"{label} --activation-offload", replace(changed, activation_offload=True)
            if combination_error(changed, sp.name):
                continue
            p = plan_strategy(m, sp.name, changed, usable, per_rank=False)
            if p.fits:
                ram = f" ({p.host_ram['bytes_per_node'] / GIB:,.0f} GiB host RAM per node)" if offload else ""
                return label + ram
    return None


def _shorter_seq(m, sp, inp, usable):
    if m.arch is None:
        return None
    mem = sp.memory
    why = f": activations ({mem.activations / GIB:,.1f} GiB) dominate the peak" if _acts_dominate(mem) else ""
    seq = inp.seq_len // 2
    while seq >= MIN_SEQ:
        for label, changed in list(_variants(m, replace(inp, seq_len=seq)))[:2]:  # as given, --ac full
            if combination_error(changed, sp.name):  # e.g. offload under TP
                continue
            if plan_strategy(m, sp.name, changed, usable, per_rank=False).fits:
                return f"--seq-len {seq}{label}{why}"
        seq //= 2
    return None


def _lora(m, sp, inp, usable):
    if inp.lora_rank or inp.params is not None:
        return None
    for quant, label in (("none", f"LoRA (--lora-rank {LORA_RANK})"),
                         ("nf4", f"QLoRA (--lora-rank {LORA_RANK} --quantize-base nf4)")):
        changed = replace(inp, lora_rank=LORA_RANK, quantize_base=quant)
        if combination_error(changed, sp.name):
            continue
        lm = _load_model(inp.model, None, LORA_RANK, quant)
        if plan_strategy(lm, sp.name, changed, usable, per_rank=False).fits:
            return label
    return None


def _larger_gpu(m, sp, inp, usable):
    now = resolve_gpu(inp.gpu)
    for gpu in sorted((g for g in GPUS.values() if g.memory_bytes > now.memory_bytes), key=lambda g: g.memory_bytes):
        reserve = default_reserve_bytes(gpu) if inp.reserve_gib is None else round(inp.reserve_gib * GIB)
        if plan_strategy(m, sp.name, replace(inp, gpu=gpu.name), gpu.memory_bytes - reserve,
                              per_rank=False).fits:
            return f"a larger GPU (--gpu {gpu.name})"
    return None


def _acts_dominate(mem) -> bool:
    states = mem.params + mem.grads + mem.optimizer + mem.optimizer_step_temp
    return mem.activations >= states and mem.activations >= mem.buffers


def fallback(m, sp, inp, usable: int) -> str:
    """The first alternative that fits, re-planned; else says that none of them does."""
    families = [_zero3, _lora, _larger_gpu, _cp, _shorter_seq]
    if _acts_dominate(sp.memory):  # the sequence is split before it is ever shortened
        families = [_cp, _shorter_seq, _zero3, _lora, _larger_gpu]
    for family in families:
        found = family(m, sp, inp, usable)
        if found:
            return found
    return ("nothing single fits: not zero3, --cp, a shorter --seq-len, LoRA / QLoRA nor a larger GPU of the "
            "catalogue")


def verdict(plans, usable: int) -> str:
    """"fits: A, B; C needs X GiB of Y GiB usable (try Z)" for each strategy that does not fit."""
    fit = [p.name for p in plans if p.fits]
    parts = [f"fits: {', '.join(fit) if fit else 'none'}"]
    for p in plans:
        host = p.host_ram or {}
        if not p.fits and not host.get("fits", True) and p.memory.total <= usable:  # --activation-offload's RAM
            parts.append(f"{p.name} needs {host['bytes_per_node'] / GIB:,.0f} GiB of host RAM per node, "
                         f"{host['node_ram_bytes'] / GIB:,.0f} GiB given (--host-ram)")
        elif not p.fits:
            parts.append(f"{p.name} needs {p.memory.total / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable"
                         f" (try {p.suggestion})")
    return "; ".join(parts)


def suggest(m, sp, inp, usable: int) -> str:
    """The smallest change that makes a strategy fit: without offload, and with offload; when the
    activations dominate, context parallelism before tensor parallelism; else `fallback`."""
    def more_gpus(base, label: str):
        if STRATEGY[sp.name].hybrid:  # a larger shard group first; the world stays
            g, dp = base.hsdp_shard_size * 2, plan_layout(base, "hsdp").dp  # the shard group: dp ranks
            while g <= dp and dp % g == 0:
                yield f"{label}--hsdp-shard-size {g}", replace(base, hsdp_shard_size=g)
                g *= 2
            return
        for k in range(1, 9):
            g = base.gpus * 2**k
            yield f"{label}--gpus {g}", replace(base, gpus=g)

    full = replace(inp, ac="full") if m.arch is not None and inp.ac != "full" else None
    scale_out = []
    if full:
        scale_out.append(("--ac full", full))
    if inp.micro_batch > 1:
        scale_out.append(("--micro-batch 1", replace(inp, micro_batch=1)))
    tps = []
    if STRATEGY[sp.name].fsdp and inp.tp == 1 and m.arch is not None and inp.accounting == "shardtune":
        for t in TP_DEGREES[1:]:  # tensor parallelism divides the states and activations on the same GPUs
            changed = with_tp(inp, t, m)
            if changed:
                tps.append((f"--tp {t}", changed))
    cps = list(_cp_labels(m, sp.name, inp))  # context parallelism divides the activations
    scale_out += cps + tps if _acts_dominate(sp.memory) else tps + cps
    if STRATEGY[sp.name].shards_optimizer:  # more GPUs shrink nothing under ddp
        scale_out += list(more_gpus(inp, ""))
        if full:
            scale_out += list(more_gpus(full, "--ac full "))
    offload = []
    if STRATEGY[sp.name].fsdp and inp.offload != "all" and inp.accounting == "shardtune":
        offload.append(("--offload all", replace(inp, offload="all")))
        if full:
            offload.append(("--ac full --offload all", replace(full, offload="all")))
    found = []
    for tries in (scale_out, offload):
        for label, changed in tries:
            if combination_error(changed, sp.name):  # e.g. offload under TP: nothing runs it
                continue
            p = plan_strategy(m, sp.name, changed, usable, per_rank=False)
            if p.fits:
                found.append(label + _ram(p))
                break
    if found:
        return " or ".join(found)
    return fallback(m, sp, inp, usable)  # re-planned alternatives


COMM_BOUND_SHARE = 0.5  # a fit whose step waits on exposed communication at least half the time
MIN_GAIN = 1.1  # a lever is named only when it lifts the MFU by 10 % or more


def _comm_levers(m, sp, inp):
    """(label, strategy, inputs) that put more compute behind each collective: a larger
    micro-batch (FSDP's gathers and reduce-scatters stay per micro-batch), a smaller tp (its
    per-layer collectives are all exposed), a pipeline across the nodes (FSDP inside each),
    hsdp with the shard group inside a node."""
    for k in (2, 4, 8):
        yield (f"--micro-batch {inp.micro_batch * k} (the global batch grows {k}×)", sp.name,
               replace(inp, micro_batch=inp.micro_batch * k))
    for t in (t for t in TP_DEGREES if t < inp.tp):
        changed = with_tp(inp, t, m)
        if changed:
            yield f"--tp {t}", sp.name, changed
    if inp.pp == 1 and inp.nodes > 1 and m.arch is not None and not m.arch.num_experts:
        # a pipeline of one node a stage: only activations cross the nodes (plan/pipeline.py); the global
        # batch kept by pp × the micro-batches, an uneven layer split written out where needed
        split = balanced_split(m.arch.num_layers, inp.nodes)
        ga = inp.grad_accum * inp.nodes
        try:
            changed = resolve_inputs(replace(inp, pp=inp.nodes, grad_accum=ga, pp_layers=split, hsdp_shard_size=None))
        except UserError:
            changed = None
        if changed:
            yield (f"--pp {inp.nodes} --grad-accum {ga}" + "".join(f" --pp-layers {n}" for n in split or ()),
                   sp.name, changed)
    in_node = plan_layout(inp, "hsdp", pp=1, hsdp_shard_size=None).shard_degree  # one node's data ranks
    if sp.name == "zero3" and inp.nodes > 1 and in_node > 1:
        yield (f"--strategy hsdp --hsdp-shard-size {in_node}", "hsdp",
               replace(inp, strategies=["hsdp"], hsdp_shard_size=in_node))


def comm_bound(m, plans, inp, usable: int, gpu) -> str:
    """"; zero3 is communication-bound: 6.68 s of its 8.7 s step ... (try X: MFU Y)" for each
    strategy that fits but waits on exposed communication at least COMM_BOUND_SHARE of its step,
    with the re-planned and re-timed lever (plan/timing.py) that lifts its MFU most; else ""."""
    from shardtune.plan.timing import time_strategy, timing_context

    bound = [p for p in plans if p.fits and p.timing
             and p.timing["exposed_comm_s"] >= COMM_BOUND_SHARE * p.timing["step_time_s"]]
    if not bound or m.arch is None:
        return ""
    ctx = timing_context(inp, gpu, **inp.timing_options())
    info = {"params": m.num_params, "trainable_params": m.trainable, "active_params": m.active}
    out = ""
    for p in bound:
        t = p.timing
        out += (f"; {p.name} is communication-bound: {t['exposed_comm_s']:.3g} s of its {t['step_time_s']:.3g} s "
                f"step is exposed communication ({t['exposed_comm_s'] / t['step_time_s']:.0%}), MFU {t['mfu']:.1%}")
        best = None
        for label, strategy, changed in _comm_levers(m, p, inp):
            if combination_error(changed, strategy):
                continue
            q = plan_strategy(m, strategy, changed, usable, per_rank=False)
            if not q.fits:
                continue
            mfu = time_strategy(q, m.arch, info, changed, gpu, ctx)["mfu"]
            if mfu >= MIN_GAIN * t["mfu"] and (best is None or mfu > best[1]):
                best = (label, mfu)
        out += (f" (try {best[0]}: MFU {best[1]:.1%})" if best else
                " (no larger micro-batch, smaller tp or shard group lifts it: a faster interconnect would)")
    return out
