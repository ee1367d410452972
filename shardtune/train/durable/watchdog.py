"""A progress watchdog: a hung rank ends the job in about a minute, named, instead of after the
collective timeout (train.timeout_s, 600 s) with no name.

Every rank's thread publishes a heartbeat in the process group's store each second: a counter,
the rank's last started step, its phase (step | save), host and pid. Ranks 0 and 1 watch every
rank's heartbeat (one `multi_get`). A rank is hung when its counter has not moved for `limit_s`
(the process is stopped, swapped out or gone), or when no rank's step has moved for `limit_s`
outside a save (a deadlock); the watcher prints one line naming the rank and its last step,
SIGKILLs it when it runs on this host, and exits 1 (torchrun ends the others; with
`--max-restarts` the restart resumes from the last checkpoint). Rank 0 acts; rank 1 only when
rank 0 is the hung one.

limit_s = max(floor, 10 × the longest step seen so far), capped at timeout_s / 2; the floor is
`SHARDTUNE_WATCHDOG_S`. OFF by default: measured through the CLI (2 gloo ranks, rank 1 SIGSTOPped),
rank 0's thread never ran while its main thread waited in FSDP2's collective (the wait holds the
GIL), so it cannot act; a watcher outside the GIL (a process) is the fix. docs/checkpoints.md.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

FLOOR_S = 60.0
STEP_FACTOR = 10.0
WATCHERS = (0, 1)


def limit_s(floor_s: float, longest_step_s: float, timeout_s: float) -> float:
    """How long a heartbeat or the step count may stand still before the job is ended."""
    return min(max(floor_s, STEP_FACTOR * longest_step_s), timeout_s / 2)


class Watchdog:
    _current: Watchdog | None = None  # one per process: a new run's start stops an earlier one

    def __init__(self, rank: int, world_size: int, timeout_s: float, store=None, poll_s: float = 1.0,
                 floor_s: float | None = None) -> None:
        env = os.environ.get("SHARDTUNE_WATCHDOG_S")
        self.floor_s = float(env) if env else (0.0 if floor_s is None else floor_s)  # off by default
        self.rank, self.world_size, self.timeout_s, self.poll_s = rank, world_size, timeout_s, poll_s
        self.enabled = world_size > 1 and self.floor_s > 0
        self.step, self.phase, self.longest_step_s = 0, "step", 0.0
        self._step_t0: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = store
        self._seen: dict[int, tuple[str, float]] = {}  # rank → (counter, when it last moved)
        self._progress: tuple[tuple, float] | None = None  # (all ranks' steps, when they last moved)

    # ------------------------------------------------------------ main thread
    def start(self) -> Watchdog:
        if self.enabled:
            if Watchdog._current is not None:
                Watchdog._current.stop()
            Watchdog._current = self
            if self._store is None:
                from torch.distributed.distributed_c10d import _get_default_store

                self._store = dist.PrefixStore("shardtune/watchdog", _get_default_store())
            self._thread = threading.Thread(target=self._run, name="shardtune-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int, phase: str = "step") -> None:
        """The main thread at each step start (and around a save): what the heartbeat says."""
        now = time.monotonic()
        if phase == "step" and self.phase == "step" and self._step_t0 is not None and step > self.step:
            self.longest_step_s = max(self.longest_step_s, now - self._step_t0)
        if phase == "step":
            self._step_t0 = now
        self.step, self.phase = step, phase

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ------------------------------------------------------------ its thread
    def _run(self) -> None:
        counter, host, failures = 0, socket.gethostname(), 0
        keys = [f"beat/{r}" for r in range(self.world_size)]
        while not self._stop.wait(self.poll_s):
            counter += 1
            try:
                self._store.set(keys[self.rank], f"{counter}|{self.step}|{self.phase}|{self.longest_step_s:.3f}|"
                                                 f"{host}|{os.getpid()}")
                if self.rank in WATCHERS:
                    self._check([v.decode() for v in self._store.multi_get(keys)] if self._all_set(keys) else [])
                failures = 0
            except Exception:  # the store goes with the process group at the end of the run
                failures += 1
                if failures > 3 or self._stop.is_set():
                    return

    def _all_set(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def _check(self, beats: list[str]) -> None:
        if not beats:
            return
        now = time.monotonic()
        fields = [b.split("|") for b in beats]
        longest = max([self.longest_step_s] + [float(f[3]) for f in fields])
        limit = limit_s(self.floor_s, longest, self.timeout_s)
        stale = []
        for r, f in enumerate(fields):
            counter = f[0]
            if r not in self._seen or self._seen[r][0] != counter:
                self._seen[r] = (counter, now)
            elif r != self.rank and now - self._seen[r][1] > limit:
                stale.append(r)
        steps = tuple(int(f[1]) for f in fields)
        if self._progress is None or self._progress[0] != steps or any(f[2] != "step" for f in fields):
            self._progress = (steps, now)
        if stale:
            if self.rank == 0 or 0 in stale:  # rank 1 acts only for a hung rank 0
                r = stale[0]
                self._end(r, fields[r], f"its heartbeat has not moved for {now - self._seen[r][1]:.0f} s "
                                        "(stopped, swapped out or gone)", limit)
        elif now - self._progress[1] > limit and self.rank == 0:
            r = min(range(len(steps)), key=lambda i: steps[i])
            self._end(r, fields[r], f"no rank has finished a step for {now - self._progress[1]:.0f} s", limit)

    def _end(self, r: int, f: list[str], why: str, limit: float) -> None:
        step, phase, host, pid = int(f[1]), f[2], f[4], int(f[5])
        where = f"in its save of step {step}" if phase == "save" else f"last step {max(step - 1, 0)}, in step {step}"
        print(f"shardtune: rank {r} (pid {pid} on {host}) is hung: {why}; {where}; the other ranks have been "
              f"waiting for it; ending the job (watchdog limit {limit:.0f} s, docs/checkpoints.md)",
              file=sys.stderr, flush=True)
        if host == socket.gethostname():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(1)
