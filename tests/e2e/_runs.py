"""Helpers of the e2e tests that train once and read what the run wrote: a one-process
`python -m shardtune.train` run, and torch's own DCP reader into a plain transformers model (the
independent reference for what a checkpoint holds)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _cli import REPO

from shardtune.processes import run_bounded


def one_process_run(tmp: Path, recipe: str, timeout_s: float = 150) -> Path:
    """Train `recipe` (YAML text) in one process into tmp/run; returns the run folder."""
    (tmp / "recipe.yaml").write_text(recipe)
    cmd = [sys.executable, "-m", "shardtune.train", str(tmp / "recipe.yaml"), "--output-dir", str(tmp / "run")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = run_bounded(cmd, timeout_s=timeout_s, cwd=REPO, stderr=subprocess.STDOUT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return tmp / "run"


def dcp_model(ckpt: Path, config_dir: Path, dtype=None):
    """torch's own DCP reader (default planner) into a plain HF model of `config_dir`'s config
    (in `dtype`, else the config's own)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if dtype is not None else {}))
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(sd["model"])
    return model.eval()

# The small checkpointed run that the checkpoint-damage files share (`shared_one_process_run`):
# 4 steps, checkpoints at 2 and 4; CKPT_RECIPE_2_STEPS: a run whose only checkpoint is step_2.
CKPT_RECIPE = """
name: ckpt
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
train: {micro_batch: 4, seq_len: 64, max_steps: 4, timeout_s: 60}
checkpoint: {every: 2, keep: 3}
"""
CKPT_RECIPE_2_STEPS = CKPT_RECIPE.replace("max_steps: 4", "max_steps: 2")
