"""`shardtune plan` as a user runs it: JSON contract, table labels, bad input, no torch import."""
import json
import sys

import pytest

from shardtune.cli import main
from shardtune.processes import run_bounded


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
    (["plan", "llama-3-8b", "--optimizer-impl", "fussed"], "did you mean 'fused'"),
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
            "with contextlib.redirect_stdout(io.StringIO()): rc = shardtune.cli.main(['plan', 'llama-3-70b', "
            "'--gpus', '8'])\n"
            "assert rc == 0, rc\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy")
    proc = run_bounded([sys.executable, "-c", code], timeout_s=50)
    assert proc.returncode == 0, proc.stderr


def test_recipe_is_planned_with_its_own_settings_and_flags_override(capsys):
    # The recipe's values, read here with plain YAML, must reach the planner; a flag wins over them.
    import yaml

    from shardtune.plan import plan
    from shardtune.strategies import normalize_ac

    path = "recipes/llama-3-8b-8xh100.yaml"
    r = yaml.safe_load(open(path))
    rc, out, _ = _run(["plan", path, "--gpus", "8", "--micro-batch", "1", "--json"], capsys)
    assert rc == 0
    got = json.loads(out)
    # the recipe's folder is not on this machine: it is planned as the architecture it names
    assert got["model"]["name"] == r["model"]["architecture"]
    assert got["inputs"]["seq_len"] == r["train"]["seq_len"]
    # the plan names the AC mode canonically (the recipe may spell layer AC `selective`, its old name)
    assert got["inputs"]["ac"] == normalize_ac(r["parallel"]["activation_checkpointing"])
    assert got["inputs"]["micro_batch"] == 1 != r["train"]["micro_batch"]
    by_hand = plan(r["model"]["architecture"], 8, seq_len=r["train"]["seq_len"], micro_batch=1,
                   grad_accum=r["train"]["grad_accum"], ac=r["parallel"]["activation_checkpointing"],
                   ac_every=r["parallel"]["ac_every"], precision=r["parallel"]["precision"],
                   optimizer_impl=r["optim"]["implementation"])
    want = {s.name: s.memory.total for s in by_hand.strategies}
    assert {s["name"]: s["memory"]["total"] for s in got["strategies"]} == want
    assert next(s for s in got["strategies"] if s["name"] == r["parallel"]["strategy"])["fits"]


@pytest.mark.parametrize("path", ["recipes/llama-3-8b-8xh100.yaml", "recipes/llama-3-70b-8xh100.yaml",
                                  "recipes/llama-3-70b-lora-8xh100.yaml", "recipes/llama-3-70b-bf16-8xh100.yaml"])
def test_shipped_big_recipes_fit_on_8_h100(path, capsys):
    import yaml

    strategy = yaml.safe_load(open(path))["parallel"]["strategy"]
    rc, out, _ = _run(["plan", path, "--gpus", "8", "--gpu", "h100-80gb", "--json"], capsys)
    assert rc == 0
    assert next(s for s in json.loads(out)["strategies"] if s["name"] == strategy)["fits"]


def test_pure_bf16_70b_recipe_states_are_8_bytes_per_param(capsys):
    """Pure bf16 AdamW: params 2 + grads 2 + m, v 2 + 2 bytes per parameter, sharded over 8
    (Ψ = 70,553,706,496 from Meta's config: 80 × 855,654,400 + 2 × 128,256 × 8,192 + 8,192);
    the stochastic-rounding step's temporary is 8 B × the largest shard, the embedding's
    128,256 / 8 rows × 8,192."""
    rc, out, _ = _run(["plan", "recipes/llama-3-70b-bf16-8xh100.yaml", "--gpus", "8", "--strategy", "zero3",
                       "--json"], capsys)
    assert rc == 0
    mem = json.loads(out)["strategies"][0]["memory"]
    psi = 80 * 855_654_400 + 2 * 128_256 * 8_192 + 8_192
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    assert states == pytest.approx(8 * psi / 8, rel=1e-4)  # FSDP2 pads dim 0: a few rows more
    assert mem["optimizer_step_temp"] == 8 * (128_256 // 8) * 8_192


@pytest.mark.parametrize("argv,expected", [
    (["--offload", "all", "--strategy", "ddp"], "needs an FSDP strategy"),
    (["--optimizer-impl", "bf16-stochastic"], "needs parallel.precision bf16"),
])
def test_combination_nothing_runs_is_one_line_exit_2(argv, expected, capsys):
    # rules.combination.check_combination, the rule `shardtune train` applies too: no empty tables
    assert main(["plan", "llama-3-8b", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and expected in err, err


def test_strategies_nothing_runs_are_omitted_with_a_note(capsys):
    assert main(["plan", "llama-3-8b", "--offload", "all", "--json"]) in (0, None)
    doc = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in doc["strategies"]] == ["zero2", "zero3", "hsdp"]
    assert any("ddp and zero1 omitted" in n for n in doc["notes"]), doc["notes"]
