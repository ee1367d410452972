"""What a user's terminal shows for a short `shardtune train` and `shardtune report`, as they run
them: none of the third-party notices shardtune/quiet.py filters (torch's ModTracker "Please file a
bug", torchao / bitsandbytes "Failed to load", setuptools), and the evaluation (val_loss from
data.val_split's held-out examples, the last sample answers) in the summary and in `report`, equal
to what the ranks wrote to metrics.jsonl and samples.jsonl. One launch, shared with test_report."""
from __future__ import annotations

import json
import sys

import pytest
from _cli import SAMPLE_PROMPT
from _runs import REPO

from shardtune.processes import run_bounded

pytestmark = [pytest.mark.e2e]
NOISE = ("module hierarchy tracking", "Please file a bug", "Failed to load", "setuptools", "distutils",
         "UserWarning", "FutureWarning", "DeprecationWarning", "kernels-community")
PROMPT = SAMPLE_PROMPT


@pytest.mark.timeout(600)
def test_train_and_report_print_no_library_noise_and_the_evaluation(reported_run):
    # train (tiny-cpu, 2 processes, 4 steps, val_split, eval_every 2, one sample prompt), its saved
    # simulation and report: one session run shared with test_report (_cli.train_simulate_report)
    run, proc, rep = reported_run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert not [line for line in out.splitlines() if any(n in line for n in NOISE)], out
    vals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [r["step"] for r in vals] == [2, 4]
    line = f"val_loss {vals[0]['val_loss']:.4f} (step 2) → {vals[-1]['val_loss']:.4f} (step 4)"
    samples = [json.loads(s) for s in (run / "samples.jsonl").read_text().splitlines()]
    answer = f'  "{json.dumps(PROMPT)[1:-1]}" → "{json.dumps(samples[-1]["completion"])[1:-1]}"'
    assert line in proc.stdout.splitlines() and "samples at step 4 (samples.jsonl):" in proc.stdout
    assert answer in proc.stdout.splitlines()

    assert rep.returncode == 0, (rep.stdout + rep.stderr)[-2000:]
    assert line in rep.stdout.splitlines() and answer in rep.stdout.splitlines()
    assert not [ln for ln in (rep.stdout + rep.stderr).splitlines() if any(n in ln for n in NOISE)]


@pytest.mark.timeout(240)
def test_torchao_and_bitsandbytes_import_notices_are_filtered_at_the_source():
    """In a fresh process (modules import once), as a rank does: torchao's "Failed to load <CUDA .so>",
    torch's pytree Enum notice and bitsandbytes' optional-kernel notice print nothing after
    quiet_library_notices(); with SHARDTUNE_VERBOSE=1 they print (so the check sees them at all)."""
    import os

    pytest.importorskip("torchao")
    pytest.importorskip("bitsandbytes")
    code = ("from shardtune.errors import quiet_library_notices; quiet_library_notices(); "
            "import torchao.optim, bitsandbytes; import bitsandbytes.backends.cpu.ops")
    quiet = run_bounded([sys.executable, "-c", code], timeout_s=110, cwd=REPO)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert not [ln for ln in (quiet.stdout + quiet.stderr).splitlines() if any(n in ln for n in NOISE)], quiet.stderr
    loud = run_bounded([sys.executable, "-c", code], timeout_s=110, cwd=REPO,
                       env={**os.environ, "SHARDTUNE_VERBOSE": "1"})
    noisy = [ln for ln in (loud.stdout + loud.stderr).splitlines() if any(n in ln for n in NOISE)]
    if not noisy:
        pytest.skip("this machine's torchao / bitsandbytes print nothing on import")
