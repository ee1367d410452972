"""The `shardtune train` launcher's process supervision: the validated config, the torchrun command
line, torchrun in its own session under train/launcher/agent.py with signals passed on, and the
exit code (a signal-triggered save exits 0 or 130). train/commands.py only parses and calls
`train_command`. Imports no torch (tests/unit/test_layers.py: the launcher side)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardtune.config import load_recipe
from shardtune.config.flags import flag_argv, flag_overrides
from shardtune.devices import has_gpu_nodes
from shardtune.errors import UserError
from shardtune.train.core.loggers import check_loop_options
from shardtune.train.durable.choice import CHOICE_ENV
from shardtune.train.durable.diskfull import on_full_disk
from shardtune.train.durable.faults import FAULT_ENV
from shardtune.train.durable.faults import clear as clear_faults
from shardtune.train.launcher.agent import LAUNCHER_PID_ENV
from shardtune.train.launcher.preflight import validate_for_launch
from shardtune.train.launcher.rerun import decide
from shardtune.train.launcher.runlock import RUN_LOCK_ENV, RunLock


def resolve_config(recipe: str, overrides: list[str], **flags):
    """The validated RunConfig: recipe, then `key=value` overrides, then the flags."""
    return load_recipe(recipe, list(overrides or []) + flag_overrides(**flags))


RANK_SCRIPT = Path(__file__).resolve().parents[1] / "__main__.py"  # shardtune/train/__main__.py
FORK_ENV = "SHARDTUNE_FORK_RANKS"  # "0": start each rank as its own Python process even without a GPU
PRELOAD_PEFT_ENV = "SHARDTUNE_PRELOAD_PEFT"  # "1" for a forking agent of a LoRA run: peft imported once too


def forks_ranks() -> bool:
    """Ranks forked from the agent (train/forked/__main__.py) on a machine without GPU device
    nodes: they inherit its imports (docs/DESIGN.md "The suite's cost"). With a GPU, or FORK_ENV=0,
    each rank is a fresh interpreter (`-m shardtune.train`), as torchrun starts it by hand."""
    value = os.environ.get(FORK_ENV, "1")
    if value not in ("0", "1"):
        raise UserError(f"{FORK_ENV}={value!r}: give 1 (fork the ranks where no GPU exists) or 0 (never)")
    return value == "1" and not has_gpu_nodes()


def torchrun_command(nproc: int, recipe: str, overrides: list[str], flags: dict,
                     max_restarts: int = 0, fork: bool = False) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts R]
    -m shardtune.train ...` (after a restart, checkpoint.resume=auto picks up the last checkpoint).
    `fork`: `--start-method=fork --run-path shardtune/train/__main__.py` instead of `-m shardtune.train`."""
    entry = ["--start-method=fork", "--run-path", str(RANK_SCRIPT)] if fork else ["-m", "shardtune.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", *entry, recipe]
    return cmd + flag_argv(flags) + list(overrides)


PREFLIGHT_ENV = "SHARDTUNE_PREFLIGHT"  # "done": the launcher validated this exact run; ranks skip it


def run_process_group(cmd: list[str], threads: int | None = None, lora: bool = False) -> int:
    """Run torchrun in its own session (OMP_NUM_THREADS=`threads` for it and its ranks, which also
    call torch.set_num_threads). Ctrl-C here: SIGINT to its process group, SIGTERM: SIGTERM
    (torchrun passes the signal on to its workers, which sit in sessions of their own; they save
    and stop), SIGKILL after 30 s more. A kill -9 here: the agent's parent-death signal (agent.py)."""
    env = {**os.environ, PREFLIGHT_ENV: "done", LAUNCHER_PID_ENV: str(os.getpid()), PRELOAD_PEFT_ENV: str(int(lora))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)

    def _on_term(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        return proc.wait()
    except BaseException as e:
        first = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        for sig, wait_s in ((first, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_by_signal(run_dir, since: float) -> int | None:
    """Rank 0 wrote <run_dir>/stopped.json after a signal-triggered save during this launch: the exit
    code, else None. SIGTERM and SIGUSR1 (preemption): 0, SLURM's requeue needs no failure code
    (docs/checkpoints.md); SIGINT (Ctrl-C): 130, as a shell expects, so `train && export` stops."""
    path = Path(run_dir) / "stopped.json"
    try:
        if path.stat().st_mtime < since:
            return None
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    name = info.get("signal", "a signal") if isinstance(info, dict) else "a signal"
    print(f"shardtune: stopped on {name} after saving step {info.get('step')} "
          f"({info.get('checkpoint')}); the same command resumes from it", file=sys.stderr)
    return 128 + signal.SIGINT if name == "SIGINT" else 0


def train_command(recipe: str, overrides: list[str], nproc: int, max_restarts: int = 0, move_aside: bool = False,
                  planner=None, **flags) -> int:
    """Validate everything, own the run folder (train/launcher/runlock.py), decide re-runs and resumes
    (train/launcher/rerun.py), then start torchrun with `nproc` processes on this machine. `planner`:
    `shardtune.plan.plan`, handed down by the command (the trainer imports no planner)."""
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: give at least 1 process")
    if not 0 <= max_restarts <= 1000:  # each restart is a start-up and a resume: more is a typo
        raise UserError(f"--max-restarts {max_restarts}: give 0 to 1000")
    cfg = resolve_config(recipe, overrides, **flags)
    check_loop_options(cfg)
    fork = forks_ranks()  # before the preflight, which creates the run folder
    validate_for_launch(cfg, nproc, nproc, planner=planner)
    for line in cfg.train.unused_settings():  # once, by the launcher (the ranks validate again)
        print(f"shardtune: warning: {line}", file=sys.stderr)
    with RunLock(cfg.run_dir) as lock:
        decision = decide(cfg, move_aside, nproc)
        if decision.done:
            print(decision.done)
            return 0
        os.environ[RUN_LOCK_ENV] = str(lock.path)  # the ranks: held by this launcher
        os.environ[CHOICE_ENV] = str(decision.resume.path) if decision.resume else "none"  # choice.py
        os.environ[FAULT_ENV] = str(cfg.run_dir / "logs" / "first_failure.json")  # durable/faults.py
        log = cfg.run_dir / "logs" / "torchrun.log"
        with on_full_disk("creating logs/", cfg.run_dir):
            log.parent.mkdir(exist_ok=True)
            log.touch()
            clear_faults(log.parent / "first_failure.json")  # an earlier launch's
        # torchrun under train/launcher/agent.py: its own stderr goes to `log`, a rank's UserError is one line;
        # forking ranks, train/forked/ imports the rank side into the agent first
        cmd = [sys.executable, "-m", "shardtune.train.forked" if fork else "shardtune.train.launcher.agent", str(log),
               "--", *torchrun_command(nproc, recipe, [*overrides, *decision.overrides], flags, max_restarts,
                                       fork=fork)[3:]]
        started = time.time()
        try:
            rc = run_process_group(cmd, cfg.train.threads_per_rank(nproc), lora=bool(cfg.lora.rank))
        except (SystemExit, KeyboardInterrupt) as e:
            stopped = stopped_by_signal(cfg.run_dir, started)
            if stopped is not None:
                return stopped
            if isinstance(e, KeyboardInterrupt):
                print("shardtune: interrupted before a checkpoint was saved", file=sys.stderr)
                return 128 + signal.SIGINT
            raise
        finally:
            os.environ.pop(RUN_LOCK_ENV, None)
            os.environ.pop(CHOICE_ENV, None)
            os.environ.pop(FAULT_ENV, None)
    stopped = stopped_by_signal(cfg.run_dir, started) if rc else None
    if stopped is not None:
        return stopped  # torchrun itself got the signal (e.g. SLURM signals every process): the ranks saved
    if rc not in (0, 1, 2):  # 1 and 2: train/launcher/agent.py said what failed
        print(f"shardtune: error: training failed (exit code {rc}); see the messages above", file=sys.stderr)
    return rc
