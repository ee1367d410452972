"""Run-folder ownership: `<run_dir>/shardtune.lock` (pid, host, start time), taken by `shardtune
train` before torchrun starts and held until it ends, or by rank 0 when the trainer is started by
hand (the launcher sets RUN_LOCK_ENV so the ranks know it is held). A second run in the folder is
refused naming the holder; a lock whose pid is dead on this host is taken over with a line.
Created with a hard link of a complete temporary file, so a lock is never seen half-written.
Imports no torch (the CLI path)."""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from shardtune.errors import UserError
from shardtune.train.durable.diskfull import on_full_disk

LOCK_FILE = "shardtune.lock"
RUN_LOCK_ENV = "SHARDTUNE_RUN_LOCK"  # the lock's path: held by the launcher for this run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("start_time", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')} (started {started})"


class RunLock:
    """`with RunLock(run_dir):` owns the folder; `acquire()` / `release()` for other shapes."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": time.time()}
        self.held = False

    def _read(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            raise UserError(f"run folder lock {str(self.path)!r} is unreadable; if no run uses the folder, "
                            "delete it") from None
        if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
            raise UserError(f"run folder lock {str(self.path)!r} is malformed; if no run uses the folder, delete it")
        return holder

    def acquire(self) -> RunLock:
        tmp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}")
        with on_full_disk("taking the run folder's lock", self.path.parent,
                          cleanup=lambda: tmp.unlink(missing_ok=True)):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.me))
        try:
            for _ in range(2):
                try:
                    os.link(tmp, self.path)  # atomic: fails if a lock exists
                    self.held = True
                    return self
                except FileExistsError:
                    holder = self._read()
                    if holder is None:
                        continue
                    if holder.get("host") == self.me["host"] and not _alive(holder["pid"]):
                        print(f"shardtune: taking over the stale lock of {_describe(holder)} in "
                              f"{self.path.parent} (that process is gone)", file=sys.stderr, flush=True)
                        self.path.unlink(missing_ok=True)
                        continue
                    raise UserError(f"run folder {str(self.path.parent)!r} is in use by {_describe(holder)}; "
                                    "wait for it, or give another --output-dir") from None
            raise UserError(f"run folder {str(self.path.parent)!r}: cannot take its lock; try again")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        if not self.held:
            return
        try:
            holder = self._read()
        except UserError:
            holder = None
        if holder and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
