"""A real mixture of experts fine-tuned with expert parallelism, checked by what it answers (issue 39 item 6).

    .venv/bin/python bench/real_moe_finetune.py [--output-dir runs/real-moe] [--json OUT]

The model: SmolLM2-135M-Instruct sparsely upcycled into a Mixtral-shaped folder, 4 experts top-2
(`python -m shardtune.testing.upcycle`, built here if missing). The task: recipes/smollm2-moe-dates.yaml
(DD/MM/YYYY dates), trained through the CLI with ep 2 on 2 gloo processes:

    shardtune train recipes/smollm2-moe-dates.yaml --nproc 2 --ep 2 --output-dir OUT

Held-out metric: exact match of the greedy answer on the recipe's `train.sample_prompts` (held-out dates of
data/smollm2-dates/val.jsonl, never in the training set). Before: transformers alone on the upcycled
folder (one process, bench/real_finetune.py `exact_match`). After: transformers alone on the ep run's
HF export (hf_export, written from the ep-sharded checkpoint), and the run's own answers at its last
step (samples.jsonl, greedy, on the trained sharded model). Also printed: losses, aux_loss,
expert_load_cv, val loss, wall and step time.

--no-ep-check: train the same recipe once more without ep (`parallel.ep=1`, zero3 over 2 ranks), compare
its losses with the ep run's, and score the export with transformers alone (the
same exact-match as before). --reuse-ep RUN: take the ep run's figures from an earlier run folder.
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


def train(out: Path, extra: list[str]) -> tuple[list[str], float]:
    """`shardtune train RECIPE --nproc 2 --output-dir OUT *extra` (a fresh folder); the command and its wall time."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(Path(sys.executable).parent / "shardtune"), "train", str(RECIPE), "--nproc", "2", *extra,
           "--output-dir", str(out)]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return ["shardtune", *cmd[1:]], time.time() - t0


def figures(out: Path, held_out: list[tuple[str, str]]) -> dict:
    """A run folder's losses, MoE metrics, val loss and its last samples' exact match."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip()]
    last = max(s["step"] for s in samples)
    answers = {s["prompt"]: s["completion"].strip() for s in samples if s["step"] == last}
    return {"after_exact": sum(answers[q] == t for q, t in held_out) / len(held_out), "after_step": last,
            "after_answers": [answers[q] for q, _ in held_out],
            "losses": [r["loss"] for r in steps], "aux_loss": [r.get("aux_loss") for r in steps],
            "expert_load_cv": [r.get("expert_load_cv") for r in steps],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r],
            "median_step_s": statistics.median(r["step_time_s"] for r in steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", default=str(ROOT / "runs" / "real-moe"))
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--no-ep-check", action="store_true", help="also train without ep, export, score the export")
    p.add_argument("--reuse-ep", help="an earlier ep run folder: its figures, no new ep run")
    args = p.parse_args()

    from shardtune.testing.upcycle import upcycled_folder
    folder = upcycled_folder(0, 4, 2)
    cfg = yaml.safe_load(RECIPE.read_text())
    if (RECIPE.parent / cfg["model"]["name"]).resolve() != folder.resolve():
        raise SystemExit(f"the recipe's model is not {folder}")
    held_out = held_out_pairs(cfg["train"]["sample_prompts"])
    out = Path(args.output_dir)
    res = {"held_out": len(held_out), "targets": [t for _, t in held_out]}

    if args.reuse_ep:
        ep_dir = Path(args.reuse_ep)
    else:
        t0 = time.time()
        res["before_exact"], res["before_answers"] = exact_match(folder, held_out)
        print(f"before: {res['before_exact']:.0%} exact, {time.time() - t0:.0f} s: {res['before_answers']}")
        ep_dir = out / "ep2"
        res["ep2_command"], res["ep2_train_wall_s"] = train(ep_dir, ["--ep", "2"])
    res["ep2"] = figures(ep_dir, held_out)
    print(f"ep 2: held-out exact {res['ep2']['after_exact']:.0%} at step {res['ep2']['after_step']}: "
          f"{res['ep2']['after_answers']}")
    res["ep2_export_exact"], res["ep2_export_answers"] = exact_match(ep_dir / "hf_export", held_out)
    print(f"ep 2's HF export, transformers alone: {res['ep2_export_exact']:.0%} exact: {res['ep2_export_answers']}")
    if args.no_ep_check:
        no_ep = out / "no-ep"
        res["no_ep_command"], res["no_ep_train_wall_s"] = train(no_ep, ["parallel.ep=1"])
        res["no_ep"] = figures(no_ep, held_out)
        res["max_abs_dloss_ep2_vs_no_ep"] = max(abs(a - b) for a, b in zip(res["ep2"]["losses"],
                                                                           res["no_ep"]["losses"], strict=True))
        res["export_exact"], res["export_answers"] = exact_match(no_ep / "hf_export", held_out)
        print(f"no ep: max |loss(ep 2) - loss(no ep)| {res['max_abs_dloss_ep2_vs_no_ep']:.2e}; its HF export, "
              f"transformers alone: {res['export_exact']:.0%} exact: {res['export_answers']}")
    print(json.dumps({k: v for k, v in res.items() if "answers" not in str(k)}, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
