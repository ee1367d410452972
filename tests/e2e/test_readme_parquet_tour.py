"""The README's parquet tour, re-run from the command it shows: its figures (loss at the first
logged step and the last, val_loss, the sample answers) are what that command writes to
metrics.jsonl and samples.jsonl today (issue 27 item 7: the README had drifted to 1.02 / 1.31 /
"dhtrshe" while a run gave 1.145 / 1.419 / "thedash"). Timings are stated as ranges and not
checked. One launch (SmolLM2-135M, 2 CPU ranks)."""
from __future__ import annotations

import json
import re
import shlex
import sys

import pytest
from _runs import REPO

from shardtune.processes import run_bounded

pytestmark = [pytest.mark.e2e]
README = (REPO / "README.md").read_text()
SECTION = README[README.index("#### Your data: parquet"):]


def _figures():
    """(loss a, step a, loss b, step b, val_loss, step, [(op, input, answer)]) as the README states them."""
    m = re.search(r"loss ([\d.]+) at step (\d+) → ([\d.]+) at step (\d+),\s+val_loss ([\d.]+) at step (\d+), and the "
                  r"samples at step (\d+): (.*?)\. `shardtune generate`", SECTION, re.S)
    assert m, "the parquet tour's figures sentence moved: update this test"
    samples = re.findall(r"`(\w+)` of \"([^\"]*)\" → \"([^\"]*)\"", m.group(8))
    assert samples
    return m, samples


@pytest.mark.timeout(3000)  # ~8 min on a quiet 2-core machine, 25 min at load average 18
def test_parquet_tour_figures_are_what_its_command_writes(tmp_path):
    m, samples = _figures()
    block = re.search(r"```bash\n(.*?)```", SECTION, re.S).group(1)
    (train,) = [line for line in block.splitlines() if line.startswith("shardtune train ")]
    argv = shlex.split(train.split("#")[0])
    argv[argv.index("--output-dir") + 1] = str(tmp_path / "run")
    proc = run_bounded([sys.executable, "-m", "shardtune.cli", *argv[1:]], timeout_s=2900, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}
    val = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    a, sa, b, sb, v, sv, ss = m.group(1, 2, 3, 4, 5, 6, 7)
    digits = len(a.split(".")[1])
    assert f"{loss[int(sa)]:.{digits}f}" == a and f"{loss[int(sb)]:.{digits}f}" == b, loss
    assert f"{val[int(sv)]:.{digits}f}" == v, val
    answers = {s["prompt"]: s["completion"] for s in map(json.loads, (tmp_path / "run" / "samples.jsonl")
                                                         .read_text().splitlines()) if s["step"] == int(ss)}
    for op, text, answer in samples:
        prompt = next(p for p in answers if f"'{op}'" in p and p.endswith(text))
        assert answers[prompt].strip() == answer, (prompt, answers[prompt])
