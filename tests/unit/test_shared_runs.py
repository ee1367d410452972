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


def _build_slowly(folder):
    import time
    time.sleep(0.5)
    with open(folder.parent / "builds.txt", "a") as f:
        f.write("built\n")
    (folder / "out.txt").write_text("x")
    return {"value": str(folder), "readonly": [folder]}


def _ask(root, q):
    q.put(_cli.once(root, ["same key"], _build_slowly)["value"])


def test_once_builds_one_time_for_concurrent_processes(tmp_path):
    """Two processes (as two pytest-xdist workers) ask for the same key at once: one builds, the
    other waits on the lock and reads the same result."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(tmp_path, q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    values = {q.get(timeout=5), q.get(timeout=5)}
    assert len(values) == 1
    assert (tmp_path / "builds.txt").read_text() == "built\n"
    (tmp_path / next(iter(values)).split("/")[-1] / "out.txt").write_text("y")
    with pytest.raises(AssertionError, match="out.txt"):
        _cli.once(tmp_path, ["same key"], _build_slowly)
