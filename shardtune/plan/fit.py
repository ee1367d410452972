"""`plan --fit`: the configuration with the highest predicted tokens/s per GPU that fits.

Searches strategy × tensor-parallel degree (1, 2, 4, 8) × activation checkpointing × offload ×
micro-batch × HSDP shard size × precision × ep (MoE) × pp across nodes (plan/fit_pp.py), and for long
sequences (≥ LONG_SEQ tokens, or a --cp or --activation-offload given) context-parallel degree ×
activation offload (plan/cp.py), with the planner's memory and step-time models, keeping the user's
sequence length, GPU, cluster and global batch (the micro-batch follows tp, grad_accum cp and pp)
unless `fit_batch` (`--fit-batch`) searches the micro-batch too. Each
ranked entry says what it changes (numerics, global batch, sequence) and why it loses to the
best (which per-token time component is larger), each rejected one why it does not fit.
Also renders the per-strategy time table of a plan. Imports no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from shardtune.errors import UserError
from shardtune.plan.tp import TP_DEGREES
from shardtune.strategies import AC_MODES, PRECISIONS, STRATEGY

GIB = 2**30
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
OFFLOADS = ("none", "all")  # what the trainer can run ("optimizer" is planner-only)
LONG_SEQ = 16384  # from here on --fit also searches context parallelism and activation offload


@dataclass
class Candidate:
    """One searched configuration, its memory verdict and predicted time."""

    strategy: str
    ac: str
    offload: str
    micro_batch: int
    hsdp_shard_size: int | None
    precision: str
    fits: bool
    peak_gib: float
    usable_gib: float
    timing: dict
    why: str = ""
    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    tp: int = 1  # tensor-parallel degree (plan/tp.py); sequence parallelism on with it
    global_batch: int = 0  # sequences per optimizer step: micro-batch × grad_accum × data-parallel ranks
    cp: int = 1  # context-parallel degree (plan/cp.py)
    activation_offload: bool = False
    grad_accum: int = 1  # follows cp and pp, keeping the global batch
    ep: int = 1  # expert-parallel degree (MoE models; plan/ep.py)
    pp: int = 1  # pipeline-parallel degree (plan/pipeline.py), stages across nodes
    pp_layers: list[int] | None = None  # the layer split when pp does not divide the layers
    pp_schedule: str = "1f1b"

    def changes(self, base: dict) -> dict:
        """What this candidate changes against the plan's own inputs (`FitResult.base`), in words."""
        def was(now, before) -> str:
            return f"{now}" if now == before else f"{now} (was {before})"
        return {"numerics": was(self.precision, base["precision"]),
                "global batch": was(self.global_batch, base["global_batch"]),
                "seq": f"{base['seq_len']} (kept)"}

    @property
    def tokens_per_s(self) -> float:
        return self.timing["tokens_per_s"]

    def label(self) -> str:
        shard = f" shard {self.hsdp_shard_size}" if STRATEGY[self.strategy].hybrid else ""
        shard = (f" × pp {self.pp}" if self.pp > 1 else "") + shard
        shard += f" × cp {self.cp}" if self.cp > 1 else ""
        shard += f" × tp {self.tp}" if self.tp > 1 else ""
        shard += f" × ep {self.ep}" if self.ep > 1 else ""
        act = " + activation offload" if self.activation_offload else ""
        accum = f" × grad-accum {self.grad_accum}" if self.cp > 1 or self.pp > 1 else ""
        return (f"{self.strategy}{shard}, AC {self.ac}{act}, offload {self.offload}, micro-batch "
                f"{self.micro_batch}{accum}, {self.precision}")

    def flags(self) -> str:
        f = (f"--strategy {self.strategy} --ac {self.ac} --offload {self.offload} "
             f"--micro-batch {self.micro_batch} --precision {self.precision}")
        f += f" --optimizer {self.optimizer}" if self.optimizer != "adamw" else ""
        f += f" --optimizer-impl {self.optimizer_impl}" if self.optimizer_impl != "auto" else ""
        f += f" --tp {self.tp}" if self.tp > 1 else ""
        f += f" --ep {self.ep}" if self.ep > 1 else ""
        f += f" --cp {self.cp} --grad-accum {self.grad_accum}" if self.cp > 1 else ""
        f += " --activation-offload" if self.activation_offload else ""
        f += f" --pp {self.pp}" + ("" if self.cp > 1 else f" --grad-accum {self.grad_accum}") if self.pp > 1 else ""
        f += "".join(f" --pp-layers {n}" for n in self.pp_layers or ())
        return f + (f" --hsdp-shard-size {self.hsdp_shard_size}" if STRATEGY[self.strategy].hybrid else "")


@dataclass
class FitResult:
    best: Candidate | None
    ranked: list[Candidate]
    rejected: list[Candidate]
    searched: int
    network: dict
    notes: list[str] = field(default_factory=list)
    base: dict = field(default_factory=dict)  # the plan's own precision, global batch, seq_len
    pipeline_gain: dict | None = None  # plan/fit_pp.py: the fastest pipeline against the fastest without

    def to_dict(self) -> dict:
        def d(c):
            return dict(asdict(c), tokens_per_s=c.tokens_per_s, flags=c.flags(), changes=c.changes(self.base))
        return {"best": d(self.best) if self.best else None, "ranked": [d(c) for c in self.ranked],
                "rejected": [d(c) for c in self.rejected], "searched": self.searched,
                "network": self.network, "notes": self.notes, "base": self.base,
                **({"pipeline_gain": self.pipeline_gain} if self.pipeline_gain else {})}


def _impl_for(base, precision: str) -> str:
    """The AdamW kernel a candidate runs: the user's, except that pure bf16 under torch's AdamW
    takes bf16-stochastic (updates below a bf16 weight's spacing would vanish; train/core/optim.py)
    (check_combination then keeps a user's bf16-stochastic to pure bf16)."""
    if base.optimizer != "adamw":
        return base.optimizer_impl
    if precision == "bf16" and base.optimizer_impl == "auto":
        return "bf16-stochastic"
    return base.optimizer_impl


def _shard_sizes(world: int, per_node: int) -> list[int]:
    """Powers of two that divide the world, from 2 up to half of it, plus one node's GPUs."""
    sizes = {per_node} if world % per_node == 0 and 1 < per_node < world else set()
    return sorted(sizes | {2**k for k in range(1, world.bit_length()) if 2**k < world and world % 2**k == 0})


def search(inputs=None, gpus: int | None = None, /, top: int = 5, fit_batch: bool = False,
           keep: frozenset[str] = frozenset(), **fields) -> FitResult:
    """Every configuration of the search space, ranked; inputs as `shardtune.plan.plan`. The global
    batch is kept unless `fit_batch` (then the micro-batch is searched over MICRO_BATCHES). `keep`:
    the PlanInputs fields the user gave (`plan --fit` passes its options and overrides), each held
    at its value and not searched."""
    from shardtune.catalog.gpus import resolve_gpu
    from shardtune.plan.ep import ep_degrees
    from shardtune.plan.fit_pp import pipeline_gain, pp_batches, pp_degrees
    from shardtune.plan.model import _load_model
    from shardtune.plan.pipeline import balanced_split
    from shardtune.plan.strategy_plan import combination_error, default_reserve_bytes, plan_strategy, with_cp, with_tp
    from shardtune.plan.timing import time_strategy, timing_context
    from shardtune.plan.validate import plan_layout, resolve_inputs
    from shardtune.rules.ep import check_ep_model
    from shardtune.strategies import STRATEGIES

    base = resolve_inputs(inputs, gpus, fields)
    gpu = resolve_gpu(base.gpu)
    reserve = default_reserve_bytes(gpu) if base.reserve_gib is None else round(base.reserve_gib * GIB)
    usable = gpu.memory_bytes - reserve
    m = _load_model(base.model, base.params, base.lora_rank, base.quantize_base, base.lora_target_parameters,
                    base.lora_target_modules)
    check_ep_model(base.ep, m.config)
    info = {"params": m.num_params, "trainable_params": m.trainable, "active_params": m.active}
    ctx = timing_context(base, gpu, **base.timing_options())
    strategies = base.strategies or list(STRATEGIES)
    # a bare --params count has no activations to model: AC and micro-batch cannot be searched
    acs = (base.ac,) if "ac" in keep or m.arch is None else AC_MODES
    micro_batches = MICRO_BATCHES if m.arch is not None and "micro_batch" not in keep else (base.micro_batch,)
    runnable = base.offload in OFFLOADS[1:] or ("offload" in keep and base.offload in OFFLOADS)
    offloads = (base.offload,) if runnable else OFFLOADS  # a runnable --offload is kept
    precisions = (base.precision,) if "precision" in keep else PRECISIONS
    out: list[Candidate] = []
    refused: dict[str, Exception] = {}
    # tensor parallelism: a --tp given is kept, else every degree of plan/tp.py that can run here
    tps = [base.tp] if base.tp > 1 or "tp" in keep or m.arch is None else [t for t in TP_DEGREES if with_tp(base, t, m)]
    long = m.arch is not None and (base.seq_len >= LONG_SEQ or base.cp > 1 or base.activation_offload)
    # expert parallelism (MoE): a --ep given is kept, else every power of two dividing the experts and the
    # data-parallel ranks (combination_error drops those a strategy's shard group cannot take)
    eps = [base.ep] if base.ep > 1 or "ep" in keep else ep_degrees(m.arch, [plan_layout(base, pp=1).grad_divide_factor])
    act_offloads = ((base.activation_offload,) if base.activation_offload or not long or
                    "activation_offload" in keep else (False, True))
    pps = pp_degrees(base, m, keep)
    for tp, strategy, cp, pp in ((t, s, c, p) for t in tps for s in strategies for c in _cps(base, t, m, long, keep)
                                 for p in pps):
        at_tp = with_tp(base, tp, m) if tp != base.tp else base
        at_tp = with_cp(at_tp, cp, m) if cp != at_tp.cp else at_tp
        # the global batch kept: grad_accum follows cp (--fit-batch: the global batch changes anyway)
        accum = base.grad_accum if fit_batch else base.grad_accum * cp // base.cp
        if at_tp is None or (not fit_batch and accum * base.cp != base.grad_accum * cp) or (
                "grad_accum" in keep and accum != base.grad_accum):
            continue
        try:  # the trainer's Layout: its data-parallel ranks and (hsdp's default shard) one node's of them
            lay = plan_layout(at_tp, "hsdp", tp=tp, cp=cp, pp=pp, hsdp_shard_size=None)
        except UserError:
            continue
        split = base.pp_layers if pp == base.pp else balanced_split(m.arch.num_layers, pp) if pp > 1 else None
        shards = _shard_sizes(lay.dp, lay.shard_degree) if STRATEGY[strategy].hybrid else [None]
        if STRATEGY[strategy].hybrid and "hsdp_shard_size" in keep and base.hsdp_shard_size:
            shards = [base.hsdp_shard_size]
        mbs = micro_batches if fit_batch else _same_batch(base, tp)
        if "micro_batch" in keep:  # given: held, so only the degrees that keep it with the global batch run
            mbs = tuple(mb for mb in mbs if mb == base.micro_batch)
        for shard, act_off, ep in ((g, a, e) for g in shards for a in act_offloads for e in eps):
            for precision in precisions:
                for ac in acs:
                    impl = base.optimizer_impl if "optimizer_impl" in keep else _impl_for(base, precision)
                    for offload in offloads:
                        inp = replace(at_tp, strategies=[strategy], hsdp_shard_size=shard or at_tp.hsdp_shard_size,
                                      precision=precision, ac=ac, offload=offload, optimizer_impl=impl,
                                      grad_accum=accum, activation_offload=act_off, ep=ep, pp=pp, pp_layers=split)
                        err = combination_error(inp, strategy)
                        if err:  # strategies.check_combination: nothing runs it
                            refused.setdefault(strategy, err)
                            continue
                        pairs = pp_batches(mbs, accum, pp // base.pp, split=not fit_batch,
                                           keep_accum="grad_accum" in keep)
                        for mb, ga in pairs:
                            inp = replace(inp, micro_batch=mb, grad_accum=ga)
                            sp = plan_strategy(m, strategy, inp, usable)
                            timing = time_strategy(sp, m.arch, info, inp, gpu, ctx)
                            c = Candidate(strategy, ac, offload, mb, shard, precision, sp.fits,
                                          sp.memory.total / GIB, usable / GIB, timing, optimizer=base.optimizer,
                                          optimizer_impl=impl, tp=tp, global_batch=mb * ga * lay.dp, cp=cp,
                                          activation_offload=act_off, grad_accum=ga, pp=pp, pp_layers=split,
                                          pp_schedule=base.pp_schedule, ep=ep)
                            if not sp.fits:
                                c.why = _why_not(sp, usable)
                            out.append(c)
                            if not sp.fits:
                                break  # larger micro-batches need more memory still
    searched = {c.strategy for c in out}
    for strategy in (base.strategies or []) + ([next(iter(refused))] if refused and not out else []):
        if strategy not in searched:  # a named strategy nothing can run, or no candidate at all
            raise refused[strategy]
    fitting = sorted((c for c in out if c.fits), key=lambda c: -c.tokens_per_s)
    best = fitting[0] if fitting else None
    for c in fitting[1:top]:
        c.why = _why_loses(c, best)
    rejected = sorted((c for c in out if not c.fits), key=lambda c: -c.tokens_per_s)
    g0 = base.micro_batch * base.grad_accum * plan_layout(base).batch_divisor
    notes = [f"grad_accum {base.grad_accum} and seq {base.seq_len} kept; micro-batch searched over "
             f"{', '.join(map(str, micro_batches))} (the global batch changes with it)" if fit_batch else
             f"global batch {g0} (micro-batch × grad_accum × data-parallel ranks) and seq {base.seq_len} kept: the "
             "micro-batch follows tp" + (", grad_accum follows cp" if long else "")
             + "; --fit-batch also searches the micro-batch (the global batch then changes)",
             f"compute at {ctx['mfu']:.0%} MFU ({ctx['network']['mfu_source']})"]
    searched_fields = {"strategies", "tp", "cp", "ac", "offload", "precision", "hsdp_shard_size", "micro_batch",
                       "grad_accum", "activation_offload", "optimizer_impl", "ep", "pp"}
    if keep & searched_fields:
        kept = sorted(keep & searched_fields)
        notes.insert(0, "kept as given: " + ", ".join(f"{k} {getattr(base, k)}" for k in kept))
    if base.offload != "none":
        notes.insert(1, f"offload {base.offload} kept (--offload)" if len(offloads) == 1 else
                     f"offload {base.offload} is planner-only: the trainer's none and all searched")
    if len(pps) > 1:
        notes.append("pp searched over " + ", ".join(map(str, pps)) + " (stages of one or two nodes, tp inside): "
                     "grad_accum follows pp, the rows of a step split into more micro-batches")
    return FitResult(best, fitting[:top], _distinct(rejected, top), len(out), ctx["network"], notes,
                     {"precision": base.precision, "global_batch": g0, "seq_len": base.seq_len},
                     pipeline_gain(fitting))


def _cps(base, tp: int, m, long: bool, keep: frozenset[str] = frozenset()) -> list[int]:
    """Context-parallel degrees to search at `tp`: a --cp given is kept; for long sequences every
    power of two of plan/cp.py that can run here; else 1."""
    from shardtune.plan.cp import cp_degrees
    from shardtune.plan.strategy_plan import with_cp, with_tp

    if base.cp > 1 or not long or "cp" in keep:
        return [base.cp]
    at_tp = with_tp(base, tp, m) if tp != base.tp else base
    return [c for c in cp_degrees(base.gpus, tp) if at_tp and (c == 1 or with_cp(at_tp, c, m))]


def _same_batch(base, tp: int) -> tuple[int, ...]:
    """The micro-batch that keeps the global batch at tensor-parallel degree `tp` (dp = gpus / tp):
    the plan's own × tp / its tp, or none when that is not a whole number."""
    num = base.micro_batch * tp
    return (num // base.tp,) if num % base.tp == 0 else ()


def _distinct(cands: list[Candidate], top: int) -> list[Candidate]:
    """The fastest rejected configuration of each strategy, then the next fastest distinct ones
    (one per strategy, precision, AC, offload) up to `top` — so every strategy's reason shows."""
    out, seen = [], set()
    for c in cands:
        if c.strategy not in {o.strategy for o in out}:
            out.append(c)
            seen.add((c.strategy, c.tp, c.cp, c.precision, c.ac, c.offload))
    for c in cands:
        if len(out) >= max(top, len({o.strategy for o in out})):
            break
        key = (c.strategy, c.tp, c.cp, c.precision, c.ac, c.offload)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return sorted(out, key=lambda c: -c.tokens_per_s)


def _why_not(sp, usable: int) -> str:
    mem = sp.memory
    parts = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
             "activations": mem.activations, "buffers": mem.buffers}
    big = max(parts, key=parts.get)
    return (f"needs {mem.total / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable; largest part {big} "
            f"{parts[big] / GIB:.1f} GiB")


def _why_loses(c: Candidate, best: Candidate) -> str:
    """Which per-token time component makes `c` slower than `best`, in words."""
    def per_token(x: Candidate, key: str) -> float:
        return x.timing[key] / (x.timing["step_time_s"] * x.tokens_per_s)

    gap = 1 - c.tokens_per_s / best.tokens_per_s
    diffs = {
        "exposed communication": per_token(c, "exposed_comm_s") - per_token(best, "exposed_comm_s"),
        "compute (recompute / smaller micro-batch)": per_token(c, "compute_time_s") - per_token(best, "compute_time_s"),
        "optimizer step": per_token(c, "optimizer_time_s") - per_token(best, "optimizer_time_s"),
    }
    worst = max(diffs, key=diffs.get)
    keys = ("strategy", "pp", "tp", "cp", "ep", "hsdp_shard_size", "ac", "activation_offload", "offload", "micro_batch",
            "precision")
    no_shard = None in (best.hsdp_shard_size, c.hsdp_shard_size)
    changed = [f"{k} {getattr(best, k)}→{getattr(c, k)}" for k in keys
               if getattr(best, k) != getattr(c, k) and not (k == "hsdp_shard_size" and no_shard)]
    return f"{gap:.1%} slower than #1 ({', '.join(changed) or 'same'}): more {worst} per token"


def render_fit(fit: FitResult, console, use: str | None = None) -> None:
    """The winner with the command line to use (`use`, default its plan flags), the runners-up
    with why they lose, the rejected."""
    net = fit.network
    link = (f"{net['interconnect']} × {net['nics_per_node']} per node" if net.get("interconnect") else "one node") + \
        (f" (measured profile {net['network_profile']['path']})" if net.get("network_profile") else "")
    console.print(f"searched {fit.searched} configurations; network: {link}, inside a node {net['intra_node']}")
    if (net.get("network_profile") or {}).get("mismatch"):
        console.print(f"warning: {net['network_profile']['mismatch']}")
    if fit.best is None:
        console.print("nothing fits; the closest:")
    else:
        b = fit.best
        console.print(f"best: {b.label()} → {b.tokens_per_s:,.0f} tokens/s per GPU, step "
                      f"{_secs(b.timing['step_time_s'])} s, "
                      f"MFU {b.timing['mfu']:.1%}, peak {b.peak_gib:.1f} of {b.usable_gib:.1f} GiB")
        changed = [f"{k} {v}" for k, v in b.changes(fit.base).items() if "(was" in v]
        if changed:
            console.print(f"  changes: {'; '.join(changed)}")
        console.print(f"  use: {use or b.flags()}", soft_wrap=True, markup=False)  # [q_proj,v_proj] is no tag
        console.print(_top_table(fit))
        for i, c in enumerate(fit.ranked[1:], 2):
            console.print(f"#{i} {c.tokens_per_s:,.0f} tokens/s — {c.why}")
    for c in fit.rejected:
        console.print(f"rejected: {c.label()} (would give {c.tokens_per_s:,.0f} tokens/s): {c.why}")
    if fit.pipeline_gain:
        from shardtune.plan.fit_pp import gain_line

        console.print(gain_line(fit.pipeline_gain))
    for n in fit.notes:
        console.print(f"note: {n}")


def _top_table(fit: FitResult):
    """The top candidates side by side with what each changes against the plan's own inputs."""
    from rich import box
    from rich.table import Table

    table = Table(title="Top configurations that fit (tokens/s per GPU, predicted); what each changes",
                  box=box.SIMPLE_HEAD, padding=(0, 1))
    for col in ("#", "configuration", "tokens/s", "peak GiB", "numerics", "global batch", "seq"):
        table.add_column(col, justify="right" if col in ("#", "tokens/s", "peak GiB") else "left")
    for i, c in enumerate(fit.ranked, 1):
        ch = c.changes(fit.base)
        conf = c.label().rsplit(", ", 1)[0]  # the precision has its own column
        table.add_row(str(i), conf, f"{c.tokens_per_s:,.0f}", f"{c.peak_gib:.1f}", ch["numerics"],
                      ch["global batch"], ch["seq"])
    return table


def _secs(v: float) -> str:
    """Seconds with 3 significant digits, without exponents for large values."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def timing_table(result, wide: bool = True):
    """Per-strategy step time, throughput and MFU of a PlanResult (filled by timing.add_timing);
    not `wide`: without the compute and comm columns (80 columns)."""
    from rich import box
    from rich.table import Table

    net = result.hardware.get("network", {})
    where = (f"{result.hardware['nodes']} nodes over {net.get('interconnect')} × {net.get('nics_per_node')}"
             if net.get("interconnect") else "one node") + f", {net.get('intra_node')} inside"
    if net.get("network_profile"):
        where += f", measured profile ({net['network_profile']['scope']})"
    table = Table(title=f"Predicted time per optimizer step ({where}; compute at {net.get('mfu_assumed', 0):.0%} MFU)",
                  box=box.SIMPLE_HEAD, padding=(0, 1))
    cols = ["strategy", "step s", "compute s", "comm s", "exposed s", "tokens/s/GPU", "MFU"]
    has_tokens = any("train_time_s" in s.timing for s in result.strategies)
    if has_tokens:
        cols += ["days", "GPU-hours"]
    keep = [i for i, c in enumerate(cols) if wide or c not in ("compute s", "comm s")]
    for i in keep:
        table.add_column(cols[i], justify="left" if cols[i] == "strategy" else "right")
    for s in result.strategies:
        t = s.timing
        row = [s.name, _secs(t["step_time_s"]), _secs(t["compute_time_s"]), _secs(t["comm_time_s"]),
               _secs(t["exposed_comm_s"]), f"{t['tokens_per_s']:,.0f}", f"{t['mfu']:.1%}"]
        if has_tokens:
            row += [f"{t['train_time_s'] / 86400:,.1f}", f"{t['gpu_hours']:,.0f}"]
        table.add_row(*(row[i] for i in keep))
    return table
