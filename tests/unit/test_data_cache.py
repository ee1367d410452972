"""The tokenised cache (train/data/cache.py): the memory-mapped loader gives the same batches as
the in-memory one, a second start does not tokenise, a change of data or seq_len rebuilds, a
corrupt cache is named and rebuilt, and concurrent starters build once."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from shardtune.config import DataConfig, TrainConfig
from shardtune.train.data import cache, dataset
from shardtune.train.data.dataset import build_dataloader
from shardtune.train.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _data(tmp_path, n=300):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"q{i}\n", "response": "x" * (i % 17)}) + "\n" for i in range(n)))
    return str(p)


def _batches(cfg, seq_len=64, n=6):
    ld = build_dataloader(cfg, TrainConfig(seq_len=seq_len, micro_batch=4), TOK, 1, 2, 3)
    return [next(ld) for _ in range(n)], ld.num_rows


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "labels", "position_ids"))


def test_cached_equals_in_memory_and_is_reused(tmp_path, monkeypatch):
    path = _data(tmp_path)
    ref, ref_rows = _batches(DataConfig(path=path, template="plain", cache_dir=None))  # in memory
    cfg = DataConfig(path=path, template="plain", cache_dir=str(tmp_path / "cache"))
    first, rows = _batches(cfg)
    assert rows == ref_rows
    _same(first, ref)
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert isinstance(cache.load_cache(folder).tokens, __import__("numpy").ndarray)

    def no_tokenising(*a, **k):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(dataset, "encode_records", no_tokenising)
    again, _ = _batches(cfg)
    _same(again, ref)
    monkeypatch.undo()
    _batches(cfg, seq_len=32)  # another seq_len: another key
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    _batches(cfg)  # the file changed: another key
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 3


def test_corrupt_cache_is_named_and_rebuilt(tmp_path, capsys):
    path = _data(tmp_path)
    ref, _ = _batches(DataConfig(path=path, template="plain", cache_dir=None))  # in memory
    cfg = DataConfig(path=path, template="plain", cache_dir=str(tmp_path / "cache"))
    _batches(cfg)
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    tokens = folder / "tokens.arrow"
    raw = bytearray(tokens.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    tokens.write_bytes(bytes(raw))
    capsys.readouterr()
    again, _ = _batches(cfg)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not this data's (tokens.arrow does not match meta.json); rebuilding it" in err[0]
    _same(again, ref)
    assert cache.check_cache(folder) is None


def test_concurrent_starters_build_once(tmp_path):
    pk = dataset.pack_examples([([1, 2, 3], [False, True, True])] * 5, 8, True, 0)
    builds = []

    def build():
        builds.append(os.getpid())
        time.sleep(0.3)
        return pk

    out = []
    threads = [threading.Thread(target=lambda: out.append(cache.cached_packed(str(tmp_path), "k", build)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(builds) == 1 and len(out) == 4
    assert all(list(o.rows) == pk.rows and o.tokens.tolist() == pk.tokens for o in out)


def test_default_caches_in_the_user_cache_folder_and_null_keeps_memory(tmp_path, monkeypatch, capsys):
    path = _data(tmp_path)
    ref, _ = _batches(DataConfig(path=path, template="plain", cache_dir=None))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = DataConfig(path=path, template="plain")
    assert cfg.cache_dir == "auto"  # tokenise once is the default
    _same(_batches(cfg)[0], ref)
    (folder,) = [p for p in (tmp_path / "xdg" / "shardtune" / "data").iterdir() if p.is_dir()]
    assert cache.check_cache(folder) is None
    monkeypatch.setattr(dataset, "encode_records", lambda *a, **k: (_ for _ in ()).throw(AssertionError("again")))
    _same(_batches(cfg)[0], ref)  # the second start maps it, no tokenising
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "off"))
    _same(_batches(DataConfig(path=path, template="plain", cache_dir=None))[0], ref)
    assert not (tmp_path / "off").exists()  # null: in memory, nothing written
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # the folder cannot be made: in memory, said once
    capsys.readouterr()
    _same(_batches(cfg)[0], ref)
    _batches(cfg)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not writable; tokenising in memory" in err[0], err


def test_launch_check_counts_rows_from_a_whole_default_cache_without_tokenising(tmp_path, monkeypatch):
    from shardtune.config import load_recipe
    from shardtune.errors import UserError
    from shardtune.train.launcher import preflight

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "shardtune" / "data"
    cfg = load_recipe(None, [f"data.path={_data(tmp_path)}", "data.template=plain", "train.micro_batch=4",
                             "train.seq_len=64"])
    preflight._check_data_fills_a_batch(cfg, 2)  # no cache yet: counted in memory (no torch), nothing built here
    assert not root.exists() or not [p for p in root.iterdir() if p.is_dir()]
    ld = build_dataloader(cfg.data, cfg.train, TOK, 0, 2, cfg.train.seed)  # a rank builds the run's cache
    monkeypatch.setattr(dataset, "encode_records", lambda *a, **k: (_ for _ in ()).throw(AssertionError("again")))
    preflight._check_data_fills_a_batch(cfg, 2)  # now the launcher reads the whole cache's rows
    cfg.train.micro_batch = ld.num_rows  # a global batch of 2 × num_rows: refused from the cache's count
    with pytest.raises(UserError, match=f"fills {ld.num_rows} rows"):
        preflight._check_data_fills_a_batch(cfg, 2)
