"""The upcycled SmolLM2 (shardtune/testing/upcycle.py): a Mixtral-shaped folder whose logits equal
SmolLM2's before any training (plain transformers on both folders, fp32), with E identical experts."""
from __future__ import annotations

import json

import pytest
import torch

from shardtune.testing.smollm2 import cut_folder
from shardtune.testing.upcycle import mixtral_config, upcycled_folder


def test_upcycled_smollm2_gives_smollm2_logits():
    from transformers import AutoModelForCausalLM

    dense_dir, moe_dir = cut_folder(2), upcycled_folder(2, num_experts=4, top_k=2)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    moe = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, experts_implementation="grouped_mm").eval()
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.tie_word_embeddings
    assert moe.lm_head.weight is moe.model.embed_tokens.weight
    experts = moe.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (4, 2 * 1536, 576) and torch.equal(experts.down_proj[0], experts.down_proj[3])
    torch.testing.assert_close(experts.gate_up_proj[2, :1536], dense.model.layers[1].mlp.gate_proj.weight)
    ids = torch.randint(0, dense.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = dense(input_ids=ids).logits, moe(input_ids=ids, output_router_logits=True)
        exact = dense.double()(input_ids=ids).logits  # the dense model's own fp32 rounding, for scale
    # within 1e-5 of each logit (|logits| reach ~80 here, where one fp32 ulp is 7.6e-6: measured max
    # |diff| 2.7e-5, relative 8.8e-6), and closer to the dense fp32 logits than those are to fp64's (5.6e-5)
    torch.testing.assert_close(got.logits, want, rtol=1e-5, atol=1e-5)
    assert (got.logits - want).abs().max() < (want.double() - exact).abs().max()
    # the router is live (random, not uniform): tokens are spread over the experts
    picked = torch.cat([logits.topk(2, dim=-1).indices.flatten() for logits in got.router_logits])
    assert torch.bincount(picked, minlength=4).min() > 0
    assert json.loads((moe_dir / "config.json").read_text())["num_local_experts"] == 4


def test_upcycling_refuses_what_it_cannot_copy():
    dense = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="top-k 5"):
        mixtral_config(dense, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="without attention or MLP biases"):
        mixtral_config({**dense, "attention_bias": True}, 4, 2)
