"""bitsandbytes' Hub kernel lookup (refused offline: `kernels` and bitsandbytes each log a line, in
every rank of every QLoRA run) prints nothing once an entry point has called
quiet_library_notices; without it the same import prints them (where the CPU path tries the Hub)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from shardtune.processes import run_bounded

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
QUIET = "from shardtune.errors import quiet_library_notices; quiet_library_notices(); "


@pytest.mark.timeout(240)
def test_bitsandbytes_import_says_nothing_about_hub_kernels():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    loud = run_bounded([sys.executable, "-c", "import bitsandbytes"], 120, env=env, stderr=subprocess.PIPE)
    quiet = run_bounded([sys.executable, "-c", QUIET + "import bitsandbytes"], 120, env=env, stderr=subprocess.PIPE)
    assert loud.returncode == 0 and quiet.returncode == 0, (loud.stderr, quiet.stderr)
    if "kernels-community" not in loud.stderr:
        pytest.skip("this CPU's bitsandbytes path does not look up Hub kernels (no AVX512-BF16)")
    assert "kernels-community" not in quiet.stderr and "publisher trust" not in quiet.stderr, quiet.stderr
