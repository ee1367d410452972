"""Human-readable rendering of a `PlanResult`: a rich table, GiB (2^30) and GB (10^9) labelled."""
from __future__ import annotations

from shardtune.plan.api import GIB, PlanResult

GB = 10**9


def make_console(piped_width: int = 120):
    """A rich Console of the terminal's width; COLUMNS, when set, wins (piped too); piped
    without COLUMNS: `piped_width`, so tables stay whole in files."""
    import os

    from rich.console import Console

    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return Console(highlight=False, width=int(cols))
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=piped_width)


def _gib(n: int) -> str:
    return f"{n / GIB:,.1f}"


WIDE_COLUMNS = 112  # the all-columns memory table's width; narrower consoles get the compact tables


def render_text(result: PlanResult, console=None, wide: bool = False, mark: str | None = None) -> None:
    """Print the header lines, the per-strategy tables and the verdict. Tables show every column
    when `wide` or the console has room (piped: 120), else a compact set that fits 80 columns.
    `mark`: a strategy (the recipe's) whose memory row is starred."""
    if console is None:
        console = make_console()
        if wide and console.width < 120:  # every column asked for: as wide as piped output
            from rich.console import Console

            console = Console(highlight=False, width=120)
    wide = wide or console.width >= WIDE_COLUMNS
    m, hw, inp = result.model, result.hardware, result.inputs
    trainable = "" if m["trainable_params"] == m["params"] else f", {m['trainable_params']:,} trainable"
    dense = m["active_params"] == m["params"] or inp["lora_rank"]
    active = "" if dense else f", {m['active_params']:,} active per token"
    console.print(f"model {m['name']}: {m['params']:,} parameters{trainable}{active}")
    console.print(
        f"{hw['gpus']} × {hw['gpu']} ({hw['nodes']} node(s) × {hw['gpus_per_node']}): "
        f"{_gib(hw['gpu_memory_bytes'])} GiB each, {_gib(hw['reserve_bytes'])} GiB reserved "
        f"(CUDA context, NCCL, allocator slack) → {_gib(hw['usable_bytes'])} GiB usable")
    console.print(
        f"seq {inp['seq_len']} × micro-batch {inp['micro_batch']}, {inp['precision']}, {inp['optimizer']}, "
        f"AC {inp['ac']}, offload {inp['offload']}"
        + (f", LoRA r={inp['lora_rank']}" if inp["lora_rank"] else "")
        + f"; accounting: {result.accounting}")
    cp, pp = inp.get("cp", 1), inp.get("pp", 1)
    pipe = (f"pipeline-parallel {pp} (outermost: {_stages_where(hw, pp)}) × ") if pp > 1 else ""
    if pp > 1 and inp.get("tp", 1) == 1 and cp == 1:
        console.print(f"layout: {pipe}data-parallel {hw['gpus'] // pp}; FSDP shards each stage over its "
                      "data-parallel ranks")
    if inp.get("tp", 1) > 1:
        sp = "with" if inp.get("sequence_parallel") else "without"
        console.print(f"layout: {pipe}data-parallel {hw['gpus'] // inp['tp'] // cp // pp}"
                      + (f" × context-parallel {cp}" if cp > 1 else "")
                      + f" × tensor-parallel {inp['tp']} (inside a node, {sp} sequence parallelism); FSDP shards "
                      f"over the data-parallel{' × context-parallel' if cp > 1 else ''} ranks")
    elif cp > 1:
        console.print(f"layout: {pipe}data-parallel {hw['gpus'] // cp // pp} × context-parallel {cp} (each rank "
                      f"{inp['seq_len'] // cp} tokens of a row; all-to-all around attention); FSDP shards over "
                      "dp × cp")
    console.print(_memory_table(result, mark) if wide else _compact_memory_table(result, mark))
    if mark and any(s.name == mark for s in result.strategies):
        console.print(f"* the recipe's strategy (parallel.strategy {mark})")
    console.print(_comm_table(result, wide))
    if any(s.timing for s in result.strategies):  # plan/timing.py
        from shardtune.plan.fit import timing_table

        console.print(timing_table(result, wide))
    for s in result.strategies:
        if s.cpu_offload_bytes_per_node:
            console.print(f"{s.name}: offloaded states need {_gib(s.cpu_offload_bytes_per_node)} GiB of CPU RAM per "
                          "node")
        if s.host_ram:  # --activation-offload (plan/cp.py)
            h = s.host_ram
            console.print(f"{s.name}: activation offload keeps {_gib(h['activation_bytes_per_rank'])} GiB per GPU in "
                          f"host RAM: {_gib(h['bytes_per_node'])} of {_gib(h['node_ram_bytes'])} GiB per node "
                          f"({'fits' if h['fits'] else 'does NOT fit; give --host-ram'}); "
                          f"{h['pcie_bytes_per_step'] / GB:,.1f} GB over {h['link']} a step ≈ "
                          f"{h['offload_time_s']:.2f} s")
    for s in result.strategies:
        if s.pipeline:
            console.print(_pipeline_line(s))
    console.print(f"verdict: {result.verdict}")
    for note in result.notes:
        console.print(f"note: {note}")


def _stages_where(hw: dict, pp: int) -> str:
    per_stage = hw["gpus"] // pp
    if per_stage >= hw["gpus_per_node"]:
        return f"each stage {per_stage // hw['gpus_per_node']} whole node(s), P2P between nodes"
    return f"{hw['gpus_per_node'] // per_stage} stages per node"


def _pipeline_line(s) -> str:
    """One strategy's pipeline: schedule, bubble, the worst stage, P2P (plan/pipeline.py)."""
    p, w = s.pipeline, s.stages[s.pipeline["worst_stage"]]
    v = f" × {p['virtual_stages']} virtual" if p["virtual_stages"] > 1 else ""
    parts = [f"{w['layers']} layers"] + (["embedding"] if w["embedding"] else []) + (["head"] if w["head"] else [])
    t = s.timing or {}
    timed = (f"; bubble {t['bubble_time_s']:.3g} s, P2P {t['p2p_time_s']:.3g} s of the {t['step_time_s']:.3g} s step"
             if "bubble_time_s" in t else "")
    return (f"{s.name}: pipeline {p['pp']}{v} stages, {p['schedule']}, {p['microbatches']} micro-batches: bubble "
            f"{p['bubble']:.1%}; worst stage rank {p['worst_stage']} ({' + '.join(parts)}, "
            f"{w['in_flight_microbatches']:g} micro-batches in flight) {_gib(w['memory']['total'])} GiB; "
            f"P2P {p['p2p_bytes_per_step'] / GB:,.2f} GB sent a step{timed}")


_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC", "all_to_all": "A2A"}


def _name(s, mark: str | None) -> str:
    return f"{s.name} *" if s.name == mark else s.name


def _cell(mem, key: str, value: int) -> str:
    """GiB; in parentheses when not alive at the row's peak (`mem.at_peak`), so the bare cells sum to it."""
    return _gib(value) if key in mem.at_peak or not value or not mem.at_peak else f"({_gib(value)})"


def _other(mem) -> int:
    """What the peak holds beyond the columns: the root's reduce buffers, DDP's unsynced grads, grpo's
    generation (gathered weights and KV cache)."""
    return sum(mem.at_peak.get(k, 0) for k in ("other", "generation_weights", "kv_cache"))


PEAK_NOTE = "(x): not alive at the row's peak; the bare cells sum to it"


def _memory_table(result: PlanResult, mark: str | None = None):
    from rich import box
    from rich.table import Table

    table = Table(title="Per-GPU memory in GiB (2^30 bytes); peak also in GB (10^9 bytes)",
                  box=box.SIMPLE_HEAD, padding=(0, 1), caption=PEAK_NOTE)
    tp, pp = result.inputs.get("tp", 1), result.inputs.get("pp", 1)
    if pp > 1:
        table.title += "; pipeline: the worst stage"
    ref, other = _has_reference(result), any(_other(s.memory) for s in result.strategies)
    degrees = ("pp×" if pp > 1 else "") + ("dp×tp" if tp > 1 else "shard")
    for col in ("strategy", degrees, "params", "grads", "optim", "activ", "buffers",
                *(("ref",) if ref else ()), "opt tmp", *(("other",) if other else ()), "peak GiB", "peak GB",
                "free GiB", "fits"):
        table.add_column(col, justify="left" if col in ("strategy", "fits") else "right")
    for s in result.strategies:
        mem = s.memory
        shard = f"{s.shard_degree}×{tp}" if tp > 1 else str(s.shard_degree)  # the FSDP shard group × TP
        shard = f"{pp}×{shard}" if pp > 1 else shard
        table.add_row(
            _name(s, mark), shard, *(_cell(mem, k, getattr(mem, k)) for k in ("params", "grads", "optimizer",
                                                                            "activations", "buffers")),
            *((_cell(mem, "reference", mem.reference),) if ref else ()),
            _cell(mem, "optimizer_step_temp", mem.optimizer_step_temp), *((_gib(_other(mem)),) if other else ()),
            _gib(mem.total), f"{mem.total / GB:,.1f}", f"{s.headroom_bytes / GIB:,.1f}", "yes" if s.fits else "NO")
    return table


def _has_reference(result: PlanResult) -> bool:
    """dpo's frozen reference copy is part of some row's peak: its column is shown (else omitted)."""
    return any(s.memory.reference for s in result.strategies)


def _compact_memory_table(result: PlanResult, mark: str | None = None):
    """strategy, states (params + grads + optimizer alive at the peak), activations, buffers, (dpo)
    reference, opt tmp, other, peak, free, fits."""
    from rich import box
    from rich.table import Table

    table = Table(title="Per-GPU memory, GiB (2^30 bytes); --wide: every column, peak in GB",
                  box=box.SIMPLE_HEAD, padding=(0, 1), caption=PEAK_NOTE)
    if result.inputs.get("pp", 1) > 1:
        table.title += "; pipeline: the worst stage"
    ref, other = _has_reference(result), any(_other(s.memory) for s in result.strategies)
    for col in ("strategy", "states", "activ", "buffers", *(("ref",) if ref else ()), "opt tmp",
                *(("other",) if other else ()), "peak GiB", "free GiB", "fits"):
        table.add_column(col, justify="left" if col in ("strategy", "fits") else "right", no_wrap=True)
    for s in result.strategies:
        mem = s.memory
        live = [k for k in ("params", "grads", "optimizer") if k in mem.at_peak or not mem.at_peak]
        table.add_row(_name(s, mark), _gib(sum(getattr(mem, k) for k in live)),
                      _cell(mem, "activations", mem.activations), _cell(mem, "buffers", mem.buffers),
                      *((_cell(mem, "reference", mem.reference),) if ref else ()),
                      _cell(mem, "optimizer_step_temp", mem.optimizer_step_temp),
                      *((_gib(_other(mem)),) if other else ()), _gib(mem.total),
                      f"{s.headroom_bytes / GIB:,.1f}", "yes" if s.fits else "NO")
    return table


def _comm_table(result: PlanResult, wide: bool = True):
    from rich import box
    from rich.table import Table

    table = Table(title="Communication per rank per optimizer step, GB (10^9 bytes) sent (ring)",
                  box=box.SIMPLE_HEAD, padding=(0, 1))
    cols = ("strategy", "collectives (GB sent each)", "total GB", "× ddp") if wide else (
        "strategy", "total GB", "× ddp")
    for col in cols:
        table.add_column(col, justify="left" if col.startswith(("strategy", "coll")) else "right")
    for s in result.strategies:
        dp = [c for c in s.collectives if c.group not in ("tp", "cp")]
        tp_bytes, cp_bytes = (sum(c.bytes_per_rank() for c in s.collectives if c.group == g) for g in ("tp", "cp"))
        parts = " + ".join(
            [f"{_SHORT[c.op]}{'/' + c.group if c.group != 'world' else ''} {c.bytes_per_rank() / GB:,.1f}" for c in dp]
            + ([f"TP {tp_bytes / GB:,.1f}"] if tp_bytes else [])
            + ([f"CP A2A {cp_bytes / GB:,.1f}"] if cp_bytes else []))
        ratio = "" if s.comm_ratio_to_ddp is None else f"{s.comm_ratio_to_ddp:.2f}"
        row = [s.name, parts, f"{s.comm_bytes_per_step / GB:,.1f}", ratio]
        table.add_row(*(row if wide else [row[0], *row[2:]]))
    return table
