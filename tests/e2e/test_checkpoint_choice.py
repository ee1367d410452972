"""One checkpoint choice (train/durable/choice.py) for the launcher and the ranks, through the real
CLI: `shardtune train --nproc 2` (resume auto) in a run folder whose newest checkpoint's `.metadata`
is cut short and where another step's checkpoint was copied in under a wrong name. The launcher
names both in one line each, the ranks resume from the same older checkpoint (not rc 2), the
misnamed folder is moved aside before a save takes its name (never deleted), and the resume on 2
ranks of a 1-rank run keeps the global batch: grad_accum 2 → 1, said, and the losses of the
resumed steps equal the uninterrupted one-process run's (the reference; another global batch
would give other losses)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import REPO, one_process_run

from shardtune.processes import run_bounded

pytestmark = [pytest.mark.e2e]
RECIPE = """
name: choice
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 2, grad_accum: 2, seq_len: 64, max_steps: 4, timeout_s: 60, log_every: 1}
checkpoint: {every: 2, keep: 5}
"""


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _losses(run: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    return one_process_run(tmp_path_factory.mktemp("choice"), RECIPE)


@pytest.mark.timeout(400)
def test_launcher_and_ranks_pass_over_a_cut_metadata_and_a_misnamed_folder_alike(finished, tmp_path):
    reference = _losses(finished)
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step_4", ckpts / "step_3")  # step 4's checkpoint under another step's name
    misnamed = _snapshot(ckpts / "step_3")
    cut = ckpts / "step_4" / ".metadata"
    cut.write_bytes(cut.read_bytes()[:200])  # cut short, as a full disk or a kill leaves it
    (tmp_path / "recipe.yaml").write_text(RECIPE.replace("{every: 2, keep: 5}", "{every: 3, keep: 5}"))
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tmp_path / "recipe.yaml"), "--nproc", "2",
           "--output-dir", str(run)]
    proc = run_bounded(cmd, 300, cwd=REPO, stderr=subprocess.STDOUT, env=dict(os.environ))
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    skip = [line for line in out.splitlines() if line.startswith(f"shardtune: skipping {ckpts / 'step_4'}: ")]
    assert len(skip) == 1 and ".metadata" in skip[0], out[-4000:]  # the launcher's line, not again per rank
    named = [line for line in out.splitlines() if f"{ckpts / 'step_3'} holds a checkpoint of step 4" in line]
    assert len(named) == 1 and "never overwritten" in named[0], out[-4000:]
    assert f"resuming from {ckpts / 'step_2'}" in out, out[-4000:]
    assert "resuming on 2 ranks (saved on 1): train.grad_accum 2 → 1 keeps the global batch of 4 rows" in out
    assert f"moved {ckpts / 'step_3'} aside to aside-" in out, out[-4000:]
    (aside,) = ckpts.glob("aside-*-step_3")
    assert _snapshot(aside) == misnamed  # never deleted or overwritten
    resumed = _losses(run)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):  # the same global batch: the one-process run's losses
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-5), (step, resumed, reference)


def test_resume_never_refuses_a_folder_holding_only_a_misnamed_checkpoint(finished, tmp_path, capsys):
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    commands_started = []
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(finished / "checkpoints" / "step_4", run / "checkpoints" / "step_9")
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    before = _snapshot(run)
    orig = commands.run_process_group
    commands.run_process_group = lambda *a, **k: commands_started.append(a) or 0
    try:
        rc = cli.main(["train", str(tmp_path / "recipe.yaml"), "--output-dir", str(run), "--resume", "never"])
    finally:
        commands.run_process_group = orig
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "holds checkpoints of an earlier run (newest step_9)" in err[0], err
    assert not commands_started and _snapshot(run) == before
