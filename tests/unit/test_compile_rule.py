"""train.compile without a C++ compiler: refused by train/launcher/preflight.py check_environment (one line,
exit 2, before any process starts), exactly where torch's inductor itself would find no compiler
(torch._inductor.cpp_builder.get_cpp_compiler, run in a fresh process with the same environment)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.errors import UserError
from shardtune.train.launcher.preflight import check_environment

REPO = Path(__file__).resolve().parents[2]
PROBE = ("from torch._inductor.cpp_builder import get_cpp_compiler\n"
         "try:\n    print(get_cpp_compiler())\nexcept Exception as e:\n    print('NONE', type(e).__name__)\n")


def _fake_compiler(folder: Path, name: str) -> Path:
    folder.mkdir(exist_ok=True)
    exe = folder / name
    exe.write_text("#!/bin/sh\necho fake compiler 1.0\n")  # torch runs `CXX --version`
    exe.chmod(0o755)
    return exe


def _envs(tmp_path: Path) -> dict[str, dict[str, str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    fake_dir = tmp_path / "bin"
    cxx = _fake_compiler(fake_dir, "my-c++")
    _fake_compiler(fake_dir, "g++")
    base = {k: v for k, v in os.environ.items() if k != "CXX"}
    return {"no compiler on PATH": {**base, "PATH": str(empty)},
            "CXX names a missing file": {**base, "PATH": str(empty), "CXX": str(tmp_path / "nope" / "g++")},
            "CXX names a compiler": {**base, "PATH": str(empty), "CXX": str(cxx)},
            "g++ on PATH": {**base, "PATH": str(fake_dir)}}


def _ours(env: dict[str, str], monkeypatch) -> bool:
    with monkeypatch.context() as m:
        m.delenv("CXX", raising=False)
        for k in ("PATH", "CXX"):
            if k in env:
                m.setenv(k, env[k])
        try:
            check_environment("zero3", compile=True)
        except UserError as e:
            assert "\n" not in str(e) and "train.compile" in str(e)
            return False
        check_environment("zero3", compile=False)
        return True


@pytest.mark.timeout(120)
def test_refused_exactly_where_inductor_finds_no_compiler(tmp_path, monkeypatch):
    for label, env in _envs(tmp_path).items():
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                             timeout=100, cwd=REPO).stdout.strip().splitlines()[-1]
        torch_finds = not out.startswith("NONE")
        assert _ours(env, monkeypatch) == torch_finds, (label, out)
    assert _ours({"PATH": os.environ["PATH"]}, monkeypatch) is True  # this machine has g++ (PYTORCH-NOTES)


@pytest.mark.timeout(120)
def test_train_compile_without_compiler_is_one_line_exit_2_before_anything(tmp_path, monkeypatch, capsys):
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    def no_torchrun(*a, **k):
        raise AssertionError("torchrun was started for bad input")

    monkeypatch.setattr(commands, "run_process_group", no_torchrun)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CXX", raising=False)
    run = tmp_path / "run"
    rc = cli.main(["train", str(REPO / "recipes" / "tiny-cpu.yaml"), "--nproc", "2", "--output-dir", str(run),
                   "train.compile=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "needs a C++ compiler" in err[0], err
    assert not run.exists()
