"""Faults a user causes that were tracebacks (issue 32 item 5), through the real CLI: each is one
line, exit 2, before any process starts: a binary `--prompt` (not blamed on the chat template),
`<run>/tensorboard` being a file with the tensorboard logger; and the data cache's "not writable"
line said once per launch, not once per process."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(120)
def test_a_binary_prompt_is_named_as_such(tmp_path):
    # argv bytes that are not UTF-8, as `--prompt "$(cat some.bin)"` passes them
    cmd = [sys.executable.encode(), b"-m", b"shardtune.cli", b"generate", str(tmp_path).encode(), b"--prompt",
           b"hello \xff\xfe\x01 world"]
    proc = run_bounded(cmd, 90, cwd=REPO, env=dict(os.environ))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert "--prompt is not text: byte 0xff at character 6 is not UTF-8" in err[0], err
    assert "template" not in err[0]


def test_tensorboard_folder_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    pytest.importorskip("tensorboard")
    monkeypatch.setattr(commands, "run_process_group",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("torchrun started")))
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("a file")
    rc = cli.main(["train", str(RECIPE), "--output-dir", str(run), "train.loggers=[tensorboard]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"tensorboard writes into '{run / 'tensorboard'}', which is a file, not a folder" in err[0], err


def test_unwritable_cache_line_is_said_by_the_launcher_not_again_by_its_ranks(tmp_path, monkeypatch, capsys):
    from shardtune.train.data import dataset

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    for env, said in (({"SHARDTUNE_PREFLIGHT": "done", "RANK": "0"}, 0), ({"RANK": "1"}, 0), ({"RANK": "0"}, 1)):
        dataset._NOTED.clear()
        for k in ("SHARDTUNE_PREFLIGHT", "RANK"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert dataset.resolve_cache_dir("auto") is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == said and all("is not writable; tokenising in memory" in e for e in err), (env, err)
