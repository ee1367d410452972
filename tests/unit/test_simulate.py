"""`plan --simulate`: the analytic planner against the trainer's step traced on fake tensors.

The reduced model keeps Llama-3-8B's real widths (hidden 4096, 32 heads, 8 KV heads, FFN 14336,
vocabulary 128256) with 2 layers, at seq 512 and N = 8 (zero3, bf16-mixed, micro-batch 1).
Tolerances are the issue's: model states within 2 %, activations and peak within 10 %.
The simulator's own correctness against real tensors is tests/dist/test_simulate_vs_real.py.
"""
from __future__ import annotations

import json

import pytest

from shardtune.catalog.models import MODELS
from shardtune.cli import main

N = 8


def _reduced_8b() -> dict:
    cfg = dict(MODELS["llama-3-8b"]["config"])
    cfg["num_hidden_layers"] = 2
    return cfg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ac", ["none", "full"])
def test_analytic_within_tolerance_of_simulated_reduced_llama3_8b(ac):
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    sim = simulate_strategy(cfg, "zero3", N, seq_len=512, ac=ac)
    mem = plan(cfg, gpus=N, seq_len=512, ac=ac, strategies=["zero3"]).strategy("zero3").memory
    # the states also have a closed form (FSDP2: 4 B fp32 params, 4 B grads, 8 B Adam per
    # parameter, dim 0 padded to a multiple of N; (rows, row size) below): the trace must give it too
    h, v, f, kv, L = 4096, 128256, 14336, 1024, 2
    rows = [(v, h), (v, h), (h, 1)] + L * [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h, 1), (h, 1)]
    shard_numel = sum(-(-r // N) * c for r, c in rows)
    assert sim["params"] == 4 * shard_numel
    assert sim["grads"] == 4 * shard_numel
    assert abs(sim["optimizer"] - 8 * shard_numel) <= 8 * (len(rows) + 1)  # + the per-tensor `step` scalars
    for key in ("params", "grads", "optimizer"):
        assert getattr(mem, key) == pytest.approx(sim[key], rel=0.02), key
    for key in ("activations", "total"):
        assert getattr(mem, key) == pytest.approx(sim[key], rel=0.10), (key, getattr(mem, key), sim[key])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero1", marks=pytest.mark.xfail(
    strict=True, reason="since optim.implementation auto = fused (e7e15af) the zero1 total is 17 % above the "
    "traced step (18.96 vs 16.21 GB); not yet found")), "zero2"])
def test_analytic_within_tolerance_of_simulated_other_strategies(strategy):
    # ddp/zero1 train an fp32 model under torch.autocast (fp32 residual stream and norms), zero2
    # keeps every layer unsharded from forward to backward: different paths from zero3's
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    sim = simulate_strategy(cfg, strategy, N, seq_len=512)
    mem = plan(cfg, gpus=N, seq_len=512, strategies=[strategy]).strategy(strategy).memory
    for key in ("params", "grads", "optimizer"):
        assert getattr(mem, key) == pytest.approx(sim[key], rel=0.02), key
    for key in ("activations", "total"):
        assert getattr(mem, key) == pytest.approx(sim[key], rel=0.10), (key, getattr(mem, key), sim[key])


@pytest.mark.timeout(60)
def test_fake_process_group_is_torn_down_and_strategies_trace_in_one_process():
    import torch.distributed as dist

    from shardtune.verify.simulate import simulate_strategy

    a = simulate_strategy("tiny-llama", "zero3", 4, seq_len=32)
    b = simulate_strategy("tiny-llama", "ddp", 4, seq_len=32)
    assert not dist.is_initialized()
    # hand derivation: ddp holds every parameter; zero3 a quarter (tiny-llama's dims divide by 4)
    assert b["params"] == 4 * a["params"]
    assert a["total"] < b["total"]


@pytest.mark.parametrize("argv,reason", [
    (["--offload", "all"], "offload all"),
    (["--lora-rank", "8"], "LoRA"),
    (["--optimizer", "sgd"], "optimizer sgd"),
])
def test_untraceable_option_falls_back_to_analytic_in_one_line(argv, reason, capsys):
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--simulate", "--json", *argv])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot trace" in lines[0] and reason in lines[0], err
    doc = json.loads(out)
    for s in doc["strategies"]:
        assert s["simulated"]["status"] == "analytic fallback"
        assert s["memory"]["total"] > 0  # the analytic plan is still there


@pytest.mark.timeout(120)
def test_cli_simulate_json_has_simulated_memory_keys(capsys):
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "64", "--strategy", "zero2", "--simulate", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    s = json.loads(out)["strategies"][0]
    assert s["simulated"]["status"] == "traced"
    assert set(s["memory"]) <= set(s["simulated"])
    assert s["simulated"]["params"] == s["memory"]["params"]  # FSDP2 shard bytes: both exact


def test_plan_table_shows_simulated_beside_analytic(capsys):
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "64", "--strategy", "zero3", "--simulate"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "Analytic vs simulated" in out and "Δ sim vs analytic" in out


@pytest.mark.timeout(120)
def test_grad_accum_2_traces_with_grads_kept_across_micro_batches():
    # train_step with grad_accum 2 runs the root module's forward twice under one tracker, which
    # torch's trackers refused ("multiple iterative calls"). FSDP2 accumulates into the sharded
    # grads, so the first micro-batch's grads are alive through the second one.
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    one = simulate_strategy(cfg, "zero3", N, seq_len=512, grad_accum=1)
    two = simulate_strategy(cfg, "zero3", N, seq_len=512, grad_accum=2)
    for key in ("params", "grads", "optimizer", "activations"):  # per micro-batch: the same
        assert two[key] == pytest.approx(one[key], rel=1e-4), key
    # Both peaks are the end of backward (the root group's reduce-scatter). By hand: the root's own
    # fp32 grad shard (embedding and LM head: ceil(128256/8) rows of 4096, the norm: 4096/8) is
    # not there yet with one micro-batch (zero_grad(set_to_none=True) freed it; the reduce-scatter
    # makes it), but is there with two: the first micro-batch made it.
    root_shard_bytes = 4 * (2 * -(-128256 // N) * 4096 + 4096 // N)
    assert one["breakdown_at_peak"]["Sharded Grad"] == one["grads"] - root_shard_bytes
    assert two["breakdown_at_peak"]["Sharded Grad"] == two["grads"]
    assert two["total"] - one["total"] == pytest.approx(root_shard_bytes, rel=1e-4)
    mem = plan(cfg, gpus=N, seq_len=512, grad_accum=2, strategies=["zero3"]).strategy("zero3").memory
    assert mem.total == pytest.approx(two["total"], rel=0.10)


@pytest.mark.timeout(120)
def test_cli_simulate_grad_accum_2_traces_every_strategy(capsys):
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "32", "--grad-accum", "2", "--simulate", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "cannot trace" not in err, err
    for s in json.loads(out)["strategies"]:
        assert s["simulated"]["status"] == "traced", (s["name"], s["simulated"])
        assert s["simulated"]["params"] == s["memory"]["params"], s["name"]


@pytest.mark.timeout(120)
def test_ddp_grad_accum_2_holds_a_second_copy_of_the_grads():
    # DDP (gradient_as_bucket_view=True): zero_grad(set_to_none=True) drops the bucket views, so
    # the no_sync micro-batch accumulates into fresh grads; the last backward copies them into the
    # buckets, which stay allocated: by hand, two copies of the fp32 grads at the peak.
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    sim = simulate_strategy(cfg, "ddp", N, seq_len=512, grad_accum=2)
    assert sim["grads"] == 4 * sum(p for p in _reduced_8b_numels())
    assert sim["breakdown_at_peak"]["Gradient"] == 2 * sim["grads"]
    mem = plan(cfg, gpus=N, seq_len=512, grad_accum=2, strategies=["ddp"]).strategy("ddp").memory
    assert mem.total == pytest.approx(sim["total"], rel=0.10)


def _reduced_8b_numels() -> list[int]:
    h, v, f, kv = 4096, 128256, 14336, 1024
    layer = [h * h, kv * h, kv * h, h * h, f * h, f * h, h * f, h, h]
    return [v * h, v * h, h] + 2 * layer
