"""Shard files against `.metadata` without torch (train/durable/shards.py): a real DCP save passes;
a shard cut short, zeroed, overwritten where an item starts or ends, or missing is named; so is an
item `.metadata` places outside the folder; an item written through a stream transform is checked
for its place only; the check imports no torch."""
from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtune.train.durable import shards
from shardtune.train.durable.safe_load import read_dcp_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def ckpt(tmp_path) -> Path:
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.arange(600, dtype=torch.float32).reshape(20, 30), "b": torch.ones(7), "lr": 0.1}
    dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    return tmp_path


def _items(ckpt: Path):
    md = read_dcp_metadata(ckpt / ".metadata")
    return md, sorted(md.storage_data.items(), key=lambda kv: kv[1].offset)


def _rewrite(ckpt: Path, edit) -> None:
    """`.metadata` with each item's _StorageInfo replaced by edit(index, info)."""
    md, items = _items(ckpt)
    md.storage_data = {index: edit(index, info) for index, info in items}
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_a_real_save_passes_and_each_item_is_a_torch_save_archive(ckpt):
    assert shards.problems(ckpt) == []
    _, items = _items(ckpt)
    raw = (ckpt / "__0_0.distcp").read_bytes()
    assert len(items) == 3 and sum(i.length for _, i in items) == len(raw)  # back to back, nothing else
    for _, info in items:  # what the check relies on, from this torch's FileSystemWriter
        assert raw[info.offset:info.offset + 4] == shards.ZIP_START
        assert raw[info.offset + info.length - 22:info.offset + info.length - 18] == shards.ZIP_END


@pytest.mark.parametrize("damage, needle", [
    (lambda p, items: p.write_bytes(p.read_bytes()[:-1]), "(cut short?)"),
    (lambda p, items: p.write_bytes(bytes(p.stat().st_size)), "no torch.save archive at byte 0"),
    (lambda p, items: _overwrite(p, items[1].offset, b"\0" * 4), "no torch.save archive at byte"),
    (lambda p, items: _overwrite(p, items[1].offset + items[1].length - 22, b"junk"), "no torch.save archive"),
    (lambda p, items: p.unlink(), "is missing"),
], ids=["cut by a byte", "zeroed", "an item's start", "an item's end", "removed"])
def test_a_damaged_shard_is_named(ckpt, damage, needle):
    items = [info for _, info in _items(ckpt)[1]]
    damage(ckpt / "__0_0.distcp", items)
    bad = shards.problems(ckpt)
    assert len(bad) == 1 and bad[0].startswith("__0_0.distcp") and needle in bad[0], bad


def test_an_item_outside_the_folder_or_without_numbers_is_named(ckpt):
    _rewrite(ckpt, lambda index, info: dataclasses.replace(info, relative_path="../__0_0.distcp"))
    assert shards.problems(ckpt)[0] == ".metadata names '../__0_0.distcp', not a file of the checkpoint"
    _rewrite(ckpt, lambda index, info: dataclasses.replace(info, relative_path="__0_0.distcp", offset=-1))
    assert "no whole offset and length" in shards.problems(ckpt)[0]


def test_a_transformed_item_is_checked_for_its_place_only(ckpt):
    _rewrite(ckpt, lambda index, info: dataclasses.replace(info, transform_descriptors=["zstd"]))
    _overwrite(ckpt / "__0_0.distcp", 0, b"\0" * 4)
    assert shards.problems(ckpt) == []  # compressed bytes need not start like a zip archive
    (ckpt / "__0_0.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes()[:-1])
    assert "(cut short?)" in shards.problems(ckpt)[0]


def test_an_unreadable_metadata_is_damage_named_once(ckpt):
    # cut short: damage that resume skips (train/durable/choice.py), named by rank 0 only
    (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:50])
    found = shards.problems(ckpt)
    assert len(found) == 1 and found[0].startswith(".metadata is unreadable ("), found
    assert shards.problems(ckpt, rank=1, world_size=2) == []


def test_the_check_imports_no_torch(ckpt):
    code = ("import sys; from shardtune.train.durable import shards; "
            f"assert shards.problems({str(ckpt)!r}) == []; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
