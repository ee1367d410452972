"""A real fine-tune, checked by what the model answers: SmolLM2-135M-Instruct learns a date format.

    .venv/bin/python bench/real_finetune.py                 # 2 ranks: shardtune zero3, ddp, HF Trainer
    .venv/bin/python bench/real_finetune.py --steps 40 --json /tmp/real.json --contenders shardtune-zero3,hf-trainer

The task: "Write the date 2017-03-09 as DD/MM/YYYY." → "09/03/2017" (chat messages, seeded dates; the
held-out dates are never in the training set). Before: greedy answers of the pretrained folder
(shardtune.testing.smollm2.full_folder(), real weights). After: greedy answers of each contender's
saved model, loaded with transformers alone. Exact match = the answer text equals the target.

Contenders, each 2 gloo processes on this machine (fp32, AdamW, lr, warm-up, clip, seed and the global
batch of 16 one-example rows the same; no packing, so each row is one padded example for every side):
  shardtune-zero3 / shardtune-ddp   `shardtune train` with a generated recipe, then its HF export
  hf-trainer                        transformers.Trainer (DDP via torchrun), its own chat tokenisation
                                    (apply_chat_template, loss on the assistant turn only)
  hf-trainer-1p                     the same in ONE process, batch 16, rows in file order: the loss
                                    reference (no side shuffles, so step k is rows 16k..16k+15 for all)
  trl-sft / trl-sft-1p              TRL's SFTTrainer (in .venv-bench: pip install trl), prompt-completion
                                    messages tokenised by TRL itself, completion-only loss; its bf16 and
                                    gradient-checkpointing defaults set off and its batches padded to
                                    seq_len, to match the others
tokens/s: target tokens per step / the median step time (shardtune: metrics.jsonl step_time_s;
HF: a callback between on_step_begin and on_step_end), so start-up is excluded for both; the ratio
is shardtune / HF. The machine is shared: run it twice and read the spread.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SYSTEM = None  # the model's own default system prompt (its chat template adds one)


def date_examples(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        y, m, d = rng.randint(1950, 2049), rng.randint(1, 12), rng.randint(1, 28)
        if (y, m, d) in seen:
            continue
        seen.add((y, m, d))
        out.append((f"Write the date {y:04d}-{m:02d}-{d:02d} as DD/MM/YYYY.", f"{d:02d}/{m:02d}/{y:04d}"))
    return out


def write_data(work: Path, n_train: int, n_eval: int) -> tuple[Path, list[tuple[str, str]]]:
    pairs = date_examples(n_train + n_eval, seed=7)
    train, held_out = pairs[:n_train], pairs[n_train:]
    path = work / "train.jsonl"
    with open(path, "w") as f:
        for q, a in train:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return path, held_out


def exact_match(folder: Path, held_out: list[tuple[str, str]]) -> tuple[float, list[str]]:
    """Greedy answers of a saved HF folder, transformers alone (one process)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answers = []
    with torch.no_grad():
        for q, _ in held_out:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_tensors="pt")
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
            answers.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    hits = sum(a == t for a, (_, t) in zip(answers, held_out))
    return hits / len(held_out), answers


def recipe(work: Path, folder: Path, data: Path, strategy: str, args) -> Path:
    text = f"""name: real-{strategy}
model: {{name: {json.dumps(str(folder))}, init: pretrained}}
data: {{path: {json.dumps(str(data))}, format: chat, tokenizer: hf, template: auto, packing: false, shuffle: false}}
parallel: {{strategy: {strategy}, precision: fp32}}
optim: {{lr: {args.lr}, warmup_steps: 0, schedule: constant, grad_clip: 1.0, weight_decay: 0.0, betas: [0.9, 0.95]}}
train: {{micro_batch: 8, grad_accum: 1, seq_len: {args.seq_len}, max_steps: {args.steps}, log_every: 1, seed: 0}}
checkpoint: {{every: 0, save_final: true, export_hf: true}}
"""
    path = work / f"{strategy}.yaml"
    path.write_text(text)
    return path


def run_shardtune(work: Path, folder: Path, data: Path, strategy: str, args) -> dict:
    out = work / f"st-{strategy}"
    cmd = [str(ROOT / ".venv" / "bin" / "shardtune"), "train", str(recipe(work, folder, data, strategy, args)),
           "--nproc", "2", "--output-dir", str(out), "--resume", "never"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr).strip().splitlines()[-1:]}
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [x["loss"] for x in recs], "step_s": [x["step_time_s"] for x in recs],
            "tokens": [x["target_tokens"] for x in recs], "folder": str(out / "hf_export"), "wall_s": wall}


def run_hf(work: Path, folder: Path, data: Path, args, nproc: int, side: str = "hf-trainer") -> dict:
    """HF Trainer (in .venv) or TRL's SFTTrainer (in .venv-bench, which has trl) on `nproc` processes."""
    out = work / (side if nproc == 2 else f"{side}-1p")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    py = str(ROOT / ".venv-bench" / "bin" / "python") if side == "trl-sft" else PY
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if nproc == 2 else []
    cmd = [py, *launch, __file__, "--worker", side,
           "--folder", str(folder), "--data", str(data), "--out", str(out), "--steps", str(args.steps),
           "--lr", str(args.lr), "--seq-len", str(args.seq_len)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr).strip().splitlines()[-3:]}
    res = json.loads((out / "steps.json").read_text())
    res.update(folder=str(out / "model"), wall_s=wall)
    return res


def hf_rows(tok, data: str, seq_len: int) -> list[dict]:
    """The HF Trainer side's own chat tokenisation: loss on the assistant turn only, padded to seq_len."""
    rows = []
    for line in Path(data).read_text().splitlines():
        msgs = json.loads(line)["messages"]
        enc = tok.apply_chat_template(msgs, return_assistant_tokens_mask=True, return_dict=True)
        ids, mask = enc["input_ids"], enc.get("assistant_masks")
        if not mask or not any(mask):  # templates without {% generation %}: loss on the answer's tokens
            prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, return_dict=True)["input_ids"]
            assert ids[: len(prompt)] == prompt, "the prompt is not a prefix of the conversation"
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        ids, mask = ids[:seq_len], mask[:seq_len]
        pad = seq_len - len(ids)
        rows.append({"input_ids": ids + [tok.pad_token_id] * pad, "attention_mask": [1] * len(ids) + [0] * pad,
                     "labels": [t if m else -100 for t, m in zip(ids, mask)] + [-100] * pad})
    return rows


def peer_worker(args) -> None:
    """One rank of the HF Trainer or TRL SFTTrainer side (torchrun sets the process group up through
    accelerate). Same optimiser, schedule, clip, seed, global batch 16 and fp32 as shardtune's side."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = AutoTokenizer.from_pretrained(args.folder)
    times: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    common = dict(output_dir=str(Path(args.out) / "tmp"), per_device_train_batch_size=16 // world,
                  max_steps=args.steps, learning_rate=args.lr, warmup_steps=0, lr_scheduler_type="constant",
                  max_grad_norm=1.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, logging_steps=1,
                  save_strategy="no", report_to=[], seed=0, use_cpu=True,
                  ddp_backend="gloo" if world > 1 else None, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    if args.worker == "trl-sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        pairs = [json.loads(line)["messages"] for line in Path(args.data).read_text().splitlines()]
        train = Dataset.from_list([{"prompt": m[:-1], "completion": m[-1:]} for m in pairs])
        # TRL's own defaults differ (bf16, gradient checkpointing on): set to the other sides' fp32, no AC
        # and every batch padded to seq_len as the other sides' rows are (TRL pads to the longest)
        targs, base = SFTConfig(**common, max_length=args.seq_len, packing=False, completion_only_loss=True,
                                bf16=False, gradient_checkpointing=False, pad_to_multiple_of=args.seq_len), SFTTrainer
        kwargs = dict(processing_class=tok)
    else:
        rows = hf_rows(tok, args.data, args.seq_len)

        class Rows(torch.utils.data.Dataset):
            def __len__(self):
                return len(rows)

            def __getitem__(self, i):
                return {k: torch.tensor(v) for k, v in rows[i].items()}

        train, targs, base, kwargs = Rows(), TrainingArguments(**common), Trainer, {}

    class InOrder(base):  # one process: rows in file order, as shardtune's data.shuffle=false
        def _get_train_sampler(self, *a, **k):
            if world > 1:
                return super()._get_train_sampler(*a, **k)
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrder(model=model, args=targs, train_dataset=train, callbacks=[Clock()], **kwargs)
    trainer.train()
    labels = [row["labels"] for row in hf_rows(tok, args.data, args.seq_len)]  # target tokens, as HF's side
    per_step = sum(sum(1 for t in lab if t != -100) for lab in labels) / len(labels) * 16
    if int(os.environ.get("RANK", "0")) == 0:
        trainer.save_model(str(Path(args.out) / "model"))
        tok.save_pretrained(str(Path(args.out) / "model"))
        (Path(args.out) / "steps.json").write_text(json.dumps({"losses": losses, "step_s": times,
                                                               "tokens": [round(per_step)] * len(times)}))


def summary(name: str, res: dict, warmup: int) -> dict:
    if "error" in res:
        return {"contender": name, "error": res["error"]}
    steps = res["step_s"][warmup:]
    tok = res["tokens"][warmup:]
    med = statistics.median(steps)
    return {"contender": name, "loss_first": res["losses"][0], "loss_last5": statistics.mean(res["losses"][-5:]),
            "tokens_per_s": statistics.mean(tok) / med, "step_s_median": med, "wall_s": res["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--train", type=int, default=1200)
    ap.add_argument("--held-out", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    ap.add_argument("--contenders", default="shardtune-zero3,shardtune-ddp,hf-trainer,hf-trainer-1p")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", choices=["hf-trainer", "trl-sft"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return peer_worker(args)
    sys.path.insert(0, str(ROOT))
    from shardtune.testing.smollm2 import full_folder

    work = Path(args.work or tempfile.mkdtemp(prefix="real-finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    folder = full_folder()
    data, held_out = write_data(work, args.train, args.held_out)
    load = os.getloadavg()
    before, before_answers = exact_match(folder, held_out)
    print(f"before: exact match {before:.0%} on {len(held_out)} held-out dates (e.g. {before_answers[0]!r} "
          f"for {held_out[0][1]!r})", flush=True)
    rows = []
    for name in args.contenders.split(","):
        if name.startswith(("hf-trainer", "trl-sft")):
            res = run_hf(work, folder, data, args, nproc=1 if name.endswith("-1p") else 2,
                         side=name.removesuffix("-1p"))
        else:
            res = run_shardtune(work, folder, data, name.removeprefix("shardtune-"), args)
        row = summary(name, res, args.warmup)
        if "error" not in res:
            row["exact_match"], answers = exact_match(Path(res["folder"]), held_out)
            row["example"] = answers[0]
            row["losses"] = res["losses"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    ok = {r["contender"]: r for r in rows if "error" not in r}
    ratios = {f"{a}/{peer}": ok[a]["tokens_per_s"] / ok[peer]["tokens_per_s"]
              for peer in ("hf-trainer", "trl-sft") if peer in ok for a in ok if a.startswith("shardtune")}
    ref = ok.get("hf-trainer-1p")
    curves = {}
    for a in ok:
        if (a.startswith("shardtune") or a == "trl-sft-1p") and ref:
            d = [abs(x - y) for x, y in zip(ok[a]["losses"], ref["losses"])]
            curves[a] = {"max_abs_diff_first5": max(d[:5]), "max_abs_diff": max(d),
                         "mean_abs_diff": statistics.mean(d)}
    result = {"before_exact_match": before, "rows": rows, "ratio_tokens_per_s": ratios,
              "loss_vs_hf_one_process": curves,
              "load_before": load, "load_after": os.getloadavg(), "steps": args.steps}
    print(f"loss curves vs HF Trainer in one process: {json.dumps(curves)}")
    print(f"ratios (tokens/s, shardtune / peer): {json.dumps(ratios)}; load {load[0]:.1f} → "
          f"{result['load_after'][0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
