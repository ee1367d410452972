"""The last line of a failed job names the first rank to fail and why, through the real CLI
(`shardtune train --nproc 2`, gloo), whatever torchrun reports: rank 1 SIGKILLed (before: the line
blamed rank 0, which only saw the broken collective). Rank 1 raising while torchrun's log is on a
full disk (/dev/full; before: "exit code 120", the line lost) shares tests/e2e/test_elastic.py's
launch of a raising rank. Hooks: SHARDTUNE_TEST_* (resilience.py)."""
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

