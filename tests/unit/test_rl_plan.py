"""`plan --objective grpo`: generation's KV cache and gathered weights (plan/rl.py), computed here
from the model's config.json values by hand, and the reference when rl.beta > 0."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardtune.catalog.models import resolve_model_config
from shardtune.plan.api import plan
from shardtune.plan.validate import PlanInputs


def _plan(**kw):
    return {s.name: s for s in plan(PlanInputs(model="llama-3-8b", gpus=8, **kw)).strategies}


@pytest.mark.parametrize("precision, per", [("bf16-mixed", 2), ("fp32", 4)])
def test_kv_cache_and_generation_weights_by_hand(precision, per):
    cfg = resolve_model_config("llama-3-8b")  # 32 layers, 8 KV heads of 128
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    plans = _plan(objective="grpo", num_generations=16, seq_len=512, max_new_tokens=1024, precision=precision)
    want = 16 * 1 * (512 + 1024) * cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * per
    assert set(plans) == {"zero2", "zero3", "hsdp"}  # what grpo runs (rules/rl.py)
    z3 = plans["zero3"].memory
    assert z3.kv_cache == want == 16 * 1536 * 32 * 2 * 8 * 128 * per
    assert z3.generation_weights == 8_030_261_248 * per  # Llama-3-8B's parameters, gathered
    assert z3.total >= z3.params + z3.optimizer + z3.kv_cache + z3.generation_weights
    assert z3.reference == 0
    sft = _plan(seq_len=512, precision=precision)["zero3"].memory
    assert (sft.kv_cache, sft.generation_weights) == (0, 0)


def test_reference_only_with_beta():
    with_ref = _plan(objective="grpo", rl_beta=0.04)["zero3"].memory
    dpo = _plan(objective="dpo")["zero3"].memory
    assert with_ref.reference == dpo.reference > 0


def test_plan_json_has_kv_cache():
    out = subprocess.run([sys.executable, "-m", "shardtune.cli", "plan", "llama-3-8b", "--gpus", "8", "--objective",
                          "grpo", "--json"], capture_output=True, text=True, timeout=120, check=True).stdout
    mem = json.loads(out)["strategies"][0]["memory"]
    assert mem["kv_cache"] == 8 * 1 * (2048 + 64) * 32 * 2 * 8 * 128 * 2  # the defaults: G 8, seq 2048, 64 new


def test_training_rows_are_the_groups_completions():
    """A grpo micro-batch of 2 prompts trains on 2 × G rows of prompt + max_new_tokens: SFT's activations there."""
    grpo = _plan(objective="grpo", micro_batch=2, num_generations=4, seq_len=512, max_new_tokens=512,
                 ac="full")["zero3"].memory
    sft = _plan(micro_batch=8, seq_len=1024, ac="full")["zero3"].memory
    assert grpo.activations == sft.activations and grpo.buffers == sft.buffers


def test_the_8b_grpo_recipe_fits_with_generation_its_peak():
    from pathlib import Path

    from shardtune.config import load_recipe

    cfg = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "llama-3-8b-grpo-8xh100.yaml")
    inputs = {**cfg.plan_inputs(), "model": "llama-3-8b"}
    z3 = {s.name: s for s in plan(PlanInputs(gpus=8, **inputs)).strategies}["zero3"]
    m = z3.memory
    gen_peak = m.params + m.optimizer + m.reference + m.generation_weights + m.kv_cache
    assert z3.fits and m.total == gen_peak and m.reference > 0  # β 0.04: the reference is held
    assert m.kv_cache == 8 * (512 + 1024) * 32 * 2 * 8 * 128 * 2  # G × (prompt + new) × L × 2 × kv × d × bf16


def test_generation_time_in_the_step_time_by_hand():
    """llama-3-8b on 8 H100 (one node, NVLink): the step's generation priced here from the catalogue's
    figures (H100: 989.4 TFLOP/s bf16, 3.35 TB/s HBM; NVLink4 ring 370 GB/s, 2 µs a step; MFU 0.4):
    the weights all-gathered once (33 FSDP2 units), then each of the 4 prompts a rank holds: a prefill
    of G × 512 tokens at 2 FLOPs a parameter a token, and 1024 decode forwards each reading the bf16
    weights and the KV cache so far. The step time is the training step's (SFT's on 2 × G rows of
    512 + 1024 tokens) plus that."""
    cfg = resolve_model_config("llama-3-8b")
    psi, L, G, P, N = 8_030_261_248, cfg["num_hidden_layers"], 16, 512, 1024
    kv_token = L * 2 * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
    gather = 33 * (7 * 2e-6 + 7 / 8 * (psi * 2 / 33) / 370e9)
    prefill = 2 * psi * G * P / (989.4e12 * 0.4)
    decode = sum(psi * 2 + G * (P + t) * kv_token for t in range(N)) / 3.35e12
    want = gather + 4 * (prefill + decode)
    grpo = _plan(objective="grpo", num_generations=G, seq_len=P, max_new_tokens=N, micro_batch=2,
                 grad_accum=2)["zero3"].timing
    assert abs(grpo["generation_time_s"] - want) <= 1e-3 * want, (grpo["generation_time_s"], want)
    sft = _plan(micro_batch=2 * G, seq_len=P + N, grad_accum=2)["zero3"].timing
    assert abs(grpo["step_time_s"] - (sft["step_time_s"] + want)) <= 1e-3 * grpo["step_time_s"]
    assert "generation_time_s" not in sft


def test_lora_reference_is_the_base_and_only_adapters_train():
    """LoRA under grpo, β > 0: no reference copy (the base with the adapters off), the adapters' states only
    (as SFT's LoRA plan), and its forward still in the step's compute (one more than β = 0's)."""
    lora = _plan(objective="grpo", rl_beta=0.04, lora_rank=16)["zero3"]
    sft = _plan(lora_rank=16)["zero3"].memory
    full = _plan(objective="grpo", rl_beta=0.04)["zero3"].memory
    assert lora.memory.reference == 0 < full.reference
    assert (lora.memory.optimizer, lora.memory.grads) == (sft.optimizer, sft.grads)
    assert sft.optimizer < full.optimizer / 100
    no_ref = _plan(objective="grpo", lora_rank=16)["zero3"].timing
    assert lora.timing["compute_time_s"] > no_ref["compute_time_s"]
