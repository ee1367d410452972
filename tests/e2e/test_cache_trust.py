"""The tokenised cache is trusted by its content, not its folder name, through the real CLI
(`shardtune train`, in process; the launcher builds data.cache_dir, torchrun's start forbidden):
two entries swapped, another data's entry copied under this key with its meta.json rewritten to
match the name, a hand-edited meta.json: each named in one line and rebuilt to the bytes a fresh
build writes, never trained on. A cache_dir that is a file: one line, exit 2."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardtune.train.data import cache, dataset
from shardtune.train.data.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
pytestmark = [pytest.mark.e2e]


def _jsonl(root: Path, name: str, n: int, word: str) -> str:
    p = root / name
    p.write_text("".join(json.dumps({"prompt": f"{word} {i}\n", "response": word * (i % 9)}) + "\n"
                         for i in range(n)))
    return str(p)


@pytest.mark.timeout(300)
def test_swapped_copied_and_edited_cache_entries_are_named_and_rebuilt(tmp_path, monkeypatch, capsys):
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    monkeypatch.setattr(commands, "run_process_group", lambda *a, **k: 0)
    root = tmp_path / "cache"
    paths = {"a": _jsonl(tmp_path, "a.jsonl", 300, "apple"), "b": _jsonl(tmp_path, "b.jsonl", 300, "berry")}

    def train(which: str, *extra: str):
        rc = cli.main(["train", str(RECIPE), "--nproc", "2", "--output-dir", str(tmp_path / "run"),
                       f"data.path={paths[which]}", f"data.cache_dir={root}", "train.max_steps=1", *extra])
        return rc, capsys.readouterr().err.strip().splitlines()

    def entries() -> dict:
        return {p.name: {f.name: f.read_bytes() for f in p.iterdir()} for p in root.iterdir() if p.is_dir()}

    assert train("a")[0] == 0
    (key_a,) = entries()
    assert train("b")[0] == 0
    (key_b,) = set(entries()) - {key_a}
    fresh = entries()

    # 1. the two entries swapped (renamed into each other's place)
    (root / key_a).rename(root / "x")
    (root / key_b).rename(root / key_a)
    (root / "x").rename(root / key_b)
    rc, err = train("a")
    assert rc == 0 and len(err) == 1, err
    assert f"data cache '{root / key_a}' is not this data's (meta.json records key" in err[0], err
    assert entries()[key_a] == fresh[key_a]

    # 2. b's entry copied under a's key, its meta.json's key rewritten to the folder's name
    shutil.rmtree(root / key_a)
    (root / key_a).mkdir()
    for name, raw in fresh[key_b].items():
        (root / key_a / name).write_bytes(raw)
    meta = json.loads(fresh[key_b]["meta.json"])
    (root / key_a / "meta.json").write_text(json.dumps({**meta, "key": key_a}))
    rc, err = train("a")
    assert rc == 0 and len(err) == 1, err
    assert "is not this data's (it was built from other inputs (data files, format options differ))" in err[0], err
    assert entries()[key_a] == fresh[key_a]

    # 3. meta.json edited by hand: a count that is no count, then text that is no JSON
    for edit in ({**json.loads(fresh[key_a]["meta.json"]), "num_truncated": "many"}, "{ not json"):
        (root / key_a / "meta.json").write_text(edit if isinstance(edit, str) else json.dumps(edit))
        rc, err = train("a")
        assert rc == 0 and len(err) == 1 and "is not this data's (meta.json" in err[0], err
        assert entries()[key_a] == fresh[key_a]
    assert train("a") == (0, [])  # whole again: reused without a word

    # 4. data.cache_dir that is a file
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    rc = cli.main(["train", str(RECIPE), "--nproc", "2", "--output-dir", str(tmp_path / "run2"),
                   f"data.path={paths['a']}", f"data.cache_dir={blocked}", "train.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"data.cache_dir '{blocked}' is a file, not a folder" in err[0], err


def test_token_ids_outside_the_vocabulary_are_refused_and_the_check_is_shared(tmp_path):
    """check_cache: ids >= the tokenizer's vocabulary fail; verify_entry (the function any
    content-keyed cache uses) compares the recorded key and inputs, not the folder name."""
    tok = ByteTokenizer()
    packed = dataset.pack_examples([([1, 2, tok.vocab_size + 5], [False, True, True])] * 4, 8, True, 0)
    inputs = {"version": 1, "what": "test"}
    folder = tmp_path / cache.key_of(inputs)
    cache.write_cache(folder, packed, inputs)
    assert cache.verify_entry(folder, folder.name, inputs) is None
    assert cache.check_cache(folder, inputs, tok.vocab_size + 6) is None
    assert f"token id {tok.vocab_size + 5}, outside the tokenizer's {tok.vocab_size} ids" in \
        cache.check_cache(folder, inputs, tok.vocab_size)
    assert "other inputs (what differ)" in cache.verify_entry(folder, folder.name, {**inputs, "what": "else"})
    assert "records key" in cache.verify_entry(folder, "another-key", inputs)
    assert np.asarray(cache.load_cache(folder).tokens).max() == tok.vocab_size + 5
