"""`shardtune train` and `export` with none of the optional extras installed (torchao, peft,
bitsandbytes, datasets, tensorboard, wandb, gguf): a plain full fine-tune needs only the core
dependencies. A GPU box without torchao once failed at import (train/core/qlora.py imported it at
module level). The extras are hidden by a sitecustomize on PYTHONPATH, so that the torchrun ranks
see the same packages as the launcher."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
EXTRAS = ("torchao", "peft", "bitsandbytes", "datasets", "tensorboard", "wandb", "gguf")


def _site_without_extras(tmp: Path) -> Path:
    """A folder of links to every entry of this venv's site-packages but the extras' packages and
    their metadata, and a sitecustomize that puts it in site-packages' place: to importlib and
    importlib.metadata (what transformers probes) the extras are simply not installed."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    filtered = tmp / "site-packages"
    filtered.mkdir()
    for entry in purelib.iterdir():
        if not entry.name.lower().replace("-", "_").startswith(EXTRAS):
            (filtered / entry.name).symlink_to(entry)
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        f"import sys\nsys.path[:] = [{str(filtered)!r} if p == {str(purelib)!r} else p for p in sys.path]\n")
    return hook


@pytest.mark.timeout(300)
def test_full_fine_tune_and_export_without_optional_extras(tmp_path):
    site = _site_without_extras(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    probe = run_bounded([sys.executable, "-c", "import torchao"], timeout_s=60, env=env,
                        stderr=subprocess.STDOUT)
    assert probe.returncode != 0 and "No module named 'torchao'" in probe.stdout  # the hiding works
    run = tmp_path / "run"
    proc = run_bounded([sys.executable, "-m", "shardtune.cli", "train", str(REPO / "recipes" / "tiny-cpu.yaml"),
                        "--nproc", "2", "--max-steps", "3", "--output-dir", str(run), "data.cache_dir=null"],
                       timeout_s=240, cwd=tmp_path, env=env, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    export = tmp_path / "export"
    proc = run_bounded([sys.executable, "-m", "shardtune.cli", "export", str(run / "checkpoints" / "step_3"),
                        str(export)], timeout_s=120, cwd=tmp_path, env=env, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
