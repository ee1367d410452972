"""QLoRA (lora.quantize_base nf4) in the trainer, ONE 2-rank gloo launch of _qlora_worker.py.

Reference, written here: a plain transformers model with the trainer's seeded base init, wrapped by
PEFT's own `get_peft_model`, A set by hand (U(-1/√in, 1/√in) from the per-tensor generator, as
tests/dist/test_lora.py), every adapted base weight replaced by torchao's own `to_nf4` of it; one
process, torch AdamW and clip_grad_norm_ on the adapters over the whole global batch. The model is
a 2-layer Llama whose projections all hold whole NF4 blocks per shard (256 × 256, 512 × 256).
Bytes: each rank's parameter storages, measured in the worker, against plan/memory.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _batches import global_batch

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_qlora_worker.py"
ROWS, SEQ, STEPS, LR, RANK, ALPHA = 4, 16, 4, 1e-2, 4, 8.0
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 264, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 256, "eos_token_id": 257,
          "pad_token_id": 258, "initializer_range": 0.02}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = [("zero3", "zero3", "fp32", {}), ("zero2", "zero2", "fp32", {}), ("ddp", "ddp", "fp32", {}),
         ("zero1", "zero1", "fp32", {}), ("hsdp", "hsdp", "fp32", {"hsdp_shard_size": 2}),
         ("zero3_offload", "zero3", "fp32", {"offload": "all"}), ("zero3_bf16", "zero3", "bf16-mixed", {}),
         ("ddp_bf16", "ddp", "bf16-mixed", {})]


def reference(cfg_path: Path):
    from peft import LoraConfig, get_peft_model
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
    from transformers import AutoModelForCausalLM

    from shardtune.config import ModelConfig
    from shardtune.train.core.model import _tensor_seed, build_hf_config, init_model_weights

    mcfg = ModelConfig(name=str(cfg_path), init="random")
    plain = AutoModelForCausalLM.from_config(build_hf_config(mcfg), attn_implementation="sdpa")
    init_model_weights(plain, mcfg, seed=0)
    model = get_peft_model(plain, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS))
    quantised = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                gen = torch.Generator().manual_seed(_tensor_seed(0, name.removeprefix("base_model.model.")))
                bound = 1 / math.sqrt(p.shape[1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
        for module in model.modules():
            if hasattr(module, "base_layer") and isinstance(module.base_layer, torch.nn.Linear):
                w = module.base_layer.weight
                module.base_layer.weight = torch.nn.Parameter(to_nf4(w.detach()), requires_grad=False)
                quantised += isinstance(module.base_layer.weight, NF4Tensor)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        b = global_batch(step, ROWS, SEQ)
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, quantised


def world2_cases(d: Path) -> tuple[list[dict], float]:
    cfg = d / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    cases = [{"name": n, "parallel": {"strategy": s, "precision": p, **kw}, "steps": STEPS, "rows": ROWS,
              "seq_len": SEQ, "lr": LR, "model": {"name": str(cfg), "init": "random"},
              "lora": {"rank": RANK, "alpha": ALPHA, "quantize_base": "nf4"}} for n, s, p, kw in CASES]
    return cases, 300


DIST_LAUNCHES = {2: world2_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.fixture(scope="module")
def runs(dist_launch, request):
    d, results = dist_launch(request.module, 2)
    return d / "config.json", results


@pytest.mark.timeout(400, func_only=True)
def test_qlora_two_ranks(runs):
    from shardtune.plan.memory import shardtune_states
    from shardtune.plan.params import architecture_from_config, model_shapes

    cfg, results = runs
    ref_losses, quantised = reference(cfg)
    assert quantised == 2 * len(TARGETS)
    shapes = model_shapes(architecture_from_config(CONFIG), RANK, "nf4")
    for name, strategy, precision, _ in CASES:
        for rank, r in enumerate(results):
            got = r[name]
            assert got["nf4_params"] == 2 * len(TARGETS), (name, rank)
            assert all(".lora_" in n for n in got["grad_params"]) and len(got["grad_params"]) == 4 * len(TARGETS)
            if precision == "fp32":  # the same NF4 base and adapters in one process vs 2 ranks
                assert got["losses"] == pytest.approx(ref_losses, abs=1e-5), (name, rank)
            else:  # bf16 compute: close to the fp32 reference, not equal
                assert got["losses"] == pytest.approx(ref_losses, rel=3e-2), (name, rank)
            shard = 2 if strategy != "ddp" and strategy != "zero1" else 1
            planned = shardtune_states(shapes, strategy, 2, shard, precision, "adamw", rank, padded=True)
            assert got["params_bytes"] == planned.params, (name, rank)
    assert ref_losses[-1] < ref_losses[0]
