"""A progress watchdog: a hung rank ends the job in about a minute, named, instead of after the
collective timeout (train.timeout_s, 600 s) with no name.

Each rank starts a watcher PROCESS (a thread cannot run while FSDP2's collective wait holds the
GIL: measured, docs/checkpoints.md). The rank writes its step, phase and longest step time into a
small file at each step (`beat`: one pwrite, no lock); its watcher reads it every second, reads
the rank's state from /proc (a stopped, zombie or vanished rank does not count as alive), and
publishes a heartbeat in the job's TCP store (MASTER_ADDR:MASTER_PORT, key prefix
`shardtune/watchdog/`): a counter that moves only while the rank is alive, its step, phase, host
and pid. The watchers of ranks 0 and 1 read every heartbeat. A rank is hung when its counter has
not moved for `limit_s` (stopped, swapped out or gone), or when no rank's step has moved for
`limit_s` outside a save (a deadlock). The watcher prints one line naming the rank and its last
step, dumps the hung rank's Python stacks (faulthandler, SIGUSR2) when it is on this host, then
SIGKILLs it and its own rank, so torchrun's group fails at once (with `--max-restarts` the restart
resumes from the last checkpoint). Rank 0's watcher acts; rank 1's only when rank 0 is the hung one.

limit_s = max(floor, 10 × the longest step seen so far), capped at 0.9 × timeout_s (a step that
slow already makes the others' collective wait near the timeout, which would end the job anyway:
the watchdog then only names it; a lower cap ended slow but healthy steps); the floor is
train.watchdog_s, 120 s, or `SHARDTUNE_WATCHDOG_S` (0 or off: no watchdog; tests/e2e/test_watchdog.py
measures it with 5). Until every rank has finished its first step (torch.compile, torchao's 8-bit
AdamW compiling inside step 1, the collectives' warm-up) the limit is train.watchdog_first_step_s
instead, 900 s (0: none), uncapped, as torchtitan gives its first step its own init timeout. On by
default for every run of more than one rank. Validation and sample prompts beat phase "eval": like a
save, no deadlock is judged while it lasts (the heartbeat still must move).

The watcher is forked (`prefork`, at the rank's start, while it has one thread) and waits on a
pipe until `start` sends its arguments: it shares the rank's imports instead of importing torch
again (1.4 CPU-s and ~300 MB of memory a rank). Where the rank has threads already (a second run in
one process), `start` runs a fresh interpreter instead:

    python -m shardtune.train.durable.watchdog BEAT_FILE RANK WORLD PID TIMEOUT_S FLOOR_S FIRST_S  # the watcher

The watcher imports no torch of its own: the store client is torch's, imported by the forked
watcher's rank already, and by a fresh interpreter only when it starts watching.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from shardtune.train.durable import faults

FLOOR_S = 120.0  # the default floor (issue 32: a hung rank ends the job within max(120 s, k × step time))
FIRST_STEP_S = 900.0  # the default limit before every rank's first step is done (config/train.py)
STEP_FACTOR = 10.0
CAP = 0.9  # of train.timeout_s
WATCHERS = (0, 1)
STACK_SIGNAL = signal.SIGUSR2  # faulthandler dumps every thread's stack on it (registered in the rank)
_BEAT = struct.Struct("<qbd")  # step, phase (0 step, 1 save, 2 stopped), longest step s
_PHASES = ("step", "save", "stop", "eval")


def limit_s(floor_s: float, longest_step_s: float, timeout_s: float, first_step_s: float = FIRST_STEP_S) -> float:
    """How long a heartbeat or the step count may stand still before the job is ended; before a
    first step is done (longest 0), the first-step limit (0: none)."""
    if longest_step_s <= 0:
        return first_step_s or float("inf")
    return min(max(floor_s, STEP_FACTOR * longest_step_s), CAP * timeout_s)


class Watchdog:
    """The rank's side: `start` spawns the watcher, `beat` records progress, `stop` ends it."""

    _current: Watchdog | None = None  # one per process: a new run's start stops an earlier one

    def __init__(self, rank: int, world_size: int, timeout_s: float, floor_s: float | None = None,
                 first_step_s: float = FIRST_STEP_S) -> None:
        """`floor_s` None: `SHARDTUNE_WATCHDOG_S`, else 120 s (the run passes train.watchdog_s, which
        the variable already overrides: config/train.py validates both before any process starts)."""
        if floor_s is None:
            env = os.environ.get("SHARDTUNE_WATCHDOG_S", "").strip()
            floor_s = (0.0 if env.lower() == "off" else float(env)) if env else FLOOR_S
        self.floor_s, self.first_step_s = floor_s, first_step_s  # 0: off
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.enabled = world_size > 1 and self.floor_s > 0
        self.step, self.phase, self.longest_step_s = 0, "step", 0.0
        self._step_t0: float | None = None
        self._fd: int | None = None
        self._path: str | None = None
        self._thread: subprocess.Popen | None = None  # the watcher (a process; keeper.py reads this name)

    def start(self) -> Watchdog:
        if not self.enabled:
            return self
        if Watchdog._current is not None:
            Watchdog._current.stop()
        Watchdog._current = self
        faulthandler.register(STACK_SIGNAL, all_threads=True, chain=False)
        self._fd, self._path = tempfile.mkstemp(prefix=f"shardtune-beat-{self.rank}-")
        self._write()
        args = [self._path, str(self.rank), str(self.world_size), str(os.getpid()), str(self.timeout_s),
                str(self.floor_s), str(self.first_step_s)]
        self._thread = _Spare.take(args) or subprocess.Popen(
            [sys.executable, "-m", "shardtune.train.durable.watchdog", *args],
            stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def _write(self) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, _BEAT.pack(self.step, _PHASES.index(self.phase), self.longest_step_s), 0)

    def beat(self, step: int, phase: str = "step") -> None:
        """The main thread at each step start (and around a save or an evaluation): what the
        heartbeat says. A step ends at the next step's start, or at the save or evaluation after it."""
        now = time.monotonic()
        if self.phase == "step" and self._step_t0 is not None and (step > self.step or phase != "step"):
            self.longest_step_s = max(self.longest_step_s, now - self._step_t0)
            self._step_t0 = None
        if phase == "step":
            self._step_t0 = now
        self.step, self.phase = step, phase
        self._write()

    def stop(self) -> None:
        if self._thread is not None:
            self.phase = "stop"
            self._write()
            try:
                self._thread.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._thread.kill()
                self._thread.wait()
            self._thread = None
        if self._fd is not None:
            os.close(self._fd)
            os.unlink(self._path)
            self._fd = None
        if Watchdog._current is self:
            Watchdog._current = None


# ---------------------------------------------------------------- the forked watcher
WATCHER_NAME = b"shardtune-watch"  # the forked watcher's /proc/<pid>/comm (ps -o comm), 15 bytes at most


def prefork() -> None:
    """Fork this rank's watcher now, to wait for `Watchdog.start`: only where it will be used (more
    than one rank, the watchdog on) and safe (Linux, this process has one thread: a fork copies no
    lock another thread holds). Called once, before the process group starts its threads."""
    will_watch = Watchdog(0, int(os.environ.get("WORLD_SIZE", "1")), timeout_s=0.0).enabled  # its one rule
    if will_watch and _Spare.current is None and hasattr(os, "fork") and _threads() == 1:
        _Spare.current = _Spare()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # not Linux: no fork


class _Spare:
    """A forked watcher waiting on a pipe; `take(args)` starts it (Popen's wait/kill for the rank)."""

    current: _Spare | None = None

    def __init__(self) -> None:
        r, self._w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing of the rank's buffered twice
            stream.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._w)
            os._exit(_serve(r))
        os.close(r)

    @classmethod
    def take(cls, args: list[str]) -> _Spare | None:
        spare, cls.current = cls.current, None
        if spare is None:
            return None
        try:
            where = [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]  # the store, as set now
            os.write(spare._w, "\0".join([*args, *where]).encode())
        except (OSError, KeyError):  # it is gone, or no store named: a fresh interpreter instead
            spare.wait(timeout=1)
            return None
        finally:
            os.close(spare._w)
        return spare

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(WATCHER_NAME.decode(), timeout)
            time.sleep(0.02)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)


def _serve(r: int) -> int:
    """The forked watcher: its own session, default signals, no file of the rank's but the pipe;
    reads its arguments (EOF: the rank never started it) and watches."""
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.closerange(3, r)
        os.closerange(r + 1, 65536)
        with contextlib.suppress(OSError):
            with open("/proc/self/comm", "wb") as f:
                f.write(WATCHER_NAME)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        if not data:
            return 0
        a = data.decode().split("\0")
        os.environ.update(MASTER_ADDR=a[7], MASTER_PORT=a[8])
        return watch(a[0], int(a[1]), int(a[2]), int(a[3]), float(a[4]), float(a[5]), float(a[6]))
    except BaseException:  # noqa: BLE001 a forked child never returns into the rank's code
        return 1


# ---------------------------------------------------------------- the watcher process
def proc_alive(pid: int) -> bool:
    """The process exists and is neither stopped nor a zombie (/proc/<pid>/stat, field 3)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("T", "t", "Z", "X")


class Judge:
    """Decides from every rank's heartbeat whether one is hung (pure: fed `(now, beats)`)."""

    def __init__(self, rank: int, floor_s: float, timeout_s: float, first_step_s: float = FIRST_STEP_S) -> None:
        self.rank, self.floor_s, self.timeout_s, self.first_step_s = rank, floor_s, timeout_s, first_step_s
        self._seen: dict[int, tuple[str, float]] = {}  # rank → (counter, when it last moved)
        self._progress: tuple[tuple, float] | None = None  # (all ranks' steps, when they last moved)

    def hung(self, now: float, beats: list[str]) -> tuple[int, list[str], str, float] | None:
        """(rank, its fields, why, limit, first) when this watcher must end the job, else None; first:
        the limit is the first step's (a rank has not finished its first step)."""
        fields = [b.split("|") for b in beats]
        longest = [float(f[3]) for f in fields]  # 0 on a rank whose first step is not done
        first = min(longest) <= 0
        limit = limit_s(self.floor_s, 0.0 if first else max(longest), self.timeout_s, self.first_step_s)
        stale = []
        for r, f in enumerate(fields):
            if r not in self._seen or self._seen[r][0] != f[0]:
                self._seen[r] = (f[0], now)
            elif now - self._seen[r][1] > limit:
                stale.append(r)
        steps = tuple(int(f[1]) for f in fields)
        if self._progress is None or self._progress[0] != steps or any(f[2] != "step" for f in fields):
            self._progress = (steps, now)
        if stale and (self.rank == 0 or 0 in stale):  # rank 1 acts only for a hung rank 0
            r = stale[0]
            return r, fields[r], (f"its heartbeat has not moved for {now - self._seen[r][1]:.0f} s (stopped, "
                                  "swapped out or gone)"), limit, first
        if not stale and self.rank == 0 and now - self._progress[1] > limit:
            r = min(range(len(steps)), key=lambda i: steps[i])
            return r, fields[r], f"no rank has finished a step for {now - self._progress[1]:.0f} s", limit, first
        return None


def _end(r: int, f: list[str], why: str, limit: float, first: bool, own_pid: int) -> None:
    step, phase, host, pid = int(f[1]), f[2], f[4], int(f[5])
    where = f"in its save of step {step}" if phase == "save" else f"last step {max(step - 1, 0)}, in step {step}"
    key = "train.watchdog_first_step_s" if first else "train.watchdog_s (or SHARDTUNE_WATCHDOG_S)"
    print(f"shardtune: rank {r} (pid {pid} on {host}) is hung: {why}; {where}; the other ranks have been waiting "
          f"for it; ending the job (watchdog limit {limit:.0f} s; a slow but healthy step: raise {key}, 0 or off "
          "turns it off; docs/checkpoints.md)", file=sys.stderr, flush=True)

    faults.record(r, f"hung, {why}; {where} (watchdog limit {limit:.0f} s)")
    if host == socket.gethostname():
        for sig, pause in ((signal.SIGCONT, 0.0), (STACK_SIGNAL, 1.0), (signal.SIGKILL, 0.0)):
            try:  # a stopped rank must run again to dump its stacks
                os.kill(pid, sig)
            except OSError:
                break
            time.sleep(pause)
    try:
        os.kill(own_pid, signal.SIGKILL)  # this rank too: torchrun ends the group now
    except OSError:
        pass


def watch(beat_file: str, rank: int, world_size: int, pid: int, timeout_s: float, floor_s: float,
          first_step_s: float) -> int:
    """The watcher's loop; returns when its rank stops the watchdog or is gone."""
    from torch.distributed import TCPStore  # noqa: PLC0415 lazy: the forked watcher's rank has it already

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=30))
    keys = [f"shardtune/watchdog/beat/{r}" for r in range(world_size)]
    judge, counter, host = Judge(rank, floor_s, timeout_s, first_step_s), 0, socket.gethostname()
    with open(beat_file, "rb") as f:
        while True:
            time.sleep(1.0)
            try:
                step, phase, longest = _BEAT.unpack(os.pread(f.fileno(), _BEAT.size, 0))
            except (OSError, struct.error):
                return 0
            if _PHASES[phase] == "stop":
                return 0
            if not os.path.exists(f"/proc/{pid}"):  # its rank was killed: nobody else removes the file
                with contextlib.suppress(OSError):
                    os.unlink(beat_file)
                return 0
            counter += proc_alive(pid)
            try:
                store.set(keys[rank], f"{counter}|{step}|{_PHASES[phase]}|{longest:.3f}|{host}|{pid}")
                if rank in WATCHERS and store.check(keys):
                    verdict = judge.hung(time.monotonic(), [v.decode() for v in store.multi_get(keys)])
                    if verdict is not None:
                        _end(*verdict, own_pid=pid)
                        with contextlib.suppress(OSError):  # its rank is killed: nobody else removes it
                            os.unlink(beat_file)
                        return 1
            except Exception:  # the store goes with the job at its end
                if not proc_alive(pid):
                    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(watch(a[0], int(a[1]), int(a[2]), int(a[3]), float(a[4]), float(a[5]), float(a[6])))
