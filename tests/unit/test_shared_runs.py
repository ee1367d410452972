"""tests/_cli.py `SharedRuns`: one training per distinct run for the session, and a shared run
folder that a test changed fails the next test that asks for it."""
from __future__ import annotations

import subprocess

import _cli
import pytest


def test_a_run_is_trained_once_and_a_changed_folder_fails(tmp_path, monkeypatch):
    calls = []

    def fake_train(tmp, recipe, *args, nproc=2, out="run", **kw):
        calls.append((recipe, args, nproc))
        (tmp / out / "checkpoints").mkdir(parents=True)
        (tmp / out / "metrics.jsonl").write_text('{"step": 1}\n')
        return subprocess.CompletedProcess([], 0, stdout="ok")

    monkeypatch.setattr(_cli, "train_recipe", fake_train)
    runs = _cli.SharedRuns(tmp_path)
    a, _ = runs.get("name: x\n", "--steps", 2)
    b, _ = runs.get("name: x\n", "--steps", "2")
    assert a == b and len(calls) == 1
    c, _ = runs.get("name: x\n", "--steps", 2, nproc=1)
    assert c != a and len(calls) == 2
    (a / "metrics.jsonl").write_text('{"step": 2}\n')
    with pytest.raises(AssertionError, match="metrics.jsonl"):
        runs.get("name: x\n", "--steps", 2)
    (c / "checkpoints" / "new").write_text("x")
    with pytest.raises(AssertionError, match="checkpoints/new"):
        runs.get("name: x\n", "--steps", 2, nproc=1)
