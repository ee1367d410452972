"""The shipped GRPO recipe through the CLI, checked by its held-out reward before and after training.

    .venv/bin/python -m shardtune.testing.smollm2          # once: the SmolLM2-135M-Instruct folder
    .venv/bin/python bench/real_grpo.py [--json out.json] [-- extra key=value overrides]

Runs `shardtune train recipes/smollm2-grpo.yaml --nproc 2` into a fresh folder and prints: the held-out
reward of the pretrained model (greedy, the start-up line `reward before training`), val_reward and its
per-function parts at each evaluation (metrics.jsonl), the training reward per step, and the wall time.
Not a test: minutes of CPU (docs/rl.md records a run).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from shardtune.processes import run_bounded

    out = Path(tempfile.mkdtemp(prefix="real_grpo-")) / "run"
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(REPO / "recipes" / "smollm2-grpo.yaml"), "--nproc", "2",
           "--output-dir", str(out), *args.overrides]
    t0 = time.monotonic()
    proc = run_bounded(cmd, timeout_s=args.timeout, cwd=REPO, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        print(proc.stdout[-3000:])
        return 1
    before = float(re.search(r"reward before training ([-\d.]+)", proc.stdout).group(1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [{k: v for k, v in r.items() if k == "step" or k.startswith("val_reward")}
             for r in rows if "val_reward" in r]
    print(f"held-out reward: before {before:.4f}, " + ", ".join(f"step {e['step']} {e['val_reward']:.4f}"
                                                                  for e in evals))
    for e in evals:
        print("  " + ", ".join(f"{k} {v:.4f}" for k, v in e.items() if k != "step") + f"  (step {e['step']})")
    print("train reward by step: " + " ".join(f"{r['reward']:.3f}" for r in rows))
    print(f"wall time {wall:.0f} s (the machine is shared: read it with its load), run folder {out}")
    if args.json:
        Path(args.json).write_text(json.dumps({"before": before, "evals": evals, "steps": rows, "wall_s": wall},
                                              indent=1))
    return 0 if evals and evals[-1]["val_reward"] > before else 1


if __name__ == "__main__":
    sys.exit(main())
