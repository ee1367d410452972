"""Wall time of `shardtune plan llama-3-70b --gpus 8` as a user runs it (a fresh process each time).

The planner imports no torch, so the command should answer in well under a second. Prints every
run and the median. Usage: python bench/plan_speed.py [--runs 7] [-- extra plan args]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time


def time_once(cmd: list[str], timeout_s: float = 60.0) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SystemExit(f"plan_speed: {' '.join(cmd)} took over {timeout_s:.0f} s")
    if proc.returncode != 0:
        raise SystemExit(f"plan_speed: {' '.join(cmd)} failed: {err.decode().strip()}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("extra", nargs="*", help="arguments after `plan` (default: llama-3-70b --gpus 8)")
    args = ap.parse_args()
    exe = shutil.which("shardtune", path=os.path.dirname(sys.executable)) or shutil.which("shardtune")
    base = [exe] if exe else [sys.executable, "-m", "shardtune.cli"]
    cmd = base + ["plan"] + (args.extra or ["llama-3-70b", "--gpus", "8"])
    times = [time_once(cmd) for _ in range(args.runs)]
    print("command: " + " ".join(cmd))
    print("runs (s): " + ", ".join(f"{t:.3f}" for t in times))
    print(f"median: {statistics.median(times):.3f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
