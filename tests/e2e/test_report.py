"""`shardtune report RUN_DIR` as a user runs it: train tiny-cpu on 2 processes, save a simulation
beside it, then draw the plots and print predicted / simulated / measured differences."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.testing.proc import run_bounded

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(cmd: list[str], timeout_s: float, stdout=subprocess.PIPE, env=None) -> tuple[int, str]:
    proc = run_bounded(cmd, timeout_s, cwd=REPO, stdout=stdout, env=env)
    return proc.returncode, (proc.stdout or "") + proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_report_after_train_and_simulate(tmp_path):
    run = tmp_path / "run"
    shardtune = [sys.executable, "-m", "shardtune.cli"]
    rc, log = _run([*shardtune, "train", str(RECIPE), "--nproc", "2", "--max-steps", "4",
                    "--output-dir", str(run)], 200)
    assert rc == 0, log[-3000:]
    memory = json.loads((run / "memory.json").read_text())
    # every CPU run carries the tracker's categories of one step, per rank
    assert all({"params", "activations", "buffers", "total"} <= set(r["tracked"]) for r in memory["per_rank"])
    with open(run / "simulated.json", "w") as f:  # as the docs tell users to save it
        rc, log = _run([*shardtune, "plan", "tiny-llama", "--gpus", "2", "--strategy", "zero3",
                        "--seq-len", "128", "--micro-batch", "8", "--precision", "fp32", "--simulate", "--json"],
                       120, stdout=f)
    assert rc == 0, log[-2000:]
    # COLUMNS set: under pytest the piped console came out 80 wide (cause not found yet), which
    # rightly abbreviates the row labels this test reads
    rc, out = _run([*shardtune, "report", str(run)], 60, env=dict(os.environ, COLUMNS="140"))
    assert rc == 0, out
    for name in ("memory.png", "loss.png", "throughput.png"):
        data = (run / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
    assert "Δ measured vs predicted" in out and "Δ measured vs simulated" in out
    # the measured row shows the run's own largest-rank params (memory.json), in MiB
    params_mib = max(r["tracked"]["params"] for r in memory["per_rank"]) / 2**20
    measured_row = next(line for line in out.splitlines() if " measured " in f" {line} " and "Δ" not in line)
    assert f"{params_mib:,.2f}" in measured_row
    # sharded states: predicted, simulated and measured params agree exactly
    delta_row = next(line for line in out.splitlines() if "Δ measured vs predicted" in line)
    assert delta_row.split()[4] == "+0.0%"


@pytest.mark.e2e
def test_report_bad_folder_is_one_line_exit_2(tmp_path):
    from shardtune.cli import main

    assert main(["report", str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2


@pytest.mark.timeout(120)
def test_report_skips_a_last_line_cut_by_a_kill_with_a_note(tmp_path, capsys):
    from shardtune.cli import main

    run = tmp_path / "run"
    run.mkdir()
    good = [{"step": 1, "loss": 5.5, "tokens_per_s": 100.0}, {"step": 2, "loss": 4.25, "tokens_per_s": 300.0}]
    text = "".join(json.dumps(r) + "\n" for r in good)
    (run / "metrics.jsonl").write_text(text + '{"step": 3, "lo')  # killed mid-write
    assert main(["report", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert "line 3 is incomplete" in out and "5.5000 (step 1) → 4.2500 (step 2)" in out
    assert "200 tokens/s mean" in out  # (100 + 300) / 2: the cut line counted nowhere
    (run / "metrics.jsonl").write_text('{"step": 1, "lo\n' + text)  # damaged in the middle: refused
    assert main(["report", str(run)]) == 2
    assert "line 1" in capsys.readouterr().err
