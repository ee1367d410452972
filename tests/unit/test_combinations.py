"""rules.combination.check_combination: the one rule of what can run, shared by train, plan and plan --fit.

Each refused case is one the trainer really cannot run (config.py / parallel/ / train/core/optim.py
say why); each accepted case is one a tests/dist parity test runs."""
from __future__ import annotations

import pytest

from shardtune.errors import UserError
from shardtune.rules.combination import check_combination


@pytest.mark.parametrize("strategy,kw,expected", [
    ("ddp", dict(offload="all"), "needs an FSDP strategy"),
    ("zero1", dict(offload="all"), "needs an FSDP strategy"),
    ("zero3", dict(quantize_base="nf4"), "needs LoRA adapters"),
    ("zero3", dict(lora_rank=8, quantize_base="int3"), "unknown quantize_base"),
    ("ddp", dict(optimizer="adamw-8bit", optimizer_impl="fused"), "leave it 'auto'"),
    ("zero3", dict(optimizer_impl="bf16-stochastic"), "needs parallel.precision bf16"),
    ("zero3", dict(precision="fp32", optimizer_impl="bf16-stochastic"), "not 'fp32'"),
    ("zero3", dict(hsdp_shard_size=2), "applies to hsdp only"),
    ("zero3", dict(offload="optimizer"), "planner-only"),
    ("zero3", dict(optimizer="sgd"), "planner-only"),
    ("zero3", dict(device="tpu"), "unknown device"),
    ("zero3", dict(ac_every=0), "ac_every"),
    ("fsdp3", {}, "unknown strategy"),
])
def test_refused_combinations_are_one_line(strategy, kw, expected):
    with pytest.raises(UserError) as e:
        check_combination(strategy, **kw)
    msg = str(e.value)
    assert expected in msg and "\n" not in msg, msg


@pytest.mark.parametrize("strategy,kw", [
    ("zero3", {}), ("ddp", dict(optimizer="adamw-8bit")), ("zero1", dict(optimizer="adamw-8bit")),
    ("zero3", dict(optimizer="adamw-8bit")), ("zero2", dict(optimizer="adamw-8bit")),
    ("zero3", dict(precision="bf16", optimizer_impl="bf16-stochastic")), ("zero3", dict(offload="all")),
    ("hsdp", dict(hsdp_shard_size=2)), ("ddp", dict(optimizer_impl="for-loop", device="cpu")),
    ("FULL_SHARD", dict(lora_rank=8, activation_checkpointing="selective", ac_every=3)),
    ("zero3", dict(lora_rank=8, quantize_base="nf4", compile=True)),  # tests/e2e/test_effective.py
])
def test_combinations_the_trainer_runs_pass(strategy, kw):
    check_combination(strategy, **kw)


def test_planner_modes_accept_what_ifs_with_their_own_rules():
    check_combination("zero2", offload="optimizer", planner_modes=True)
    check_combination("zero3", optimizer="sgd", planner_modes=True)
    with pytest.raises(UserError, match="ZeRO stage"):  # DeepSpeed's offload needs ZeRO ≥ 1
        check_combination("ddp", offload="optimizer", planner_modes=True)
    with pytest.raises(UserError, match="leave it 'auto'"):
        check_combination("zero3", optimizer="sgd", optimizer_impl="fused", planner_modes=True)


@pytest.mark.parametrize("strategy,package", [("zero3", "torchao"), ("hsdp", "torchao"), ("zero2", "torchao"),
                                              ("ddp", "bitsandbytes"), ("zero1", "bitsandbytes")])
def test_adamw_8bit_without_its_package_is_one_line(monkeypatch, strategy, package):
    """FSDP strategies run torchao's AdamW8bit, ddp/zero1 bitsandbytes': the missing one is named."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    from shardtune.train.launcher.preflight import check_environment

    with pytest.raises(UserError, match=f"needs {package} "):
        check_environment(strategy, optimizer="adamw-8bit")
    check_environment(strategy)  # adamw needs neither
    check_combination(strategy, optimizer="adamw-8bit")  # the combination runs where the package is


def test_pure_bf16_adamw_8bit_under_fsdp_is_refused_by_train_and_plan():
    """torchao's compiled 8-bit step fails on bf16 DTensor shards (measured through shardtune train):
    the one rule refuses it for train and plan alike; bf16-mixed and ddp's bitsandbytes stay allowed."""
    for strategy in ("zero2", "zero3", "hsdp"):
        with pytest.raises(UserError, match="pure bf16 weights fails in torchao"):
            check_combination(strategy, precision="bf16", optimizer="adamw-8bit")
        check_combination(strategy, precision="bf16-mixed", optimizer="adamw-8bit")
    check_combination("ddp", precision="bf16", optimizer="adamw-8bit")


def test_ac_every_without_layer_ac_is_refused_by_plan_as_by_train():
    """`parallel.ac_every` only acts under layer AC: the trainer refused it with AC full while `plan`
    planned it (the rule lived in ParallelConfig); now check_combination holds it for both."""
    from shardtune.config import load_recipe  # noqa: PLC0415
    from shardtune.plan import plan  # noqa: PLC0415

    with pytest.raises(UserError, match="applies to activation_checkpointing=layer only"):
        load_recipe(None, ["parallel.ac_every=3", "parallel.activation_checkpointing=full"])
    with pytest.raises(UserError, match="applies to activation_checkpointing=layer only"):
        check_combination("zero3", activation_checkpointing="full", ac_every=3)
    with pytest.raises(UserError, match="applies to activation_checkpointing=layer only"):
        plan("llama-3-8b", 8, ac="full", ac_every=3)  # every strategy refused: one line, no empty plan
    assert plan("llama-3-8b", 8, ac="layer", ac_every=3).strategy("zero3").fits  # where it acts
    check_combination("zero3", activation_checkpointing="layer", ac_every=3)  # where it acts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("train_args, plan_args, needle", [
    (["lora.target_modules=[q_proj]"], ["--lora-target-modules", "q_proj"], "need lora.rank > 0"),
    (["lora.rank=4", "lora.target_modules=[self_attn.q_proj]"],
     ["--lora-rank", "4", "--lora-target-modules", "self_attn.q_proj"], "must be module names"),
    (["lora.rank=4", "lora.target_modules=[nope]"], ["--lora-rank", "4", "--lora-target-modules", "nope"], "nope"),
])
def test_bad_lora_targets_are_refused_by_train_and_plan(monkeypatch, capsys, tmp_path, train_args, plan_args, needle):
    """LoRA targets without a rank (once planned and trained as a full fine-tune, silently), a dotted
    name (once planned, refused by train), a module the model lacks: one line, exit 2, no process,
    no run folder, from `shardtune train` and `shardtune plan` alike."""
    from _cli import REPO, refused_before_any_process  # noqa: PLC0415

    run = tmp_path / "run"
    assert needle in refused_before_any_process(monkeypatch, capsys, [
        "train", REPO / "recipes" / "tiny-cpu.yaml", "--nproc", "2", "--output-dir", run, *train_args])
    assert needle in refused_before_any_process(monkeypatch, capsys, ["plan", "tiny-llama", "--gpus", "2", *plan_args])
    assert not run.exists()
