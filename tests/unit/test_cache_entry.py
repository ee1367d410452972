"""A cache entry that is a link (issue 42 item 4): the DPO reference cache and the data cache follow
it (the target is replaced, the link stays) instead of a NotADirectoryError traceback, and leave no
temporary folder; a folder that cannot be written is one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from shardtune.errors import UserError
from shardtune.train.core.dpo_ref import FILE, _load, _save


def test_a_linked_reference_cache_entry_is_followed_and_leaves_no_temporary(tmp_path):
    shared = tmp_path / "shared" / "ref-abc"
    shared.mkdir(parents=True)
    (shared / "stale.txt").write_text("an older entry")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "ref-abc").symlink_to(shared)
    arr = np.arange(6, dtype=np.float32)
    _save(cache / "ref-abc", {"x": 1}, arr)
    assert (cache / "ref-abc").is_symlink() and sorted(p.name for p in shared.iterdir()) == sorted([FILE, "meta.json"])
    assert json.loads((shared / "meta.json").read_text())["key"] == "ref-abc"
    assert np.array_equal(_load(cache / "ref-abc", {"x": 1}, 6), arr)  # read back through the link
    assert sorted(p.name for p in cache.iterdir()) == ["ref-abc"]
    assert sorted(p.name for p in shared.parent.iterdir()) == ["ref-abc"]  # no .tmp-<pid> left


def test_a_folder_that_cannot_be_written_is_one_line_and_no_temporary(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(UserError, match="cannot be written"):
        _save(tmp_path / "a-file" / "ref-abc", {"x": 1}, np.zeros(2, dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_stale_reference_cache_is_said_by_one_rank(tmp_path, capsys):
    """Every rank checks the entry; only rank 0 (say=True) prints the "recomputing" line (it was
    printed once per rank, interleaved)."""
    _save(tmp_path / "ref-abc", {"x": 1}, np.zeros(4, dtype=np.float32))
    capsys.readouterr()
    assert _load(tmp_path / "ref-abc", {"x": 2}, 4, say=False) is None
    assert capsys.readouterr().err == ""
    assert _load(tmp_path / "ref-abc", {"x": 2}, 4, say=True) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recomputing it" in err
