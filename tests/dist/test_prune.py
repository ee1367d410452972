"""Pruning on 2 ranks through the real CLI (`shardtune train --nproc 2`, zero3, gloo): keep K of
this run's checkpoints, never another run's (issue 15 item 3).

Run 1 saves every step to step 4 with keep 2: step_3 and step_4 are left. Then two checkpoints
that are not this run's are put beside them, as a user copying folders would: another run's (its
run_id changed, a higher step number, saved earlier) and one written before run ids (no run_id).
Run 2 resumes (auto: the last saved, step_4) to step 8: this run's step_3..step_6 go, step_7 and
step_8 stay, the two others are untouched byte for byte; every checkpoint left verifies against
its checksums (integrity.py's reader on the files). Two 2-rank launches.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.processes import run_bounded
from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import META_FILE, read_info

pytestmark = [pytest.mark.dist]
REPO = Path(__file__).resolve().parents[2]
RECIPE = """
name: prune
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 2, seq_len: 64, timeout_s: 60}
checkpoint: {every: 1, keep: 2}
"""


def _train(tmp: Path, steps: int) -> None:
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tmp / "recipe.yaml"), "--nproc", "2",
           "--output-dir", str(tmp / "run"), "--max-steps", str(steps)]
    proc = run_bounded(cmd, timeout_s=150, cwd=REPO, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]


def _foreign(src: Path, dest: Path, **meta_changes) -> None:
    shutil.copytree(src, dest)
    meta = json.loads((dest / META_FILE).read_text())
    meta.update(meta_changes)
    if meta.get("run_id") is None:
        meta.pop("run_id")
    (dest / META_FILE).write_text(json.dumps(meta))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(400)
def test_prune_keeps_k_of_this_run_and_never_touches_another_runs(tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    _train(tmp_path, 4)
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_3", "step_4"]
    run_id = read_info(ckpts / "step_4").run_id
    assert run_id and read_info(ckpts / "step_3").run_id == run_id
    _foreign(ckpts / "step_4", ckpts / "step_9", step=9, run_id="another-run", saved_at=1.0)
    _foreign(ckpts / "step_3", ckpts / "step_1", step=1, run_id=None, saved_at=2.0)
    others = {name: _files(ckpts / name) for name in ("step_9", "step_1")}

    _train(tmp_path, 8)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_7", "step_8", "step_9"]
    assert all(_files(ckpts / name) == files for name, files in others.items())
    for name in ("step_7", "step_8"):
        info = read_info(ckpts / name)
        assert info.run_id == run_id and info.world_size == 2  # a resume keeps the run's id
    for name in ("step_1", "step_7", "step_8", "step_9"):
        info = read_info(ckpts / name)
        assert info.files and integrity.problems(info.path, info.files) == [], name
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 8
