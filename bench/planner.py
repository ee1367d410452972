"""Planner latency as a user meets it: `shardtune plan` and `shardtune plan --simulate`, each in a
fresh process (imports included), for llama-3-8b and llama-3-70b at N = 8 (`--strategy zero3`).

The analytic planner imports no torch, so a plain plan should answer in well under a second; the
simulation imports torch and transformers and traces one step on fake tensors, so it is timed
apart (fewer runs: tens of seconds each). Prints every run and the median.
Usage: python bench/planner.py [--runs 7] [--simulate-runs 1] [--models M ...] [--json FILE]
       [-- extra plan args]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

from shardtune.processes import run_bounded


def time_once(cmd: list[str], timeout_s: float) -> float:
    start = time.perf_counter()
    try:
        proc = run_bounded(cmd, timeout_s, stdout=subprocess.DEVNULL)
    except TimeoutError as e:
        raise SystemExit(f"planner bench: {e}") from None
    if proc.returncode != 0:
        raise SystemExit(f"planner bench: {' '.join(cmd)} failed: {proc.stderr.strip()}")
    return time.perf_counter() - start


def plan_command() -> list[str]:
    """The installed `shardtune` script beside this interpreter, as a user would type it."""
    exe = shutil.which("shardtune", path=os.path.dirname(sys.executable)) or shutil.which("shardtune")
    return [exe] if exe else [sys.executable, "-m", "shardtune.cli"]


def bench_case(cmd: list[str], runs: int, timeout_s: float) -> dict:
    times = [time_once(cmd, timeout_s) for _ in range(runs)]
    row = {"command": " ".join(cmd), "runs_s": [round(t, 3) for t in times],
           "median_s": round(statistics.median(times), 3)}
    print(f"{row['command']}\n  runs (s): {', '.join(f'{t:.3f}' for t in times)}; "
          f"median {row['median_s']:.3f} s over {runs}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="runs of the plain plan per model")
    ap.add_argument("--simulate-runs", type=int, default=1, help="runs of plan --simulate per model (0: skip)")
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "llama-3-70b"])
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("extra", nargs="*", help="more plan arguments (default: --gpus 8 --strategy zero3)")
    args = ap.parse_args()
    base = plan_command() + ["plan"]
    extra = args.extra or ["--gpus", "8", "--strategy", "zero3"]
    results = {"python": platform.python_version(), "load_avg_start": os.getloadavg(), "cases": []}
    for model in args.models:
        plain = base + [model] + extra
        results["cases"].append({"model": model, "mode": "plan", **bench_case(plain, args.runs, 60.0)})
        if args.simulate_runs:
            row = bench_case(plain + ["--simulate"], args.simulate_runs, 600.0)
            results["cases"].append({"model": model, "mode": "simulate", **row})
    results["load_avg_end"] = os.getloadavg()
    print(f"load average: start {results['load_avg_start'][0]:.1f}, end {results['load_avg_end'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
