"""devices.resolve_backend: the one choice of collective backend, for the launcher (preflight) and
each rank (setup_distributed): auto is what torch says (nccl with CUDA, else gloo), nccl without
CUDA is one line, and on a machine without GPU device nodes the choice imports no torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtune.devices import GPU_DEVICE_PATHS, resolve_backend
from shardtune.errors import UserError


def test_auto_is_what_torch_says_and_gloo_is_gloo():
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert resolve_backend("gloo") == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_nccl_without_cuda_is_one_line():
    with pytest.raises(UserError, match="needs CUDA") as e:
        resolve_backend("nccl")
    assert "\n" not in str(e.value)


@pytest.mark.skipif(any(Path(p).exists() for p in GPU_DEVICE_PATHS), reason="GPU device nodes here")
def test_the_choice_imports_no_torch_without_gpu_device_nodes():
    code = ("import sys; from shardtune.devices import resolve_backend; "
            "print(resolve_backend('auto'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["gloo", "False"], out.stderr
