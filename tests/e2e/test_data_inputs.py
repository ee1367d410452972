"""Bad data through the real CLI (`shardtune train`, in process, torchrun's start forbidden): each is
exit 2 and exactly one stderr line naming the problem, before any process starts."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
pytestmark = [pytest.mark.e2e]


def _jsonl(root: Path, name: str, rows: list) -> str:
    p = root / name
    p.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return str(p)


def _cases(root: Path) -> list[tuple[list[str], str]]:
    good = _jsonl(root, "good.jsonl", [{"text": f"example {i}"} for i in range(200)])
    pq.write_table(pa.table({"q": ["a"] * 50, "a": ["b"] * 50}), root / "qa.parquet")
    latin1 = _jsonl(root, "latin1.jsonl", [{"text": "a"}, b'{"text": "caf\xe9"}'])
    broken = _jsonl(root, "broken.jsonl", [{"text": "a"}, b'{"text": '])
    return [
        ([f"data.path={_jsonl(root, 'unknown.jsonl', [{'text': 'a'}, {'question': 'x', 'answer': 'y'}])}"],
         "unknown.jsonl' line 2: unknown format (keys ['answer', 'question']); give 'text',"),
        ([f"data.path={root / 'qa.parquet'}", "data.columns={prompt: q, response: nope}"],
         "data.columns names ['nope'] but dataset"),
        ([f"data.path={_jsonl(root, 'empty.jsonl', [])}"], "empty.jsonl' is empty"),
        ([f"data.path={_jsonl(root, 'small.jsonl', [{'text': 'a'}, {'text': 'b'}, {'text': 'c'}])}",
          "data.packing=false"], "fills 3 rows of seq_len 128, fewer than one global batch (16 ="),
        ([f"data.path={latin1}"],
         "latin1.jsonl' line 2: not UTF-8"),
        ([f"data.path={broken}"],
         "broken.jsonl' line 2: malformed JSON"),
        ([f"data.path={good}", "data.template=plain",
          f"data.val_path={_jsonl(root, 'val.jsonl', [{'prompt': 'x' * 300, 'response': 'y'}])}"],
         "has no target token within seq_len=128"),
        ([f"data.sources=[{{path: {good}, weight: 1}}, {{path: {good}, weight: -2}}]"], "weight -2.0 of"),
        ([f"data.sources=[{{path: {good}, weight: 0}}]"], "data.sources weights sum to 0"),
    ]


@pytest.mark.timeout(300)
def test_bad_data_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    def no_torchrun(*a, **k):
        raise AssertionError("torchrun was started for bad input")

    monkeypatch.setattr(commands, "run_process_group", no_torchrun)
    failures = []
    for args, needle in _cases(tmp_path):
        rc = cli.main(["train", str(RECIPE), "--nproc", "2", "--output-dir", str(tmp_path / "run"), *args])
        err = capsys.readouterr().err.strip().splitlines()
        if rc != 2 or len(err) != 1 or needle not in err[0]:
            failures.append((args, rc, err))
    assert not failures, failures


@pytest.mark.timeout(300)
def test_corrupt_cache_is_named_and_rebuilt_before_launch(tmp_path, monkeypatch, capsys):
    """The launcher builds data.cache_dir; a damaged cache is named in one line and rebuilt to the
    bytes a fresh build writes, before the ranks (not started here) would map it."""
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    launched = []
    monkeypatch.setattr(commands, "run_process_group", lambda *a, **k: launched.append(a) or 0)
    data = _jsonl(tmp_path, "d.jsonl", [{"prompt": f"q{i}\n", "response": "r" * (i % 9)} for i in range(300)])
    args = [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=1"]

    def train(run):
        rc = cli.main(["train", str(RECIPE), "--nproc", "2", "--output-dir", str(tmp_path / run), *args])
        return rc, capsys.readouterr().err.strip().splitlines()

    assert train("r1") == (0, [])
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    fresh = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder / "rows.arrow").write_bytes(fresh["rows.arrow"][:-7])  # truncated
    rc, err = train("r2")
    assert rc == 0 and len(err) == 1 and "is not this data's (rows.arrow does not match meta.json)" in err[0]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == fresh
    assert len(launched) == 2


@pytest.mark.timeout(300)
def test_default_cache_is_built_by_a_rank_once_and_reused_by_the_next_run(tmp_path):
    """data.cache_dir unset (auto): the first `shardtune train` on 2 processes leaves one whole cache
    in $XDG_CACHE_HOME/shardtune/data; a second run maps that same folder (not rebuilt) and trains
    on the same rows (the same losses)."""
    import os
    import subprocess
    import sys

    from shardtune.processes import run_bounded
    from shardtune.train.data.cache import check_cache

    data = _jsonl(tmp_path, "d.jsonl", [{"prompt": f"q{i}\n", "response": "r" * (i % 9)} for i in range(300)])
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    root = tmp_path / "xdg" / "shardtune" / "data"

    def train(run: str) -> list[float]:
        cmd = [sys.executable, "-m", "shardtune.cli", "train", str(RECIPE), "--nproc", "2", "--output-dir",
               str(tmp_path / run), f"data.path={data}", "train.max_steps=2", "checkpoint.save_final=false",
               "checkpoint.export_hf=false"]
        proc = run_bounded(cmd, 150, cwd=REPO, stderr=subprocess.STDOUT, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:]
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    first = train("r1")
    (folder,) = [p for p in root.iterdir() if p.is_dir()]  # one key, no .tmp- folder left
    assert check_cache(folder) is None
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.iterdir()]}
    assert train("r2") == first
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.iterdir()]} == before
