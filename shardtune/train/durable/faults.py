"""Who failed first, and why: the one line that ends a failed job names it, whatever torchrun reports.

`shardtune train` sets `FAULT_ENV` to <run_dir>/logs/first_failure.json before torchrun starts. A
rank that fails (a UserError, any exception that is not a broken collective) and a watchdog that
ends a hung rank each `record` one line there; the file is created exclusively, so the first to
fail wins. The agent (train/launcher/agent.py) reads it when the job has failed. Without it (a rank killed
by a signal writes nothing) the agent names the rank that did not stop because of another's
failure (`PEER_EXIT`) or by torchrun's SIGTERM, the earliest first. Torch-free; every write is best
effort (a full disk).
"""
from __future__ import annotations

import json
import os
import signal
import time

FAULT_ENV = "SHARDTUNE_FAULT_FILE"
PEER_EXIT = 3  # a rank's exit code when it stopped because another rank failed (train/__main__.py)


def record(rank: int | str, line: str, env=os.environ) -> bool:
    """Record `line` as rank `rank`'s failure if no failure is recorded yet; True when it was first."""
    path = env.get(FAULT_ENV)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, json.dumps({"rank": int(rank), "why": " ".join(str(line).split())[:400],
                                 "time": time.time()}).encode())
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)
    return True


def read(path: str | None, since: float = 0.0) -> dict | None:
    """The recorded first failure, or None (none, unreadable, or from before `since`)."""
    try:
        info = json.loads(open(path).read()) if path else None  # noqa: SIM115
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("rank"), int) or not isinstance(info.get("why"), str):
        return None
    return info if float(info.get("time") or 0) >= since else None


def clear(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def exit_words(code: int) -> str:
    """A process's exit code in words: `killed by SIGKILL` for -9."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def first_failed(failures: list[tuple[int, int, float]]) -> tuple[int, int]:
    """(rank, exit code) of the first failure among (rank, exit code, timestamp): a rank that stopped
    because another failed (`PEER_EXIT`) is never the first while another is listed, nor is one
    killed by SIGTERM (torchrun's signal to the ranks still running once one has failed; its
    timestamps are whole seconds, so the order alone cannot tell them apart)."""
    own = [f for f in failures if f[1] != PEER_EXIT] or failures
    own = [f for f in own if f[1] != -signal.SIGTERM] or own
    rank, code, _ = min(own, key=lambda f: (f[2], f[0]))
    return rank, code
