"""DPO checked against TRL's DPOTrainer: shardtune on 2 ranks zero3 vs TRL in one process, fp32.

    .venv/bin/python bench/real_dpo.py --json bench/results/real_dpo-2026-12-04.json
    .venv/bin/python bench/real_dpo.py --write-data data/smollm2-dpo    # the shipped pairs, made again

TRL runs in .venv-bench (pip install trl; it must see this project's torch and transformers). The
model: the SmolLM2-135M-Instruct fixture cut to its first 2 layers (shardtune.testing.smollm2, real
weights and chat template), fp32. The same initial policy and reference (the folder's weights),
the same pairs in the same order (the first steps × 4 of data/smollm2-dpo/train.jsonl, no
shuffle: TRL's sampler is made sequential), β 0.1, AdamW lr 5e-4 betas (0.9, 0.95) eps 1e-8 no
decay, constant lr, clip 1.0, global batch 4 pairs (shardtune 2 ranks × 2, TRL 1 process × 4).
TRL tokenises the conversational pairs itself (its chat-template split of prompt and completion).
Printed and written: per step, each side's loss, rewards/margins, rewards/chosen, rewards/rejected,
rewards/accuracies, and the largest difference of each.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STEPS, BATCH, LR, BETA = 3, 4, 5e-4, 0.1
KEYS = {"loss": "loss", "reward_margin": "rewards/margins", "reward_chosen": "rewards/chosen",
        "reward_rejected": "rewards/rejected", "reward_acc": "rewards/accuracies"}


def date_pairs(n: int, seed: int = 7) -> list[dict]:
    """bench/real_finetune.py's dates as pairs: chosen DD/MM/YYYY, rejected MM/DD/YYYY (YYYY/MM/DD
    where day == month, so the two differ)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from real_finetune import date_examples

    out = []
    for q, a in date_examples(n, seed):
        d, m, y = a.split("/")
        out.append({"prompt": q, "chosen": a, "rejected": f"{m}/{d}/{y}" if d != m else f"{y}/{m}/{d}"})
    return out


def write_data(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pairs = date_pairs(440)
    for name, part in (("train", pairs[:400]), ("val", pairs[400:])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in part))
    print(f"wrote {folder}/train.jsonl (400 pairs) and val.jsonl (40)")


def run_shardtune(work: Path, folder: Path, data: Path) -> list[dict]:
    recipe = work / "dpo.yaml"
    recipe.write_text(f"""name: bench-dpo
model: {{name: {folder}, init: pretrained}}
data: {{path: {data}, packing: false, shuffle: false, cache_dir: null}}
parallel: {{strategy: zero3, precision: fp32}}
optim: {{lr: {LR}, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.0, grad_clip: 1.0, warmup_steps: 0,
        schedule: constant}}
train: {{micro_batch: {BATCH // 2}, seq_len: 128, max_steps: {STEPS}, objective: dpo, dpo_beta: {BETA}, log_every: 1}}
checkpoint: {{save_final: false}}
""")
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(recipe), "--nproc", "2", "--output-dir",
           str(work / "run")]
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]


TRL_SIDE = """
import json, sys, torch
from datasets import Dataset
import trl
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer
folder, data, out = sys.argv[1:4]
steps, batch, lr, beta = {steps}, {batch}, {lr}, {beta}
pairs = [json.loads(l) for l in open(data)][:steps * batch]
rows = [{{"prompt": [{{"role": "user", "content": p["prompt"]}}],
         "chosen": [{{"role": "assistant", "content": p["chosen"]}}],
         "rejected": [{{"role": "assistant", "content": p["rejected"]}}]}} for p in pairs]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
args = DPOConfig(output_dir=out + ".trl", per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                 max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9,
                 adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, beta=beta, bf16=False,
                 fp16=False, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                 gradient_checkpointing=False, max_length=128, dataloader_num_workers=0)
logs = []
class Keep(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        keep.append(dict(logs or {{}}))
keep = logs
class Seq(DPOTrainer):
    def _get_train_sampler(self, *a, **k):
        return torch.utils.data.SequentialSampler(self.train_dataset)
trainer = Seq(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Keep()])
trainer.train()
json.dump({{"trl": trl.__version__, "logs": [l for l in logs if "rewards/margins" in l]}}, open(out, "w"))
"""


def run_trl(work: Path, folder: Path, data: Path) -> dict:
    script = work / "trl_dpo.py"
    script.write_text(TRL_SIDE.format(steps=STEPS, batch=BATCH, lr=LR, beta=BETA))
    out = work / "trl.json"
    py = ROOT / ".venv-bench" / "bin" / "python"
    subprocess.run([str(py), str(script), str(folder), str(data), str(out)], check=True, cwd=work,
                   env=dict(os.environ, OMP_NUM_THREADS="2"))
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--write-data", metavar="DIR", help="write the shipped pairs (data/smollm2-dpo) and exit")
    args = ap.parse_args(argv)
    if args.write_data:
        write_data(Path(args.write_data))
        return
    from shardtune.testing.smollm2 import cut_folder

    folder = cut_folder(2)
    data = ROOT / "data" / "smollm2-dpo" / "train.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ours, theirs = run_shardtune(work, folder, data), run_trl(work, folder, data)
    trl = theirs["logs"]
    steps = []
    for k, (a, b) in enumerate(zip(ours, trl), 1):
        steps.append({"step": k, **{key: {"shardtune": a[key], "trl": b[trl_key]} for key, trl_key in KEYS.items()}})
        print(f"step {k}: " + "  ".join(f"{key} {a[key]:+.6f} / {b[trl_key]:+.6f}" for key, trl_key in KEYS.items()))
    worst = {key: max(abs(s[key]["shardtune"] - s[key]["trl"]) for s in steps) for key in KEYS}
    print("largest |shardtune - TRL|: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    if args.json:
        result = {"trl": theirs["trl"], "command": "python bench/real_dpo.py --json " + args.json,
                  "model": "SmolLM2-135M-Instruct, first 2 layers (shardtune.testing.smollm2.cut_folder(2)), fp32",
                  "setup": f"{STEPS} steps, {BATCH} pairs a step, lr {LR}, beta {BETA}; shardtune zero3 2 ranks "
                           "(gloo) vs TRL DPOTrainer 1 process", "steps": steps, "largest_abs_diff": worst}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
