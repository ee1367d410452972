"""The last line of a failed job names the first rank to fail and why, through the real CLI
(`shardtune train --nproc 2`, gloo), whatever torchrun reports: rank 1 SIGKILLed (before: the line
blamed rank 0, which only saw the broken collective), and rank 1 raising while torchrun's log is
on a full disk (/dev/full: every write fails with ENOSPC; before: "exit code 120", the line lost).
Hooks: SHARDTUNE_TEST_* (resilience.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _cli import train_recipe

pytestmark = [pytest.mark.e2e]
RECIPE = """
name: first
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 2, seq_len: 64, max_steps: 8, timeout_s: 60, log_every: 1}
checkpoint: {every: 0, save_final: false}
"""


def _train(tmp: Path, env: dict) -> tuple[int, str]:
    proc = train_recipe(tmp, RECIPE, env=env, timeout_s=200, stderr=subprocess.PIPE)
    return proc.returncode, proc.stderr


@pytest.mark.timeout(300)
def test_a_killed_rank_is_named_not_the_rank_that_saw_it(tmp_path):
    rc, err = _train(tmp_path, {"SHARDTUNE_TEST_KILL": "3:1"})
    last = err.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("shardtune: error: rank 1 failed first (killed by SIGKILL)"), err[-3000:]


@pytest.mark.timeout(300)
def test_a_raising_rank_is_named_with_its_error_when_the_log_disk_is_full(tmp_path):
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs" / "torchrun.log").symlink_to("/dev/full")
    rc, err = _train(tmp_path, {"SHARDTUNE_TEST_RAISE": "3:1"})
    last = err.strip().splitlines()[-1]
    assert rc == 1, err[-3000:]
    assert last.startswith("shardtune: error: rank 1 failed first: RuntimeError: injected failure on rank 1 at "
                           "step 3"), err[-3000:]
    assert "exit code 120" not in err
