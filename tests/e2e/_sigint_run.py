"""One signalled `shardtune train --nproc 2` per signal for the whole session, read by the launcher
signal tests of test_launcher_signals.py and test_train_cli.py (each launch costs ~10 s of imports).

The run is long (max_steps 100000): only the signal ends it, whatever the machine's load. The
launcher starts with SIGINT at its default, as a terminal's foreground process has it: a child of a
background job (`pytest ... &` in a script) inherits SIGINT *ignored*, and Python then installs no
KeyboardInterrupt handler, so Ctrl-C's signal would do nothing (the race seen under load was this)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _cli import REPO

from shardtune.processes import kill_groups
from shardtune.train.launcher.supervise import FORK_ENV

RECIPE = """
name: signals
model: {name: tiny-llama}
data: {generated_examples: 400}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 2, seq_len: 64, max_steps: 100000, timeout_s: 120, log_every: 2}
checkpoint: {every: 0, save_final: false}
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(tmp: Path, fork: bool = True) -> tuple[subprocess.Popen, Path]:
    """`shardtune train RECIPE --nproc 2 --output-dir tmp/run` in its own session, its output in
    tmp/out.txt (a file, not a pipe: after a kill -9 nobody would read a pipe). `fork=False`: each
    rank its own interpreter, as on a GPU machine (train/launcher/supervise.py `forks_ranks`)."""
    (tmp / "recipe.yaml").write_text(RECIPE)
    out = tmp / "out.txt"
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tmp / "recipe.yaml"), "--nproc", "2",
           "--output-dir", str(tmp / "run")]
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_default_sigint, env={**os.environ, FORK_ENV: str(int(fork))})
    return proc, out


def wait_for_steps(proc: subprocess.Popen, run: Path, out: Path, timeout_s: float = 150) -> None:
    """Until run/metrics.jsonl holds a record (the ranks are training)."""
    metrics, t0 = run / "metrics.jsonl", time.monotonic()
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() - t0 < timeout_s, "no step logged in time: " + out.read_text()[-3000:]
        time.sleep(0.5)


def command_of(pid: int) -> str:
    """The process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def processes_of(tmp: Path, but: int = -1) -> list[int]:
    """Live pids (not this one, not `but`) whose command line names `tmp` (launcher, agent,
    torchrun, the ranks, their watchers)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) not in (os.getpid(), but) and str(tmp) in command_of(int(d.name)):
            try:
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


@dataclass
class Signalled:
    run: Path
    rc: int
    text: str  # the launcher's stdout and stderr
    running_before: list[int]  # its processes (but the launcher) when the signal was sent
    left_after: list[int]  # its processes still alive 10 s after the launcher exited
    signal_sent_at_step: int  # the last logged step when the signal was sent
    commands: list[str]  # the command lines of `running_before`

    def exec_ranks(self) -> int:
        """How many of its processes run `python -m shardtune.train` (ranks not forked, their watchers)."""
        return sum(c.split()[1:4] == ["-u", "-m", "shardtune.train"] for c in self.commands)  # torchrun's form

    def stopped(self) -> dict:
        return json.loads((self.run / "stopped.json").read_text())


_RUNS: dict[int, Signalled] = {}


def signalled(tmp_path_factory, sig: int) -> Signalled:
    """The session's run stopped by `sig` sent to the launcher (only) once it has logged a step.
    The SIGTERM run (a preemption: a cluster's case) starts its ranks as a GPU machine does, each
    its own interpreter; the SIGINT one forks them, as a CPU machine does."""
    if sig not in _RUNS:
        tmp = tmp_path_factory.mktemp(f"signalled_{signal.Signals(sig).name}")
        proc, out = start(tmp, fork=sig != signal.SIGTERM)
        try:
            wait_for_steps(proc, tmp / "run", out)
            before = processes_of(tmp, but=proc.pid)
            commands = [command_of(pid) for pid in before]
            at_step = json.loads((tmp / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"]
            proc.send_signal(sig)  # SIGINT: what Ctrl-C sends the terminal's foreground process
            rc = proc.wait(timeout=120)
            deadline = time.monotonic() + 10
            while processes_of(tmp) and time.monotonic() < deadline:
                time.sleep(0.5)
            left = processes_of(tmp)
        finally:
            kill_groups([proc])
            for pid in processes_of(tmp):
                os.kill(pid, signal.SIGKILL)
        _RUNS[sig] = Signalled(tmp / "run", rc, out.read_text(), before, left, at_step, commands)
    return _RUNS[sig]
