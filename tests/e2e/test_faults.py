"""Faults through the real CLI (`shardtune train ... --nproc 2`, gloo): a signal is a save, one
line and exit 0 with stopped.json for the launcher. The ranks agree on a signal in the gather of
a logged step (train/rank/loop.py), so the save comes within `train.log_every` steps.
Hooks: SHARDTUNE_TEST_* (resilience.py).
(The hung-rank watchdog, train/durable/watchdog.py, is on by default: a watcher process per rank;
tests/e2e/test_watchdog.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import train_recipe

from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import read_info

pytestmark = [pytest.mark.e2e]
RECIPE = """
name: faults
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 2, seq_len: 64, max_steps: 30, timeout_s: 120, log_every: 3}
checkpoint: {every: 0, save_final: false}
"""


def _train(tmp: Path, env: dict, timeout_s: float):
    proc = train_recipe(tmp, RECIPE, env=env, timeout_s=timeout_s)
    return proc.returncode, proc.stdout, proc.seconds


@pytest.mark.timeout(180)
def test_sigterm_saves_says_one_line_writes_stopped_json_and_exits_0(tmp_path):
    # rank 1 alone gets SIGTERM before step 4 (not a logged step: log_every 3); the ranks learn it
    # in step 6's gather, the first logged step after it: saved and stopped there, within 3 steps
    rc, out, _ = _train(tmp_path, {"SHARDTUNE_TEST_SIGTERM": "4:1"}, 150)
    assert "shardtune: saved step_6, stopped on SIGTERM" in out, out[-3000:]
    stopped = json.loads((tmp_path / "run" / "stopped.json").read_text())
    assert stopped["step"] == 6 and stopped["signal"] == "SIGTERM"
    info = read_info(Path(stopped["checkpoint"]))
    assert info.step == 6 and integrity.problems(info.path, info.files) == []
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3, 6]  # logged steps only, none after the stop
    assert rc == 0, out[-3000:]
