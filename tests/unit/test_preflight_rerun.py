"""Run-folder ownership (train/launcher/runlock.py) and re-run / resume decisions (train/launcher/rerun.py), on run
folders laid out by hand as the trainer writes them (docs/checkpoints.md)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardtune.config import dump_config, load_recipe
from shardtune.errors import UserError
from shardtune.train.durable.ckpt_files import config_hash
from shardtune.train.launcher.rerun import check_rerun
from shardtune.train.launcher.runlock import LOCK_FILE, RunLock


def test_second_run_refused_naming_holder_stale_lock_taken_over(tmp_path, capsys):
    with RunLock(tmp_path):
        with pytest.raises(UserError) as e:
            RunLock(tmp_path).acquire()
        assert f"pid {os.getpid()} on {socket.gethostname()}" in str(e.value)
    assert not (tmp_path / LOCK_FILE).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "start_time": 0}))
    lock = RunLock(tmp_path).acquire()
    assert f"stale lock of pid {dead.pid}" in capsys.readouterr().err
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "another-host", "start_time": 0}))
    with pytest.raises(UserError, match="in use by pid 1 on another-host"):
        RunLock(tmp_path).acquire()


def _finished_run(tmp_path, steps=5):
    """A run folder as a finished `max_steps=steps` run leaves it: config.yaml + a complete checkpoint."""
    run = tmp_path / "run"
    cfg = load_recipe(None, [f"output_dir={run}", f"train.max_steps={steps}"])
    ck = run / "checkpoints" / f"step_{steps}"
    ck.mkdir(parents=True)
    # DCP's own files, one process, one small tensor: the launcher checks the shard against .metadata
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.zeros(3)}, checkpoint_id=ck)
    (ck / "shardtune_checkpoint.json").write_text(json.dumps(
        {"complete": True, "step": steps, "world_size": 2, "strategy": "zero3", "config_hash": config_hash(cfg)}))
    (ck / "trainer.json").write_text(json.dumps({"step": steps, "tokens_seen": 0, "data": None, "scheduler": {}}))
    (run / "config.yaml").write_text(dump_config(cfg))
    return run


def _snapshot(run):
    return sorted((str(p.relative_to(run)), p.read_bytes()) for p in run.rglob("*") if p.is_file())


def test_finished_run_rerun_is_a_no_op_and_changes_are_named(tmp_path, capsys):
    run = _finished_run(tmp_path)
    before = _snapshot(run)
    msg = check_rerun(load_recipe(None, [f"output_dir={run}", "train.max_steps=5"]))
    assert "already complete at step 5" in msg
    assert check_rerun(load_recipe(None, [f"output_dir={run}", "train.max_steps=8"])) is None
    assert "train.max_steps 5 → 8" in capsys.readouterr().out
    with pytest.raises(UserError, match="train.seq_len 128 → 64") as e:
        check_rerun(load_recipe(None, [f"output_dir={run}", "train.max_steps=8", "train.seq_len=64"]))
    assert "--output-dir" in str(e.value) and "\n" not in str(e.value)
    assert _snapshot(run) == before  # nothing read was written


@pytest.mark.parametrize(("override", "named"), [
    ("data.chat_template=chatml", "data.chat_template None → chatml"),
    ("data.system_prompt=Be brief.", "data.system_prompt None → Be brief."),
    ("data.shuffle=false", "data.shuffle True → False"),
    ("data.columns={prompt: q, response: a}", "data.columns.prompt None → q"),
])
def test_resume_with_another_token_stream_is_refused(tmp_path, override, named):
    """Settings that change the token stream or its order: the saved data position would point into
    another stream, so the resume is refused naming the change (a train_on_inputs change is not:
    same tokens, other loss mask)."""
    run = _finished_run(tmp_path)
    before = _snapshot(run)
    with pytest.raises(UserError, match="would not continue that run") as e:
        check_rerun(load_recipe(None, [f"output_dir={run}", "train.max_steps=8", override]))
    assert named in str(e.value), str(e.value)
    assert _snapshot(run) == before
    assert check_rerun(load_recipe(None, [f"output_dir={run}", "train.max_steps=8", "data.train_on_inputs=true"])) \
        is None


def test_fresh_start_over_checkpoints_refused_unless_moved_aside(tmp_path, capsys):
    run = _finished_run(tmp_path)
    fresh = load_recipe(None, [f"output_dir={run}", "checkpoint.resume=never"])
    with pytest.raises(UserError, match="--move-aside"):
        check_rerun(fresh)
    before = {name: data for name, data in _snapshot(run)}
    assert check_rerun(fresh, move_old=True) is None
    assert "moved the earlier run" in capsys.readouterr().out
    (aside,) = run.glob("previous-*")
    assert {str(p.relative_to(aside)): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before
    assert not (run / "checkpoints").exists()


def test_checkpoint_of_another_model_refused_before_launch(tmp_path):
    run = _finished_run(tmp_path)
    hf = run / "checkpoints" / "step_5" / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32}))
    before = _snapshot(run)
    with pytest.raises(UserError, match="another model") as e:  # tiny-llama: hidden 128, 4 layers
        check_rerun(load_recipe(None, [f"output_dir={run}", "train.max_steps=8"]))
    assert "hidden_size 4096 → 128" in str(e.value)
    assert _snapshot(run) == before


def test_signal_stop_is_read_from_stopped_json_of_this_launch_only(tmp_path, capsys):
    import time

    from shardtune.train.launcher.supervise import stopped_by_signal

    assert stopped_by_signal(tmp_path, 0.0) is None
    (tmp_path / "stopped.json").write_text(json.dumps({"step": 7, "signal": "SIGTERM", "checkpoint": "c/step_7"}))
    assert stopped_by_signal(tmp_path, time.time() + 60) is None  # written before this launch: not ours
    assert stopped_by_signal(tmp_path, 0.0) == 0  # preemption: a clean stop
    assert "stopped on SIGTERM after saving step 7" in capsys.readouterr().err
    (tmp_path / "stopped.json").write_text(json.dumps({"step": 7, "signal": "SIGINT", "checkpoint": "c/step_7"}))
    assert stopped_by_signal(tmp_path, 0.0) == 130  # Ctrl-C: the shell's code, so `train && export` stops
