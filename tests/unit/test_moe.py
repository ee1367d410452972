"""MoE models as the trainer builds them (train/core/moe.py), on one process, against plain
transformers: the experts run grouped (grouped_mm), the fp32 router and the step's objective
(token loss + coefficient x load-balancing loss) give transformers' own loss and gradients
(eager experts, `output_router_logits=True`), for Mixtral, Qwen3-MoE (a config.json and the catalogue's
tiny-qwen3-moe) and GPT-OSS (tiny-gpt-oss: router bias, top-k-then-softmax, sinks, transposed and
biased experts, clamped SwiGLU; eager attention on both sides)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from shardtune.catalog.models import resolve_model_config
from shardtune.config import ModelConfig
from shardtune.train.core.model import build_meta_model, init_model_weights
from shardtune.train.core.moe import MoeTerms, attention_implementation, load_cv, routers

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 264,
             "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
             "num_experts_per_tok": 3, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "max_position_embeddings": 256}


def _models(name: str):
    """(the trainer's model: meta build, filled; plain transformers, eager experts, same weights)."""
    from transformers import AutoModelForCausalLM

    ours = build_meta_model(ModelConfig(name=name))
    ours.to_empty(device="cpu")
    init_model_weights(ours, ModelConfig(name=name), seed=3)
    plain = AutoModelForCausalLM.from_config(copy.deepcopy(ours.config), experts_implementation="eager",
                                             attn_implementation=attention_implementation(ours.config))
    plain.load_state_dict(ours.state_dict())
    return ours, plain


@pytest.fixture(params=["tiny-mixtral", "qwen3-moe", "tiny-qwen3-moe", "tiny-gpt-oss", "gpt-oss-clamped"])
def models(request, tmp_path):
    name = request.param
    if name == "qwen3-moe":
        (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
        name = str(tmp_path / "config.json")
    if name == "gpt-oss-clamped":  # the published swiglu_limit 7.0 never binds at this init; 0.3 does
        clamped = {**resolve_model_config("tiny-gpt-oss"), "swiglu_limit": 0.3}
        (tmp_path / "config.json").write_text(json.dumps(clamped))
        name = str(tmp_path / "config.json")
    return _models(name)


def test_the_step_objective_is_transformers_loss_with_its_aux_loss(models):
    ours, plain = models
    assert ours.config._experts_implementation == "grouped_mm"
    assert len(routers(ours)) == ours.config.num_hidden_layers
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 24))
    pos = torch.arange(24).expand(2, -1)
    want = plain(input_ids=ids, position_ids=pos, labels=ids, output_router_logits=True)
    want.loss.backward()
    # the step's pieces: the token-loss sum / tokens, then MoeTerms adds coef x aux (one micro-batch, one rank)
    terms = MoeTerms(ours, num_micro_batches=1)
    with terms.routing() as seen:
        logits = ours(input_ids=ids, position_ids=pos).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    loss = terms.add_objective(ce / ids[:, 1:].numel(), seen, dp_size=1)
    loss.backward()
    assert float(loss) == pytest.approx(float(want.loss), abs=1e-6)
    parts = terms.parts(dp_size=1)
    assert float(parts["aux_loss"]) == pytest.approx(float(want.aux_loss), abs=1e-6)
    assert float(want.aux_loss) > 1.0  # E x sum f P is 1 at perfect balance: a real term, not zero
    if ours.config.model_type == "gpt_oss":
        assert ours.config._attn_implementation == "eager"  # SDPA has no sink term
    grads = dict(plain.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_router_logits_stay_fp32_under_bf16_autocast():
    ours, _ = _models("tiny-mixtral")
    with routers(ours)[0].register_forward_hook(lambda m, a, out: seen.append(out)) as _, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        seen = []
        ours(input_ids=torch.randint(0, 256, (1, 8)))
    logits, weights, index = seen[0]
    assert logits.dtype == torch.float32 and weights.dtype == torch.float32
    assert torch.allclose(weights.sum(-1), torch.ones(8))  # top-k weights renormalised
    assert index.shape == (8, 2)


def test_load_cv_is_the_std_over_the_mean_of_tokens_per_expert():
    assert float(load_cv(torch.tensor([[4.0, 4.0, 4.0, 4.0]]))) == 0.0
    # counts 2, 6 (mean 4, population std 2) in one layer, 4, 4 in the other: std sqrt(2), cv sqrt(2)/4
    assert float(load_cv(torch.tensor([[2.0, 6.0], [4.0, 4.0]]))) == pytest.approx(2 ** 0.5 / 4)


def test_a_dense_model_has_no_moe_terms():
    model = build_meta_model(ModelConfig(name="tiny-llama"))
    terms = MoeTerms(model, num_micro_batches=1)
    with terms.routing() as seen:
        pass
    assert seen is None and terms.parts(1) == {}
    x = torch.ones(())
    assert terms.add_objective(x, seen, 1) is x


def test_gpt_oss_router_is_transformers_with_its_bias():
    """GPT-OSS's router (bias, softmax over the top-k logits) as the trainer runs it, against
    transformers' own forward on the same weights, with a non-zero bias that changes the picks."""
    ours, plain = _models("tiny-gpt-oss")
    ours_r, plain_r = routers(ours)[0], routers(plain)[0]
    with torch.no_grad():
        for r in (ours_r, plain_r):
            r.bias.copy_(torch.tensor([0.5, -0.5, 0.0, 0.2]))
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    got, want = ours_r(x), type(plain_r).forward(plain_r, x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert not torch.equal(want[2], torch.topk(x @ plain_r.weight.T, 2).indices)  # the bias moved a pick


def test_the_clamped_swiglu_binds_in_the_clamped_variant(tmp_path):
    """The gpt-oss-clamped case above is a real check of the clamp: at limit 0.3 a share of the
    gate and up pre-activations lies beyond it (measured 9 % and 18 % in layer 0)."""
    (tmp_path / "config.json").write_text(json.dumps({**resolve_model_config("tiny-gpt-oss"), "swiglu_limit": 0.3}))
    ours, _ = _models(str(tmp_path / "config.json"))
    experts, seen = ours.model.layers[0].mlp.experts, []
    gate = experts._apply_gate
    experts._apply_gate = lambda x: seen.append(x.detach()) or gate(x)
    ours(input_ids=torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0)))
    beyond = float((seen[0].abs() > 0.3).float().mean())
    assert beyond > 0.02, beyond


@pytest.mark.parametrize("extra", [["--nproc", "2", "--ep", "2", "parallel.cp=2"],
                                   ["--nproc", "4", "--tp", "2", "--ep", "2"]])
def test_gpt_oss_with_tp_or_cp_is_refused_in_one_line(monkeypatch, capsys, extra):
    from _cli import REPO, refused_before_any_process

    err = refused_before_any_process(monkeypatch, capsys, ["train", REPO / "recipes" / "tiny-moe-cpu.yaml",
                                                          "model.name=tiny-gpt-oss", *extra])
    assert "GPT-OSS" in err and "sinks" in err
