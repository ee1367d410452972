"""`shardtune train` with `train.objective: dpo` on the real SmolLM2 fixture (cut to 2 layers), zero3 on
2 processes, fp32, against DPO written here in plain torch on one unsharded transformers model with
full logits (Rafailov et al. 2023 eq. 7): ids from `tokenizer.apply_chat_template`, chosen and
rejected as separate padded sequences, a deep copy as the reference, torch's AdamW and clipping.
Then `train.reference: precompute` must give the same numbers as the live reference.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardtune.processes import run_bounded
from shardtune.testing.smollm2 import cut_folder

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
STEPS, PAIRS_PER_STEP, BETA, LR = 3, 4, 0.1, 5e-4
DATES = ["2017-03-09", "1999-12-31", "2041-07-04", "1988-02-15", "2003-10-21", "2025-06-30", "1970-01-02",
         "2012-11-08", "1995-05-27", "2033-09-13", "2008-04-19", "1961-08-25", "2020-02-29", "2050-12-01",
         "1977-03-16", "2001-09-05"]


def pair(date: str) -> dict:
    y, m, d = date.split("-")
    return {"prompt": f"Write the date {date} as DD/MM/YYYY.", "chosen": f"{d}/{m}/{y}", "rejected": f"{m}/{d}/{y}"}


TRAIN = [pair(d) for d in DATES[:STEPS * PAIRS_PER_STEP]]
VAL = [pair(d) for d in DATES[STEPS * PAIRS_PER_STEP:]]


def recipe(folder: Path, data: Path, val: Path, reference: str) -> str:
    return f"""name: dpo-test
model: {{name: {folder}, init: pretrained}}
data: {{path: {data}, val_path: {val}, packing: false, shuffle: false, cache_dir: null}}
parallel: {{strategy: zero3, precision: fp32}}
optim: {{lr: {LR}, betas: [0.9, 0.95], weight_decay: 0.0, grad_clip: 1.0, warmup_steps: 0, schedule: constant}}
train: {{micro_batch: 2, seq_len: 128, max_steps: {STEPS}, objective: dpo, reference: {reference}, dpo_beta: {BETA},
        log_every: 1}}
checkpoint: {{save_final: false}}
"""


def side(tok, p: dict, key: str) -> tuple[list[int], int]:
    """(ids of prompt + response, where the response starts) by the tokenizer's own chat template."""
    prompt = [{"role": "user", "content": p["prompt"]}]
    ids = list(tok.apply_chat_template([*prompt, {"role": "assistant", "content": p[key]}], tokenize=True,
                                       return_dict=True)["input_ids"])
    head = list(tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"])
    assert ids[:len(head)] == head
    return ids, len(head)


def seq_logps(model, seqs: list[tuple[list[int], int]]) -> torch.Tensor:
    """Summed log-probs of each sequence's response tokens, from the full logits."""
    out = []
    for ids, start in seqs:
        x = torch.tensor([ids])
        logp = F.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)  # (T-1, V)
        out.append(logp.gather(1, x[0, 1:, None])[start - 1:, 0].sum())
    return torch.stack(out)


def dpo_numbers(policy, ref, tok, pairs: list[dict]) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of plain DPO over `pairs`, mean over pairs."""
    chosen = [side(tok, p, "chosen") for p in pairs]
    rejected = [side(tok, p, "rejected") for p in pairs]
    with torch.no_grad():
        ref_c, ref_r = seq_logps(ref, chosen), seq_logps(ref, rejected)
    r_c, r_r = BETA * (seq_logps(policy, chosen) - ref_c), BETA * (seq_logps(policy, rejected) - ref_r)
    loss = -F.logsigmoid(r_c - r_r).mean()
    r_c, r_r = r_c.detach(), r_r.detach()
    return loss, {"reward_acc": float((r_c > r_r).float().mean()), "reward_margin": float((r_c - r_r).mean()),
                  "reward_chosen": float(r_c.mean()), "reward_rejected": float(r_r.mean())}


def reference_run(folder: Path) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    policy = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
    ref = copy.deepcopy(policy).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    steps = []
    for s in range(STEPS):
        opt.zero_grad()
        loss, metrics = dpo_numbers(policy, ref, tok, TRAIN[s * PAIRS_PER_STEP:(s + 1) * PAIRS_PER_STEP])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        steps.append({"loss": float(loss.detach()), **metrics})
    with torch.no_grad():
        loss, metrics = dpo_numbers(policy, ref, tok, VAL)
    return steps, {"val_loss": float(loss), **{f"val_{k}": v for k, v in metrics.items()}}


def train(tmp: Path, text: str) -> list[dict]:
    (tmp / "recipe.yaml").write_text(text)
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tmp / "recipe.yaml"), "--nproc", "2",
           "--output-dir", str(tmp / "run")]
    proc = run_bounded(cmd, timeout_s=800, cwd=REPO, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(1800)  # two 2-rank launches and a one-process reference; a dead rank fails at once
def test_dpo_zero3_two_ranks_equals_plain_torch_dpo_and_precompute_equals_live(tmp_path):
    folder = cut_folder(2)
    data, val = tmp_path / "pairs.jsonl", tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in TRAIN))
    val.write_text("".join(json.dumps(p) + "\n" for p in VAL))
    runs = {}
    for mode in ("live", "precompute"):
        (tmp_path / mode).mkdir()
        runs[mode] = train(tmp_path / mode, recipe(folder, data, val, mode))
    want_steps, want_val = reference_run(folder)
    assert want_steps[-1]["reward_margin"] > 0.01  # the policy moved: the comparison means something
    for mode, records in runs.items():
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        for got, want in zip(records, want_steps):
            for key, value in want.items():  # fp32 sums over ~10 tokens; packing vs padding, 2 ranks vs 1
                assert abs(got[key] - value) <= 2e-5 + 1e-4 * abs(value), (mode, got["step"], key, got[key], value)
        for key, value in want_val.items():
            assert abs(records[-1][key] - value) <= 2e-5 + 1e-4 * abs(value), (mode, key, records[-1][key], value)
    for a, b in zip(runs["live"], runs["precompute"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["reward_margin"] - b["reward_margin"]) <= 1e-6
