"""The planner's MoE math (plan/moe.py, plan/params.py): each tensor of Qwen3-MoE, GPT-OSS,
DeepSeek-V3 and Mixtral as transformers 5.25 builds it, the catalogue's MoE models against their
published total and active parameter counts, and `memory.experts` derived by hand."""
from __future__ import annotations

import pytest
from _tolerance import assert_plan_within_trace

from shardtune.catalog.models import MODELS
from shardtune.plan import plan
from shardtune.plan.params import architecture_from_config, count_active_params, count_params, param_shapes
from shardtune.plan.validate import PlanInputs

SMALL = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 96, "max_position_embeddings": 128}
TINY = {
    "qwen3-30b-a3b": {"moe_intermediate_size": 16, "intermediate_size": 48, "num_experts": 8, "head_dim": 16,
                      "mlp_only_layers": [1]},
    "gpt-oss-20b": {"intermediate_size": 32, "num_local_experts": 4, "head_dim": 16, "sliding_window": 8,
                    "pad_token_id": 95,
                    "layer_types": ["sliding_attention", "full_attention"] * 2},
    "deepseek-v3": {"intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 8, "n_group": 2,
                    "topk_group": 1, "num_experts_per_tok": 2, "q_lora_rank": 24, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1,
                    "num_key_value_heads": 4, "rope_scaling": None},
    "mixtral-8x7b": {"intermediate_size": 32, "num_local_experts": 4},
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_shapes_are_transformers_own(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**MODELS[name]["config"], **SMALL, **TINY[name]}
    hf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}
    got = {p.name: p.shape for p in param_shapes(architecture_from_config(cfg))}
    assert got == want


# published totals / active per token, in billions (rounded as published): Qwen3 technical report
# table 1 / model cards; DeepSeek-V3 report abstract; Mistral's Mixtral 8x22B announcement; the gpt-oss
# model card table 1, whose active counts leave the input embedding out
PUBLISHED = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235, 22), "deepseek-v3": (671, 37),
             "mixtral-8x22b": (141, 39), "gpt-oss-20b": (20.9, 3.6), "gpt-oss-120b": (116.8, 5.1)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameters_match_the_published_counts(name):
    arch = architecture_from_config(MODELS[name]["config"])
    total, active = count_params(arch), count_active_params(arch)
    if name.startswith("gpt-oss"):
        active -= arch.vocab_size * arch.hidden_size  # OpenAI counts the unembedding, not the embedding
    # the published figures are rounded down (DeepSeek's "37B activated": 37.55 B here; Qwen's 3.3 B: 3.35 B)
    assert (total / 1e9, active / 1e9) == pytest.approx(PUBLISHED[name], rel=0.02)


def test_plan_json_gives_total_active_and_expert_states():
    d = plan("qwen3-30b-a3b", 8, strategies=["zero3", "ddp"]).to_dict()
    assert (d["model"]["params_total"], d["model"]["params_active"]) == (30_532_122_624, 3_353_032_704)
    # 48 layers x 128 experts x (gate_up 2*768*2048 + down 2048*768), zero3 sharded over 8 ranks
    # (128 % 8 == 0: no padding); bf16-mixed keeps fp32 params and
    # grads (4 + 4 B) and AdamW's two fp32 moments (8 B) and its 4-byte step counter per tensor
    routed, counters = 48 * 128 * 3 * 768 * 2048, 4 * 2 * 48
    by = {s["name"]: s["memory"] for s in d["strategies"]}
    assert by["zero3"]["experts"] == routed * 16 // 8 + counters
    assert by["ddp"]["experts"] == routed * 16 + counters


def test_a_dense_plan_has_no_moe_fields():
    d = plan("llama-3-8b", 8, strategies=["zero3"]).to_dict()
    assert "params_total" not in d["model"] and "experts" not in d["strategies"][0]["memory"]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-mixtral", "qwen3-30b-a3b"])
def test_moe_layer_activations_match_torch_saved_tensors(name, dtype_name):
    # Independent measurement, as test_memory.py's dense one: every tensor autograd saves in one
    # decoder layer's forward (saved_tensors_hooks; parameters, and storages made before the
    # layer, excluded; each storage once) of transformers' model with the trainer's grouped_mm
    # experts and fp32 router, plus what the trainer's load-balancing loss adds for that layer:
    # the router logits it holds and what its softmax saves (aux_loss_part over all layers, less
    # its step-wide f (E fp32) and row count (fp32), divided by the layers).
    import torch
    from _saved import saved_in
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.catalog.models import resolve_model_config
    from shardtune.plan.activations import layer_activation_bytes
    from shardtune.train.core.moe import EXPERTS_IMPLEMENTATION, aux_loss_part, prepare_moe, record_routing

    cfg = resolve_model_config(name)
    if name != "tiny-mixtral":
        cfg = {**cfg, **SMALL, **TINY[name], "mlp_only_layers": []}
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf._attn_implementation, hf._experts_implementation = "sdpa", EXPERTS_IMPLEMENTATION
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).to(getattr(torch, dtype_name)).train()
    prepare_moe(model)
    aux = {}

    def pack_aux(t):
        aux[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    arch = architecture_from_config(cfg)
    b, s, E = 2, 48, arch.num_experts
    ids = torch.randint(0, 90, (b, s))
    with record_routing(model) as seen:
        with saved_in(model, model.model.layers[1]) as saved:
            model(input_ids=ids, labels=ids, use_cache=False)
        with torch.autograd.graph.saved_tensors_hooks(pack_aux, lambda t: t):
            aux_loss_part(seen, E)
    aux_layer = (sum(aux.values()) - (4 * E + 4)) / len(seen)
    measured = sum(saved.values()) + seen[1][0].untyped_storage().nbytes() + aux_layer
    elem = torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
    assert measured == layer_activation_bytes(arch, b * s, elem)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,ac", [("zero3", "none"), ("zero3", "full"), ("ddp", "none")])
def test_moe_analytic_within_tolerance_of_simulated(strategy, ac):
    # Qwen3-30B-A3B's real widths (hidden 2048, 128 experts of 768, top-8, vocabulary 151,936)
    # with 4 layers at seq 512 on N = 8, bf16-mixed: the trainer's MoE step traced on fake tensors
    # (grouped GEMMs through transformers' fallback op, balanced counts: verify/moe_fake.py)
    # against the analytic plan, at the dense models' tolerances (tests/unit/test_simulate.py:
    # states within 2 %, activations and peak within 10 %). ddp: an fp32 model under autocast,
    # whose experts run in fp32.
    from shardtune.verify.simulate import simulate_strategy

    cfg = {**MODELS["qwen3-30b-a3b"]["config"], "num_hidden_layers": 4}
    sim = simulate_strategy(PlanInputs(cfg, 8, seq_len=512, ac=ac), strategy)
    mem = plan(cfg, gpus=8, seq_len=512, ac=ac, strategies=[strategy]).strategy(strategy).memory
    assert_plan_within_trace(mem, sim)


@pytest.mark.timeout(180)
def test_cli_simulate_traces_the_moe_recipe_and_says_why_not_under_ep(capsys):
    import json

    from shardtune.cli import main

    recipe = "recipes/tiny-moe-cpu.yaml"  # tiny-mixtral, fp32, seq 64 × micro-batch 4
    assert main(["plan", recipe, "--gpus", "2", "--strategy", "zero3", "--simulate", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["strategies"][0]
    assert s["simulated"]["status"] == "traced", s["simulated"]
    assert s["memory"]["activations"] == pytest.approx(s["simulated"]["activations"], rel=0.10)
    assert main(["plan", recipe, "--gpus", "2", "--strategy", "zero3", "--ep", "2", "--simulate", "--json"]) == 0
    out = capsys.readouterr()
    sim = json.loads(out.out)["strategies"][0]["simulated"]
    assert sim["status"] == "analytic fallback" and "expert parallelism" in sim["reason"]
    assert "expert parallelism" in out.err
