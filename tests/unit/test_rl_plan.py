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
    assert set(plans) == {"zero2", "zero3"}  # what grpo runs (rules/rl.py)
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
