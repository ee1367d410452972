"""DPO checked against TRL's DPOTrainer: shardtune on 2 ranks zero3 vs TRL in one process, fp32.

    .venv/bin/python bench/real_dpo.py --json bench/results/real_dpo-2026-12-04.json
    .venv/bin/python bench/real_dpo.py --write-data data/smollm2-dpo    # the shipped pairs, made again
    .venv/bin/python bench/real_dpo.py --timed --json bench/results/real_dpo-timed-2026-12-04.json

TRL runs in .venv-bench (pip install trl; it must see this project's torch and transformers). The
model: the SmolLM2-135M-Instruct fixture cut to its first 2 layers (shardtune.testing.smollm2, real
weights and chat template), fp32. The same initial policy and reference (the folder's weights),
the same pairs in the same order (the first steps × 4 of data/smollm2-dpo/train.jsonl, no
shuffle: TRL's sampler is made sequential), β 0.1, AdamW lr 5e-4 betas (0.9, 0.95) eps 1e-8 no
decay, constant lr, clip 1.0, global batch 4 pairs (shardtune 2 ranks × 2, TRL 1 process × 4).
TRL tokenises the conversational pairs itself (its chat-template split of prompt and completion).
Printed and written: per step, each side's loss, rewards/margins, rewards/chosen, rewards/rejected,
rewards/accuracies, and the largest difference of each.

--timed: the whole SmolLM2-135M-Instruct fixture, fp32, recipes/smollm2-dpo.yaml's settings (lr 2e-5,
β 0.1, 8 pairs a step, seq_len 128, zero3, a live reference), TIMED_STEPS steps of the same pairs on
both sides, both on the machine's 2 cores (shardtune 2 ranks × 1 thread, TRL 1 process × 2 threads).
tokens/s: the pairs' tokens (prompt + chosen and prompt + rejected by the tokenizer's chat template,
counted once, the same for both) per step / the median step time of steps 2.. (step 1 warms up;
shardtune's step 3 runs under the CPU memory tracker). Preference accuracy: the share of the 40
held-out pairs (data/smollm2-dpo/val.jsonl) whose chosen side the policy's summed response log-prob
ranks higher, before and after training (shardtune: its start-up line and val_pref_acc; TRL's
process: the same sums through plain transformers).
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
TIMED_STEPS, TIMED_BATCH, TIMED_LR = 4, 8, 2e-5
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


def run_shardtune(work: Path, folder: Path, data: Path, steps: int = STEPS, batch: int = BATCH, lr: float = LR,
                  val: Path | None = None) -> tuple[list[dict], str]:
    """(metrics.jsonl's records, the run's stdout) of `shardtune train` on 2 ranks."""
    recipe = work / "dpo.yaml"
    held_out = f", val_path: {val}" if val else ""
    recipe.write_text(f"""name: bench-dpo
model: {{name: {folder}, init: pretrained}}
data: {{path: {data}{held_out}, packing: false, shuffle: false, cache_dir: null}}
parallel: {{strategy: zero3, precision: fp32}}
optim: {{lr: {lr}, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.0, grad_clip: 1.0, warmup_steps: 0,
        schedule: constant}}
train: {{micro_batch: {batch // 2}, seq_len: 128, max_steps: {steps}, objective: dpo, dpo_beta: {BETA}, log_every: 1,
        eval_every: {steps}}}
checkpoint: {{save_final: false}}
""")
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(recipe), "--nproc", "2", "--output-dir",
           str(work / "run")]
    out = subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                         text=True).stdout
    return [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()], out


TRL_SIDE = """
import json, sys, time, torch
from datasets import Dataset
import trl
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer
folder, data, out = sys.argv[1:4]
steps, batch, lr, beta, timed = {steps}, {batch}, {lr}, {beta}, {timed}
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
logs, times = [], []
class Keep(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        keep.append(dict(logs or {{}}))
    def on_step_begin(self, args, state, control, **kwargs):
        times.append(time.perf_counter())
    def on_step_end(self, args, state, control, **kwargs):
        times[-1] = time.perf_counter() - times[-1]
keep = logs
def side(p, key):  # (ids of prompt + response, where the response starts), the chat template's
    prompt = [{{"role": "user", "content": p["prompt"]}}]
    ids = tok.apply_chat_template([*prompt, {{"role": "assistant", "content": p[key]}}], tokenize=True,
                                  return_dict=True)["input_ids"]
    head = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    return list(ids), len(head)
@torch.no_grad()
def prefers(pairs):  # held-out pairs whose chosen side has the larger summed response log-prob
    t0, sums = time.perf_counter(), []
    sides = [side(p, key) for p in pairs for key in ("chosen", "rejected")]
    for i in range(0, len(sides), 16):  # 16 sequences a forward, right-padded (causal: padding is never seen)
        part = sides[i:i + 16]
        width = max(len(ids) for ids, _ in part)
        x = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in part])
        logp = model(input_ids=x).logits[:, :-1].float().log_softmax(-1).gather(2, x[:, 1:, None])[..., 0]
        sums += [float(logp[j, start - 1:len(ids) - 1].sum()) for j, (ids, start) in enumerate(part)]
    print(f"held-out preference: {{time.perf_counter() - t0:.1f}} s", file=sys.stderr, flush=True)
    return sum(sums[2 * k] > sums[2 * k + 1] for k in range(len(pairs)))
val = [json.loads(l) for l in open(sys.argv[4])] if timed else []
before = prefers(val) if timed else None
class Seq(DPOTrainer):
    def _get_train_sampler(self, *a, **k):
        return torch.utils.data.SequentialSampler(self.train_dataset)
trainer = Seq(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Keep()])
trainer.train()
model.eval()
tokens = sum(len(side(p, "chosen")[0]) + len(side(p, "rejected")[0]) for p in pairs)
json.dump({{"trl": trl.__version__, "logs": [l for l in logs if "rewards/margins" in l], "step_times": times,
           "tokens": tokens, "val_pairs": len(val), "prefer_before": before,
           "prefer_after": prefers(val) if timed else None}}, open(out, "w"))
"""


def run_trl(work: Path, folder: Path, data: Path, steps: int = STEPS, batch: int = BATCH, lr: float = LR,
            val: Path | None = None) -> dict:
    script = work / "trl_dpo.py"
    script.write_text(TRL_SIDE.format(steps=steps, batch=batch, lr=lr, beta=BETA, timed=val is not None))
    out = work / "trl.json"
    py = ROOT / ".venv-bench" / "bin" / "python"
    subprocess.run([str(py), str(script), str(folder), str(data), str(out), str(val)], check=True, cwd=work,
                   env=dict(os.environ, OMP_NUM_THREADS="2"))
    return json.loads(out.read_text())


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def timed(json_path: str | None) -> None:
    """tokens/s and held-out preference accuracy: the whole SmolLM2, shardtune vs TRL in one run."""
    import re

    folder = ROOT / ".cache" / "smollm2" / "SmolLM2-135M-Instruct"
    data, val = ROOT / "data" / "smollm2-dpo" / "train.jsonl", ROOT / "data" / "smollm2-dpo" / "val.jsonl"
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "st").mkdir()
        (work / "trl").mkdir()
        ours, out = run_shardtune(work / "st", folder, data, TIMED_STEPS, TIMED_BATCH, TIMED_LR, val)
        load.append(os.getloadavg()[0])
        print("shardtune done: " + json.dumps(ours) + "\n" + "\n".join(
            line for line in out.splitlines() if "prefers the chosen" in line), flush=True)
        theirs = run_trl(work / "trl", folder, data, TIMED_STEPS, TIMED_BATCH, TIMED_LR, val)
        load.append(os.getloadavg()[0])
    tokens = theirs["tokens"] / TIMED_STEPS  # a step's pair tokens, the same pairs on both sides
    before = re.search(r"prefers the chosen side in (\d+) of (\d+)", out)
    final = [r for r in ours if "val_pref_acc" in r][-1]
    rows = {
        "shardtune": {"step_times_s": [r["step_time_s"] for r in ours if "step_time_s" in r],
                      "prefer_before": int(before[1]), "val_pairs": int(before[2]),
                      "prefer_after": round(final["val_pref_acc"] * int(before[2])), "final_loss": ours[-1]["loss"]},
        "trl": {"step_times_s": theirs["step_times"], "prefer_before": theirs["prefer_before"],
                "val_pairs": theirs["val_pairs"], "prefer_after": theirs["prefer_after"],
                "final_loss": theirs["logs"][-1]["loss"]},
    }
    for name, r in rows.items():
        r["median_step_s"] = median(r["step_times_s"][1:])
        r["tokens_per_s"] = tokens / r["median_step_s"]
        print(f"{name:9s}: {r['tokens_per_s']:7.1f} tokens/s (median step {r['median_step_s']:.2f} s of steps 2-"
              f"{TIMED_STEPS}: {', '.join(f'{t:.2f}' for t in r['step_times_s'])}); held-out pairs preferred "
              f"{r['prefer_before']}/{r['val_pairs']} before, {r['prefer_after']}/{r['val_pairs']} after; "
              f"last loss {r['final_loss']:.4f}")
    print(f"pair tokens a step: {tokens:.0f}; load average (1 min) before / between / after: "
          + " / ".join(f"{x:.1f}" for x in load))
    if json_path:
        result = {"trl_version": theirs["trl"], "command": "python bench/real_dpo.py --timed --json " + json_path,
                  "model": "SmolLM2-135M-Instruct (the whole fixture), fp32",
                  "setup": f"{TIMED_STEPS} steps, {TIMED_BATCH} pairs a step, lr {TIMED_LR}, beta {BETA}, seq_len 128; "
                           "shardtune zero3 2 ranks (gloo, 1 thread each) vs TRL DPOTrainer 1 process (2 threads)",
                  "tokens_per_step": tokens, "load_average": load, **rows}
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--write-data", metavar="DIR", help="write the shipped pairs (data/smollm2-dpo) and exit")
    ap.add_argument("--timed", action="store_true", help="tokens/s and held-out preference accuracy on the whole "
                    "SmolLM2 against TRL (about 10 minutes of 2 cores)")
    args = ap.parse_args(argv)
    if args.write_data:
        write_data(Path(args.write_data))
        return
    if args.timed:
        timed(args.json)
        return
    from shardtune.testing.smollm2 import cut_folder

    folder = cut_folder(2)
    data = ROOT / "data" / "smollm2-dpo" / "train.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ours, theirs = run_shardtune(work, folder, data)[0], run_trl(work, folder, data)
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
