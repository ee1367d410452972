"""A real mixture of experts fine-tuned with expert parallelism, checked by what it answers (issue 39 item 6).

    .venv/bin/python bench/real_moe_finetune.py [--output-dir runs/real-moe] [--json OUT]

The model: SmolLM2-135M-Instruct sparsely upcycled into a Mixtral-shaped folder, 4 experts top-2
(`python -m shardtune.testing.upcycle`, built here if missing). The task: recipes/smollm2-moe-dates.yaml
(DD/MM/YYYY dates), trained through the CLI with ep 2 on 2 gloo processes:

    shardtune train recipes/smollm2-moe-dates.yaml --nproc 2 --ep 2 --output-dir OUT

Held-out metric: exact match of the greedy answer on the recipe's `train.sample_prompts` (held-out dates of
data/smollm2-dates/val.jsonl, never in the training set). Before: transformers alone on the upcycled
folder (one process, bench/real_finetune.py `exact_match`). After: the run's own answers at its last
step (samples.jsonl, greedy, on the trained sharded model) - ep > 1 refuses the HF export, so no
folder is left to load. Also printed: losses, aux_loss, expert_load_cv, val loss, wall and step time.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-moe-dates.yaml"
sys.path.insert(0, str(ROOT / "bench"))
from real_finetune import exact_match  # noqa: E402


def held_out_pairs(prompts: list[str]) -> list[tuple[str, str]]:
    """(prompt, target) for each sample prompt, the target from val.jsonl; a prompt not held out fails."""
    def pairs(path: Path) -> dict[str, str]:
        rows = [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]
        return {m[0]["content"]: m[1]["content"] for m in rows}
    val, train = pairs(ROOT / "data/smollm2-dates/val.jsonl"), pairs(ROOT / "data/smollm2-dates/train.jsonl")
    leaked = [p for p in prompts if p in train or p not in val]
    if leaked:
        raise SystemExit(f"not held-out dates: {leaked}")
    return [(p, val[p]) for p in prompts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", default=str(ROOT / "runs" / "real-moe"))
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()

    from shardtune.testing.upcycle import upcycled_folder
    folder = upcycled_folder(0, 4, 2)
    cfg = yaml.safe_load(RECIPE.read_text())
    if (RECIPE.parent / cfg["model"]["name"]).resolve() != folder.resolve():
        raise SystemExit(f"the recipe's model is not {folder}")
    held_out = held_out_pairs(cfg["train"]["sample_prompts"])

    t0 = time.time()
    before, before_answers = exact_match(folder, held_out)
    before_s = time.time() - t0
    print(f"before: {before:.0%} exact ({before_answers[0]!r} for {held_out[0][1]!r}), {before_s:.0f} s")

    out = Path(args.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(Path(sys.executable).parent / "shardtune"), "train", str(RECIPE), "--nproc", "2", "--ep", "2",
           "--output-dir", str(out)]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.time() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip()]
    last = max(s["step"] for s in samples)
    after_answers = {s["prompt"]: s["completion"].strip() for s in samples if s["step"] == last}
    hits = sum(after_answers[q] == t for q, t in held_out)
    res = {
        "command": " ".join(["shardtune", *cmd[1:]]),
        "held_out": len(held_out), "before_exact": before, "after_exact": hits / len(held_out),
        "after_step": last, "before_answers": before_answers, "after_answers": [after_answers[q] for q, _ in held_out],
        "targets": [t for _, t in held_out],
        "losses": [r["loss"] for r in steps], "aux_loss": [r.get("aux_loss") for r in steps],
        "expert_load_cv": [r.get("expert_load_cv") for r in steps], "val_loss": vals,
        "median_step_s": statistics.median(r["step_time_s"] for r in steps), "train_wall_s": wall,
    }
    print(json.dumps({k: v for k, v in res.items() if "answers" not in k}, indent=1))
    print(f"held-out exact match: {before:.0%} before -> {res['after_exact']:.0%} after {last} steps "
          f"({hits}/{len(held_out)}); e.g. {after_answers[held_out[0][0]]!r} for {held_out[0][1]!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
