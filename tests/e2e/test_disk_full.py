"""A full disk during training, on a real small file system: a tmpfs mounted in a private mount
namespace (`unshare -m`, root), its limits set by remounting between runs (issue 15 item 5).

One namespace, three one-process runs in it: train to step 2; remount with room for less than one
more checkpoint and resume: the save of step 4 is refused before it starts (one line: the bytes
needed and free); remount with plenty of bytes but seven free inodes (the start of a resume takes
about four) and resume: the save runs out of inodes midway (ENOSPC) and is one line too. Each
time: exit 2, no traceback, no partial save left, step_2 verifies against its checksums.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.testing.proc import run_bounded
from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import read_info

sys.path.insert(0, str(Path(__file__).parent))
from _runs import REPO  # noqa: E402

pytestmark = [pytest.mark.e2e]
RECIPE = """
name: diskfull
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 4, seq_len: 64, max_steps: 4, timeout_s: 60}
checkpoint: {every: 2, keep: 3}
"""
SCRIPT = r"""
set -u
M={mnt}
mount -t tmpfs -o size=200m tmpfs $M || exit 90
train() {{ {py} -m shardtune.train {recipe} --output-dir $M/run "$@"; }}
train train.max_steps=2 2>{out}/first.err || exit 91
used=$(df -B1 --output=used $M | tail -1); ckpt=$(du -sb $M/run/checkpoints/step_2 | cut -f1)
mount -o remount,size=$((used + ckpt / 2)) $M
train 2>{out}/bytes.err; echo $? >{out}/bytes.rc
cp -a $M/run {out}/after_bytes
mount -o remount,size=200m $M
iused=$(df --output=iused $M | tail -1)
mount -o remount,nr_inodes=$((iused + 7)) $M  # a resume start makes ~4 (segments/N, its config and plan, the lock)
train 2>{out}/inodes.err; echo $? >{out}/inodes.rc
cp -a $M/run {out}/after_inodes
"""


def _unshare_reason() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -m fails here: {probe.stderr.strip()[:100]}"


@pytest.mark.timeout(240)
@pytest.mark.skipif(_unshare_reason() is not None, reason=str(_unshare_reason()))
def test_disk_full_before_and_during_a_save_is_one_line_and_the_last_checkpoint_is_intact(tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    (tmp_path / "mnt").mkdir()
    script = SCRIPT.format(mnt=tmp_path / "mnt", py=sys.executable, recipe=tmp_path / "recipe.yaml", out=tmp_path)
    proc = run_bounded(["unshare", "-m", "sh", "-c", script], timeout_s=200, cwd=REPO)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:], (tmp_path / "first.err").read_text()[-2000:]
                                  if (tmp_path / "first.err").exists() else "")
    for case, needle in (("bytes", "not enough space to save a checkpoint"),
                         ("inodes", "disk full while saving step 4")):
        err = (tmp_path / f"{case}.err").read_text()
        errors = [line for line in err.splitlines() if line.startswith("shardtune: error")]
        assert (tmp_path / f"{case}.rc").read_text().strip() == "2", err[-2000:]
        assert len(errors) == 1 and needle in errors[0] and "Traceback" not in err, err[-2000:]
        ckpts = tmp_path / f"after_{case}" / "checkpoints"
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_2"]  # no partial save, nothing lost
        info = read_info(ckpts / "step_2")
        assert info is not None and info.files and integrity.problems(info.path, info.files) == []
