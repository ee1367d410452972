"""Tensor parallelism's layout and checks (layout.Layout, check_tp_model, the combination rule)
and `shardtune train --tp` refusing what cannot run: one line, exit 2, before any process starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import refused_before_any_process

from shardtune.catalog.models import resolve_model_config
from shardtune.errors import UserError
from shardtune.layout import Layout
from shardtune.rules.combination import check_combination
from shardtune.rules.tp import check_tp_model

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


@pytest.mark.parametrize("strategy, world, per_node, tp, shard, mesh", [
    ("zero3", 8, 8, 2, None, (1, 1, 4, 1, 2)),  # dp 4, all sharded
    ("zero2", 4, 4, 4, None, (1, 1, 1, 1, 4)),
    ("hsdp", 16, 8, 2, None, (1, 2, 4, 1, 2)),  # shard group: one node's 8 ranks / tp 2 = 4 dp ranks
    ("hsdp", 8, 8, 2, 2, (1, 2, 2, 1, 2)),
    ("zero3", 4, 4, 1, None, (1, 1, 4, 1, 1)),  # tp 1: the same 5-D mesh, tp's dimension of size 1
])
def test_layout_degrees_and_mesh(strategy, world, per_node, tp, shard, mesh):
    lay = Layout.build(strategy, world, per_node, shard, tp=tp)
    assert lay.mesh_shape == mesh
    assert lay.dp == world // tp
    assert lay.replicate_degree * lay.shard_degree * lay.tp == world
    assert lay.mesh_axes == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert lay.sequence_parallel == (tp > 1)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(strategy_name="zero3", world_size=6, tp=4), "tp 4 does not divide the world size 6"),
    (dict(strategy_name="ddp", world_size=4, tp=2), "composes with FSDP2 strategies"),
    (dict(strategy_name="zero1", world_size=4, tp=2), "not 'zero1'"),
    (dict(strategy_name="zero3", world_size=16, gpus_per_node=8, tp=16), "exceeds the 8 GPUs of a node"),
        (dict(strategy_name="zero3", world_size=12, gpus_per_node=6, tp=4), "would straddle two nodes"),
    (dict(strategy_name="hsdp", world_size=8, tp=2, hsdp_shard_size=3), "data-parallel degree 4"),
    (dict(strategy_name="zero3", world_size=4, tp=0), "not a positive integer"),
])
def test_layout_refusals_are_one_line(kwargs, needle):
    with pytest.raises(UserError) as e:
        Layout.build(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_tp_across_nodes_when_the_user_insists():
    assert Layout.build("zero3", 16, 8, tp=16, tp_across_nodes=True).mesh_shape == (1, 1, 1, 1, 16)


def test_model_checks_name_what_tp_does_not_divide():
    hf = resolve_model_config("tiny-llama")  # 4 heads, 2 KV heads, intermediate 344, vocab 264
    check_tp_model(2, hf, 64)
    for tp, seq, needle in ((4, 64, "KV heads"), (8, 64, "attention heads"), (3, 63, "attention heads"),
                            (2, 63, "seq_len 63")):
        with pytest.raises(UserError, match=needle):
            check_tp_model(tp, hf, seq)
    check_tp_model(2, hf, 63, sequence_parallel=False)  # no SP: any length
    with pytest.raises(UserError, match="intermediate size"):
        check_tp_model(2, {**hf, "intermediate_size": 345}, 64)
    with pytest.raises(UserError, match="vocabulary"):
        check_tp_model(2, {**hf, "vocab_size": 265}, 64)
    check_tp_model(2, {**hf, "tie_word_embeddings": True}, 64)  # tied: one Shard(0) weight (e2e/test_tied_export.py)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(lora_rank=8, quantize_base="nf4"), "QLoRA's NF4 base"),
    (dict(loss_chunks=8), "loss_chunks 8"),
    (dict(strategy="ddp"), "'ddp'"),
])
def test_what_tp_does_not_compose_with_is_refused_by_the_one_rule(kwargs, needle):
    strategy = kwargs.pop("strategy", "zero3")
    if kwargs.get("quantize_base") and __import__("importlib").util.find_spec("torchao") is None:
        pytest.skip("torchao absent: the NF4 check fires first")
    with pytest.raises(UserError, match=needle):
        check_combination(strategy, tp=2, **kwargs)
    check_combination(strategy if strategy != "ddp" else "zero3", tp=1, **{k: v for k, v in kwargs.items()
                                                                          if k != "quantize_base"})


def test_compile_offload_and_8bit_adamw_compose_with_tp():
    # refused as untried until tests/e2e/test_effective.py's tp 2 run with all three gave one process's losses
    check_combination("zero3", tp=2, compile=True, offload="all", optimizer="adamw-8bit")


def test_config_keys_and_flag():
    from shardtune.config import load_recipe
    from shardtune.config.flags import flag_overrides

    cfg = load_recipe(RECIPE, flag_overrides(tp=2))
    assert cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel is True
    assert load_recipe(RECIPE, ["parallel.sequence_parallel=false"]).parallel.sequence_parallel is False
    # sample prompts run under tp (each forward padded to a multiple of tp: tests/e2e/test_sample_prompts.py)
    assert load_recipe(RECIPE, ["parallel.tp=2", "train.sample_prompts=[hi]"]).train.sample_prompts == ["hi"]


BAD = [
    (["--nproc", "3", "--tp", "2"], "tp 2 does not divide the world size 3"),
    (["--nproc", "4", "--tp", "4"], "KV heads"),
    (["--nproc", "2", "--tp", "2", "--strategy", "ddp"], "'ddp'"),
    (["--nproc", "2", "--tp", "2", "train.seq_len=127"], "seq_len 127"),
    (["--nproc", "4", "--tp", "2", "--strategy", "hsdp", "parallel.hsdp_shard_size=4"], "data-parallel degree 2"),
]


@pytest.mark.parametrize("objective", ["dpo", "simpo"])
def test_plan_takes_a_pair_objective_under_tp_as_train_does(capsys, objective):
    # both were refused under tp until the pair step ran vocabulary-parallel (tests/e2e/test_dpo_tp_cp.py)
    from shardtune import cli

    rc = cli.main(["plan", "llama-3-8b", "--gpus", "8", "--tp", "2", "--strategy", "zero3", "--objective", objective,
                   "--json"])
    assert rc == 0
    mem = json.loads(capsys.readouterr().out)["strategies"][0]["memory"]
    # dpo: the frozen copy is sharded as the policy is (zero3 x tp 2), in the compute dtype (bf16: half of
    # the fp32 masters' bytes); simpo has no reference
    assert mem["reference"] * 2 == mem["params"] if objective == "dpo" else mem["reference"] == 0, mem


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", BAD, ids=[b[1] for b in BAD])
def test_train_refuses_before_any_process(monkeypatch, capsys, tmp_path, args, needle):
    err = refused_before_any_process(monkeypatch, capsys, ["train", RECIPE, "--output-dir", tmp_path / "run", *args])
    assert needle in err


def test_a_resume_keeps_the_global_batch_over_data_parallel_ranks():
    """Saved at tp 2 on 4 ranks (dp 2, micro 4: 8 rows); resumed on 4 ranks at tp 1 (dp 4) with
    micro 1: grad_accum 2; at tp 2 on 4 ranks: nothing changes; at tp 2 on 8 ranks (dp 4), micro 4:
    one line naming the --nproc that fit."""
    from types import SimpleNamespace

    from shardtune.config import load_recipe
    from shardtune.train.launcher.rerun import keep_global_batch

    old = load_recipe(RECIPE, ["parallel.tp=2", "train.micro_batch=4"])
    info = SimpleNamespace(world_size=4)
    assert keep_global_batch(info, old, load_recipe(RECIPE, ["train.micro_batch=1"]), 4, []) == ["train.grad_accum=2"]
    assert keep_global_batch(info, old, load_recipe(RECIPE, ["parallel.tp=2", "train.micro_batch=1"]), 4, []) == []
    with pytest.raises(UserError, match="--nproc 2 or 4,"):  # dp 1 or 2 at tp 2: 8 rows of micro 4
        keep_global_batch(info, old, load_recipe(RECIPE, ["parallel.tp=2", "train.micro_batch=4"]), 8, [])


def test_a_tp_run_uses_and_reports_one_loss_chunk_whatever_the_vocabulary():
    # under tp the loss is vocabulary-parallel on the whole logits; the effective line once said the
    # vocabulary's default (8 for Llama-3's 128,256 ids) while the step ran 1
    from shardtune.config import load_recipe
    from shardtune.rules.loss import default_loss_chunks
    from shardtune.train.core.step import StepOptions

    assert default_loss_chunks(128_256) > 1
    assert StepOptions.from_config(load_recipe(RECIPE, ["parallel.tp=2"]), 128_256).loss_chunks == 1
    assert StepOptions.from_config(load_recipe(RECIPE, []), 128_256).loss_chunks == default_loss_chunks(128_256)
