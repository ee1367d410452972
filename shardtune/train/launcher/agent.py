"""`python -m shardtune.train.launcher.agent LOG -- TORCHRUN_ARGS...`: torchrun, with torchrun's own stderr
(its ChildFailedError block and log lines) in LOG instead of the terminal; the ranks keep the
terminal (they inherit file descriptor 2), so a genuine traceback is never hidden. A rank's
UserError reaches here through torchrun's error file (TORCHELASTIC_ERROR_FILE, written by the rank:
train/__main__.py): printed once as one line, exit 2. Any other failure: one line naming the rank
and LOG, exit 1. Used by `shardtune train` (train/commands.py).

The agent dies with its launcher: a parent-death signal (prctl PR_SET_PDEATHSIG, SIGTERM) set at
start, so a `kill -9` of `shardtune train` (a scheduler, the OOM killer) stops torchrun, which stops
its ranks (they save on SIGTERM), instead of leaving them running without a parent."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback

from shardtune.train.durable import faults

USER_ERROR = "UserError: "
LAUNCHER_PID_ENV = "SHARDTUNE_LAUNCHER_PID"  # set by train/commands.py: the process to die with


def die_with_parent(parent_pid: int | None) -> bool:
    """SIGTERM to this process when its parent dies (Linux prctl PR_SET_PDEATHSIG); if the parent
    is gone already (died before the call), SIGTERM now. False where prctl is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _text(message) -> str:
    """A ProcessFailure's message: a string, or the error file's {"message": ..., "extraInfo": ...}."""
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "").strip().splitlines()[-1] if message else ""


class FallbackLog:
    """torchrun's log file, line-buffered; on a full disk (any OSError writing it) the rest goes to
    the terminal's stderr, so the one line that ends the job is never lost to the disk."""

    def __init__(self, path: str) -> None:
        try:
            self._f = open(path, "a", buffering=1)  # noqa: SIM115 (open for torchrun's whole life)
        except OSError:
            self._f = None

    def write(self, text: str) -> int:
        if self._f is not None:
            try:
                return self._f.write(text)
            except OSError:
                self._f = None
        return sys.__stderr__.write(text)

    def flush(self) -> None:
        if self._f is not None:
            try:
                self._f.flush()
            except OSError:
                self._f = None

    def isatty(self) -> bool:
        return False


def first_failure_line(failures: list[tuple[int, int, float]], log_path: str, since: float) -> str:
    """The last line of a failed job: the first rank to fail and why (its recorded error line,
    train/durable/faults.py), else the first rank that did not stop because another failed."""
    fault = faults.read(os.environ.get(faults.FAULT_ENV), since)
    if fault is not None:
        return f"shardtune: error: rank {fault['rank']} failed first: {fault['why']} (torchrun's report in {log_path})"
    rank, code = faults.first_failed(failures)
    return (f"shardtune: error: rank {rank} failed first ({faults.exit_words(code)}); its traceback, if any, is "
            f"above, torchrun's report in {log_path}")


def main(argv: list[str], preload=None) -> int:
    """`preload()`, if given, runs once stderr is the log and before torchrun starts its ranks: what
    ranks forked from this process inherit instead of importing (train/forked/__main__.py)."""
    log_path, args = argv[0], argv[2:] if argv[1:2] == ["--"] else argv[1:]
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")
    die_with_parent(int(launcher) if launcher.isdigit() else None)
    started = time.time()
    log = FallbackLog(log_path)
    sys.stderr = log
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415 after stderr is the fallback log: torch's import notices land there
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415 after stderr is the fallback log: torch's import notices land there
    from torch.distributed.run import main as torchrun  # noqa: PLC0415 after stderr is the fallback log: torch's import notices land there

    if preload is not None:
        preload()

    try:
        torchrun(args)
    except ChildFailedError as e:
        traceback.print_exc(file=log)
        failures = sorted(e.failures.items())
        texts = [(f.exitcode, _text(f.message)) for _, f in failures]
        user = [t for code, t in texts if code == 2 and USER_ERROR in t]
        if user:  # "UserError: ..." or "shardtune.errors.UserError: ...", as torch formats it
            print(f"shardtune: error: {user[0].split(USER_ERROR, 1)[1]}", file=sys.__stderr__)
            return 2
        print(first_failure_line([(r, f.exitcode, f.timestamp) for r, f in failures], log_path, started),
              file=sys.__stderr__)
        return 1
    except SignalException as e:  # stopped by a signal: the launcher says how (train/commands.py)
        traceback.print_exc(file=log)
        return 128 + int(e.sigval)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc(file=log)
        print(f"shardtune: error: torchrun stopped; its report is in {log_path}", file=sys.__stderr__)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
