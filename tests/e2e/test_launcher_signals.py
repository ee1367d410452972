"""Signals to the launcher itself, through the real CLI (`shardtune train ... --nproc 2`, gloo):
Ctrl-C (SIGINT) saves and exits 130, so `train && export` stops; a kill -9 of the launcher takes
its job with it (the agent's and the ranks' parent-death signal, train/launcher/agent.py), no process of
the run outlives it. The SIGINT run is the session's one (tests/e2e/_sigint_run.py), which
test_train_cli.py's Ctrl-C test reads too."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from _sigint_run import processes_of, signalled, start, wait_for_steps

from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import read_info

pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(300)
def test_ctrl_c_saves_and_exits_130(tmp_path_factory):
    r = signalled(tmp_path_factory, signal.SIGINT)
    assert r.rc == 130, r.text[-3000:]
    assert "stopped on SIGINT" in r.text and "Traceback" not in r.text, r.text[-3000:]
    stopped = r.stopped()
    info = read_info(Path(stopped["checkpoint"]))
    assert stopped["signal"] == "SIGINT" and info.step == stopped["step"] >= 1
    assert stopped["step"] >= r.signal_sent_at_step  # saved where the signal stopped it, not before
    assert integrity.problems(info.path, info.files) == []


@pytest.mark.timeout(300)
def test_kill_9_of_the_launcher_ends_its_job(tmp_path):
    proc, out = start(tmp_path)
    try:
        wait_for_steps(proc, tmp_path / "run", out)
        assert len(processes_of(tmp_path)) >= 3  # the agent and two ranks, running
        proc.kill()
        proc.wait(timeout=10)
        t0, left = time.monotonic(), processes_of(tmp_path)
        while left and time.monotonic() - t0 < 120:
            time.sleep(1)
            left = processes_of(tmp_path)
        assert not left, f"still running {time.monotonic() - t0:.0f} s after kill -9 of the launcher: {left}; " \
                         + out.read_text()[-2000:]
    finally:
        proc.kill()
        proc.wait()
        for pid in processes_of(tmp_path):
            os.kill(pid, signal.SIGKILL)
