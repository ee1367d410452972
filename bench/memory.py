"""Per-rank memory of shardtune vs its peers on the same run, vs the planner and vs 16Ψ/N.

    .venv/bin/python bench/memory.py                                # runs each contender once (3 + 1 steps)
    .venv/bin/python bench/memory.py --from /tmp/tp.json            # the runs bench/throughput.py --json kept
    .venv/bin/python bench/memory.py --contenders shardtune-ddp,hf-trainer

What each number is (bytes per rank; MiB = 2^20 bytes):
  states    params + grads + optimizer state: the distinct storages of the rank's local parameters
            (DTensor local shards), their .grad and every optimizer-state tensor, counted after the
            optimizer step of step 3 while all three exist. shardtune: its own memory.json (train/
            metrics.py, after its last step: it zeroes grads at the start of a step, so they exist);
            the peers and the limit: counted inside their process by bench/peer_loops.py (its own
            counter; a Trainer callback `on_optimizer_step` for hf-trainer).
  theory    16 B/param × Ψ / N for a sharded strategy (N = ranks), 16Ψ for ddp: fp32 AdamW holds
            fp32 params 4 + fp32 grads 4 + Adam m, v 8 bytes per parameter; bf16-mixed AdamW in
            FSDP2's fp32-master layout is the same 16 (the ZeRO paper's 2 + 2 + 12). These runs are
            fp32. A peer is held to the strategy it was asked for (hf-trainer: fsdp="full_shard").
  planner   shardtune.plan's prediction for the same run (the run folder's plan.json; the peers are
            compared with the shardtune run of the same strategy).
  VmHWM     the peak resident set of each rank's process, read from /proc/PID/status by the
            driver every 0.2 s while it runs: everything the process ever held at once, the
            Python, torch and transformers libraries (~0.4–0.5 GiB before any tensor) included.
  tracked   shardtune only: the peak of torch's FSDPMemTracker / MemTracker over its 3rd step
            (train/core/memtrack.py), tensors only, against the planner's peak ("total").
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # noqa: E402  (bench/ is not a package)

MIB = 2**20
BYTES_PER_PARAM = 16  # fp32 AdamW: 4 + 4 + 8


def _states(rank: dict) -> int | None:
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes")
    return sum(rank[k] for k in keys) if all(k in rank for k in keys) else None


def nominal_strategy(name: str) -> str:
    kind, _, strategy = name.partition("-")
    return strategy.partition("+")[0] if kind in ("shardtune", "limit") else "zero3"


def planned(runs: dict, strategy: str) -> dict | None:
    r = runs.get(f"shardtune-{strategy}") or next(
        (v for k, v in runs.items() if k.startswith(f"shardtune-{strategy}+")), None)
    plan = r and r.get("plan")
    if not plan or "strategies" not in plan:
        return None
    return next((s["memory"] for s in plan["strategies"] if s["name"] == strategy), None)


def rows(runs: dict, num_params: int, nproc: int) -> list[dict]:
    out = []
    for name, r in runs.items():
        strategy = nominal_strategy(name)
        theory = BYTES_PER_PARAM * num_params / (1 if strategy in ("ddp", "zero1") else nproc)
        plan = planned(runs, strategy)
        plan_states = plan and plan["params"] + plan["grads"] + plan["optimizer"]
        per_rank = (r.get("memory") or {}).get("per_rank") or []
        for i in range(max(len(per_rank), len(r.get("vm_hwm_bytes", [])))):
            rank = per_rank[i] if i < len(per_rank) else {}
            states = _states(rank)
            tracked = (rank.get("tracked") or {}).get("total")
            hwm = r["vm_hwm_bytes"][i] if i < len(r.get("vm_hwm_bytes", [])) else None
            out.append({"contender": name, "rank": i, "strategy": strategy, "states": states,
                        "params": rank.get("params_bytes"), "grads": rank.get("grads_bytes"),
                        "optimizer": rank.get("optimizer_bytes"),
                        "states_vs_theory": states / theory if states else None,
                        "states_vs_planner": states / plan_states if states and plan_states else None,
                        "vm_hwm": hwm, "tracked_peak": tracked,
                        "tracked_vs_planner": tracked / plan["total"] if tracked and plan else None,
                        "error": r.get("error")})
    return out


def print_table(table: list[dict], num_params: int, nproc: int, markdown: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt = lambda v: "—" if v is None else f"{v / MIB:,.2f}"  # noqa: E731
    rat = lambda v: "—" if v is None else f"{v:.4f}"  # noqa: E731
    t = Table(title=f"memory per rank, MiB (Ψ = {num_params:,} params, N = {nproc}; theory 16Ψ/N = "
                    f"{BYTES_PER_PARAM * num_params / nproc / MIB:,.2f} MiB sharded, 16Ψ = "
                    f"{BYTES_PER_PARAM * num_params / MIB:,.2f} ddp)")
    cols = ("contender", "rank", "params", "grads", "optim", "states", "states/theory", "states/planner",
            "VmHWM", "tracked peak", "tracked/planner peak")
    for c in cols:
        t.add_column(c)
    for r in table:
        if r["states"] is None and r["vm_hwm"] is None:
            t.add_row(r["contender"], str(r["rank"]), *["—"] * 8, (r["error"] or "")[:60])
            continue
        t.add_row(r["contender"], str(r["rank"]), fmt(r["params"]), fmt(r["grads"]), fmt(r["optimizer"]),
                  fmt(r["states"]), rat(r["states_vs_theory"]), rat(r["states_vs_planner"]),
                  fmt(r["vm_hwm"]), fmt(r["tracked_peak"]), rat(r["tracked_vs_planner"]))
    tp.show(Console(width=200), t, markdown)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", help="bench/throughput.py --json output: use its first round")
    ap.add_argument("--contenders", default="shardtune-zero3,limit-zero3,hf-trainer,fabric-fsdp2")
    tp.add_run_args(ap)
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args()
    if args.src:
        data = json.loads(Path(args.src).read_text())
        runs, num_params, nproc = data["rounds"][0], data["params"], data["args"]["nproc"]
    else:
        args.warmup, args.steps = 3, 1  # states are counted at step 3 everywhere
        work = Path(tempfile.mkdtemp(prefix="shardtune-mem-"))
        inputs = tp.write_inputs(work, args)
        num_params, nproc = tp._param_count(tp.model_config(args.layers, args.hidden)), args.nproc
        runs = {}
        for name in args.contenders.split(","):
            runs[name] = tp.run_one(name, inputs, work, args.nproc, args.timeout)
            print(f"  {name}: rc {runs[name]['rc']}, {runs[name]['wall_s']:.0f} s", flush=True)
    table = rows(runs, num_params, nproc)
    print_table(table, num_params, nproc, args.markdown)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
