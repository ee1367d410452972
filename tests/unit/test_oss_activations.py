"""GPT-OSS's activation terms (plan/oss.py: eager attention's s × s scores, GptOssRMSNorm's fp32
output, the biased clamped experts) held to independent measurements: torch's saved-tensor hooks on
one decoder layer of transformers' GptOssForCausalLM as the trainer builds it (eager attention,
grouped_mm experts, fp32 router), and the trainer's own memory tracker (memory.json) on a tiny run
through the CLI."""
from __future__ import annotations

import json

import pytest

from shardtune.catalog.models import resolve_model_config
from shardtune.plan.activations import layer_activation_bytes
from shardtune.plan.params import architecture_from_config


def _measure(dtype_name: str, layer: int, seq_len: int, autocast: bool = False) -> tuple[int, int]:
    """(bytes autocast's bf16 weight copies take among them, bytes one layer's forward saves: every
    tensor autograd keeps in layer `layer` (tests/_saved.py), plus, as tests/unit/test_moe_plan.py
    counts them, the router logits the step keeps and what the load-balancing loss saves for the layer)."""
    import torch
    from _saved import saved_in
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.train.core.moe import EXPERTS_IMPLEMENTATION, aux_loss_part, prepare_moe, record_routing

    cfg = resolve_model_config("tiny-gpt-oss")
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf._attn_implementation, hf._experts_implementation = "eager", EXPERTS_IMPLEMENTATION
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).to(getattr(torch, dtype_name)).train()
    prepare_moe(model)
    ids = torch.randint(0, 90, (2, seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), record_routing(model) as seen:
        with saved_in(model, model.model.layers[layer]) as saved:
            model(input_ids=ids, labels=ids, use_cache=False)
    aux = {}

    def pack_aux(t):
        aux[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    E = cfg["num_local_experts"]
    with torch.autograd.graph.saved_tensors_hooks(pack_aux, lambda t: t):
        aux_loss_part(seen, E)
    aux_layer = (sum(aux.values()) - (4 * E + 4)) // len(seen)  # less the step-wide f and row count
    attn = model.model.layers[layer].self_attn
    cache = sum(2 * m.weight.numel() for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)) if autocast else 0
    return cache, sum(saved.values()) + seen[layer][0].untyped_storage().nbytes() + aux_layer


@pytest.mark.parametrize("seq_len", [48, 80])
@pytest.mark.parametrize("layer", [1, 2])  # full, sliding attention (layer 0 also saves RoPE's tables)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gpt_oss_layer_activations_match_torch_saved_tensors(dtype_name, layer, seq_len):
    cfg = resolve_model_config("tiny-gpt-oss")
    assert cfg["layer_types"][layer] == ("full_attention", "sliding_attention")[layer - 1]
    assert seq_len > cfg["sliding_window"]  # the window masks scores, it does not shrink them
    _, measured = _measure(dtype_name, layer, seq_len)
    e = 4 if dtype_name == "float32" else 2
    assert measured == layer_activation_bytes(architecture_from_config(cfg), 2 * seq_len, e, seq_len=seq_len)


def test_gpt_oss_layer_activations_under_autocast_match_torch_saved_tensors():
    # ddp / zero1 with bf16-mixed: the fp32 model under autocast (CPU's here; CUDA's casts the same
    # ops: linear and matmul to bf16, softmax with an explicit dtype kept). The bf16 copies of the
    # attention weights autocast saves are its weight cache, priced as a buffer (plan/memory.py).
    cache, measured = _measure("float32", 1, 48, autocast=True)
    arch = architecture_from_config(resolve_model_config("tiny-gpt-oss"))
    assert measured - cache == layer_activation_bytes(arch, 96, 2, autocast=True, seq_len=48)


@pytest.mark.timeout(300)
def test_the_planned_gpt_oss_activations_are_what_the_trainer_measured(tmp_path):
    """`shardtune train recipes/tiny-moe-cpu.yaml model.name=tiny-gpt-oss`, one step on one process:
    the activation bytes torch's memory tracker saw (memory.json) against the plan the trainer wrote
    (plan.json). Measured 1.30 × planned before the eager-attention terms; within 1 % now."""
    from shardtune.cli import main

    run = tmp_path / "run"
    assert main(["train", "recipes/tiny-moe-cpu.yaml", "model.name=tiny-gpt-oss", "--nproc", "1",
                 "--output-dir", str(run), "train.max_steps=1"]) == 0
    measured = json.loads((run / "memory.json").read_text())["per_rank"][0]["tracked"]["activations"]
    planned = json.loads((run / "plan.json").read_text())["strategies"][0]["memory"]["activations"]
    assert planned == pytest.approx(measured, rel=0.01), (planned, measured)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,ac", [("zero3", "none"), ("zero3", "full"), ("ddp", "none")])
def test_gpt_oss_analytic_within_tolerance_of_simulated(strategy, ac):
    # gpt-oss-20b's real widths (64 heads, 2880 wide, 32 experts top-4, vocabulary 201,088) cut to
    # one sliding and one full layer at seq 1024 on N = 8, bf16-mixed: the trainer's step traced on
    # fake tensors (plan --simulate; eager attention as the trainer builds it) against the analytic
    # plan's activations, at the dense models' 10 % (tests/_tolerance.py). ddp: autocast. Measured:
    # +0.03 % (zero3), -7.3 % (zero3, AC full), -0.5 % (ddp); before plan/oss.py -40 %, -47 %, -53 %.
    # The total is not held here: zero3's plans 12 % over the trace at these two layers, from the
    # buffers (the vocabulary-sized gathers), not the activations.
    from shardtune.catalog.models import MODELS
    from shardtune.plan import plan
    from shardtune.plan.validate import PlanInputs
    from shardtune.verify.simulate import simulate_strategy

    cfg = {**MODELS["gpt-oss-20b"]["config"], "num_hidden_layers": 2,
           "layer_types": ["sliding_attention", "full_attention"]}
    sim = simulate_strategy(PlanInputs(cfg, 8, seq_len=1024, ac=ac), strategy)
    mem = plan(cfg, gpus=8, seq_len=1024, ac=ac, strategies=[strategy]).strategy(strategy).memory
    assert mem.activations == pytest.approx(sim["activations"], rel=0.10), (mem.activations, sim["activations"])


def test_plan_refuses_gpt_oss_under_cp_as_the_trainer_does(capsys):
    # the trainer's rule (rules/ep.py check_ep_model): no cp path for the sinks; the planner neither
    # plans it nor proposes it in a verdict (its cp rows priced the eager scores over the whole row)
    from shardtune.cli import main

    assert main(["plan", "gpt-oss-20b", "--gpus", "8", "--cp", "2"]) == 2
    assert "GPT-OSS is not built" in capsys.readouterr().err
    assert main(["plan", "gpt-oss-20b", "--gpus", "8"]) == 0
    assert "--cp" not in capsys.readouterr().out
