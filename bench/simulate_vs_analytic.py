"""Analytic plan vs the trainer's step traced on fake tensors, per category, at full model size.

For each model × seq × AC (zero3, bf16-mixed, micro-batch 1, N = 8 by default) prints the
analytic and simulated per-GPU bytes (GiB = 2^30 B) by category, their relative difference
(simulated − analytic) / analytic, and the trace's wall time. Each configuration runs in its
own process (`plan --simulate --json`), so one failure or slow trace does not hide the others.
Usage: python bench/simulate_vs_analytic.py [--models llama-3-8b llama-3-70b] [--seqs 2048 4096]
       [--acs none full] [--gpus 8] [--strategy zero3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

KEYS = ("params", "grads", "optimizer", "activations", "buffers", "optimizer_step_temp", "total")
GIB = 2**30


def run_one(model: str, gpus: int, strategy: str, seq: int, ac: str, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "shardtune.cli", "plan", model, "--gpus", str(gpus), "--strategy", strategy,
           "--seq-len", str(seq), "--ac", ac, "--micro-batch", "1", "--precision", "bf16-mixed",
           "--simulate", "--json"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timeout after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"error": err.decode().strip()[-500:]}
    s = json.loads(out)["strategies"][0]
    return {"analytic": s["memory"], "simulated": s["simulated"], "process_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "llama-3-70b"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--acs", nargs="+", default=["none", "full"])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--json", help="also write every result to this file")
    args = ap.parse_args()
    results = []
    for model in args.models:
        for seq in args.seqs:
            for ac in args.acs:
                r = run_one(model, args.gpus, args.strategy, seq, ac, args.timeout_s)
                r.update(model=model, seq=seq, ac=ac)
                results.append(r)
                head = f"{model} {args.strategy} N={args.gpus} seq {seq} AC {ac}"
                if "error" in r:
                    print(f"{head}: FAILED {r['error']}", flush=True)
                    continue
                a, s = r["analytic"], r["simulated"]
                print(f"{head}: trace {s['wall_s']:.0f} s (process {r['process_s']:.0f} s)")
                print(f"  {'category':20s} {'analytic GiB':>12s} {'simulated GiB':>13s} {'Δ':>8s}")
                for k in KEYS:
                    d = (s[k] - a[k]) / a[k] if a[k] else float("nan")
                    print(f"  {k:20s} {a[k] / GIB:12.2f} {s[k] / GIB:13.2f} {d * 100:+7.1f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
