"""`shardtune train RECIPE [--nproc N] [flags] [key.path=value ...]`: validate, then start torchrun.

Everything a user can get wrong is checked here, before any process starts (exit code 2, one
line). Imports no torch at module level.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import typer

from shardtune.errors import UserError
from shardtune.train.preflight import validate_for_launch

FLAGS = ("strategy", "precision", "max_steps", "seed", "output_dir", "checkpoint_every", "keep", "resume",
         "lora_rank")
_FLAG_KEYS = {"strategy": "parallel.strategy", "precision": "parallel.precision",
              "max_steps": "train.max_steps", "seed": "train.seed", "output_dir": "output_dir",
              "checkpoint_every": "checkpoint.every", "keep": "checkpoint.keep",
              "resume": "checkpoint.resume", "lora_rank": "lora.rank"}


def flag_overrides(**flags) -> list[str]:
    """`--strategy zero2` → `parallel.strategy="zero2"` (JSON is YAML: strings stay strings)."""
    return [f"{_FLAG_KEYS[k]}={json.dumps(v)}" for k, v in flags.items() if v is not None]


def resolve_config(recipe: str, overrides: list[str], **flags):
    """The validated RunConfig: recipe, then `key=value` overrides, then the flags."""
    from shardtune.config import load_recipe

    return load_recipe(recipe, list(overrides or []) + flag_overrides(**flags))


def torchrun_command(nproc: int, recipe: str, overrides: list[str], flags: dict,
                     max_restarts: int = 0) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts R]
    -m shardtune.train ...` (after a restart, checkpoint.resume=auto picks up the last checkpoint)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "shardtune.train", recipe]
    for k, v in flags.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd + list(overrides)


def run_process_group(cmd: list[str]) -> int:
    """Run torchrun in its own session. Ctrl-C or SIGTERM here: SIGTERM to its process group
    (torchrun then stops its workers, which sit in sessions of their own), SIGKILL after 30 s."""
    proc = subprocess.Popen(cmd, start_new_session=True)

    def _on_term(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        return proc.wait()
    except BaseException:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
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


def train_command(recipe: str, overrides: list[str], nproc: int, max_restarts: int = 0, **flags) -> int:
    """Validate everything, then start torchrun with `nproc` processes on this machine."""
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: give at least 1 process")
    if max_restarts < 0:
        raise UserError(f"--max-restarts {max_restarts}: give 0 or more")
    cfg = resolve_config(recipe, overrides, **flags)
    validate_for_launch(cfg, nproc, nproc)
    rc = run_process_group(torchrun_command(nproc, recipe, overrides, flags, max_restarts))
    if rc:
        print(f"shardtune: error: training failed (exit code {rc}); see the messages above", file=sys.stderr)
    return rc


def register(app: typer.Typer) -> None:
    @app.command("train", context_settings={"allow_interspersed_args": True})
    def train(
        recipe: str = typer.Argument(..., help="YAML recipe, e.g. recipes/tiny-cpu.yaml"),
        overrides: list[str] | None = typer.Argument(None, help="key.path=value overrides, e.g. optim.lr=1e-4"),
        nproc: int = typer.Option(1, "--nproc", help="Processes on this machine (torchrun --nproc-per-node)."),
        strategy: str | None = typer.Option(None, "--strategy", help="ddp | zero1 | zero2 | zero3 | hsdp"),
        precision: str | None = typer.Option(None, "--precision", help="bf16-mixed | bf16 | fp32"),
        max_steps: int | None = typer.Option(None, "--max-steps", help="Optimizer steps."),
        seed: int | None = typer.Option(None, "--seed"),
        output_dir: str | None = typer.Option(None, "--output-dir", help="Run folder (default runs/<recipe name>)."),
        checkpoint_every: int | None = typer.Option(None, "--checkpoint-every", help="Save a checkpoint every N steps (checkpoint.every)."),
        keep: int | None = typer.Option(None, "--keep", help="Keep the newest K checkpoints (checkpoint.keep)."),
        resume: str | None = typer.Option(None, "--resume", help="auto (newest complete checkpoint) | never | a checkpoints/step_N path."),
        max_restarts: int = typer.Option(0, "--max-restarts", help="torchrun restarts of the whole group after a failure; each resumes from the last checkpoint."),
        lora_rank: int | None = typer.Option(None, "--lora-rank", help="LoRA rank on q/k/v/o/gate/up/down (lora.rank; 0: full fine-tune), as `shardtune plan --lora-rank`."),
    ) -> int:
        """Fine-tune with a recipe on this machine (torchrun under the hood)."""
        return train_command(recipe, overrides or [], nproc, strategy=strategy, precision=precision,
                             max_steps=max_steps, seed=seed, output_dir=output_dir,
                             checkpoint_every=checkpoint_every, keep=keep, resume=resume,
                             max_restarts=max_restarts, lora_rank=lora_rank)
