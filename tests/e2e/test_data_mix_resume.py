"""A mixed run (`data.sources`: two weighted sources in two formats) through the real CLI:
8 steps on 2 processes uninterrupted, then its step-4 checkpoint resumed on 1 and on 3 processes
(same global batch). Every resumed step's loss equals the uninterrupted run's (the same rows of each
source in the same order), and the step-8 checkpoints hold the same position of every source."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import shardtune_cli

pytestmark = [pytest.mark.e2e]
GLOBAL_BATCH = 6  # rows per step: 2 × 3, 1 × 6, 3 × 2
RECIPE = """
name: mix
model: {name: tiny-llama}
data:
  tokenizer: byte
  packing: false
  sources:
    - {path: @A@, weight: 2}
    - {path: @B@, weight: 1, format: alpaca}
parallel: {strategy: zero3, precision: fp32}
optim: {lr: 0.003, warmup_steps: 2}
train: {micro_batch: 3, seq_len: 64, max_steps: 8, timeout_s: 60}
checkpoint: {every: 4, keep: 2}
"""


def _write_sources(tmp: Path) -> tuple[Path, Path]:
    a, b = tmp / "a.jsonl", tmp / "b.jsonl"
    # distinct rows, so a row from the wrong place or the wrong source changes the step's loss
    a.write_text("".join(json.dumps({"text": f"row {i} of a: {'xyz'[i % 3] * (i % 7 + 1)} {i * 37 % 101}"}) + "\n"
                         for i in range(40)))
    b.write_text("".join(json.dumps({"instruction": f"reverse {i * 13 % 97}", "input": "",
                                     "output": str(i * 13 % 97)[::-1]}) + "\n" for i in range(12)))
    return a, b


def _train(tmp: Path, out: str, nproc: int, *args: str) -> Path:
    proc = shardtune_cli("train", tmp / "recipe.yaml", "--nproc", nproc, "--output-dir", tmp / out,
                         f"train.micro_batch={GLOBAL_BATCH // nproc}", *args, timeout_s=150,
                         env={"XDG_CACHE_HOME": str(tmp / "xdg")})  # the default tokenised cache, shared by the runs
    assert proc.returncode == 0, proc.stdout[-3000:]
    return tmp / out


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("loss") is not None}


def _data_position(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step_{step}" / "trainer.json").read_text())["data"]


@pytest.mark.timeout(420)
def test_mixed_run_resumed_at_another_world_size_continues_every_source(tmp_path):
    a, b = _write_sources(tmp_path)
    (tmp_path / "recipe.yaml").write_text(RECIPE.replace("@A@", str(a)).replace("@B@", str(b)))
    ref = _train(tmp_path, "ref", 2)
    want = _losses(ref)
    assert sorted(want) == list(range(1, 9))
    ref_pos = _data_position(ref, 8)
    # 48 rows drawn: both sources used; b (12 rows) is read past its end, so its epoch wraps
    consumed = [s["consumed"] for s in ref_pos["sources"]]
    assert sum(consumed) == 8 * GLOBAL_BATCH and min(consumed) > 0
    step4 = ref / "checkpoints" / "step_4"
    for nproc in (1, 3):
        run = _train(tmp_path, f"resumed{nproc}", nproc, "--resume", str(step4))
        got = _losses(run)
        assert sorted(got) == [5, 6, 7, 8], (nproc, got)  # resumed at step 4, not started afresh
        for step in (5, 6, 7, 8):
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (nproc, step, got, want)
        assert _data_position(run, 8) == ref_pos, nproc
    assert len([p for p in (tmp_path / "xdg" / "shardtune" / "data").iterdir() if p.is_dir()]) == 2  # one a source
    # the resumed steps are not a flat curve that any rows would give: the data moved the loss
    assert len({round(want[s], 3) for s in (5, 6, 7, 8)}) == 4
