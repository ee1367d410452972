"""Signals to the launcher itself, through the real CLI (`shardtune train ... --nproc 2`, gloo):
Ctrl-C (SIGINT) saves and exits 130, so `train && export` stops; a kill -9 of the launcher takes
its job with it (the agent's and the ranks' parent-death signal, train/launcher/agent.py), no process of
the run outlives it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.processes import kill_groups
from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import read_info

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
RECIPE = """
name: signals
model: {name: tiny-llama}
data: {generated_examples: 400}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 2, seq_len: 64, max_steps: 5000, timeout_s: 120, log_every: 2}
checkpoint: {every: 0, save_final: false}
"""


def _start(tmp: Path) -> tuple[subprocess.Popen, Path]:
    (tmp / "recipe.yaml").write_text(RECIPE)
    out = tmp / "out.txt"  # a file, not a pipe: after a kill -9 nobody would read a pipe
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tmp / "recipe.yaml"), "--nproc", "2",
           "--output-dir", str(tmp / "run")]
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def _wait_for_steps(proc: subprocess.Popen, run: Path, out: Path, timeout_s: float = 150) -> None:
    metrics, t0 = run / "metrics.jsonl", time.monotonic()
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() - t0 < timeout_s, "no step logged in time: " + out.read_text()[-3000:]
        time.sleep(0.5)


def _processes_of(tmp: Path) -> list[int]:
    """Pids whose command line names this test's folder (the agent, torchrun and the ranks)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if str(tmp).encode() in (d / "cmdline").read_bytes():
                    state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        pids.append(int(d.name))
            except OSError:
                continue
    return pids


@pytest.mark.timeout(300)
def test_ctrl_c_saves_and_exits_130(tmp_path):
    proc, out = _start(tmp_path)
    try:
        _wait_for_steps(proc, tmp_path / "run", out)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the terminal's foreground process
        rc = proc.wait(timeout=120)
    finally:
        kill_groups([proc])
        for pid in _processes_of(tmp_path):
            os.kill(pid, signal.SIGKILL)
    text = out.read_text()
    assert rc == 130, text[-3000:]
    assert "stopped on SIGINT" in text and "Traceback" not in text, text[-3000:]
    stopped = json.loads((tmp_path / "run" / "stopped.json").read_text())
    info = read_info(Path(stopped["checkpoint"]))
    assert stopped["signal"] == "SIGINT" and info.step == stopped["step"] >= 1
    assert integrity.problems(info.path, info.files) == []


@pytest.mark.timeout(300)
def test_kill_9_of_the_launcher_ends_its_job(tmp_path):
    proc, out = _start(tmp_path)
    try:
        _wait_for_steps(proc, tmp_path / "run", out)
        assert len(_processes_of(tmp_path)) >= 3  # the agent and two ranks, running
        proc.kill()
        proc.wait(timeout=10)
        t0, left = time.monotonic(), _processes_of(tmp_path)
        while left and time.monotonic() - t0 < 120:
            time.sleep(1)
            left = _processes_of(tmp_path)
        assert not left, f"still running {time.monotonic() - t0:.0f} s after kill -9 of the launcher: {left}; " \
                         + out.read_text()[-2000:]
    finally:
        for pid in _processes_of(tmp_path):
            os.kill(pid, signal.SIGKILL)
