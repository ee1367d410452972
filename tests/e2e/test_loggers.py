"""train.loggers and validation through the real CLI (2 ranks, tiny-llama): metrics.jsonl carries
val_loss at every train.eval_every step and the last; the TensorBoard event file, read back with
TensorBoard's own EventAccumulator, holds the same numbers as metrics.jsonl. Bad options are one
line, exit 2, before any process starts."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
RECIPE = """
name: loggers
model: {name: tiny-llama}
data: {generated_examples: 200, val_path: VAL}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 2, seq_len: 64, max_steps: 5, timeout_s: 120, log_every: 1, eval_every: 2,
        loggers: [tensorboard]}
checkpoint: {every: 0, save_final: false}
"""


def _val_file(path: Path) -> Path:
    rows = [{"prompt": f"reverse: abc{i}", "response": f"{i}cba"} for i in range(7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(180)
def test_val_loss_and_tensorboard_event_file_match_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("VAL", str(_val_file(tmp_path / "val.jsonl"))))
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(recipe), "--nproc", "2", "--output-dir",
           str(tmp_path / "run")]
    proc = run_bounded(cmd, 150, cwd=REPO, stderr=subprocess.STDOUT, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "thread per rank" in proc.stdout or "threads per rank" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(val) == [2, 4, 5]  # every 2 steps and after the last
    assert all(math.isfinite(v) and 0 < v < 10 for v in val.values())
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes"):
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert got == pytest.approx({r["step"]: r[tag] for r in records}, rel=1e-6), tag
    assert {e.step: e.value for e in acc.Scalars("val_loss")} == pytest.approx(val, rel=1e-6)


def test_bad_loop_options_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from shardtune.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("VAL", str(_val_file(tmp_path / "val.jsonl"))))
    out = ["--output-dir", str(tmp_path / "run")]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as where the extra is not installed
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    cases = [(["train.loggers=[wandb]"], "pip install 'shardtune[wandb]'"),
             (["data.val_path=null"], "needs validation data"),
             (["train.sample_prompts=[hi]", "train.sample_max_new_tokens=0"], "greater than or equal to 1")]
    for overrides, says in cases:
        assert main(["train", str(recipe), *out, *overrides]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was written
