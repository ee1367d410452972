"""Parameter counts: hand derivations, and transformers' own models built on the meta device."""
import pytest

from shardtune.catalog.models import MODELS, resolve_model_config
from shardtune.errors import UserError
from shardtune.plan.params import (
    architecture_from_config,
    count_active_params,
    count_params,
    lora_shapes,
    model_shapes,
    param_shapes,
)


def _count(name):
    return count_params(architecture_from_config(resolve_model_config(name)))


def test_llama2_7b_by_hand():
    # MHA (32 KV heads), SwiGLU 11008, untied 32k vocabulary.
    h, inter, L, V = 4096, 11008, 32, 32000
    attn = 4 * h * h  # q, k, v, o all (h, h)
    mlp = 3 * h * inter  # gate, up, down
    norms = 2 * h
    expected = L * (attn + mlp + norms) + 2 * V * h + h  # embedding + lm_head + final norm
    assert expected == 6_738_415_616  # the figure the issue quotes
    assert _count("llama-2-7b") == expected


def test_llama3_70b_by_hand():
    # GQA: 64 query heads, 8 KV heads of 128 → k, v are (1024, 8192); untied 128,256 vocabulary.
    h, inter, L, V, kv = 8192, 28672, 80, 128256, 8 * 128
    attn = 2 * h * h + 2 * kv * h
    per_layer = attn + 3 * h * inter + 2 * h
    expected = L * per_layer + 2 * V * h + h
    assert expected == 70_553_706_496
    assert _count("llama-3-70b") == expected
    assert _count("llama-3.1-70b") == expected


def test_mixtral_total_and_active_by_hand():
    h, inter, L, V, E, k = 4096, 14336, 32, 32000, 8, 2
    attn = 2 * h * h + 2 * 1024 * h
    expert = 3 * h * inter
    per_layer = attn + E * h + E * expert + 2 * h  # router (E, h) has no bias
    arch = architecture_from_config(resolve_model_config("mixtral-8x7b"))
    assert count_params(arch) == L * per_layer + 2 * V * h + h  # ≈ 46.7 B
    assert count_active_params(arch) == L * (per_layer - (E - k) * expert) + 2 * V * h + h  # ≈ 12.9 B


def test_qwen2_has_qkv_bias():
    arch = architecture_from_config(resolve_model_config("qwen2.5-7b"))
    names = [p.name for p in param_shapes(arch) if p.group == 0]
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


def _meta_model(cfg):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in cfg.items() if k not in ("architectures",)}
    hf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_count_matches_transformers_meta_model(name):
    cfg = resolve_model_config(name)
    model = _meta_model(cfg)
    assert count_params(architecture_from_config(cfg)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny-llama", "qwen2.5-7b", "mixtral-8x7b"])
def test_shapes_match_transformers_named_parameters(name):
    # FSDP2 shards each tensor on dim 0, so the planner's shapes must be transformers' shapes.
    cfg = dict(resolve_model_config(name), num_hidden_layers=2)
    model = _meta_model(cfg)
    ours = [(p.name, p.shape) for p in param_shapes(architecture_from_config(cfg))]
    assert ours == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["o_proj", "down_proj"]])
def test_lora_shapes_match_peft(targets):
    """The default targets (every projection) and a recipe's own `lora.target_modules`: the planner
    once planned the default always."""
    import torch
    from peft import LoraConfig, get_peft_model

    cfg = resolve_model_config("tiny-llama")
    model = _meta_model(cfg)
    names = targets or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=names))
    trainable = {n.removeprefix("base_model.model."): tuple(p.shape)
                 for n, p in peft_model.named_parameters() if p.requires_grad}
    kw = {} if targets is None else {"target_modules": targets}
    ours = {p.name: p.shape for p in lora_shapes(architecture_from_config(cfg), 8, *kw.values())}
    assert ours == trainable
    shapes = model_shapes(architecture_from_config(cfg), 8, **kw)
    assert sum(p.numel for p in shapes if p.trainable) == sum(
        p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_a_recipes_lora_targets_reach_the_plan():
    """lora.target_modules → plan inputs (config/plan_keys.py) → the planned trainable count."""
    from shardtune.config import load_recipe
    from shardtune.plan import plan

    cfg = load_recipe(None, ["lora.rank=4", "lora.target_modules=[q_proj,v_proj]"])
    inputs = cfg.plan_inputs()
    assert inputs["lora_target_modules"] == ["q_proj", "v_proj"]
    # tiny-llama: 4 layers x r 4 x (q: 128 + 128, v: 128 + 64)
    assert plan(None, 2, **inputs).model["trainable_params"] == 4 * 4 * (128 + 128 + 128 + 64)


@pytest.mark.parametrize("bad,fragment", [
    ({"model_type": "gpt2"}, "not supported"),
    ({"model_type": "llama", "hidden_size": 64}, "num_attention_heads"),
    ({"model_type": "llama", "hidden_size": -1, "num_attention_heads": 4}, "hidden_size"),
])
def test_bad_config_is_user_error(bad, fragment):
    with pytest.raises(UserError, match=fragment):
        architecture_from_config(bad)
