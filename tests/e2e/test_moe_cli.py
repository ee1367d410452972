"""`shardtune train recipes/tiny-moe-cpu.yaml` as a user runs it: a tiny Mixtral (4 experts, top-2,
grouped-GEMM experts, fp32 router) under zero3, zero2 with AC full, hsdp, and zero3 with expert
parallelism (`--ep 2`: 2 experts a rank, tokens sent by all-to-all) on 2 processes, and ep 2 x
expert-FSDP 2 on 4 processes (2 rows each, the same global batch), each giving one
process's losses over 4 fp32 steps (same 8-row global batch), its load-balancing loss (`aux_loss`)
and its expert load (`expert_load_cv`) included. The runs are made once for the module."""
from __future__ import annotations

from pathlib import Path

import pytest
from _cli import REPO, metrics, shardtune_cli

pytestmark = [pytest.mark.e2e]
RECIPE = REPO / "recipes" / "tiny-moe-cpu.yaml"
RUNS = {
    "one": ["--nproc", "1", "train.micro_batch=8"],
    "zero3": ["--nproc", "2"],
    "zero2_ac": ["--nproc", "2", "--strategy", "zero2", "parallel.activation_checkpointing=full"],
    "hsdp": ["--nproc", "2", "--strategy", "hsdp", "parallel.hsdp_shard_size=1"],
    "ep2": ["--nproc", "2", "--ep", "2"],
    # ep 2 x expert-FSDP 2: each expert's states on 2 ranks, its gradient summed on the wire then divided
    "ep2_efsdp2": ["--nproc", "4", "--ep", "2", "train.micro_batch=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    tmp: Path = tmp_path_factory.mktemp("moe")
    out = {}
    for name, args in RUNS.items():
        proc = shardtune_cli("train", RECIPE, "--output-dir", tmp / name, *args, timeout_s=240)
        assert proc.returncode == 0, proc.stdout[-3000:]
        out[name] = (metrics(tmp / name), proc.stdout)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["zero3", "zero2_ac", "hsdp", "ep2", "ep2_efsdp2"])
def test_two_processes_give_one_process_losses_aux_loss_and_load(runs, layout):
    one, _ = runs["one"]
    got, _ = runs[layout]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for key in ("loss", "aux_loss", "expert_load_cv", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in one], abs=1e-5), key


@pytest.mark.timeout(900)
def test_the_moe_run_learns_and_logs_its_terms(runs):
    one, log = runs["one"]
    assert one[-1]["loss"] < one[0]["loss"] - 0.5
    # aux = E · Σ f·P: 1 when the router is uniform and balanced, up to E; near 2 from a random init
    assert all(1.0 <= r["aux_loss"] <= 4.0 for r in one)
    assert all(r["expert_load_cv"] > 0 for r in one)  # top-2 of 4 random routers is never exactly even
    assert "experts grouped_mm" in log


@pytest.mark.timeout(900)
def test_ep_says_what_it_ran(runs, tmp_path_factory):
    """memory.json's `effective` and the start-up line: ep 2, each expert's states on one rank (expert
    FSDP degree 2 ranks / ep 2); without --ep, ep 1 and the experts sharded over both ranks."""
    import json

    _, log = runs["ep2"]
    assert "experts grouped_mm (4 per layer, top-2, ep 2, expert_fsdp 1)" in log
    base = tmp_path_factory.getbasetemp()
    eff = {n: json.loads(next(base.glob(f"moe*/{n}/memory.json")).read_text())["effective"]
           for n in ("ep2", "zero3", "ep2_efsdp2")}
    assert (eff["ep2"]["ep"], eff["ep2"]["expert_fsdp"]) == (2, 1)
    assert (eff["ep2_efsdp2"]["ep"], eff["ep2_efsdp2"]["expert_fsdp"]) == (2, 2)
    assert (eff["zero3"]["ep"], eff["zero3"]["expert_fsdp"]) == (1, 2)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["ep2", "ep2_efsdp2"])
def test_ep_states_per_rank_equal_the_planners(runs, tmp_path_factory, name):
    """Each rank's parameter, gradient and optimizer bytes (the trainer's storage count, memory.json)
    equal plan.json's (plan/ep.py: experts E/ep rows over expert-FSDP ranks, the rest over all)."""
    import json

    run = next(tmp_path_factory.getbasetemp().glob(f"moe*/{name}"))
    planned = json.loads((run / "plan.json").read_text())["strategies"][0]
    assert planned["layout"]["ep"] == 2
    for rank in json.loads((run / "memory.json").read_text())["per_rank"]:
        for key in ("params", "grads", "optimizer"):
            assert rank[f"{key}_bytes"] == planned["memory"][key], key
