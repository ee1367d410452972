"""Processes that cannot hang: the one place shardtune and its tests start bounded subprocesses,
and end a rank whose work is done (`exit_now`).

Every child starts in its own session (`start_new_session=True`), so a timeout kills its whole
process group — torchrun's workers included (killing torchrun alone leaves them running,
docs/PYTORCH-NOTES.md).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kill_groups(procs: Iterable[subprocess.Popen], sig: int = signal.SIGKILL) -> None:
    """Send `sig` to each still-running child's process group, then reap them all."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_bounded(cmd: Sequence[str], timeout_s: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` to completion in its own session, text output captured (stdout and stderr apart
    unless `stderr=subprocess.STDOUT` is given). On timeout its process group is killed and
    `TimeoutError` names the command."""
    popen_kwargs.setdefault("stdout", subprocess.PIPE)
    popen_kwargs.setdefault("stderr", subprocess.PIPE)
    popen_kwargs.setdefault("text", True)
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen_kwargs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_groups([proc])
        out, err = proc.communicate()
        raise TimeoutError(f"{' '.join(map(str, cmd[:6]))} ... did not finish in {timeout_s:.0f} s; "
                           f"output tail: {(out or '')[-2000:]}{(err or '')[-2000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def exit_now(code: int) -> None:
    """End the rank with `code` once its run has returned, skipping interpreter finalization: there
    a C++ thread of the process group's (gloo) that asks for the GIL is ended by Python, which
    aborts the process ("terminate called without an active exception", SIGABRT) after the run
    has succeeded. Everything is written and closed by then (train/rank/main.py `run`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
