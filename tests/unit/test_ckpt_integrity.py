"""Checkpoint files without torch: checksums catch a truncated, bit-flipped, missing or
overwritten shard (the expected bytes are the file on disk before the damage); pruning touches
only its own run's checkpoints; a re-save cut between its two renames loses nothing."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardtune.train.durable import ckpt_files, integrity


def _checkpoint(run: Path, step: int, run_id: str, saved_at: float) -> Path:
    d = ckpt_files.checkpoints_dir(run) / f"step_{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    (d / "__0_0.distcp").write_bytes(os.urandom(4096))
    (d / "__1_0.distcp").write_bytes(os.urandom(4096))
    files = integrity.digest(d, integrity.listing(d))
    (d / ckpt_files.META_FILE).write_text(json.dumps({
        "format": 1, "step": step, "world_size": 2, "strategy": "zero3", "run_id": run_id,
        "saved_at": saved_at, "complete": True, "files": files}))
    return d


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[:-1])


def _flip(p: Path):
    b = bytearray(p.read_bytes())
    b[100] ^= 0x10
    p.write_bytes(bytes(b))


def _overwrite_64_floats(p: Path):
    b = bytearray(p.read_bytes())
    b[512:512 + 256] = bytes(256)  # 64 fp32 values zeroed, same size
    p.write_bytes(bytes(b))


@pytest.mark.parametrize("damage, needle", [(_truncate, "bytes, 4096 were written"), (_flip, "fails its checksum"),
                                            (Path.unlink, "is missing"), (_overwrite_64_floats, "fails its checksum")])
def test_every_kind_of_damage_is_found(tmp_path, damage, needle):
    d = _checkpoint(tmp_path, 2, "a", 1.0)
    info = ckpt_files.read_info(d)
    assert integrity.problems(d, info.files) == []
    damage(d / "__1_0.distcp")
    bad = integrity.problems(d, info.files)
    assert len(bad) == 1 and "__1_0.distcp" in bad[0] and needle in bad[0], bad


def test_each_rank_checks_its_own_files_and_every_file_is_someones():
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__3_0.distcp", "rng_rank1.json", "hf/config.json"]
    shares = [integrity.mine(names, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(names)
    assert shares[1] == ["__1_0.distcp", "__3_0.distcp", "rng_rank1.json"]


def test_prune_keeps_another_runs_checkpoints_and_the_newest_is_the_last_saved(tmp_path):
    for step, t in ((6, 1.0), (8, 2.0)):
        _checkpoint(tmp_path, step, "old", t)
    for step, t in ((2, 3.0), (4, 4.0)):  # a fresh run in the same folder: lower steps, saved later
        _checkpoint(tmp_path, step, "new", t)
    assert ckpt_files.prune(tmp_path, 1, "new") == [2]
    assert [i.step for i in ckpt_files.complete_checkpoints(tmp_path)] == [6, 8, 4]
    assert ckpt_files.prune(tmp_path, 1, "") == []  # no run id: nothing is anyone's to delete


def test_a_resave_cut_between_its_renames_is_found_and_restored(tmp_path):
    d = _checkpoint(tmp_path, 4, "a", 1.0)
    old = d.with_name(ckpt_files.OLD_PREFIX + d.name)
    d.rename(old)  # the first rename of a re-save happened, the second did not
    assert [i.path for i in ckpt_files.complete_checkpoints(tmp_path)] == [old]
    ckpt_files.remove_stale_temporaries(tmp_path)
    assert d.is_dir() and not old.exists() and ckpt_files.read_info(d).step == 4
