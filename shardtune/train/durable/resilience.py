"""Keeping a long run alive and honest: skipped non-finite steps, preemption, quiet peer failures.

- Bad numerics: `train_step` skips the optimizer step when the loss or gradient norm is non-finite
  (both are global values, so every rank skips the same step); `BadStepCounter` stops the run
  after `train.max_bad_steps` skips in a row, with the last good checkpoint untouched.
- Preemption: SLURM and Kubernetes send SIGTERM (torchrun forwards it to its workers and waits
  30 s before SIGKILL), a user Ctrl-C. `PreemptionSignal` only records it; the loop agrees on it
  across ranks at the next step boundary (`agree_max`), saves a checkpoint and stops, exit 0.
- Peer failures: when one rank raises, its peers see a broken collective. `is_peer_failure` lets
  them exit with one line instead of a second traceback, so the first error is the one shown.
- A stuck exit: gloo's teardown can hang after the work is done (PYTORCH-NOTES); after a
  completed run `exit_if_stuck` ends the process if the teardown takes over 30 s, so torchrun
  and the job's nodes are not held with everything already saved.
- Test hooks (`DebugHooks`): environment variables `SHARDTUNE_TEST_*`, read once per run, that
  inject a NaN loss, an exception, a SIGKILL or a SIGTERM at a given step. Only tests set them.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from shardtune.errors import UserError


class NonFiniteError(UserError):
    """Raised on every rank alike after too many consecutive non-finite steps (a UserError: the
    user fixes it with a lower lr or cleaner data; the CLI prints it as one line)."""


def agree_any(flags: list[bool], device: torch.device, group=None) -> list[bool]:
    """Element-wise OR of `flags` over all ranks (one all-reduce): every rank takes the same decision."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def agree_max(value: int, device: torch.device, group=None) -> int:
    """The largest `value` over all ranks (one all-reduce)."""
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def exit_if_stuck(after_s: float, what: str) -> threading.Timer:
    """Start a daemon timer that ends this process with exit code 0 if `what` (the caller's
    remaining work, all of it after the run's results are written) is still going after
    `after_s` seconds; `cancel()` it when `what` is done."""
    def fire() -> None:
        print(f"shardtune: {what} still running {after_s:g} s after the run completed; exiting "
              "(everything is saved)", file=sys.stderr, flush=True)
        os._exit(0)

    timer = threading.Timer(after_s, fire)
    timer.daemon = True
    timer.start()
    return timer


@dataclass
class BadStepCounter:
    """Counts consecutive skipped steps; `update` raises NonFiniteError past `max_bad_steps`."""
    max_bad_steps: int
    consecutive: int = 0
    first_bad_step: int = 0

    def update(self, step: int, skipped: bool, last_good_checkpoint: str | None, rank: int) -> None:
        if not skipped:
            self.consecutive = 0
            return
        if self.consecutive == 0:
            self.first_bad_step = step
        self.consecutive += 1
        if rank == 0:
            print(f"shardtune: warning: step {step}: non-finite loss or gradient norm; step skipped "
                  f"({self.consecutive}/{self.max_bad_steps} in a row)", file=sys.stderr, flush=True)
        if self.consecutive >= self.max_bad_steps:
            where = last_good_checkpoint or "none saved yet"
            raise NonFiniteError(
                f"{self.consecutive} consecutive steps ({self.first_bad_step}-{step}) had a non-finite "
                f"loss or gradient norm; training stopped. Last good checkpoint: {where}. Lower "
                "optim.lr, raise optim.warmup_steps or check the data, then resume from it")


class PreemptionSignal:
    """Records SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (SLURM's `--signal` choice) instead of dying at
    once; `signum` is the first one received (0: none)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self.signum = self.signum or signum

    def install(self) -> PreemptionSignal:
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


_PEER_FAILURE_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe",
                      "connection refused", "timed out", "socket closed", "recvbytes", "sendbytes",
                      "nccl communicator was aborted", "read error", "write error", "gloo")


def is_peer_failure(e: BaseException) -> bool:
    """True for the errors a rank gets because ANOTHER rank died (a broken collective), so that it
    can step aside and let the first rank's own error be the one the user reads."""
    if isinstance(e, getattr(dist, "DistError", ())) and not isinstance(e, NonFiniteError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(s in text for s in _PEER_FAILURE_TEXT)


# ---------------------------------------------------------------- test hooks (tests only)
def _step_rank(value: str | None, attempt: int) -> tuple[int, int] | None:
    """'3:1' → (step 3, rank 1) in torchrun's first attempt; '3' → (3, 0); '3:1@2' → (3, 1) in
    the attempt after the second restart only (None in any other attempt)."""
    if not value:
        return None
    value, _, when = value.partition("@")
    if int(when or 0) != attempt:
        return None
    step, _, rank = value.partition(":")
    return int(step), int(rank or 0)


@dataclass
class DebugHooks:
    """Fault injection for tests, from `SHARDTUNE_TEST_*` environment variables (never set in
    normal use). Each fires in torchrun's first attempt only (or the one named by `@ATTEMPT`),
    so a restart can succeed.

    SHARDTUNE_TEST_NAN_STEPS=3,4  — the logits (hence loss and gradients) of rank 0 become NaN
    SHARDTUNE_TEST_RAISE=STEP:RANK — that rank raises RuntimeError before the step
    SHARDTUNE_TEST_KILL=STEP:RANK — that rank SIGKILLs itself before the step
    SHARDTUNE_TEST_KILL_IN_SAVE=STEP:RANK — that rank SIGKILLs itself inside the save of STEP,
                                             after its files are written, before the rename
    SHARDTUNE_TEST_SIGTERM=STEP:RANK — that rank gets SIGTERM before the step
    SHARDTUNE_TEST_SIGINT=STEP:RANK — that rank gets SIGINT before the step
    SHARDTUNE_TEST_STOP=STEP:RANK — that rank SIGSTOPs itself before the step (a hung rank)
    SHARDTUNE_TEST_SLOW=STEP:RANK — that rank sleeps SHARDTUNE_TEST_SLOW_S seconds in the step (a
                                    step that compiles: slow, healthy)
    """
    nan_steps: set[int] = field(default_factory=set)
    raise_at: tuple[int, int] | None = None
    kill_at: tuple[int, int] | None = None
    kill_in_save: tuple[int, int] | None = None
    sigterm_at: tuple[int, int] | None = None
    sigint_at: tuple[int, int] | None = None
    stop_at: tuple[int, int] | None = None
    slow_at: tuple[int, int] | None = None
    slow_s: float = 0.0
    step: int = 0  # the step being run (the NaN hook reads it)

    @classmethod
    def from_env(cls, env=os.environ) -> DebugHooks:
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        nan = {int(s) for s in env.get("SHARDTUNE_TEST_NAN_STEPS", "").split(",") if s.strip()}
        at = lambda var: _step_rank(env.get(var), attempt)  # noqa: E731
        return cls(nan_steps=nan, raise_at=at("SHARDTUNE_TEST_RAISE"), kill_at=at("SHARDTUNE_TEST_KILL"),
                   kill_in_save=at("SHARDTUNE_TEST_KILL_IN_SAVE"), sigterm_at=at("SHARDTUNE_TEST_SIGTERM"),
                   sigint_at=at("SHARDTUNE_TEST_SIGINT"), stop_at=at("SHARDTUNE_TEST_STOP"),
                   slow_at=at("SHARDTUNE_TEST_SLOW"), slow_s=float(env.get("SHARDTUNE_TEST_SLOW_S", "0")))

    @property
    def active(self) -> bool:
        return bool(self.nan_steps or self.raise_at or self.kill_at or self.kill_in_save or self.sigterm_at
                    or self.sigint_at or self.stop_at or self.slow_at)

    def install_nan(self, model: nn.Module, rank: int) -> None:
        """A forward hook that turns rank 0's logits into NaN at the chosen steps."""
        if not self.nan_steps or rank != 0:
            return

        def hook(module, args, output):
            if self.step in self.nan_steps:
                output.logits = output.logits * float("nan")
            return output

        model.register_forward_hook(hook)

    def before_step(self, step: int, rank: int) -> None:
        self.step = step
        if self.raise_at == (step, rank):
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (SHARDTUNE_TEST_RAISE)")
        if self.kill_at == (step, rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sigterm_at == (step, rank):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.sigint_at == (step, rank):
            os.kill(os.getpid(), signal.SIGINT)
        if self.stop_at == (step, rank):
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.slow_at == (step, rank):
            time.sleep(self.slow_s)

    def in_save(self, step: int, rank: int) -> None:
        if self.kill_in_save == (step, rank):
            os.kill(os.getpid(), signal.SIGKILL)


def restart_safe_store_kwargs(timeout_s: float, env=os.environ) -> dict:
    """`init_process_group` arguments that keep a torchrun restart from reading the previous
    attempt's keys. Under torchelastic's agent store (TORCHELASTIC_USE_AGENT_STORE=True) the
    workers of every attempt share one TCPStore; measured here (torch 2.13, gloo, --max-restarts 1):
    a restarted rank read its dead peer's old address ("connectFullMesh ... Connection refused")
    in 3 of 3 runs where the kill hit a checkpoint save. Prefixing the keys with the restart
    count gives every attempt a fresh namespace. {} when not under the agent store."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]),
                          is_master=False, timeout=timedelta(seconds=timeout_s))
    prefix = f"shardtune/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return {"store": dist.PrefixStore(prefix, store), "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"])}
