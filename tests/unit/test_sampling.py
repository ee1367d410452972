"""generate_ids on a plain transformers model (the cut SmolLM2 fixture) against transformers itself:
greedy = generate(do_sample=False), it stops at a stop id (kept as the last id), and the sampling
distribution = transformers' TemperatureLogitsWarper + TopPLogitsWarper."""
from __future__ import annotations

import pytest
import torch

from shardtune.testing.smollm2 import cut_folder
from shardtune.train.core.sampling import generate_ids, next_token_probs


@pytest.fixture(scope="module")
def model_tok():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cut_folder(2)
    return (AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32),
            AutoTokenizer.from_pretrained(str(folder)))


def test_greedy_equals_transformers_generate_and_stops_at_a_stop_id(model_tok):
    model, tok = model_tok
    ids = tok("The capital of France is")["input_ids"]
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=10,
                         eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert generate_ids(model, ids, max_new_tokens=10, stop_ids=[]) == ref
    assert generate_ids(model, ids, max_new_tokens=10, stop_ids=[ref[3]]) == ref[:ref.index(ref[3]) + 1]
    assert generate_ids(model, ids, max_new_tokens=0, stop_ids=[]) == []
    assert not model.training


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.5, 0.05)])
def test_sampling_distribution_equals_transformers_warpers(temperature, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    warped = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    want = torch.softmax(warped, dim=-1)[0]
    got = next_token_probs(logits, temperature, top_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_bad_arguments_are_refused(model_tok):
    model, _ = model_tok
    for kw in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            generate_ids(model, [1, 2], max_new_tokens=2, stop_ids=[], **kw)
