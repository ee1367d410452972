"""`shardtune train` as a user runs it: a real 2-process zero3 run of the demo recipe, and bad
inputs that must be refused (exit 2, one line) before any process starts."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _sigint_run import signalled

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(300)
def test_tiny_cpu_recipe_trains_on_two_processes(shared_run):
    """`shardtune train recipes/tiny-cpu.yaml --nproc 2 --max-steps 40` (its text, through the
    session's shared run: test_two_hosts.py compares its first losses with a two-node run)."""
    out, proc = shared_run(RECIPE.read_text(), "--max-steps", "40", nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for name in ("config.yaml", "plan.json", "metrics.jsonl", "memory.json"):
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_mem_bytes"):
        assert key in records[0], key
    assert records[0]["mfu"] is None  # CPU: no GPU peak to compare with
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, (records[0]["loss"], records[-1]["loss"])
    memory = json.loads((out / "memory.json").read_text())
    assert len(memory["per_rank"]) == 2
    assert records[-1]["peak_mem_bytes"] == max(r["peak_bytes"] for r in memory["per_rank"])
    assert json.loads((out / "plan.json").read_text())["strategies"][0]["name"] == "zero3"


BAD = [
    (["--strategy", "zero9"], "unknown strategy"),
    (["--strategy", "hsdp", "parallel.hsdp_shard_size=3"], "does not divide the world size 2"),
    (["train.micro_batch=0"], "micro_batch"),
    (["train.seq_len=1"], "seq_len"),
    (["model.name=/nonexistent/model_dir"], "/nonexistent/model_dir"),
    (["train.lr=1e-3"], "did you mean 'optim.lr'"),
    (["data.path=/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
    (["--precision", "fp8"], "unknown precision"),
    (["--output-dir", "/proc/shardtune-cannot-write"], "cannot be written"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_exit_2_one_line_before_any_process(monkeypatch, capsys, args, needle):
    from shardtune import cli

    def no_process(*a, **k):
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    rc = cli.main(["train", str(RECIPE), "--nproc", "2", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_torchrun_and_every_worker(tmp_path_factory, sig):
    """Ctrl-C (SIGINT) or SIGTERM to `shardtune train` mid-run leaves no process behind; SIGINT exits
    130 (so `train && export` stops), SIGTERM 0 (a preemption), each after saving. The runs are the
    session's (tests/e2e/_sigint_run.py: only the signal ends them; test_launcher_signals.py reads
    the SIGINT one too)."""
    r = signalled(tmp_path_factory, sig)
    assert r.running_before, "no torchrun / worker processes found while training"
    # SIGINT's ranks forked from torchrun's agent (no GPU here), SIGTERM's each an interpreter of its own
    # (2 ranks, and each rank's watcher, forked from it, shows its command line)
    assert (r.exec_ranks() >= 2) if sig == signal.SIGTERM else (r.exec_ranks() == 0), r.commands
    # the ranks save; the launcher exits 0 after SIGTERM (a preemption is not a failure) and 130 after
    # Ctrl-C (docs/checkpoints.md)
    assert r.rc == (130 if sig == signal.SIGINT else 0), r.text[-3000:]
    stopped = r.stopped()  # the launcher passes the signal on to the group
    assert stopped["signal"] == sig.name and Path(stopped["checkpoint"]).is_dir()
    assert r.left_after == []


# the flags each entry point must offer, written out here (not read from config/flags.py)
EXPECTED_FLAGS = {"--strategy": "parallel.strategy", "--precision": "parallel.precision",
                  "--max-steps": "train.max_steps", "--seed": "train.seed", "--output-dir": "output_dir",
                  "--checkpoint-every": "checkpoint.every", "--keep": "checkpoint.keep",
                  "--resume": "checkpoint.resume", "--lora-rank": "lora.rank"}


def test_train_help_lists_every_flag_with_its_help():
    from typer.testing import CliRunner

    from shardtune.cli import app
    from shardtune.config.flags import TRAIN_FLAGS

    out = CliRunner().invoke(app, ["train", "--help"], terminal_width=400).output
    for option in [*EXPECTED_FLAGS, "--nproc", "--max-restarts"]:
        assert option in out, option
    for f in TRAIN_FLAGS:
        assert " ".join(f.help.split()[:3]) in " ".join(out.split()), f.name


def test_a_bad_fork_setting_is_one_line_before_any_process(monkeypatch, capsys, tmp_path):
    """SHARDTUNE_FORK_RANKS is 0 or 1; anything else is refused, not read as "fork"."""
    from _cli import refused_before_any_process

    monkeypatch.setenv("SHARDTUNE_FORK_RANKS", "yes")
    run = tmp_path / "run"
    err = refused_before_any_process(monkeypatch, capsys, ["train", RECIPE, "--nproc", "2", "--output-dir", run])
    assert "SHARDTUNE_FORK_RANKS='yes'" in err and not run.exists(), err


def test_flags_reach_the_same_keys_from_typer_argparse_and_torchrun():
    from shardtune.train.__main__ import parse_args
    from shardtune.train.launcher.supervise import flag_overrides, torchrun_command

    given = {"strategy": "zero2", "precision": "fp32", "max_steps": 5, "seed": 3, "output_dir": "/tmp/x",
             "checkpoint_every": 2, "keep": 1, "resume": "never", "lora_rank": 4}
    want = ['parallel.strategy="zero2"', 'parallel.precision="fp32"', "train.max_steps=5", "train.seed=3",
            'output_dir="/tmp/x"', "checkpoint.every=2", "checkpoint.keep=1", 'checkpoint.resume="never"',
            "lora.rank=4"]
    assert flag_overrides(**given) == want
    cmd = torchrun_command(2, "r.yaml", ["optim.lr=1"], given)
    assert cmd[-1] == "optim.lr=1" and cmd[cmd.index("r.yaml") - 1] == "shardtune.train"
    args = parse_args(cmd[cmd.index("r.yaml"):])  # what torchrun hands each rank parses back
    assert args.recipe == "r.yaml" and args.overrides == ["optim.lr=1"]
    assert {k: getattr(args, k) for k in given} == given
    assert set(EXPECTED_FLAGS) == {a for a in cmd[cmd.index("r.yaml"):] if a.startswith("--")}
    forked = torchrun_command(2, "r.yaml", ["optim.lr=1"], given, fork=True)  # the ranks: train/__main__.py
    script = forked[forked.index("r.yaml") - 1]
    assert "--start-method=fork" in forked and Path(script) == REPO / "shardtune" / "train" / "__main__.py"
    assert forked[forked.index("r.yaml"):] == cmd[cmd.index("r.yaml"):]


@pytest.mark.timeout(240)
def test_finished_run_rerun_is_a_no_op_and_a_second_run_is_refused(tmp_path):
    """Issue 14 item 4 / issue 15 item 3 through the real CLI: the re-run of a finished run rewrites
    nothing; `--resume never` over its checkpoints is refused before torchrun."""
    out = tmp_path / "run"
    base = [sys.executable, "-m", "shardtune.cli", "train", str(RECIPE), "--nproc", "1", "--max-steps", "2",
            "--output-dir", str(out), "checkpoint.export_hf=false", "data.generated_examples=200"]
    first = run_bounded(base, timeout_s=200, cwd=REPO, stderr=subprocess.STDOUT)
    assert first.returncode == 0, first.stdout[-3000:]
    assert not (out / "shardtune.lock").exists()
    before = sorted((p, p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file())
    again = run_bounded(base, timeout_s=60, cwd=REPO)
    assert again.returncode == 0 and "already complete at step 2" in again.stdout, (again.stdout, again.stderr)
    fresh = run_bounded(base + ["--resume", "never"], timeout_s=60, cwd=REPO)
    assert fresh.returncode == 2 and len(fresh.stderr.strip().splitlines()) == 1, fresh.stderr
    assert "--move-aside" in fresh.stderr
    assert sorted((p, p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()) == before
