"""Checkpoints damaged by hand, with their checksums rewritten to match (so only the reader's own
checks stand), through every entry point that reads one: `shardtune export`, `shardtune generate`,
`shardtune train --resume PATH` and `shardtune train` (resume auto). Each is exit 2, one line, before
any process starts (torchrun forbidden here), and the checkpoint is left byte for byte. A cut or
zeroed shard in a run with an older intact checkpoint: resume auto falls back to it, in the
launcher and in the ranks.

Two one-process runs shared with the other checkpoint files (`shared_one_process_run`:
_runs.CKPT_RECIPE_2_STEPS, and CKPT_RECIPE's 4 steps with checkpoints at 2 and 4) give the
checkpoints; every case edits a copy.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from _runs import CKPT_RECIPE, CKPT_RECIPE_2_STEPS, REPO

pytestmark = [pytest.mark.e2e]
META = "shardtune_checkpoint.json"


def _meta(**changes):
    return lambda m: m.update(changes)


def _files(edit):
    return lambda m: edit(m["files"])


# (name, metadata edit, files written over, files removed, entry points that must refuse, words in the line)
CASES = [
    ("metadata not JSON", "{bad", {}, (), "all", META),
    ("metadata a list", "[1]", {}, (), "all", "complete: true"),
    ("complete is text", _meta(complete="yes"), {}, (), "all", "complete: true"),
    ("step is text", _meta(step="two"), {}, (), "all", "step is 'two'"),
    ("negative step", _meta(step=-3), {}, (), "all", "step is -3"),
    ("world size 0", _meta(world_size=0), {}, (), "all", "world_size is 0"),
    ("saved_at is text", _meta(saved_at="yesterday"), {}, (), "all", "saved_at"),
    ("run_id a number", _meta(run_id=3), {}, (), "all", "run_id is 3"),
    ("unknown strategy", _meta(strategy="zero9"), {}, (), "all", "strategy 'zero9'"),
    ("newer format", _meta(format=99), {}, (), "all", "format 99"),
    ("file list is text", _meta(files="abc"), {}, (), "all", "file list"),
    ("file entry is text", _files(lambda f: f.update({"__0_0.distcp": "x"})), {}, (), "all", "file list entry"),
    ("file list leaves the folder", _files(lambda f: f.update({"../../../etc/hostname": [1, "0"]})), {}, (), "all",
     "outside the checkpoint"),
    (".metadata removed", None, {}, (".metadata",), "all", ".metadata is missing"),
    (".metadata truncated", None, {".metadata": lambda b: b[:100]}, (), "all", ".metadata"),
    ("shard truncated", None, {"__0_0.distcp": lambda b: b[:1000]}, (), "all", "(cut short?)"),
    ("shard zeroed", None, {"__0_0.distcp": lambda b: bytes(len(b))}, (), "all", "no torch.save archive at byte 0"),
    ("shard's last item zeroed", None, {"__0_0.distcp": lambda b: b[:-22] + bytes(22)}, (), "all",
     "no torch.save archive"),
    ("hf/config.json not JSON", None, {"hf/config.json": lambda b: b"{bad"}, (), "export", "config.json"),
    ("trainer.json not JSON", None, {"trainer.json": lambda b: b"{bad"}, (), "train", "trainer.json"),
    ("trainer.json of another step", None, {"trainer.json": lambda b: b'{"step": 7}'}, (), "train", "step 7"),
    ("rng state not base64", None, {"rng_rank0.json": lambda b: b'{"cpu": [1, 2]}'}, (), "train", "rng_rank0"),
]


@pytest.fixture(scope="module")
def run(shared_one_process_run) -> Path:
    """A run whose only (and final) checkpoint is step_2; read-only."""
    return shared_one_process_run(CKPT_RECIPE_2_STEPS)


def _damaged(run: Path, root: Path, meta_edit, writes: dict, drops, step: int = 2) -> Path:
    """A copy of the run whose step_<step> has the damage, its checksums rewritten to match."""
    from shardtune.train.durable import integrity

    copy = root / "run"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / f"step_{step}"
    for name in drops:
        (ckpt / name).unlink()
    for name, change in writes.items():
        (ckpt / name).write_bytes(change((ckpt / name).read_bytes()))
    meta = json.loads((ckpt / META).read_text())
    for name in meta["files"]:
        if (ckpt / name).is_file():
            meta["files"][name] = [(ckpt / name).stat().st_size, integrity.crc32_file(ckpt / name)]
    if callable(meta_edit):
        meta_edit(meta)
    (ckpt / META).write_text(meta_edit if isinstance(meta_edit, str) else json.dumps(meta))
    return copy


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, meta_edit, writes, drops, where, needle", CASES, ids=[c[0] for c in CASES])
def test_a_damaged_checkpoint_is_one_line_everywhere_and_left_as_it_was(run, tmp_path, monkeypatch, capsys, name,
                                                                      meta_edit, writes, drops, where, needle):
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    monkeypatch.setattr(commands, "run_process_group",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("torchrun started")))
    copy = _damaged(run, tmp_path, meta_edit, writes, drops)
    ckpt = copy / "checkpoints" / "step_2"
    (tmp_path / "recipe.yaml").write_text(CKPT_RECIPE)  # 4 steps: step_2 is resumed
    before = _snapshot(copy / "checkpoints")
    entries = {
        "export": ["export", str(ckpt), str(tmp_path / "out")],
        "generate": ["generate", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2"],
        "train --resume": ["train", str(tmp_path / "recipe.yaml"), "--output-dir", str(copy), "--resume", str(ckpt)],
        "train auto": ["train", str(tmp_path / "recipe.yaml"), "--output-dir", str(copy)],
    }
    chosen = {"all": entries, "read": ["export", "generate"], "export": ["export"],
              "train": ["train --resume", "train auto"]}[where]
    failures = []
    for entry in chosen:
        rc = cli.main(entries[entry])
        err = capsys.readouterr().err.strip().splitlines()
        if rc != 2 or len(err) != 1 or not err[0].startswith("shardtune: error") or needle not in err[0]:
            failures.append((entry, rc, err[-3:]))
    assert not failures, failures
    assert _snapshot(copy / "checkpoints") == before
    assert not (tmp_path / "out").exists()


def test_an_export_into_its_own_checkpoint_is_refused(run, capsys):
    from shardtune import cli

    ckpt = run / "checkpoints" / "step_2"
    before = _snapshot(ckpt)
    assert cli.main(["export", str(ckpt), str(ckpt / "model")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "inside the checkpoint" in err[0], err
    assert _snapshot(ckpt) == before


@pytest.fixture(scope="module")
def two_checkpoints(shared_one_process_run) -> Path:
    """A finished 4-step run with checkpoints step_2 and step_4; read-only."""
    return shared_one_process_run(CKPT_RECIPE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", [lambda b: b[:1000], lambda b: bytes(len(b))], ids=["truncated", "zeroed"])
def test_resume_auto_falls_back_past_a_damaged_shard_in_the_launcher_and_the_ranks(two_checkpoints, tmp_path,
                                                                                    monkeypatch, capsys, damage):
    from shardtune import cli
    from shardtune.processes import run_bounded
    from shardtune.train.launcher import supervise as commands

    copy = _damaged(two_checkpoints, tmp_path, None, {"__0_0.distcp": damage}, (), step=4)
    recipe = tmp_path / "recipe.yaml"  # steps 3 to 5, saved at 3 and 5: step_4 stays as it is
    recipe.write_text(CKPT_RECIPE.replace("max_steps: 4", "max_steps: 5").replace("{every: 2, keep: 3}",
                                                                                 "{every: 3, keep: 4}"))
    before = _snapshot(copy / "checkpoints" / "step_4")
    launched = []
    monkeypatch.setattr(commands, "run_process_group", lambda *a, **k: launched.append(a) or 0)
    assert cli.main(["train", str(recipe), "--output-dir", str(copy)]) == 0, capsys.readouterr()
    assert launched  # the launcher let it start: step_2 is intact
    # the ranks, by hand (no launcher check): skip step_4, naming why, and resume from step_2
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = run_bounded([sys.executable, "-m", "shardtune.train", str(recipe), "--output-dir", str(copy)],
                       timeout_s=150, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipping {copy / 'checkpoints' / 'step_4'}: __0_0.distcp" in proc.stderr, proc.stderr[-3000:]
    assert f"resuming from {copy / 'checkpoints' / 'step_2'}" in proc.stdout + proc.stderr
    assert _snapshot(copy / "checkpoints" / "step_4") == before


@pytest.mark.timeout(300)
def test_a_finished_run_whose_last_checkpoint_is_damaged_trains_its_last_steps_again(two_checkpoints, tmp_path,
                                                                                      monkeypatch, capsys):
    """resume auto decides "already complete" on the checkpoint the ranks will load, not on a damaged
    newest one they would skip: the re-run resumes from step_2 instead of doing nothing."""
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    recipe = tmp_path / "recipe.yaml"  # the finished run's own settings
    recipe.write_text(CKPT_RECIPE)
    launched = []
    monkeypatch.setattr(commands, "run_process_group", lambda *a, **k: launched.append(a) or 0)
    intact = tmp_path / "intact"
    shutil.copytree(two_checkpoints, intact)
    assert cli.main(["train", str(recipe), "--output-dir", str(intact)]) == 0
    assert "already complete at step 4" in capsys.readouterr().out and not launched
    copy = _damaged(two_checkpoints, tmp_path, None, {"__0_0.distcp": lambda b: b[:1000]}, (), step=4)
    assert cli.main(["train", str(recipe), "--output-dir", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "already complete" not in out and launched, out
