"""`shardtune train --cp` as a user runs it (recipes/tiny-cpu.yaml: ~6 documents packed per 128-token
row, positions restarting), against one process at the same global batch.

one: `--nproc 1` (micro 8), 4 steps, with a validation file. cp2: `--nproc 2 --cp 2` (dp 1, micro 8:
the same 8-row global batch), checkpoints at 2 and 4: one's losses and val_loss, half its measured
activation bytes per rank (memory.json), and an export that loads in plain transformers with one's
export's logits. resumed: cp2's step 2 resumed at `--nproc 2` with cp 1 (dp 2, micro 4: the same
8 rows): steps 3 and 4 give cp2's losses. dp2: `--nproc 4 --cp 2` (dp 2, micro 4: the same 8 rows),
4 steps, against one (one reference run for both: a launch costs ~10 s of imports). Bad inputs: one
line, exit 2, before any process starts.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cli import refused_before_any_process

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
pytestmark = [pytest.mark.e2e]
COMMON = ("data.generated_examples=400", "train.timeout_s=120", "checkpoint.keep=5")


def _train(tmp: Path, out: str, *args: str) -> tuple[list[dict], str]:
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(RECIPE), "--output-dir", str(tmp / out), *COMMON,
           *args]
    proc = run_bounded(cmd, timeout_s=400, cwd=REPO, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return [json.loads(line) for line in (tmp / out / "metrics.jsonl").read_text().splitlines()], proc.stdout


def _losses(records: list[dict]) -> dict[int, float]:
    return {x["step"]: x["loss"] for x in records if "loss" in x}


def _activations(run: Path) -> list[int]:
    return [r["activations_bytes"] for r in json.loads((run / "memory.json").read_text())["per_rank"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    rows = [{"prompt": f"reverse: abc{i}", "response": f"{i}cba"} for i in range(9)]
    (tmp / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    val = f"data.val_path={tmp / 'val.jsonl'}"
    r = {}
    r["one"] = _train(tmp, "one", "--nproc", "1", "--max-steps", "4", val, "checkpoint.every=0")
    r["cp2"] = _train(tmp, "cp2", "--nproc", "2", "--cp", "2", "--max-steps", "4", val, "checkpoint.every=2")
    r["resumed"] = _train(tmp, "resumed", "--nproc", "2", "--max-steps", "4", "checkpoint.every=0",
                          "train.micro_batch=4", "--resume", str(tmp / "cp2" / "checkpoints" / "step_2"))
    r["dp2"] = _train(tmp, "dp2", "--nproc", "4", "--cp", "2", "--max-steps", "4", "train.micro_batch=4",
                      "checkpoint.every=0", "checkpoint.export_hf=false")
    return tmp, r


@pytest.mark.timeout(1500)
def test_cp2_gives_one_process_losses_and_val_loss(runs):
    _, r = runs
    (one, _), (cp2, log) = r["one"], r["cp2"]
    assert "as dp 1 x cp 2" in log and "global batch 8 x 128 tokens" in log
    assert _losses(cp2) == pytest.approx(_losses(one), abs=1e-5)
    assert len(_losses(cp2)) == 4 and _losses(cp2)[4] < _losses(cp2)[1]
    assert cp2[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], abs=1e-5)


@pytest.mark.timeout(1500)
def test_cp2_dp2_gives_one_process_losses_at_the_same_global_batch(runs):
    _, r = runs
    (dp2, log), (one, _) = r["dp2"], r["one"]
    assert "as dp 2 x cp 2" in log and "global batch 8 x 128 tokens" in log
    assert len(_losses(dp2)) == 4
    assert _losses(dp2) == pytest.approx(_losses(one), abs=1e-5)


@pytest.mark.timeout(1500)
def test_activation_bytes_per_rank_halve_at_cp2(runs):
    """The bytes saved for backward per rank (memory.json), cp 2 against one process on the same rows:
    every (b, s, ·) activation is split in two; what is not (none, in this model) would show."""
    tmp, _ = runs
    one, cp2 = _activations(tmp / "one"), _activations(tmp / "cp2")
    assert len(cp2) == 2 and cp2[0] == cp2[1]
    assert cp2[0] / one[0] == pytest.approx(0.5, abs=0.01)


@pytest.mark.timeout(1500)
def test_resume_at_cp1_dp2_reproduces_the_cp2_losses(runs):
    _, r = runs
    (cp2, _), (resumed, log) = r["cp2"], r["resumed"]
    assert "parallel.cp 2 → 1" in log
    got = _losses(resumed)
    assert sorted(got) == [3, 4]
    assert [got[3], got[4]] == pytest.approx([_losses(cp2)[3], _losses(cp2)[4]], abs=1e-5)


@pytest.mark.timeout(1500)
def test_export_from_a_cp_run_loads_in_transformers(runs):
    from transformers import AutoModelForCausalLM

    tmp, _ = runs
    config = json.loads((tmp / "cp2" / "hf_export" / "config.json").read_text())
    assert config.get("_attn_implementation") in (None, "sdpa", "eager")  # not the training-only name
    ids = torch.arange(0, 40).reshape(2, 20)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp / "cp2" / "hf_export").eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(tmp / "one" / "hf_export").eval()(ids).logits
    assert (got - want).abs().max().item() <= 1e-4


BAD = [
    (["--nproc", "3", "--cp", "2"], "cp 2 does not divide the world size 3"),
    (["--nproc", "4", "--cp", "2", "--tp", "2", "train.seq_len=126"], "cp x tp = 4"),
    (["--nproc", "2", "--cp", "2", "--strategy", "ddp"], "composes with FSDP2 strategies"),
    (["--nproc", "2", "parallel.activation_offload=true", "parallel.offload=all"], "activation_offload"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", BAD, ids=[b[1] for b in BAD])
def test_train_refuses_before_any_process(monkeypatch, capsys, tmp_path, args, needle):
    err = refused_before_any_process(monkeypatch, capsys, ["train", RECIPE, "--output-dir", tmp_path / "run", *args])
    assert needle in err
