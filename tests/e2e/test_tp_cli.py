"""`shardtune train --tp` as a user runs it, and what a tensor-parallel checkpoint gives.

A: `--nproc 4 --tp 2` (dp 2, micro 4), 4 steps, checkpoints at 2 and 4. B: resume A's step 2 at
`--nproc 4 --tp 1` (dp 4, micro 2: the same 8-row global batch): steps 3 and 4 give A's losses.
C: `--nproc 2 --tp 2` (dp 1, micro 8), 2 steps with validation: A's first two losses, and its
val_loss equals the one computed here from C's export with plain transformers and torch's
cross_entropy. `shardtune export` of A's step 4 (a DTensor checkpoint saved under tp 2 × dp 2)
loads with plain transformers and gives the logits of B's export (trained at tp 1); `shardtune
generate` answers from A's TP checkpoint what it answers from B's export (export and generate run
in this process, as tests/e2e/test_export.py and test_generate.py do).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cli import metrics, shardtune_cli

pytestmark = [pytest.mark.e2e]
RECIPE = """
name: tp
model: {name: tiny-llama}
data: {generated_examples: 400}
parallel: {strategy: zero3, precision: fp32}
optim: {lr: 0.003, warmup_steps: 2}
train: {micro_batch: 4, seq_len: 64, max_steps: 4, timeout_s: 120}
checkpoint: {every: 2, keep: 5, export_hf: true}
"""


def _train(tmp: Path, out: str, *args: str) -> list[dict]:
    proc = shardtune_cli("train", tmp / "recipe.yaml", "--output-dir", tmp / out, *args, timeout_s=280)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return metrics(tmp / out), proc.stdout


def _val_file(path: Path) -> Path:
    rows = [{"prompt": f"reverse: abc{i}", "response": f"{i}cba"} for i in range(9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tp")
    (tmp / "recipe.yaml").write_text(RECIPE)
    _val_file(tmp / "val.jsonl")
    a, a_log = _train(tmp, "a", "--nproc", "4", "--tp", "2")
    b, b_log = _train(tmp, "b", "--nproc", "4", "--tp", "1", "train.micro_batch=2", "--resume",
                      str(tmp / "a" / "checkpoints" / "step_2"))
    c, _ = _train(tmp, "c", "--nproc", "2", "--tp", "2", "train.micro_batch=8", "--max-steps", "2",
                  f"data.val_path={tmp / 'val.jsonl'}", "checkpoint.every=0")
    return tmp, {"a": a, "b": b, "c": c, "a_log": a_log, "b_log": b_log}


@pytest.mark.timeout(900)
def test_resume_at_tp1_dp4_reproduces_the_tp2_dp2_losses(runs):
    _, r = runs
    assert "as dp 2 x tp 2 (sequence parallel)" in r["a_log"]
    assert "_NormPartial" not in r["a_log"]  # DTensor's grad-norm notice, once per rank (shardtune/quiet.py)
    assert "parallel.tp 2 → 1" in r["b_log"]
    a = {x["step"]: x["loss"] for x in r["a"]}
    b = {x["step"]: x["loss"] for x in r["b"]}
    assert sorted(b) == [3, 4]
    assert [b[3], b[4]] == pytest.approx([a[3], a[4]], abs=1e-5)
    assert a[4] < a[1]


@pytest.mark.timeout(900)
def test_tp2_dp1_gives_the_tp2_dp2_losses_and_the_plain_val_loss(runs):
    from transformers import AutoModelForCausalLM

    from shardtune.config import load_recipe
    from shardtune.train.data.dataset import build_tokenizer
    from shardtune.train.data.val import build_val_batches

    tmp, r = runs
    assert [x["loss"] for x in r["c"]] == pytest.approx([x["loss"] for x in r["a"][:2]], abs=1e-5)
    cfg = load_recipe(tmp / "c" / "config.yaml")
    batches = build_val_batches(cfg.data, cfg.train, build_tokenizer(cfg.data, cfg.model.name), 0, 1)
    model = AutoModelForCausalLM.from_pretrained(tmp / "c" / "hf_export").eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(),
                                                       ignore_index=-100, reduction="sum").item()
            tokens += int((b["labels"] != -100).sum())
    assert r["c"][-1]["val_loss"] == pytest.approx(total / tokens, abs=1e-5)


@pytest.mark.timeout(900)
def test_export_and_generate_from_a_tp_checkpoint(runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from shardtune import cli
    from shardtune.train.generation import generate_answer

    tmp, _ = runs
    out = tmp_path / "hf"
    # `shardtune export` in this process (as tests/e2e/test_export.py): no interpreter start-up
    assert cli.main(["export", str(tmp / "a" / "checkpoints" / "step_4"), str(out)]) == 0
    ids = torch.arange(0, 40).reshape(2, 20)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(tmp / "b" / "hf_export").eval()(ids).logits
    assert (got - want).abs().max().item() <= 1e-4
    capsys.readouterr()
    # `shardtune generate` in this process too (as tests/e2e/test_generate.py): one launch less
    rc = cli.main(["generate", str(tmp / "a" / "checkpoints" / "step_4"), "--prompt", "reverse: abc",
                   "--max-new-tokens", "8", "--temperature", "1", "--seed", "3"])
    gen = capsys.readouterr()
    assert rc == 0, gen.err[-3000:]
    # what `shardtune generate` prints for B's export (its command prints generate_answer's string)
    want = generate_answer(str(tmp / "b" / "hf_export"), "reverse: abc", max_new_tokens=8, temperature=1.0, seed=3)
    assert gen.out.strip() and gen.out == want + "\n"  # sampled: rarely empty


@pytest.mark.timeout(900)
def test_lora_with_dropout_under_tp_trains_and_exports_what_one_process_does(tmp_path):
    """`--tp 2 --lora-rank 4 lora.dropout=0.1` on 2 processes (dp 1) against the same LoRA run in one
    process (test_lora_export.py's recipe: 5 steps, a checkpoint at 4, merged export): the losses,
    and the merged export's logits (from the TP run's adapters-only checkpoint). With dropout, the
    same losses also say the masks are one process's: the o/down adapters' inputs are split by
    columns over tp; their dropout draws the whole input's mask on every tp rank and keeps its
    columns (parallel/tp.py `SplitInputDropout`); a mask drawn per shard (the same on both, as
    before) moved step 2's loss by 1e-3. One launch checks both levers (LoRA under tp, its dropout;
    they were two 2-rank launches, and a one-process run each)."""
    from test_lora_export import RECIPE as LORA_RECIPE
    from transformers import AutoModelForCausalLM

    (tmp_path / "recipe.yaml").write_text(LORA_RECIPE)
    args = ["--lora-rank", "4", "lora.dropout=0.1"]
    one, _ = _train(tmp_path, "one", "--nproc", "1", *args)
    tp, _ = _train(tmp_path, "tp", "--nproc", "2", "--tp", "2", *args)
    eff = json.loads((tmp_path / "tp" / "memory.json").read_text())["effective"]
    assert (eff["tp"], eff["lora_rank"], eff["lora_dropout"]) == (2, 4, 0.1)
    assert len(tp) == len(one) == 5
    assert [x["loss"] for x in tp] == pytest.approx([x["loss"] for x in one], abs=1e-5)
    ids = torch.arange(0, 40).reshape(2, 20)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "hf_export").eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "hf_export").eval()(ids).logits
    assert (got - want).abs().max().item() <= 1e-4
