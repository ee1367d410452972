"""Recipe loading and validation: aliases, overrides, one-line errors, world-size checks, recipes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.config import (
    RunConfig,
    check_model,
    check_output_dir,
    dump_config,
    load_recipe,
    preflight,
    validate_for_world,
)
from shardtune.errors import UserError

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _err(overrides, path=None) -> str:
    with pytest.raises(UserError) as e:
        load_recipe(path, overrides)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_defaults_and_overrides_parse_as_yaml():
    cfg = load_recipe(None, ["optim.lr=3e-4", "train.micro_batch=2", "data.packing=false",
                             "optim.betas=[0.9, 0.99]", "output_dir=/tmp/x"])
    assert cfg.optim.lr == 3e-4 and cfg.train.micro_batch == 2 and cfg.data.packing is False
    assert cfg.optim.betas == (0.9, 0.99) and str(cfg.run_dir) == "/tmp/x"
    assert load_recipe(None).run_dir == Path("runs/run")


@pytest.mark.parametrize("alias,name", [("FULL_SHARD", "zero3"), ("ShardingStrategy.SHARD_GRAD_OP", "zero2"),
                                        ("NO_SHARD", "ddp"), ("hybrid_shard", "hsdp"), ("ZeRO3", "zero3")])
def test_fsdp1_strategy_aliases(alias, name):
    assert load_recipe(None, [f"parallel.strategy={alias}"]).parallel.strategy == name


def test_recipe_file_name_and_override_order(tmp_path):
    p = tmp_path / "my-run.yaml"
    p.write_text("train:\n  micro_batch: 3\nparallel:\n  strategy: FULL_SHARD\n")
    cfg = load_recipe(p, ["train.micro_batch=5"])
    assert cfg.name == "my-run" and cfg.train.micro_batch == 5 and cfg.parallel.strategy == "zero3"
    # the dumped config loads back to the same config
    back = tmp_path / "resolved.yaml"
    back.write_text(dump_config(cfg))
    assert load_recipe(back) == cfg


@pytest.mark.parametrize("overrides,expected", [
    (["parallel.strategy=fsdp3"], "unknown strategy 'fsdp3'"),
    (["parallel.precision=fp8"], "unknown precision 'fp8'"),
    (["train.micro_batch=0"], "'train.micro_batch' = 0: input should be greater than or equal to 1"),
    (["train.seq_len=1"], "'train.seq_len' = 1: input should be greater than or equal to 2"),
    (["train.lr=1e-4"], "unknown recipe key 'train.lr' (did you mean 'optim.lr'?)"),
    (["optim.lrr=1e-4"], "unknown recipe key 'optim.lrr' (did you mean 'optim.lr'?)"),
    (["modle.name=x"], "unknown recipe key 'modle' (did you mean 'model'?)"),
    (["data.format=csv"], "'data.format' = 'csv'"),
    (["train.micro_batch=two"], "valid integer"),
    (["parallel.strategy=ddp", "parallel.offload=all"], "needs an FSDP strategy"),
    (["nodots"], "is not key.path=value"),
    (["optim.implementation=fuse"], "unknown optimizer implementation 'fuse'"),
    (["optim.name=adamw-8bit"], "runs under ddp or zero1 only"),  # default strategy zero3
    (["optim.name=adamw-8bit", "parallel.strategy=ddp", "optim.implementation=fused"], "leave it 'auto'"),
    (["optim.name=sgd"], "'optim.name' = 'sgd'"),
    (["optim.implementation=bf16-stochastic"], "needs parallel.precision bf16, not 'bf16-mixed'"),
])
def test_bad_values_are_one_line_errors(overrides, expected):
    assert expected in _err(overrides)


def test_bad_recipe_files(tmp_path):
    assert "does not exist" in _err([], tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    assert "not valid YAML" in _err([], bad)
    bad.write_text("- a\n- b\n")
    assert "must be a YAML mapping" in _err([], bad)
    bad.write_text("parallelism:\n  strategy: zero3\n")
    assert "unknown recipe key 'parallelism' (did you mean 'parallel'?)" in _err([], bad)


def test_validate_for_world_layout_and_global_batch():
    cfg = load_recipe(None, ["parallel.strategy=hsdp", "train.micro_batch=2", "train.grad_accum=3"])
    lay = validate_for_world(cfg, world_size=16, gpus_per_node=8)
    # hand: shard group = one node (8), 16 / 8 = 2 replicas; batch 2 × 3 × 16 = 96 sequences
    assert (lay.shard_degree, lay.replicate_degree, lay.global_batch) == (8, 2, 96)
    assert lay.tokens_per_step == 96 * cfg.train.seq_len
    z3 = validate_for_world(load_recipe(None), world_size=4, gpus_per_node=4)
    assert (z3.shard_degree, z3.replicate_degree) == (4, 1)
    assert validate_for_world(load_recipe(None, ["parallel.strategy=ddp"]), 4, 4).shard_degree == 1


@pytest.mark.parametrize("overrides,world,per_node,expected", [
    (["parallel.strategy=hsdp", "parallel.hsdp_shard_size=3"], 8, 8, "hsdp shard size 3 does not divide the world size 8"),
    (["parallel.strategy=hsdp"], 12, 8, "hsdp shard size 8 does not divide the world size 12"),
    (["parallel.strategy=hsdp", "parallel.hsdp_shard_size=16"], 8, 8, "does not divide"),
    (["parallel.hsdp_shard_size=2"], 4, 4, "only used by strategy hsdp"),
    ([], 0, 1, "world size 0 is not positive"),
])
def test_world_errors(overrides, world, per_node, expected):
    with pytest.raises(UserError, match=expected):
        validate_for_world(load_recipe(None, overrides), world, per_node)


def test_output_dir_checks(tmp_path):
    assert check_output_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_output_dir(tmp_path / "f")
    with pytest.raises(UserError, match="cannot be written"):
        check_output_dir(tmp_path / "f" / "sub")  # a folder inside a file cannot be created


def test_model_checks(tmp_path):
    cfg = load_recipe(None)
    assert check_model(cfg.model, 128)["vocab_size"] == 264
    with pytest.raises(UserError, match="model path .* does not exist"):
        check_model(load_recipe(None, [f"model.name={tmp_path}/nope"]).model, 128)
    with pytest.raises(UserError, match="has no config.json"):
        check_model(load_recipe(None, [f"model.name={tmp_path}"]).model, 128)
    with pytest.raises(UserError, match="exceeds the model's max_position_embeddings 512"):
        check_model(cfg.model, 1024)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UserError, match="not a folder with \\*.safetensors"):
        check_model(load_recipe(None, [f"model.name={tmp_path}", "model.init=pretrained"]).model, 128)


def test_preflight_runs_every_check_without_torch(tmp_path):
    cfg = load_recipe(None, [f"output_dir={tmp_path}/run", "data.generated_examples=10"])
    assert preflight(cfg, 2, 2).global_batch == 2 * cfg.train.micro_batch
    bad = load_recipe(None, [f"output_dir={tmp_path}/run", f"data.path={tmp_path}/none.jsonl"])
    with pytest.raises(UserError, match="dataset .* does not exist"):
        preflight(bad, 2, 2)
    # in a fresh interpreter: the CLI validates before starting processes, without importing torch
    code = ("import sys; from shardtune.config import load_recipe, preflight; "
            f"preflight(load_recipe(None, ['output_dir={tmp_path}/run2']), 2, 2); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_load_and_fit_their_world(recipe):
    cfg = load_recipe(recipe)
    assert isinstance(cfg, RunConfig)
    world = {"tiny-cpu": (2, 2)}.get(recipe.stem, (8, 8))
    validate_for_world(cfg, *world)
    check_model(cfg.model, cfg.train.seq_len)


def test_adamw_8bit_without_bitsandbytes_is_a_one_line_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert "needs bitsandbytes (pip install bitsandbytes)" in _err(["optim.name=adamw-8bit", "parallel.strategy=ddp"])
