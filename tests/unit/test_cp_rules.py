"""Context parallelism's layout and rules (layout.Layout with cp, rules.cp.check_cp, the KV-head
repeat) and the config refusing what cp was not made to work with: one line each."""
from __future__ import annotations

import pytest

from shardtune.config import load_recipe
from shardtune.errors import UserError
from shardtune.layout import Layout
from shardtune.rules.combination import check_combination
from shardtune.rules.cp import check_cp, kv_repeat


@pytest.mark.parametrize("strategy, world, per_node, tp, cp, shard, mesh, dp", [
    ("zero3", 4, 4, 1, 2, None, (1, 1, 2, 2, 1), 2),  # dp 2 x cp 2
    ("zero3", 2, 2, 1, 2, None, (1, 1, 1, 2, 1), 1),
    ("zero2", 4, 4, 2, 2, None, (1, 1, 1, 2, 2), 1),  # tp 2 x cp 2
    ("hsdp", 16, 8, 2, 2, None, (1, 2, 2, 2, 2), 4),  # shard group: 8 per node / (tp x cp)
    ("hsdp", 8, 8, 1, 2, 2, (1, 2, 2, 2, 1), 4),
])
def test_layout_with_cp(strategy, world, per_node, tp, cp, shard, mesh, dp):
    lay = Layout.build(strategy, world, per_node, shard, tp=tp, cp=cp)
    assert lay.mesh_axes == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert lay.mesh_shape == mesh and lay.dp == dp
    assert lay.replicate_degree * lay.shard_degree * lay.cp * lay.tp == world
    assert lay.fsdp_shard_degree == lay.shard_degree * cp


def test_cp_1_keeps_its_size_1_dimension():
    assert Layout.build("zero3", 4, 4).mesh_shape == (1, 1, 4, 1, 1)
    assert Layout.build("zero3", 4, 4, tp=2).mesh_shape == (1, 1, 2, 1, 2)


LLAMA = {"num_attention_heads": 32, "num_key_value_heads": 8}


@pytest.mark.parametrize("kwargs, needle", [
    (dict(cp=0), "not a positive integer"),
    (dict(cp=4, world_size=6), "cp 4 does not divide the world size 6"),
    (dict(cp=2, tp=2, world_size=6), "tp x cp = 4 does not divide the world size 6"),
    (dict(cp=4, seq_len=66), "train.seq_len 66 over cp 4"),
    (dict(cp=2, tp=4, seq_len=68), "cp x tp = 8"),
    (dict(cp=3, hf=LLAMA), "does not divide the model's 32 attention heads"),
    (dict(cp=8, tp=8, hf=LLAMA), "4 query heads per tp rank"),
    (dict(cp=2, quantize_base="nf4"), "NF4"),
])
def test_check_cp_refusals_are_one_line(kwargs, needle):
    with pytest.raises(UserError) as e:
        check_cp(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_cp_refuses_non_fsdp_strategies(strategy):
    """The strategy's part of the rule (strategies.py), through both of its callers."""
    for call in (lambda: check_combination(strategy, cp=2), lambda: Layout.build(strategy, 4, 4, cp=2)):
        with pytest.raises(UserError) as e:
            call()
        assert "composes with FSDP2 strategies" in str(e.value) and f"not {strategy!r}" in str(e.value)
        assert "\n" not in str(e.value)


def test_check_cp_accepts():
    check_cp(1, quantize_base="nf4")  # cp 1: nothing to check
    check_combination("ddp", cp=1, compile=True)
    check_cp(2, world_size=4, seq_len=64, hf=LLAMA)
    # once refused as untried: tests/e2e/test_effective.py's cp 2 run with all three gives one process's losses
    check_combination("zero3", cp=2, compile=True, offload="all", optimizer="adamw-8bit")
    check_combination("zero3", cp=2)
    check_cp(2, tp=2, world_size=4, seq_len=64, hf=LLAMA)  # (32 / 2) / 2 heads each
    check_cp(8, tp=2, world_size=16, seq_len=64, hf=LLAMA)  # KV heads 8 / 2 = 4 < cp 8: repeated
    check_cp(2, tp=2, seq_len=66, sequence_parallel=False)  # no SP: the sequence splits over cp only


@pytest.mark.parametrize("kv, q, cp, r", [(4, 16, 2, 1), (4, 16, 8, 2), (2, 16, 8, 4), (1, 4, 4, 4),
                                          (3, 6, 2, 2), (4, 4, 2, 1)])
def test_kv_repeat_makes_cp_divide_the_kv_heads(kv, q, cp, r):
    assert kv_repeat(kv, q, cp) == r
    assert (kv * r) % cp == 0 and (q // kv) % r == 0


@pytest.mark.parametrize("overrides, needle", [
    (["parallel.cp=2", "parallel.strategy=ddp"], "composes with FSDP2"),
    (["parallel.cp=2", "train.seq_len=65"], "train.seq_len 65"),
    (["parallel.activation_offload=true", "train.compile=true"], "activation_offload does not compose"),
    (["parallel.activation_offload=true", "parallel.offload=all"], "offload 'all'"),
])
def test_config_refuses_in_one_line(overrides, needle):
    with pytest.raises(UserError) as e:
        load_recipe("recipes/tiny-cpu.yaml", overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_config_accepts_cp_and_activation_offload():
    cfg = load_recipe("recipes/tiny-cpu.yaml", ["parallel.cp=2", "parallel.activation_offload=true"])
    assert cfg.parallel.cp == 2 and cfg.plan_inputs()["cp"] == 2 and cfg.plan_inputs()["activation_offload"]


def test_a_resume_keeps_the_global_batch_over_data_parallel_ranks():
    """Saved at cp 2 on 4 ranks (dp 2, micro 4: 8 rows); resumed on 4 ranks at cp 1 (dp 4), micro 1:
    grad_accum 2; at tp 2 x cp 2 on 4 ranks (dp 1), micro 4: grad_accum 2; at cp 2 on 8 ranks (dp 4),
    micro 4: one line naming the --nproc that fit (multiples of cp)."""
    from types import SimpleNamespace

    from shardtune.train.launcher.rerun import keep_global_batch

    old = load_recipe("recipes/tiny-cpu.yaml", ["parallel.cp=2", "train.micro_batch=4"])
    info = SimpleNamespace(world_size=4)
    new = load_recipe("recipes/tiny-cpu.yaml", ["train.micro_batch=1"])
    assert keep_global_batch(info, old, new, 4, []) == ["train.grad_accum=2"]
    new = load_recipe("recipes/tiny-cpu.yaml", ["parallel.tp=2", "parallel.cp=2", "train.micro_batch=4"])
    assert keep_global_batch(info, old, new, 4, []) == ["train.grad_accum=2"]
    with pytest.raises(UserError, match="--nproc 2 or 4,"):
        keep_global_batch(info, old, load_recipe("recipes/tiny-cpu.yaml", ["parallel.cp=2", "train.micro_batch=4"]),
                          8, [])


@pytest.mark.timeout(120)
def test_compiled_cp_with_attention_dropout_is_refused_by_train_and_launch(monkeypatch, capsys, tmp_path):
    """parallel/cp.py's compiled attention recomputes the forward in its backward, so a dropout mask
    would differ: a model folder with attention dropout, cp 2 and train.compile is one line, exit 2,
    before any process (train and launch); without compile, or without cp, it is accepted."""
    import json

    from _cli import REPO, refused_before_any_process

    from shardtune.catalog.models import MODELS

    folder = tmp_path / "dropout"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**MODELS["tiny-llama"]["config"], "attention_dropout": 0.1}))
    recipe, args = REPO / "recipes" / "tiny-cpu.yaml", [f"model.name={folder}", "parallel.cp=2", "train.compile=true"]
    needle = "does not compose with train.compile with the model's attention dropout 0.1"
    assert needle in refused_before_any_process(monkeypatch, capsys, [
        "train", recipe, "--output-dir", tmp_path / "run", "--nproc", "2", *args])
    assert needle in refused_before_any_process(monkeypatch, capsys, [
        "launch", "slurm", recipe, "--nodes", "1", "--gpus-per-node", "2", *args])
    hf = {**MODELS["tiny-llama"]["config"], "attention_dropout": 0.1}
    check_cp(2, hf=hf)  # eager cp draws its masks in the forward it differentiates
    check_cp(1, hf=hf, compile=True)
