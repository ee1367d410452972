"""QLoRA's planner bytes against torchao's NF4Tensor itself, its shapes, its flag, its export base."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4

from shardtune.plan.memory import nf4_bytes, nf4_stored, shardtune_states
from shardtune.plan.params import architecture_from_config, model_shapes
from shardtune.train.core.qlora import quantizable

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 264, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu",
          "initializer_range": 0.02}


def _storage_bytes(t: NF4Tensor) -> int:
    """Every inner tensor torchao flattens the NF4Tensor into, by its storage."""
    names, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).untyped_storage().nbytes() for n in names)


@pytest.mark.parametrize("shape", [(256, 256), (512, 256), (1024, 64), (128, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_bytes_equal_torchao_storages(shape, dtype):
    q = to_nf4(torch.randn(shape, dtype=dtype))
    assert q.block_size == 64 and q.scaler_block_size == 256  # the layout nf4_bytes assumes
    assert nf4_bytes(q.numel(), dtype.itemsize) == _storage_bytes(q)
    half = torch.chunk(q, 2, dim=0)[1]  # an FSDP2 shard: the row chunk of the whole tensor
    assert isinstance(half, NF4Tensor)
    assert nf4_bytes(half.numel(), dtype.itemsize) == sum(
        getattr(half, n).numel() * getattr(half, n).element_size() for n in half.__tensor_flatten__()[0])


def test_nf4_rule_same_in_planner_and_trainer():
    for shape in [(256, 256), (64, 256), (128, 128), (344, 128), (8192, 8192), (1024, 8192), (3, 16384)]:
        for shard in (1, 2, 4, 8):
            assert nf4_stored(shape, shard) == quantizable(shape, shard), (shape, shard)
    assert nf4_stored((256, 256), 4) and not nf4_stored((128, 128), 2)


def test_model_shapes_marks_the_adapted_base_weights_only():
    arch = architecture_from_config(CONFIG)
    shapes = model_shapes(arch, 4, "nf4")
    marked = {p.name for p in shapes if p.nf4}
    assert len(marked) == 14 and all(n.endswith("_proj.weight") and ".lora_" not in n for n in marked)
    assert not any(p.nf4 for p in model_shapes(arch, 4))
    # the base in NF4 at 0.53 B/weight instead of 4 (fp32), the rest unchanged
    full, q = (shardtune_states(s, "zero3", 2, 2, "fp32", "adamw").params for s in (model_shapes(arch, 4), shapes))
    base = sum(p.numel for p in shapes if p.nf4) // 2
    assert full - q == 4 * base - sum(nf4_bytes(p.numel // 2, 4) for p in shapes if p.nf4)


def _plan(*args):
    exe = Path(sys.executable).with_name("shardtune")
    return subprocess.run([str(exe), "plan", *args], capture_output=True, text=True, timeout=120)


def test_plan_flag_and_refusal():
    bad = _plan("llama-3-8b", "--gpus", "2", "--quantize-base", "nf4")
    assert bad.returncode == 2 and "needs LoRA adapters" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    lora = _plan("llama-3-70b", "--gpus", "2", "--strategy", "zero3", "--lora-rank", "16", "--json")
    qlora = _plan("llama-3-70b", "--gpus", "2", "--strategy", "zero3", "--lora-rank", "16", "--quantize-base",
                  "nf4", "--json")
    assert lora.returncode == 0 and qlora.returncode == 0, qlora.stderr
    p_lora, p_q = (json.loads(r.stdout)["strategies"][0]["memory"]["params"] for r in (lora, qlora))
    assert 3.5 < p_lora / p_q < 3.9  # bf16 base → ~0.52 B/weight, embeddings and head stay bf16


def test_merged_export_base_is_the_dequantised_nf4(tmp_path):
    from shardtune.config import ModelConfig
    from shardtune.train.core.lora_base import base_tensors
    from shardtune.train.core.model import build_meta_model, random_full_tensors

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "down_proj"],
            "quantize_base": "nf4", "nf4_shard": 2,
            "base": {"model": "x", "init": "random", "seed": 0, "dtype": "bfloat16"}}
    got = base_tensors(lora, tmp_path)
    made = dict(random_full_tensors(build_meta_model(ModelConfig(name=str(tmp_path), init="random")), 0))
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]:
        want = to_nf4(made[name]().to(torch.bfloat16)).get_original_weight()
        assert torch.equal(got[name][2](), want)
        assert not torch.equal(want, made[name]().to(torch.bfloat16))  # NF4 did change it
    k = "model.layers.0.self_attn.k_proj.weight"  # not a target: the plain bf16 weight
    assert torch.equal(got[k][2](), made[k]().to(torch.bfloat16))
