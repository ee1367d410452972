"""`shardtune plan` as a user runs it: JSON contract, table labels, bad input, no torch import."""
import json
import sys

import pytest

from shardtune.cli import main
from shardtune.testing.proc import run_bounded


def _run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_contract(capsys):
    rc, out, err = _run(["plan", "llama-3-70b", "--gpus", "8", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["model"]["params"] == 70_553_706_496
    assert d["model"]["trainable_params"] == 70_553_706_496
    assert [s["name"] for s in d["strategies"]] == ["ddp", "zero1", "zero2", "zero3", "hsdp"]
    for s in d["strategies"]:
        assert set(s["memory"]) >= {"params", "grads", "optimizer", "activations", "buffers", "total"}
        assert all(isinstance(v, int) for v in s["memory"].values())
        assert isinstance(s["fits"], bool) and isinstance(s["comm_bytes_per_step"], int)
    z3 = next(s for s in d["strategies"] if s["name"] == "zero3")
    assert z3["memory"]["params"] == 4 * 70_553_706_496 // 8  # fp32 master shards, no padding needed here


def test_zero_figure1_through_the_cli(capsys):
    rc, out, err = _run(["plan", "--params", "7.5e9", "--gpus", "64", "--accounting", "paper", "--json"], capsys)
    assert rc == 0, err
    totals = {s["name"]: round(s["memory"]["total"] / 1e9, 1) for s in json.loads(out)["strategies"]}
    assert [totals[k] for k in ("ddp", "zero1", "zero2", "zero3")] == [120.0, 31.4, 16.6, 1.9]


def test_table_labels_units(capsys):
    rc, out, err = _run(["plan", "llama-3-8b", "--gpus", "8", "--ac", "full"], capsys)
    assert rc == 0, err
    assert "GiB (2^30 bytes)" in out and "GB (10^9 bytes)" in out
    assert "verdict: fits:" in out and "zero3" in out


def test_offload_reports_cpu_ram(capsys):
    rc, out, err = _run(["plan", "llama-3-70b", "--gpus", "8", "--offload", "all", "--ac", "full"], capsys)
    assert rc == 0, err
    assert "CPU RAM per node" in out


@pytest.mark.parametrize("argv,fragment", [
    (["plan", "llama-3-70", "--gpus", "8"], "did you mean"),
    (["plan", "llama-3-8b", "--gpu", "h100"], "unknown GPU"),
    (["plan", "llama-3-8b", "--gpus", "0"], "--gpus 0"),
    (["plan", "llama-3-8b", "--seq-len", "-5"], "--seq-len"),
    (["plan", "llama-3-8b", "--micro-batch", "0"], "--micro-batch"),
    (["plan", "--params", "-1"], "--params"),
    (["plan", "--params", "1e20"], "--params"),
    (["plan", "llama-3-8b", "--gpus", "8", "--hsdp-shard-size", "3"], "does not divide"),
    (["plan", "llama-3-8b", "--gpus", "8", "--nodes", "2", "--gpus-per-node", "8"], "--nodes 2"),
    (["plan", "llama-3-8b", "--params", "7e9"], "not both"),
    (["plan", "llama-3-8b", "--precision", "fp8"], "unknown precision"),
    (["plan", "llama-3-8b", "--gpus", "12"], "--gpus-per-node"),
    (["plan", "llama-3-8b", "--lora-rank", "100000"], "--lora-rank"),
    (["plan", "llama-3-8b", "--reserve-gib", "500"], "reserve"),
    (["plan", "llama-3-8b", "--gpus", "abc"], "--gpus"),
])
def test_bad_input_is_one_line_exit_2(argv, fragment, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardtune: error:"), err
    assert fragment in lines[0]
    assert "Traceback" not in err


def test_malformed_config_json(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    rc, _, err = _run(["plan", str(bad)], capsys)
    assert rc == 2 and "malformed config.json" in err and len(err.strip().splitlines()) == 1
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    rc, _, err = _run(["plan", str(tmp_path)], capsys)  # a model folder holding it
    assert rc == 2 and "num_attention_heads" in err


def test_local_config_folder_plans(tmp_path, capsys):
    from shardtune.catalog.models import resolve_model_config

    (tmp_path / "config.json").write_text(json.dumps(resolve_model_config("tiny-llama")))
    rc, out, err = _run(["plan", str(tmp_path), "--gpus", "2", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["model"]["params"] > 0


@pytest.mark.timeout(60)
def test_plan_path_imports_no_torch():
    code = ("import sys, io, contextlib; import shardtune.cli; from shardtune.plan import plan; "
            "plan('llama-3-70b', 8)\n"
            "with contextlib.redirect_stdout(io.StringIO()): rc = shardtune.cli.main(['plan', 'llama-3-70b', '--gpus', '8'])\n"
            "assert rc == 0, rc\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy")
    proc = run_bounded([sys.executable, "-c", code], timeout_s=50)
    assert proc.returncode == 0, proc.stderr
