"""A full disk during training, on a real small file system: a tmpfs mounted in a private mount
namespace (`unshare -m`, root), its limits set by remounting between runs (issue 15 item 5).

One namespace, one-process runs in it: a copy of the shared 2-step run to start from
(`shared_one_process_run`, _runs.CKPT_RECIPE_2_STEPS, trained once for the checkpoint
files, as `train train.max_steps=2` in the namespace did before); remount with room for less than one
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
from _runs import CKPT_RECIPE, CKPT_RECIPE_2_STEPS, REPO

from shardtune.processes import run_bounded
from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import read_info

pytestmark = [pytest.mark.e2e]
SCRIPT = r"""
set -u
M={mnt}
mount -t tmpfs -o size=200m tmpfs $M || exit 90
train() {{ {py} -m shardtune.train {recipe} --output-dir $M/run "$@"; }}
cp -a {base} $M/run || exit 91  # trained to step 2 (shared); was `train train.max_steps=2` here
used=$(df -B1 --output=used $M | tail -1); ckpt=$(du -sb $M/run/checkpoints/step_2 | cut -f1)
mount -o remount,size=$((used + ckpt / 2)) $M
train 2>{out}/bytes.err; echo $? >{out}/bytes.rc
cp -a $M/run {out}/after_bytes
mount -o remount,size=200m $M
iused=$(df --output=iused $M | tail -1)
mount -o remount,nr_inodes=$((iused + 7)) $M  # a resume start makes ~4 (segments/N, its config and plan, the lock)
train 2>{out}/inodes.err; echo $? >{out}/inodes.rc
cp -a $M/run {out}/after_inodes
# start-up: a resume's segments/ copy has no inode left (the lock takes the one free before it)
mount -o remount,nr_inodes=100000 $M; rm -f $M/run/shardtune.lock; cp -a $M/run {out}/before_start
mount -o remount,nr_inodes=$(($(df --output=iused $M | tail -1) + 2)) $M
train 2>{out}/start_inodes.err; echo $? >{out}/start_inodes.rc
cp -a $M/run {out}/after_start_inodes
# start-up: one page free, which the lock takes: config.yaml, plan.json and segments/ are refused
mount -o remount,nr_inodes=100000 $M
mount -o remount,size=$(($(df -B1 --output=used $M | tail -1) + 4096)) $M
train 2>{out}/start_bytes.err; echo $? >{out}/start_bytes.rc
cp -a $M/run {out}/after_start_bytes
# the launcher's own lock with no byte free
mount -o remount,size=$(($(df -B1 --output=used $M | tail -1))) $M
{st} train {recipe} --output-dir $M/run 2>{out}/start_lock.err; echo $? >{out}/start_lock.rc
cp -a $M/run {out}/after_start_lock
# export: a first one fits; then a second into a new folder: too few bytes (refused before writing),
# then too few inodes (the disk fills midway): no new folder, no temporary, the first one as it was
mount -o remount,size=200m $M
{st} export $M/run/checkpoints/step_2 $M/out 2>{out}/export_ok.err || exit 92
cp -a $M/out {out}/export_first
mount -o remount,size=$(($(df -B1 --output=used $M | tail -1) + $(du -sb $M/out | cut -f1) / 2)) $M
{st} export $M/run/checkpoints/step_2 $M/new 2>{out}/export_bytes.err; echo $? >{out}/export_bytes.rc
ls -A $M >{out}/export_bytes.ls; cp -a $M/out {out}/export_after_bytes
mount -o remount,size=200m $M
mount -o remount,nr_inodes=$(($(df --output=iused $M | tail -1) + 2)) $M
{st} export $M/run/checkpoints/step_2 $M/new 2>{out}/export_inodes.err; echo $? >{out}/export_inodes.rc
ls -A $M >{out}/export_inodes.ls; cp -a $M/out {out}/export_after_inodes
"""


def _unshare_reason() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -m fails here: {probe.stderr.strip()[:100]}"


@pytest.mark.timeout(400)
@pytest.mark.skipif(_unshare_reason() is not None, reason=str(_unshare_reason()))
def test_disk_full_before_and_during_a_save_is_one_line_and_the_last_checkpoint_is_intact(tmp_path,
                                                                                          shared_one_process_run):
    base = shared_one_process_run(CKPT_RECIPE_2_STEPS)
    (tmp_path / "recipe.yaml").write_text(CKPT_RECIPE)
    (tmp_path / "mnt").mkdir()
    script = SCRIPT.format(mnt=tmp_path / "mnt", base=base, py=sys.executable, recipe=tmp_path / "recipe.yaml",
                           out=tmp_path, st=Path(sys.executable).parent / "shardtune")
    proc = run_bounded(["unshare", "-m", "sh", "-c", script], timeout_s=360, cwd=REPO)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
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
    # start-up writes on a full disk: one line with the bytes, nothing half-written, nothing lost
    before = _files(tmp_path / "before_start")
    for case, needle in (("start_inodes", "disk full while writing the run's config.yaml, plan.json and segments/"),
                         ("start_bytes", "not enough space for writing the run's config.yaml, plan.json and segm"),
                         ("start_lock", "disk full while taking the run folder's lock")):
        _one_line(tmp_path, case, needle)
        assert "bytes" in (tmp_path / f"{case}.err").read_text()
        assert _files(tmp_path / f"after_{case}") == before  # config.yaml, plan.json, segments/, checkpoints
    # the export: no new folder, no temporary folder, the first export byte for byte
    first = _files(tmp_path / "export_first")
    assert "model.safetensors" in first and "config.json" in first
    for case, needle in (("export_bytes", "not enough space for the export"),
                         ("export_inodes", "disk full while writing the export")):
        _one_line(tmp_path, case, needle)
        assert _files(tmp_path / f"export_after_{case.split('_')[1]}") == first
        assert sorted((tmp_path / f"{case}.ls").read_text().split()) == ["out", "run"]


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (the run lock aside: it is the writer's, not the run's) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "shardtune.lock"}


def _one_line(tmp_path: Path, case: str, needle: str) -> None:
    err = (tmp_path / f"{case}.err").read_text()
    errors = [line for line in err.splitlines() if line.startswith("shardtune: error")]
    assert (tmp_path / f"{case}.rc").read_text().strip() == "2", err[-2000:]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in err, err[-2000:]
