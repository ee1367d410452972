"""Launch → first step of `shardtune train`: this tree against another checkout (an older commit's
worktree) or against itself with other environment variables, runs alternated (A B, B A, ...) so a
shared machine's load hits both alike, beside a bare `python -c "import torch, transformers"` timed
the same way.

    git worktree add /tmp/st-old 7d9fbef        # the commit issue 19 measured (4.5 s at nproc 2)
    .venv/bin/python bench/startup.py --other /tmp/st-old --rounds 5
    .venv/bin/python bench/startup.py --other-env SHARDTUNE_FORK_RANKS=0   # forked ranks vs fresh ones

Each run is `python -m shardtune.cli train RECIPE --nproc N --max-steps 1` with no final save or
export, started in the tree's own folder with it first on PYTHONPATH; its time is from the launch
to the moment the run's metrics.jsonl holds step 1 (polled every 10 ms), and the CPU seconds of the
whole run (launcher, torchrun, ranks: the children's rusage). Printed: the medians, the ratio
other / this (> 1: this tree starts faster) with its spread, and the load.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def first_step_s(tree: Path, out: Path, nproc: int, timeout_s: float, extra_env: dict) -> tuple[float, float]:
    """(seconds from launch to step 1, CPU seconds of the whole run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = str(tree)
    env.update(extra_env)
    cpu0 = _children_cpu_s()
    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tree / "recipes" / "tiny-cpu.yaml"),
           "--nproc", str(nproc), "--max-steps", "1", "--output-dir", str(out),
           "checkpoint.save_final=false", "checkpoint.export_hf=false"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = None
    while time.perf_counter() - start < timeout_s:
        if metrics.is_file() and metrics.read_text().strip():
            elapsed = time.perf_counter() - start
            break
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    _, err = proc.communicate(timeout=timeout_s)
    if elapsed is None:
        raise SystemExit(f"{tree}: no step 1 (exit {proc.returncode}): {err[-1500:]}")
    return elapsed, _children_cpu_s() - cpu0


def bare_import_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", default=str(ROOT), help="another checkout of shardtune (a git worktree); "
                    "default: this one (then give --other-env)")
    ap.add_argument("--other-env", action="append", default=[], metavar="KEY=VALUE",
                    help="set for the other's runs only (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180)
    args = ap.parse_args()
    other = Path(args.other).resolve()
    envs = {"this": {}, "other": dict(kv.split("=", 1) for kv in args.other_env)}
    times: dict[str, list[float]] = {"this": [], "other": [], "import": []}
    cpu: dict[str, list[float]] = {"this": [], "other": []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = [("this", ROOT), ("other", other)]
            for name, tree in order if i % 2 == 0 else order[::-1]:
                wall, cpu_s = first_step_s(tree, Path(tmp) / f"{name}-{i}", args.nproc, args.timeout, envs[name])
                times[name].append(wall)
                cpu[name].append(cpu_s)
            times["import"].append(bare_import_s())
    ratios = [o / t for o, t in zip(times["other"], times["this"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    label = f"{other}{' with ' + ' '.join(args.other_env) if args.other_env else ''}"
    print(f"launch -> step 1, nproc {args.nproc}, {args.rounds} rounds: this {med['this']:.2f} s, "
          f"other ({label}) {med['other']:.2f} s; bare import torch+transformers {med['import']:.2f} s")
    print(f"CPU s of the whole 1-step run (median): this {statistics.median(cpu['this']):.2f}, "
          f"other {statistics.median(cpu['other']):.2f}")
    print(f"other / this: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"this / bare import {med['this'] / med['import']:.2f}; "
          f"load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
