"""Recipe loading and validation: aliases, overrides, one-line errors, the launch checks
(train/launcher/preflight.py: world size, model, data, run folder), the shipped recipes."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.catalog.models import resolve_model_config
from shardtune.config import RunConfig, dump_config, load_recipe
from shardtune.errors import UserError
from shardtune.testing.smollm2 import full_folder
from shardtune.testing.upcycle import upcycled_folder
from shardtune.train.launcher.preflight import validate_for_launch

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
    (["optim.name=adamw-8bit", "parallel.strategy=ddp", "optim.implementation=fused"], "leave it 'auto'"),
    (["optim.name=sgd"], "'optim.name' = 'sgd'"),
    (["optim.implementation=bf16-stochastic"], "needs parallel.precision bf16"),
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


def _launch(tmp_path, overrides=(), world=2, per_node=2):
    """validate_for_launch on a small generated dataset in a fresh run folder (unless overridden)."""
    base = [f"output_dir={tmp_path}/run", "data.generated_examples=1000"]
    return validate_for_launch(load_recipe(None, base + list(overrides)), world, per_node)


def _launch_err(tmp_path, overrides=(), world=2, per_node=2) -> str:
    with pytest.raises(UserError) as e:
        _launch(tmp_path, overrides, world, per_node)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_launch_layout_and_global_batch(tmp_path):
    cfg = load_recipe(None, ["parallel.strategy=hsdp", "train.micro_batch=2", "train.grad_accum=3",
                             f"output_dir={tmp_path}/run", "data.generated_examples=1000"])
    lay = validate_for_launch(cfg, world_size=16, local_world_size=8)
    # hand: shard group = one node (8), 16 / 8 = 2 replicas; every strategy is data-parallel over
    # all 16 ranks, so batch 2 × 3 × 16 = 96 sequences
    assert (lay.shard_degree, lay.replicate_degree) == (8, 2)
    assert cfg.train.micro_batch * cfg.train.grad_accum * lay.world_size == 96
    z3 = _launch(tmp_path, [], 4, 4)
    assert (z3.shard_degree, z3.replicate_degree) == (4, 1)
    assert _launch(tmp_path, ["parallel.strategy=ddp"], 4, 4).shard_degree == 1


@pytest.mark.parametrize("overrides,world,per_node,expected", [
    (["parallel.strategy=hsdp", "parallel.hsdp_shard_size=3"], 8, 8,
     "hsdp shard size 3 does not divide the world size 8"),
    (["parallel.strategy=hsdp"], 12, 8, "hsdp shard size 8 does not divide the world size 12"),
    (["parallel.strategy=hsdp", "parallel.hsdp_shard_size=16"], 8, 8, "does not divide"),
    ([], 0, 1, "world size 0 is not positive"),
])
def test_world_errors(tmp_path, overrides, world, per_node, expected):
    assert expected in _launch_err(tmp_path, overrides, world, per_node)


def test_options_the_strategy_would_ignore_are_refused(tmp_path):
    # issue 15: hsdp_shard_size under zero3 was silently ignored; ac_every without selective AC too
    assert "applies to hsdp only" in _launch_err(tmp_path, ["parallel.hsdp_shard_size=2"], 4, 4)
    assert "activation_checkpointing=layer" in _err(["parallel.ac_every=3"])
    assert load_recipe(None, ["parallel.ac_every=3", "parallel.activation_checkpointing=layer"])
    # `selective`, the old name of layer AC, is still accepted and normalised
    old = load_recipe(None, ["parallel.ac_every=3", "parallel.activation_checkpointing=selective"])
    assert old.parallel.activation_checkpointing == "layer"


@pytest.mark.parametrize("overrides,expected", [
    (["train.max_steps=true"], "is a boolean"), (["train.micro_batch=false"], "is a boolean"),
    (["optim.lr=.inf"], "finite"), (["optim.lr=.nan"], "finite"),
    (["optim.betas=[0.9, 1.0]"], "[0, 1)"), (["optim.betas=[-0.1, 0.9]"], "[0, 1)"),
])
def test_counts_ranges_and_finite_numbers(overrides, expected):
    assert expected in _err(overrides)


def test_recipe_must_be_utf8_without_duplicate_keys(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"name: caf\xe9\n")
    assert "is not UTF-8 text" in _err([], p)
    p.write_text("train:\n  seq_len: 12\n  seq_len: 14\n")
    assert "'seq_len' given twice" in _err([], p)
    p.write_text("train:\n  seq_len: 12\noptim:\n  lr: 1.0e-3\n")  # the same key in two sections is fine
    assert load_recipe(p).train.seq_len == 12


def test_output_dir_checks(tmp_path):
    _launch(tmp_path, [f"output_dir={tmp_path}/a/b"])
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    assert "is a file" in _launch_err(tmp_path, [f"output_dir={tmp_path}/f"])
    # a folder inside a file cannot be created
    assert "cannot be written" in _launch_err(tmp_path, [f"output_dir={tmp_path}/f/sub"])


def test_model_checks(tmp_path):
    _launch(tmp_path, ["train.seq_len=128"])
    assert resolve_model_config(load_recipe(None).model.name)["vocab_size"] == 264
    assert re.search("model path .* does not exist", _launch_err(tmp_path, [f"model.name={tmp_path}/nope"]))
    assert "has no config.json" in _launch_err(tmp_path, [f"model.name={tmp_path}"])
    assert "exceeds the model's max_position_embeddings 512" in _launch_err(tmp_path, ["train.seq_len=1024"])
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert "has no *.safetensors" in _launch_err(tmp_path, [f"model.name={tmp_path}", "model.init=pretrained"])


def test_launch_checks_run_without_torch(tmp_path):
    assert _launch(tmp_path).world_size == 2
    assert re.search("dataset .* does not exist", _launch_err(tmp_path, [f"data.path={tmp_path}/none.jsonl"]))
    # in a fresh interpreter: the CLI validates before starting processes, without importing torch
    code = ("import sys; from shardtune.config import load_recipe; "
            "from shardtune.train.launcher.preflight import validate_for_launch; "
            f"validate_for_launch(load_recipe(None, ['output_dir={tmp_path}/run2']), 2, 2); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_load_and_fit_their_world(recipe, tmp_path, monkeypatch):
    from shardtune.train.launcher import preflight

    # the 8×H100 recipes' model states do not fit this machine's RAM, and the launcher says so
    # (tests/e2e/test_bad_inputs.py); here the recipe's own layout and model are the subject
    monkeypatch.setattr(preflight, "_check_model_states_fit", lambda *a: None)
    if recipe.stem.startswith("smollm2"):  # they name the SmolLM2 fixture's folder: built here, not by an earlier test
        full_folder()
    if recipe.stem.startswith("smollm2-moe"):  # and its sparse upcycling (shardtune/testing/upcycle.py)
        upcycled_folder()
    cfg = load_recipe(recipe)
    assert isinstance(cfg, RunConfig)
    world = {"tiny-cpu": (2, 2), "tiny-moe-cpu": (2, 2), "smollm2-moe-dates": (2, 2)}.get(recipe.stem, (8, 8))
    # the big recipes name data/train.jsonl, the user's file: the layout and the model are checked
    # here, on the generated data (one global batch of short rows), in a temporary run folder, on gloo;
    # a recipe whose model folder is not here is checked on its architecture (random init; the
    # missing folder itself: test_big_recipes_name_the_folder_to_download)
    model = [f"model.name={cfg.model.architecture}"] if cfg.model.architecture else []
    launchable = load_recipe(recipe, [f"output_dir={tmp_path}/run", "data.path=null", "train.backend=auto",
                                      "train.seq_len=128", "train.grad_accum=1", *model])
    validate_for_launch(launchable, *world)


@pytest.mark.parametrize("recipe", ["llama-3-8b-8xh100", "llama-3-70b-8xh100", "llama-3-70b-lora-8xh100",
                                    "llama-3-70b-bf16-8xh100", "llama-3-70b-qlora-2x4090"])
def test_big_recipes_name_the_folder_to_download(recipe, tmp_path, capsys):
    """The 8B/70B recipes point at the Instruct folder: training without it is one line naming the
    download command; planning uses the recipe's architecture, and says so."""
    from shardtune import cli

    path = str(RECIPES / f"{recipe}.yaml")
    cfg = load_recipe(path)
    size = cfg.model.architecture.rsplit("-", 1)[1].upper()  # llama-3-70b → 70B
    assert cfg.model.name == f"/path/to/Meta-Llama-3-{size}-Instruct" and cfg.model.plan_name() != cfg.model.name
    assert cfg.plan_inputs()["model"] == cfg.model.architecture
    msg = _launch_err(tmp_path, [f"model.name={cfg.model.name}", f"model.architecture={cfg.model.architecture}",
                                 f"model.download={cfg.model.download}"])
    assert msg == (f"model path '{cfg.model.name}' does not exist; download it first: hf download "
                   f"meta-llama/Meta-Llama-3-{size}-Instruct --exclude 'original/*' --local-dir {cfg.model.name}")
    assert cli.main(["train", path, "--output-dir", str(tmp_path / "run")]) == 2
    assert "hf download meta-llama/" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert cli.main(["plan", path, "--gpus", "8", "--json"]) == 0
    out = capsys.readouterr()
    assert f"planned as its architecture {cfg.model.architecture!r}" in out.err


def test_model_architecture_is_checked_against_the_folder(tmp_path):
    import json

    from shardtune.catalog.models import MODELS
    from shardtune.train.launcher import preflight

    folder = tmp_path / "m"
    folder.mkdir()
    hf = dict(MODELS["llama-3-8b"]["config"])
    (folder / "config.json").write_text(json.dumps(hf))
    on = load_recipe(None, [f"model.name={folder}", "model.architecture=llama-3-8b", "model.init=random"])
    assert on.model.plan_name() == str(folder)  # the folder is here: it is what is planned
    preflight._check_model(on.model, 128)
    (folder / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 30, "tie_word_embeddings": True}))
    with pytest.raises(UserError, match=r"is not model.architecture 'llama-3-8b': num_hidden_layers 30 \(not 32\), "
                                        r"tie_word_embeddings True \(not False\)"):
        preflight._check_model(on.model, 128)
    assert "not a catalogue architecture (did you mean 'llama-3-8b'?)" in _err(["model.architecture=llama-3-8"])
    assert "is not a Hub id" in _err(["model.download=a b/c; rm"])


def test_adamw_8bit_without_bitsandbytes_is_a_one_line_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    from shardtune.train.launcher.preflight import check_environment

    with pytest.raises(UserError, match=r"needs bitsandbytes \(pip install 'shardtune\[8bit\]'\)"):
        check_environment("ddp", optimizer="adamw-8bit")  # the launcher's check: the recipe itself is valid
    load_recipe(None, ["optim.name=adamw-8bit", "parallel.strategy=ddp"])
