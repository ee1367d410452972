"""The README's parquet tour, re-run from the command it shows (SmolLM2-135M, 2 CPU ranks, ~4 min
on a quiet 2-core machine): its figures (loss at the first logged step and the last, val_loss,
the sample answers) against what that command writes to metrics.jsonl and samples.jsonl today.
A long real-model run, so a benchmark and not a test (it was the e2e test test_readme_parquet_tour,
a quarter of `make test`'s e2e minutes); BENCHMARKS.md records its last run. Exit 1 when a figure
differs. Timings are stated as ranges and not checked.

    python -m shardtune.testing.smollm2          # once: the model folder under .cache/
    .venv/bin/python bench/readme_parquet_tour.py [--out runs/bench-parquet-tour]
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[1]


def readme_figures(readme: str):
    """(the tour's train command, its figures match, [(op, input, answer)]) as the README states them."""
    section = readme[readme.index("#### Your data: parquet"):]
    m = re.search(r"loss ([\d.]+) at step (\d+) → ([\d.]+) at step (\d+),\s+val_loss ([\d.]+) at step (\d+), and the "
                  r"samples at step (\d+): (.*?)\. `shardtune generate`", section, re.S)
    if not m:
        raise SystemExit("the parquet tour's figures sentence moved: update bench/readme_parquet_tour.py")
    samples = re.findall(r"`(\w+)` of \"([^\"]*)\" → \"([^\"]*)\"", m.group(8))
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    (train,) = [line for line in block.splitlines() if line.startswith("shardtune train ")]
    return train, m, samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-parquet-tour"), help="the run folder (replaced)")
    out = Path(ap.parse_args().out).resolve()
    train, m, samples = readme_figures((REPO / "README.md").read_text())
    argv = shlex.split(train.split("#")[0])
    argv[argv.index("--output-dir") + 1] = str(out)
    shutil.rmtree(out, ignore_errors=True)
    print("running:", shlex.join(argv), flush=True)
    proc = run_bounded([sys.executable, "-m", "shardtune.cli", *argv[1:]], timeout_s=3600, cwd=REPO)
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-3000:])
        return 1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}
    val = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    a, sa, b, sb, v, sv, ss = m.group(1, 2, 3, 4, 5, 6, 7)
    digits = len(a.split(".")[1])
    checks = [(f"loss at step {sa}", a, f"{loss[int(sa)]:.{digits}f}"),
              (f"loss at step {sb}", b, f"{loss[int(sb)]:.{digits}f}"),
              (f"val_loss at step {sv}", v, f"{val[int(sv)]:.{digits}f}")]
    answers = {s["prompt"]: s["completion"] for s in map(json.loads, (out / "samples.jsonl").read_text().splitlines())
               if s["step"] == int(ss)}
    for op, text, answer in samples:
        prompt = next(p for p in answers if f"'{op}'" in p and p.endswith(text))
        checks.append((f"sample at step {ss}: {op} of {text!r}", answer, answers[prompt].strip()))
    width = max(len(c[0]) for c in checks)
    print(f"{'figure':<{width}}  {'README':>12}  {'this run':>12}")
    for name, said, got in checks:
        print(f"{name:<{width}}  {said!r:>12}  {got!r:>12}  {'same' if said == got else 'DIFFERS'}")
    tok = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    if tok:
        print(f"tokens/s over the logged steps: {min(tok):.1f}–{max(tok):.1f} (2 CPU ranks; the README states a range)")
    return 0 if all(said == got for _, said, got in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
