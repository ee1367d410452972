"""A tampered or damaged checkpoint through the training entry points (issue 15 items 1 and 2):
`shardtune train` with resume auto and with --resume PATH (refused in the launcher, before any
process starts), `python -m shardtune.train` by hand (refused inside the rank by the safe reader),
and a gadget among the non-tensor values that only a rank's `torch.load(weights_only=True)` sees.
Each: exit 2, one `shardtune: error` line, no traceback, the sentinel file never created. Every
tampered file's size and CRC-32 are re-recorded, as an attacker would, so the checksums pass and
the reader's allow-list is what must refuse. One training run (shared with test_bad_checkpoints),
four more launches.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _runs import CKPT_RECIPE, REPO

from shardtune.processes import run_bounded
from shardtune.train.durable import integrity

pytestmark = [pytest.mark.e2e]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _popen_payload(marker: Path) -> bytes:
    """Protocol 4 STACK_GLOBAL through a DCP module to subprocess.Popen(["touch", marker]) (issue 15)."""
    enc = lambda s: pickle.SHORT_BINUNICODE + bytes([len(s)]) + s.encode()  # noqa: E731
    return (pickle.PROTO + bytes([4]) + enc("torch.distributed.checkpoint.metadata")
            + enc("torch._strobelight.cli_function_profiler.subprocess.Popen") + pickle.STACK_GLOBAL
            + pickle.MARK + enc("touch") + enc(str(marker)) + pickle.LIST + pickle.TUPLE1 + pickle.REDUCE
            + pickle.STOP)


def _rerecord(ckpt: Path, *names: str) -> None:
    meta = json.loads((ckpt / "shardtune_checkpoint.json").read_text())
    for name in names:
        meta["files"][name] = [(ckpt / name).stat().st_size, integrity.crc32_file(ckpt / name)]
    (ckpt / "shardtune_checkpoint.json").write_text(json.dumps(meta))


def _tamper_metadata(ckpt: Path, payload: bytes) -> None:
    (ckpt / ".metadata").write_bytes(payload)
    _rerecord(ckpt, ".metadata")


def _tamper_a_value(ckpt: Path, marker: Path) -> str:
    """A torch.save'd gadget appended to a .distcp file; the (legitimate) metadata points a non-tensor
    value (the lr of param group 0) at it. Returns the value's key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from shardtune.train.durable.safe_load import read_dcp_metadata

    md = read_dcp_metadata(ckpt / ".metadata")
    key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata) and "lr" in k)
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    target = ckpt / info.relative_path
    offset = target.stat().st_size
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    with open(target, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    _rerecord(ckpt, ".metadata", info.relative_path)
    return key


@pytest.fixture(scope="module")
def run(shared_one_process_run) -> Path:
    """4 steps, checkpoints step_2 and step_4 (_runs.CKPT_RECIPE), shared with test_bad_checkpoints; read-only."""
    return shared_one_process_run(CKPT_RECIPE)


@pytest.fixture
def copy(run, tmp_path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    shutil.copy(run.parent / "recipe.yaml", tmp_path / "recipe.yaml")
    return tmp_path / "run"


def _one_line(err: str, needle: str) -> None:
    errors = [line for line in err.splitlines() if line.startswith("shardtune: error")]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in err, err


def _train(copy: Path, *args: str) -> int:
    from shardtune import cli

    return cli.main(["train", str(copy.parent / "recipe.yaml"), "--output-dir", str(copy), "--max-steps", "6",
                     *args])


@pytest.mark.timeout(120)
def test_launcher_refuses_a_tampered_checkpoint_before_any_process(copy, tmp_path, capsys):
    marker = tmp_path / "pwned"
    ckpts = copy / "checkpoints"
    before = sorted(p.name for p in ckpts.iterdir())
    _tamper_metadata(ckpts / "step_4", pickle.dumps(_Evil(marker), protocol=2))
    assert _train(copy) == 2  # resume auto: the newest checkpoint
    _one_line(capsys.readouterr().err, "refusing to load it")
    _tamper_metadata(ckpts / "step_2", _popen_payload(marker))
    assert _train(copy, "--resume", str(ckpts / "step_2")) == 2
    _one_line(capsys.readouterr().err, "refusing to load it")
    assert not marker.exists()
    assert sorted(p.name for p in ckpts.iterdir()) == before and not (copy / "segments").exists()


@pytest.mark.timeout(120)
def test_launcher_refuses_a_resume_path_whose_file_sizes_differ_from_its_manifest(copy, capsys):
    shard = sorted((copy / "checkpoints" / "step_2").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    assert _train(copy, "--resume", str(copy / "checkpoints" / "step_2")) == 2
    _one_line(capsys.readouterr().err, f"{shard.name} has {shard.stat().st_size} bytes")


@pytest.mark.timeout(300)  # two starts; one took > 60 s at load 18 on 2 cores
def test_a_rank_refuses_a_tampered_checkpoint_and_a_gadget_value(copy, tmp_path):
    """By hand (`python -m shardtune.train`, no launcher check): the rank's reader refuses the
    tampered step_4 (resume auto); then step_4 is made legitimate again but for one non-tensor
    value, which only torch.load(weights_only=True) in the rank sees."""
    marker = tmp_path / "pwned"
    step4 = copy / "checkpoints" / "step_4"
    pristine = tmp_path / "step_4.pristine"
    shutil.copytree(step4, pristine)
    _tamper_metadata(step4, _popen_payload(marker))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "shardtune.train", str(copy.parent / "recipe.yaml"), "--output-dir", str(copy),
           "--max-steps", "6"]
    proc = run_bounded(cmd, timeout_s=130, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    _one_line(proc.stderr, "refusing to load it")
    shutil.rmtree(step4)
    shutil.copytree(pristine, step4)
    key = _tamper_a_value(step4, marker)
    proc = run_bounded([sys.executable, "-m", "shardtune.cli", "train", str(copy.parent / "recipe.yaml"),
                        "--output-dir", str(copy), "--max-steps", "6", "--nproc", "1"], timeout_s=150, cwd=REPO,
                       env=env, stderr=subprocess.PIPE)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _one_line(proc.stderr, f"checkpoint value {key!r} is not plain data")
    assert not marker.exists()


@pytest.mark.timeout(180)
def test_a_rank_names_the_changed_settings_and_refuses_a_breaking_one(copy):
    """By hand (a multi-node script runs so: no launcher check), the ranks apply the launcher's
    rule: a changed data seed cannot continue the checkpoint (one line, exit 2); a changed
    learning rate resumes and is named with its old and new value."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "shardtune.train", str(copy.parent / "recipe.yaml"), "--output-dir", str(copy),
           "--max-steps", "5"]
    proc = run_bounded([*cmd, "data.generated_seed=7"], timeout_s=90, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    _one_line(proc.stderr, "data.generated_seed 1234 → 7 would not continue that run")
    proc = run_bounded([*cmd, "optim.lr=0.0005"], timeout_s=120, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(step 4," in proc.stdout and "changed: optim.lr 0.0003 → 0.0005" in proc.stdout, proc.stdout
