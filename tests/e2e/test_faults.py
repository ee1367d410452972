"""Faults through the real CLI (`shardtune train ... --nproc 2`, gloo): a signal is a save, one
line and exit 0 with stopped.json for the launcher. Hooks: SHARDTUNE_TEST_* (resilience.py).
(The hung-rank watchdog, train/durable/watchdog.py, is off by default: its thread cannot run while
the main thread waits in a GIL-holding collective; measured, see docs/checkpoints.md.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.testing.proc import run_bounded
from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import read_info

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
RECIPE = """
name: faults
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 2, seq_len: 64, max_steps: 30, timeout_s: 120}
checkpoint: {every: 0, save_final: false}
"""


def _train(tmp: Path, env: dict, timeout_s: float):
    (tmp / "recipe.yaml").write_text(RECIPE)
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tmp / "recipe.yaml"), "--nproc", "2",
           "--output-dir", str(tmp / "run")]
    t0 = time.monotonic()
    proc = run_bounded(cmd, timeout_s, cwd=REPO, stderr=subprocess.STDOUT, env={**os.environ, **env})
    return proc.returncode, proc.stdout, time.monotonic() - t0


@pytest.mark.timeout(180)
def test_sigterm_saves_says_one_line_writes_stopped_json_and_exits_0(tmp_path):
    rc, out, _ = _train(tmp_path, {"SHARDTUNE_TEST_SIGTERM": "3:1"}, 150)
    assert "shardtune: saved step_3, stopped on SIGTERM" in out, out[-3000:]
    stopped = json.loads((tmp_path / "run" / "stopped.json").read_text())
    assert stopped["step"] == 3 and stopped["signal"] == "SIGTERM"
    info = read_info(Path(stopped["checkpoint"]))
    assert info.step == 3 and integrity.problems(info.path, info.files) == []
    assert rc == 0, out[-3000:]
