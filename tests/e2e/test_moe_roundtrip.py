"""A Hugging Face MoE folder through `shardtune train` and `shardtune export` comes back bit for bit.

Source folders: tiny-mixtral and a tiny Qwen3-MoE as transformers' own `save_pretrained` writes them
(random, fp32, the Hub's per-expert names: train/core/hub_layout.py fuses them at load and the
export splits them back), and the upcycled SmolLM2 MoE (shardtune/testing/upcycle.py: its first 2
layers x 4 experts, bf16, tied embeddings, the fused `experts.gate_up_proj` / `down_proj` names that
transformers' classes hold; all 30 layers with UPCYCLED_LAYERS=0: bench/moe_roundtrip.py). Each
trains one step on 2 processes (zero3, and `--ep 2`; Qwen3-MoE `--ep 2` only), then `shardtune
export` writes its final checkpoint. The CLI has no zero-step run (train.max_steps >= 1, optim.lr >
0): the step runs with optim.lr=1e-46, so AdamW's update (lr x m/(sqrt(v) + eps), at most lr on the
first step) is below half of fp32's smallest subnormal (1.4e-45) and rounds to zero, weight decay 0
(pure bf16 updates in fp32 too). What comes back is then the loader, the sharding (experts split by
ep and FSDP), DCP's save and the export: every tensor's name, dtype, shape and bytes equal the
source's, in the source's own layout, and the config reads back the same. The zero3 runs'
memory.json also measures the planner's MoE activations (plan.json, within 10 %).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _cli import REPO, metrics, shardtune_cli

pytestmark = [pytest.mark.e2e]
RECIPE = REPO / "recipes" / "tiny-moe-cpu.yaml"
NO_STEP = ["train.max_steps=1", "optim.lr=1e-46", "optim.warmup_steps=0", "optim.weight_decay=0",
           "checkpoint.save_final=true", "model.init=pretrained"]
SOURCES = {"tiny-mixtral": ["parallel.precision=fp32"], "tiny-qwen3-moe": ["parallel.precision=fp32"],
           "upcycled": ["parallel.precision=bf16", "train.seq_len=32", "train.micro_batch=1"]}
LAYOUTS = {"zero3": ["--nproc", "2"], "ep2": ["--nproc", "2", "--ep", "2"]}
# Qwen3-MoE's per-expert names under ep only (one launch more; one process's whole-tensor read of both
# layouts against from_pretrained is tests/unit/test_hub_layout.py's)
RUNS = [("tiny-mixtral", "zero3"), ("tiny-mixtral", "ep2"), ("tiny-qwen3-moe", "ep2"),
        ("upcycled", "zero3"), ("upcycled", "ep2")]
# the upcycled source's decoder layers (shardtune/testing/upcycle.py `upcycled_folder`; 0: all 30, the
# real model's round trip, ~3 minutes: bench/moe_roundtrip.py runs this file so)
UPCYCLED_LAYERS = int(os.environ.get("UPCYCLED_LAYERS", "2"))


def _hub_folder(folder: Path, model_type: str) -> Path:
    """A tiny MoE as transformers 5's own `save_pretrained` writes it: the Hub's per-expert names
    (Mixtral `block_sparse_moe.experts.N.w1/w2/w3`, Qwen3-MoE `mlp.experts.N.gate/up/down_proj`),
    which transformers fuses into `experts.gate_up_proj` / `down_proj` when loading. tiny-mixtral's
    widths, vocabulary and token ids for both (the recipe's byte tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.catalog.models import resolve_model_config

    cfg = {k: v for k, v in resolve_model_config("tiny-mixtral").items() if k not in ("architectures", "model_type")}
    if model_type == "qwen3_moe":
        cfg.update(num_experts=cfg.pop("num_local_experts"), moe_intermediate_size=cfg["intermediate_size"],
                   head_dim=32, decoder_sparse_step=1, mlp_only_layers=[])
    hf = AutoConfig.for_model(model_type, **cfg)
    hf.dtype = "float32"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trips(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path, list[dict], Path]]:
    from shardtune import cli
    from shardtune.testing.upcycle import upcycled_folder

    tmp: Path = tmp_path_factory.mktemp("moe_roundtrip")
    sources = {"tiny-mixtral": _hub_folder(tmp / "tiny-mixtral", "mixtral"),
               "tiny-qwen3-moe": _hub_folder(tmp / "tiny-qwen3-moe", "qwen3_moe"),
               "upcycled": upcycled_folder(UPCYCLED_LAYERS)}
    out = {}
    for name, layout in RUNS:
        source, run, export = sources[name], tmp / f"{name}-{layout}", tmp / f"{name}-{layout}-hf"
        proc = shardtune_cli("train", RECIPE, "--output-dir", run, *LAYOUTS[layout],
                             f"model.name={source}", *NO_STEP, *SOURCES[name], timeout_s=420)
        assert proc.returncode == 0, proc.stdout[-3000:]
        # `shardtune export` in this process (tests/e2e/test_export.py does so too): the command's own
        # code, without a fresh interpreter's ~5 s of torch + transformers imports for each of 5 runs
        assert cli.main(["export", str(run / "checkpoints" / "step_1"), str(export)]) == 0, (name, layout)
        out[name, layout] = (source, export, metrics(run), run)
    return out


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(("name", "layout"), RUNS)
def test_train_then_export_gives_the_source_tensors_bit_for_bit(trips, name, layout):
    import torch

    source, export, steps, _ = trips[name, layout]
    # the step ran: a loss and a gradient (the update it made rounds to nothing)
    assert [r["step"] for r in steps] == [1] and steps[0]["grad_norm"] > 0 and steps[0]["lr"] == 1e-46
    want, got = _tensors(source), _tensors(export)
    assert sorted(got) == sorted(want)
    experts = [k for k in want if ".experts." in k]  # the source's own layout, per expert or fused
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    assert name != "upcycled" or layers == (UPCYCLED_LAYERS or 30)  # SmolLM2-135M: 30 decoder layers
    assert len(experts) == (2 * layers if name == "upcycled" else 3 * 4 * 4), sorted(want)[:8]
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), key  # the bytes, signed zeros too


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(("name", "layout"), RUNS)
def test_the_exported_config_is_the_source_config(trips, name, layout):
    from transformers import AutoConfig

    source, export, _, _ = trips[name, layout]
    want, got = (json.loads((f / "config.json").read_text()) for f in (source, export))
    assert {k: got.get(k) for k in want} == want  # every source key, its value unchanged
    # what the export adds is what transformers writes on save; read back, the configs are one
    assert set(got) - set(want) <= {"transformers_version", "dtype", "torch_dtype", "use_cache"}
    stored = str(next(iter(_tensors(source).values())).dtype).removeprefix("torch.")
    assert all(got[k] == stored for k in ("dtype", "torch_dtype") if k in got)  # the weights' own dtype
    read = [AutoConfig.from_pretrained(f).to_dict() for f in (source, export)]
    for d in read:
        d.pop("transformers_version", None), d.pop("_name_or_path", None)  # where it was read from
    assert read[0] == read[1]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ["tiny-mixtral", "upcycled"])
def test_the_planned_moe_activations_are_what_the_trainer_measured(trips, name):
    """The same zero3 runs as a measurement of the planner's MoE activation terms (plan/moe.py): the
    activation bytes torch's memory tracker saw in the trainer's step (memory.json, rank 0) against
    the plan the trainer wrote for the run (plan.json), within the dense models' 10 %."""
    run = trips[name, "zero3"][3]
    measured = json.loads((run / "memory.json").read_text())["per_rank"][0]["tracked"]["activations"]
    planned = json.loads((run / "plan.json").read_text())["strategies"][0]["memory"]["activations"]
    assert planned == pytest.approx(measured, rel=0.10), (planned, measured)
