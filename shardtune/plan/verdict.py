"""What the verdict suggests when no single change of a strategy's own settings fits: each
alternative is re-planned and named only when it fits (issue 27: "try zero3" was printed where
zero3 did not fit). The families are tried in the order the peak's largest part suggests:
activations first → a shorter sequence; else another strategy that shards the parameters, LoRA /
QLoRA, a larger GPU of the catalogue. Imports no torch."""
from __future__ import annotations

from dataclasses import replace

from shardtune.strategies import STRATEGY

GIB = 2**30
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
    from shardtune.plan import api

    if STRATEGY[sp.name].reshard_after_forward or api._combination_error(inp, "zero3"):
        return None
    for label, changed in _variants(m, inp):
        if not api._combination_error(changed, "zero3"):
            p = api._plan_strategy(m, "zero3", changed, usable, per_rank=False)
            if p.fits:
                return f"zero3{label}{_ram(p)}"
    return None


def _shorter_seq(m, sp, inp, usable):
    from shardtune.plan import api

    if m.arch is None:
        return None
    mem = sp.memory
    why = f": activations ({mem.activations / GIB:,.1f} GiB) dominate the peak" if _acts_dominate(mem) else ""
    seq = inp.seq_len // 2
    while seq >= MIN_SEQ:
        for label, changed in list(_variants(m, replace(inp, seq_len=seq)))[:2]:  # as given, --ac full
            if api._combination_error(changed, sp.name):  # e.g. offload under TP
                continue
            if api._plan_strategy(m, sp.name, changed, usable, per_rank=False).fits:
                return f"--seq-len {seq}{label}{why}"
        seq //= 2
    return None


def _lora(m, sp, inp, usable):
    from shardtune.plan import api

    if inp.lora_rank or inp.params is not None:
        return None
    for quant, label in (("none", f"LoRA (--lora-rank {LORA_RANK})"),
                         ("nf4", f"QLoRA (--lora-rank {LORA_RANK} --quantize-base nf4)")):
        changed = replace(inp, lora_rank=LORA_RANK, quantize_base=quant)
        if api._combination_error(changed, sp.name):
            continue
        lm = api._load_model(inp.model, None, LORA_RANK, quant)
        if api._plan_strategy(lm, sp.name, changed, usable, per_rank=False).fits:
            return label
    return None


def _larger_gpu(m, sp, inp, usable):
    from shardtune.catalog.gpus import GPUS, resolve_gpu
    from shardtune.plan import api

    now = resolve_gpu(inp.gpu)
    for gpu in sorted((g for g in GPUS.values() if g.memory_bytes > now.memory_bytes), key=lambda g: g.memory_bytes):
        reserve = api.default_reserve_bytes(gpu) if inp.reserve_gib is None else round(inp.reserve_gib * GIB)
        if api._plan_strategy(m, sp.name, replace(inp, gpu=gpu.name), gpu.memory_bytes - reserve,
                              per_rank=False).fits:
            return f"a larger GPU (--gpu {gpu.name})"
    return None


def _acts_dominate(mem) -> bool:
    states = mem.params + mem.grads + mem.optimizer + mem.optimizer_step_temp
    return mem.activations >= states and mem.activations >= mem.buffers


def fallback(m, sp, inp, usable: int) -> str:
    """The first alternative that fits, re-planned; else says that none of them does."""
    families = [_zero3, _lora, _larger_gpu, _shorter_seq]
    if _acts_dominate(sp.memory):
        families = [_shorter_seq, _zero3, _lora, _larger_gpu]
    for family in families:
        found = family(m, sp, inp, usable)
        if found:
            return found
    return "nothing single fits: not zero3, a shorter --seq-len, LoRA / QLoRA nor a larger GPU of the catalogue"


def verdict(plans, usable: int) -> str:
    """"fits: A, B; C needs X GiB of Y GiB usable (try Z)" for each strategy that does not fit."""
    fit = [p.name for p in plans if p.fits]
    parts = [f"fits: {', '.join(fit) if fit else 'none'}"]
    for p in plans:
        if not p.fits:
            parts.append(f"{p.name} needs {p.memory.total / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable"
                         f" (try {p.suggestion})")
    return "; ".join(parts)
