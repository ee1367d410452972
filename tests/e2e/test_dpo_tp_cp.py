"""DPO under tensor and context parallelism through `shardtune train`: recipes/smollm2-dpo.yaml on the
seeded tiny Llama (byte tokenizer), fp32, 3 steps, against the same recipe in one process. tp 2 with
the live reference (a frozen tp 2 + FSDP2 copy), dp 2 x tp 2 with `train.reference: precompute`
(each pair's reference log-probs computed by one data-parallel rank, the two ranks of a tp group
running the same rows), and cp 2 with the live reference (each rank's block of every row, the side
sums added over the cp group): every logged number equals the one-process run's, and the ranks
report the split they ran."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
STEPS = 3
KEYS = ("loss", "grad_norm", "reward_acc", "reward_margin", "reward_chosen", "reward_rejected")
VAL_KEYS = ("val_loss", "val_reward_acc", "val_reward_margin", "val_pref_acc")


def _write_pairs(tmp: Path) -> None:
    """The shipped pairs cut to STEPS steps (a global batch of 4 pairs) and 8 held-out pairs, once."""
    pairs = (REPO / "data" / "smollm2-dpo" / "train.jsonl").read_text().splitlines()
    val = (REPO / "data" / "smollm2-dpo" / "val.jsonl").read_text().splitlines()
    (tmp / "train.jsonl").write_text("\n".join(pairs[:STEPS * 4]) + "\n")
    (tmp / "val.jsonl").write_text("\n".join(val[:8]) + "\n")


def _train(tmp: Path, name: str, args: list[str]) -> tuple[list[dict], dict, str]:
    out = tmp / name
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(REPO / "recipes" / "smollm2-dpo.yaml"), "--output-dir",
           str(out), "model.name=tiny-llama", "model.init=random", "data.tokenizer=byte", "data.chat_template=null",
           f"data.path={tmp / 'train.jsonl'}", f"data.val_path={tmp / 'val.jsonl'}", f"data.cache_dir={tmp / 'cache'}",
           f"train.max_steps={STEPS}", f"train.eval_every={STEPS}", "optim.lr=5e-3", "checkpoint.save_final=false",
           "checkpoint.export_hf=false", *args]
    proc = run_bounded(cmd, timeout_s=420, cwd=REPO, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((out / "memory.json").read_text())["effective"], proc.stdout


@pytest.mark.timeout(900)  # four launches (1, 2, 4 and 2 ranks); a dead rank fails at once
def test_dpo_under_tp_and_cp_live_and_precompute_equals_one_process(tmp_path):
    _write_pairs(tmp_path)
    want, one, _ = _train(tmp_path, "one", ["--nproc", "1", "train.micro_batch=2", "train.grad_accum=2"])
    assert (one["tp"], one["objective"]) == (1, "dpo")
    assert max(r["reward_margin"] for r in want) > 0.01  # the policy moved: the comparison means something
    runs = {"tp2 live": ["--nproc", "2", "--tp", "2", "train.micro_batch=4"],
            "dp2 x tp2 precompute": ["--nproc", "4", "--tp", "2", "train.micro_batch=2", "train.reference=precompute"],
            "cp2 live": ["--nproc", "2", "--cp", "2", "train.micro_batch=4"]}
    for name, args in runs.items():
        got, eff, log = _train(tmp_path, name.replace(" ", "-"), args)
        split = args[2].removeprefix("--")
        assert (eff[split], eff["objective"], eff["world_size"]) == (2, "dpo", int(args[1])), eff
        assert [r["step"] for r in got] == list(range(1, STEPS + 1))
        for g, w in zip(got, want):  # fp32; vocabulary-parallel log-softmax vs one process's
            for key in KEYS:
                # each side's reward is β x a difference of two sums of ~30 byte-token log-probs (~-170
                # each): 1e-4 is 6e-6 of those sums; the margin, their difference, is held to the tighter bound
                tol = 1e-4 if key in ("reward_chosen", "reward_rejected") else 2e-5 + 1e-4 * abs(w[key])
                assert abs(g[key] - w[key]) <= tol, (name, g["step"], key, g[key], w[key])
        for key in VAL_KEYS:
            assert abs(got[-1][key] - want[-1][key]) <= 2e-5 + 1e-4 * abs(want[-1][key]), (name, key)
        # the held-out pairs counted once, not once per tp rank
        assert "prefers the chosen side in" in log and " of 8 (" in log, log[-2000:]
